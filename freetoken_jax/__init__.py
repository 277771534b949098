"""freetoken_jax: Mixture-of-Experts serving beyond GPU memory, on JAX/XLA."""

import os as _os

# XLA's pinned host pool (expert banks live there on a GPU) is a BFC allocator capped at
# XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (default 64) that grows in regions of doubling size, each
# pinned whole: past half the cap it pins up to the cap, whatever the banks need. Unless the
# user set it, the cap becomes the machine's RAM less an eighth (at least 8 GiB) for the process
# and the system; this takes effect only if jax's GPU backend has not started yet.
if "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" not in _os.environ and hasattr(_os, "sysconf"):
    try:
        _ram_gb = _os.sysconf("SC_PAGE_SIZE") * _os.sysconf("SC_PHYS_PAGES") // (1 << 30)
        _os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(max(1, _ram_gb - max(8, _ram_gb // 8)))
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
