"""The typed Python face of the C++ CPU expert executor (`freetoken_jax._cpu_ext`).

`CpuExecutor.run(x_TH, tokens, experts, weights, gate, up, down)` returns
Σ w · down_e(act(gate_e x_t) ⊙ up_e x_t) per token as float32 [T, H]. The banks are the engine's
host banks — one row per expert, gate/up [E, F·H], down [E, H·F], float32 or bfloat16, or the
bytes of a quantized expert format (`fmt`, `quant/formats.py`) — read in place: a numpy view of the bank's memory is handed to C++, never a copy, and the view (and with
it the bank) is kept alive by the caller for the duration of the call.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from freetoken_jax import _cpu_ext

TIERS = ("scalar", "avx2_fma", "avx512f", "avx512_bf16")


def supported_tiers() -> list[str]:
    return list(_cpu_ext.supported_tiers())


def host_view(a) -> np.ndarray:
    """A numpy array over the memory of a host-resident jax array, without copying.

    The pointer comes from `unsafe_buffer_pointer()`: for a bank in host memory (`pinned_host`
    on a GPU, the default memory on the CPU backend) it is the address of the one copy of the
    bank in RAM, the same memory the GPU fetch kernel reads. It stays valid while the jax array
    lives and is not donated; the engine holds every bank for its whole life and never donates
    one, and the returned view (and any slice of it) keeps the array alive, no longer."""
    import ctypes

    import jax

    if not isinstance(a, jax.Array):
        return np.asarray(a)
    kind = getattr(a.sharding, "memory_kind", None)
    if jax.default_backend() != "cpu" and kind not in ("pinned_host", "unpinned_host"):
        raise ValueError(f"expected a bank in host memory, got memory kind {kind!r}")
    buf = (ctypes.c_char * a.nbytes).from_address(a.unsafe_buffer_pointer())
    view = np.frombuffer(buf, dtype=a.dtype).reshape(a.shape)
    view.flags.writeable = False
    buf.array = a  # every view of the memory (this one, its slices) holds the buffer, the buffer the array
    return view


def _bank_view(a, fmt: str = "bf16") -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"an expert bank must be 2-D [E, row], got shape {a.shape}")
    if fmt != "bf16":
        if a.dtype != np.uint8:
            raise TypeError(f"{fmt} expert banks must be uint8, got {a.dtype}")
        return np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return np.ascontiguousarray(a).view(np.uint16)
    if a.dtype != np.float32:
        raise TypeError(f"expert banks must be float32 or bfloat16, got {a.dtype}")
    return np.ascontiguousarray(a)


def _ffn(row: int, H: int, fmt: str) -> int:
    """F of gate rows of `row` elements (bytes when quantized) for inputs of width H."""
    if fmt == "bf16":
        if row % H:
            raise ValueError(f"gate rows ({row}) are not a multiple of H={H}")
        return row // H
    from freetoken_jax.quant.formats import get_format

    f = get_format(fmt.split("/")[0])  # "a/b": gate and up in a, down in b
    F, rest = divmod(row - f.trailer, f.row_bytes(H))
    if rest or F <= 0:
        raise ValueError(f"gate rows of {row} bytes are not {fmt} matrices with {H} inputs")
    return F


def default_threads() -> int:
    """FREETOKEN_CPU_THREADS if set; else the cores this process may run on, less one (where there
    are 8 or more) for the thread that holds the GPU stream at the handoff (cpu_ext/src/ffi_handoff.h):
    a pool thread that loses its core to it delays the whole job."""
    import os

    if os.environ.get("FREETOKEN_CPU_THREADS"):
        n = int(os.environ["FREETOKEN_CPU_THREADS"])
        if n <= 0:
            raise ValueError(f"FREETOKEN_CPU_THREADS must be a positive integer, got {n}")
        return n
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n - 1 if n >= 8 else n


def hybrid_threads() -> int:
    """Executor threads under strategy "hybrid": FREETOKEN_HYBRID_THREADS if set, else the
    `default_threads()` less 3 (at least half of them). Its CPU share runs beside the threads
    that drive the GPU step (the XLA launch thread, the handoff's, the host loop). On the H200
    machine (16 cores) q4_0 hybrid decoded 65.6 tok/s with 15 executor threads, 91.8 with 12 and
    98.3 with 8, while bf16 hybrid (48 layers, skew 0) took 30.9-32.5 ms per token with 15 and
    36.5 with 8 (benchmarks/RESULTS.md); strategy "cpu" wants every core."""
    import os

    if os.environ.get("FREETOKEN_HYBRID_THREADS"):
        n = int(os.environ["FREETOKEN_HYBRID_THREADS"])
        if n <= 0:
            raise ValueError(f"FREETOKEN_HYBRID_THREADS must be a positive integer, got {n}")
        return n
    n = default_threads()
    return max(1, n // 2, n - 3)


def max_tier() -> str:
    """The highest ISA tier the engine's executors may use: FREETOKEN_CPU_TIER if set, else
    "avx512_bf16" (the best this CPU has at most). At "avx512_bf16" the 4- and 8-bit formats
    multiply activations rounded to int8 blocks (as llama.cpp does, VNNI) and bf16 experts
    activations rounded to bf16; at "avx2_fma" q4_0 / mxfp4 / nvfp4 use int8 blocks too;
    "avx512f" keeps every activation in float32 (slower)."""
    tier = os.environ.get("FREETOKEN_CPU_TIER", "avx512_bf16")
    if tier not in TIERS:
        raise ValueError(f"FREETOKEN_CPU_TIER must be one of {TIERS}, got {tier!r}")
    return tier


_SHARED: dict[tuple[int, str], CpuExecutor] = {}


def shared_executor(threads: int | None = None) -> CpuExecutor:
    """One executor (one thread pool) per thread count and `max_tier()` for the whole process;
    default `default_threads()`."""
    key = (threads or default_threads(), max_tier())
    if key not in _SHARED:
        _SHARED[key] = CpuExecutor(*key)
    return _SHARED[key]


class CpuExecutor:
    def __init__(self, threads: int = 0, max_tier: str = "avx512_bf16", pin: bool = False):
        if max_tier not in TIERS:
            raise ValueError(f"max_tier must be one of {TIERS}")
        self._ex = _cpu_ext.CpuMoeExecutor(threads or default_threads(), max_tier, pin)
        self._registered: dict = {}  # banks registered for the FFI handoff, kept alive with the executor

    @property
    def tier(self) -> str:
        return self._ex.tier

    @property
    def threads(self) -> int:
        return self._ex.threads

    def run(self, x_TH, tokens, experts, weights, gate, up, down, act: str = "silu", fmt: str = "bf16", bias=None) -> np.ndarray:
        """`bias`: (gate [E, F], up [E, F], down [E, H]) float32 per-expert biases, or None."""
        x = np.ascontiguousarray(np.asarray(x_TH, dtype=np.float32))
        if x.ndim != 2:
            raise ValueError(f"x must be [T, H], got shape {x.shape}")
        g, u, d = _bank_view(gate, fmt), _bank_view(up, fmt), _bank_view(down, fmt)
        H = x.shape[1]
        F = _ffn(g.shape[1], H, fmt)
        out = np.zeros_like(x)
        self._ex.run(
            x,
            np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1),
            np.ascontiguousarray(experts, dtype=np.int32).reshape(-1),
            np.ascontiguousarray(weights, dtype=np.float32).reshape(-1),
            g, u, d, F, act, out, "" if fmt == "bf16" else fmt, *_biases(bias),
        )  # fmt: skip
        return out

    def register_layer(self, gate, up, down, hidden: int, ffn: int, act: str = "silu", fmt: str = "bf16", bias=None) -> int:
        """Registers one layer's banks (and biases) for the FFI handoff (`freetoken_jax.runtime.handoff`);
        returns the handle its calls carry. The banks stay referenced for the executor's life."""
        views, biases = (_bank_view(gate, fmt), _bank_view(up, fmt), _bank_view(down, fmt)), _biases(bias)
        handle = int(
            _cpu_ext.register_handoff_layer(self._ex, *views, hidden, ffn, act, "" if fmt == "bf16" else fmt, *biases)
        )  # the same banks: the same handle
        self._registered[handle] = ((gate, up, down), views, biases)
        return handle


def _biases(bias) -> tuple:
    """(gate, up, down) biases as contiguous float32 arrays for the executor; Nones without."""
    if bias is None:
        return (None, None, None)
    return tuple(np.ascontiguousarray(np.asarray(b, dtype=np.float32)) for b in bias)
