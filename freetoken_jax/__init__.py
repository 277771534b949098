"""freetoken_jax: Mixture-of-Experts serving beyond GPU memory, on JAX/XLA."""

import os as _os

# XLA caps pinned host allocations at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (default 64): expert
# banks may need more. Raise the cap to the machine's RAM unless the user set it; this takes
# effect only if jax's GPU backend has not started yet.
if "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" not in _os.environ and hasattr(_os, "sysconf"):
    try:
        _ram_gb = _os.sysconf("SC_PAGE_SIZE") * _os.sysconf("SC_PHYS_PAGES") // (1 << 30)
        _os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(max(64, int(_ram_gb)))
    except (ValueError, OSError):
        pass

from freetoken_jax.config import ConfigError, EngineConfig, MoEModelConfig
from freetoken_jax.engine import FreeTokenEngine, RequestError
from freetoken_jax.runtime.steps import DecodeBatch, DecodeState, PrefillBatch, Sampling, Weights, decode_step, prefill_step

__all__ = [
    "ConfigError",
    "DecodeBatch",
    "DecodeState",
    "EngineConfig",
    "FreeTokenEngine",
    "MoEModelConfig",
    "PrefillBatch",
    "RequestError",
    "Sampling",
    "Weights",
    "decode_step",
    "prefill_step",
]
__version__ = "0.1.0"
