"""Decode's routed experts over q4_0 banks through the C++ module's CUDA kernels
(`cpu_ext/cuda/q4_0_experts.cu`), outside XLA's reduction emitter.

XLA fuses decode's gathered q4_0 matvecs into reductions that read the chosen experts at about
1 TB/s on an H100, and so do these kernels (benchmarks/RESULTS.md: loads straight from global
memory or whole lines staged in shared memory first, the same rate; at a layer's size a kernel's
launch, ramp and tail cost as much as its bytes). Where the tokens' x fits a block's shared memory
one launch takes the layer (gate and up, a grid-wide barrier, down: one block an SM), else two.
On an H100 the one launch ran 19.2-20.1 µs a layer by itself against XLA's 17.5 + 2.4, and the
fused step at 678 against 706 tok/s with XLA's reductions. `experts` computes what
`models.routed._gathered` computes, Σ_k w[t,k] · down(silu(gate x_t) · up x_t) over each token's
pairs with each pair's h rounded to bfloat16 after its routing weight, through XLA FFI calls that
XLA may record into its CUDA graphs; `_gathered` is the reference (tests compare both with
float64). Only where `fits` says so: q4_0 gate, up and down without biases, silu, bfloat16
activations, F and D multiples of 256, a GPU whose driver loaded the kernels (`unavailable`). The
engine takes them where FREETOKEN_DECODE_EXPERTS=cuda or cuda2 asks for them (`choice`); the
default stays XLA's reductions until a decode step has run faster with the kernels on a GPU
(benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.config import env_choice
from freetoken_jax.quant.layout import ExpertLayout
from freetoken_jax.runtime.ffi import cuda_ordinal, register_targets
from pallas_kernels import Stacked

GATE_UP, DOWN, MOE = "freetoken_q4_0_gate_up", "freetoken_q4_0_down", "freetoken_q4_0_moe"
MULTIPLE = 256  # F and D: rows of a multiple of 16 bytes (256 inputs are 8 blocks of 18 bytes, 144 = 9 × 16)
# The kernels' launch geometry (cpu_ext/cuda/q4_0_experts.h): rows a block of gate_up (of F) and of
# down (of D); padding floats after every 64 staged inputs.
GATE_UP_ROWS, DOWN_ROWS, PAD = 16, 16, 4


def choice() -> str:
    """FREETOKEN_DECODE_EXPERTS: "xla" (XLA's reductions, the default), "cuda" (the kernels where
    `fits`: one launch a layer where `one_fits`, else two) or "cuda2" (always the two)."""
    return env_choice("FREETOKEN_DECODE_EXPERTS", "xla", ("xla", "cuda", "cuda2"))


@functools.cache
def _load(ordinal: int) -> str:
    from freetoken_jax import _cpu_ext

    register_targets()
    return _cpu_ext.load_expert_kernels(ordinal)


def unavailable() -> str | None:
    """Why the kernels cannot run in this process (None where they can): no GPU backend, or the
    driver could not load them (loads them into the first device on the first call)."""
    if jax.default_backend() != "gpu":
        return f"the {jax.default_backend()} backend has no CUDA kernels"
    return _load(cuda_ordinal()) or None


def one_bytes(layout: ExpertLayout, T: int, K: int) -> int:
    """The one-launch kernel's dynamic shared memory a block: the T tokens' x, then a token's K
    pairs' h, as padded float32 (`moe_smem` of `q4_0_experts.h`)."""
    padded = lambda n: n + n // 64 * PAD  # noqa: E731
    return 4 * max(T * padded(layout.D), padded(K * layout.F))


def shared_bytes(layout: ExpertLayout, K: int) -> int:
    """The larger of the two kernels' dynamic shared memory a block, for K pairs a token: one
    token's x for gate_up, its K pairs' h for down — the one-launch kernel's for one token."""
    return one_bytes(layout, 1, K)


def _device_shared() -> int:
    """The dynamic shared memory a block of the kernels may take on this process's GPU (0 where
    they are not loaded)."""
    from freetoken_jax import _cpu_ext

    return _cpu_ext.expert_kernels_shared_memory(cuda_ordinal())


def fits(layout: ExpertLayout, dtype, K: int, bias=None, pairs: int = 1) -> bool:
    """Whether the kernels compute this layer's `pairs` token-expert pairs (K a token): q4_0
    throughout (one format, not a mixed model's slots), no biases, silu, bfloat16 activations, F
    and D multiples of 256, at most 65535 pairs (a grid's second dimension), a block's shared
    memory within the device's, and the kernels loaded (`unavailable`)."""
    if (
        pairs > 65535
        or layout.fmts != ("q4_0",) * 3
        or layout.mixed
        or bias is not None
        or layout.act != "silu"
        or jnp.dtype(dtype) != jnp.bfloat16
    ):
        return False
    if layout.F % MULTIPLE or layout.D % MULTIPLE or unavailable() is not None:
        return False
    return shared_bytes(layout, K) <= _device_shared()


def _operand(bank) -> tuple[jax.Array, int]:
    """(the array the kernels read, the entry of its stack): a `Stacked` entry is read in place."""
    return (bank.array, bank.index) if isinstance(bank, Stacked) else (bank, 0)


def one_fits(layout: ExpertLayout, T: int, K: int) -> bool:
    """Whether `experts` takes one launch for these T tokens (`fits` holding): FREETOKEN_DECODE_EXPERTS
    is not "cuda2" and the tokens' x fits a block's shared memory."""
    return choice() != "cuda2" and one_bytes(layout, T, K) <= _device_shared()


def experts(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout) -> jax.Array:
    """Σ_k w[t,k] · down(silu(gate x_t) · up x_t) over each token's pairs, bfloat16 [T, D], from
    the q4_0 `banks` (gate, up, down: uint8 [E, row] arrays or `Stacked` entries of [L, E, row]
    stacks); `fits` must hold. One launch (gate and up, a grid-wide barrier, down) where
    `one_fits`, else two. ids index the banks' rows and must be in range (the kernels read what
    they name)."""
    T, K = ids_TK.shape
    (g, gi), (u, ui), (d, di) = (_operand(b) for b in banks)
    if gi != ui:
        raise ValueError(f"gate and up are entries {gi} and {ui} of their stacks; the kernel reads one entry of both")
    ids, w = ids_TK.astype(jnp.int32), w_TK.astype(jnp.float32)
    if one_fits(layout, T, K):  # y, and h: the kernel's scratch between its phases
        results = (jax.ShapeDtypeStruct((T, layout.D), jnp.bfloat16), jax.ShapeDtypeStruct((T, K, layout.F), jnp.bfloat16))
        attrs = dict(index=np.int64(gi), down_index=np.int64(di), ffn=np.int64(layout.F))
        return jax.ffi.ffi_call(MOE, results)(g, u, d, x_TD.astype(jnp.bfloat16), ids, w, **attrs)[0]
    h = jax.ffi.ffi_call(GATE_UP, jax.ShapeDtypeStruct((T, K, layout.F), jnp.bfloat16))(
        g, u, x_TD.astype(jnp.bfloat16), ids, w, index=np.int64(gi), ffn=np.int64(layout.F)
    )
    return jax.ffi.ffi_call(DOWN, jax.ShapeDtypeStruct((T, layout.D), jnp.bfloat16))(d, h, ids, index=np.int64(di))
