"""The typed Python face of the C++ CPU expert executor (`freetoken_jax._cpu_ext`).

`CpuExecutor.run(x_TH, tokens, experts, weights, gate, up, down)` returns
Σ w · down_e(act(gate_e x_t) ⊙ up_e x_t) per token as float32 [T, H]. The banks are the engine's
host banks — one row per expert, gate/up [E, F·H], down [E, H·F], float32 or bfloat16 — read in
place: a numpy view of the bank's memory is handed to C++, never a copy, and the view (and with
it the bank) is kept alive by the caller for the duration of the call.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from freetoken_jax import _cpu_ext

TIERS = ("scalar", "avx2_fma", "avx512f", "avx512_bf16", "amx_bf16")


def supported_tiers() -> list[str]:
    return list(_cpu_ext.supported_tiers())


def _bank_view(a) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"an expert bank must be 2-D [E, row], got shape {a.shape}")
    if a.dtype == ml_dtypes.bfloat16:
        return np.ascontiguousarray(a).view(np.uint16)
    if a.dtype != np.float32:
        raise TypeError(f"expert banks must be float32 or bfloat16, got {a.dtype}")
    return np.ascontiguousarray(a)


class CpuExecutor:
    def __init__(self, threads: int = 0, max_tier: str = "amx_bf16", pin: bool = False):
        import os

        if max_tier not in TIERS:
            raise ValueError(f"max_tier must be one of {TIERS}")
        self._ex = _cpu_ext.CpuMoeExecutor(threads or os.cpu_count() or 1, max_tier, pin)

    @property
    def tier(self) -> str:
        return self._ex.tier

    @property
    def threads(self) -> int:
        return self._ex.threads

    def run(self, x_TH, tokens, experts, weights, gate, up, down, act: str = "silu") -> np.ndarray:
        x = np.ascontiguousarray(np.asarray(x_TH, dtype=np.float32))
        if x.ndim != 2:
            raise ValueError(f"x must be [T, H], got shape {x.shape}")
        g, u, d = _bank_view(gate), _bank_view(up), _bank_view(down)
        H = x.shape[1]
        if g.shape[1] % H:
            raise ValueError(f"gate rows ({g.shape[1]}) are not a multiple of H={H}")
        out = np.zeros_like(x)
        self._ex.run(
            x,
            np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1),
            np.ascontiguousarray(experts, dtype=np.int32).reshape(-1),
            np.ascontiguousarray(weights, dtype=np.float32).reshape(-1),
            g, u, d, g.shape[1] // H, act, out,
        )  # fmt: skip
        return out
