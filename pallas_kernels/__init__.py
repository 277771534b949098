"""Pallas kernels of freetoken_jax: one module per kernel, each with a jnp reference beside it
and an `interpret` switch (interpret mode is how they run on the CPU backend)."""


def call_params(interpret: bool, num_warps: int, num_stages: int | None = None) -> dict:
    """`pallas_call`'s keywords for a kernel: interpret mode, or Triton's warps a program (and
    its software pipeline's stages, where given)."""
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
