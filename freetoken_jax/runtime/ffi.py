"""The C++ module's XLA FFI targets as JAX primitives: the CPU handoff (`runtime/handoff.py`), the
bank copies (`runtime/bank_copy.py`) and the q4_0 expert kernels (`runtime/cuda_experts.py`)."""

from __future__ import annotations

import functools

import jax


@functools.cache
def register_targets() -> None:
    """Registers every FFI handler of the C++ module with XLA (its CUDA handlers only on a GPU)."""
    from freetoken_jax import _cpu_ext

    gpu = jax.default_backend() == "gpu"
    for name, by_platform in _cpu_ext.ffi_handlers().items():
        for platform, capsule in by_platform.items():
            if platform == "cpu" or gpu:
                jax.ffi.register_ffi_target(name, capsule, platform=platform)


def cuda_ordinal() -> int:
    """The CUDA ordinal of JAX's first device for the C++ module's calls outside XLA's (pinned
    allocations, kernel loads), -1 off a GPU."""
    if jax.default_backend() != "gpu":
        return -1
    return int(getattr(jax.devices()[0], "local_hardware_id", None) or 0)


@functools.cache
def primitive(target: str, aliases: tuple[tuple[int, int], ...] = (), multiple: bool = False):
    """A primitive that lowers to FFI custom call `target`, marked side-effecting in the HLO (XLA
    neither removes nor merges it) but carrying no JAX effect: `jax.ffi.ffi_call(...,
    has_side_effect=True)` gives the step an effect, and jit dispatches a step with effects
    through its Python path at every call (on the H200, most of a 24-layer hybrid step's host
    time). Callers fix the calls' order by data (a call takes what must exist before it) and
    optimization barriers. `aliases`: (operand, result) pairs that share a buffer; `multiple`:
    the call has several results. Params: `result` (a ShapeDtypeStruct, a tuple of them where
    `multiple`) and the call's attributes."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    register_targets()
    prim = Primitive(target)
    prim.multiple_results = multiple
    aval = lambda r: jax.core.ShapedArray(r.shape, r.dtype)  # noqa: E731
    prim.def_abstract_eval(lambda *args, result, **attrs: [aval(r) for r in result] if multiple else aval(result))
    prim.def_impl(lambda *args, **params: jax.jit(lambda *a: prim.bind(*a, **params))(*args))
    lower = jax.ffi.ffi_lowering(target, has_side_effect=True, operand_output_aliases=dict(aliases) or None)
    mlir.register_lowering(prim, lambda ctx, *args, result, **attrs: lower(ctx, *args, **attrs))
    return prim
