"""Pallas kernels of freetoken_jax: one module per kernel, each with a jnp reference beside it
and an `interpret` switch (interpret mode is how they run on the CPU backend)."""


def call_params(interpret: bool, num_warps: int) -> dict:
    """`pallas_call`'s keywords for a kernel: interpret mode, or Triton's warps a program."""
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps)}
