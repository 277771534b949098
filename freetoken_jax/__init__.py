"""freetoken_jax: Mixture-of-Experts serving beyond GPU memory, on JAX/XLA."""

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
