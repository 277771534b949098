"""Flax NNX models of the supported MoE families (see `registry`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.models.transformer import MoETransformer


def jnp_dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def build_random(cfg: MoEModelConfig, dtype: str = "float32", seed: int = 0) -> MoETransformer:
    """A model with seeded random weights (normal, std 0.02; norms at one)."""
    return MoETransformer(cfg, jnp_dtype(dtype), nnx.Rngs(seed))


def build_abstract(cfg: MoEModelConfig, dtype: str = "float32") -> nnx.State:
    """Shapes and dtypes of every parameter, allocating nothing."""
    model = nnx.eval_shape(lambda: MoETransformer(cfg, jnp_dtype(dtype), nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


def split_model(model: MoETransformer):
    """(graphdef, params): the static structure and the parameter pytree, split once."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def abstract_graphdef(cfg: MoEModelConfig, dtype: str = "float32"):
    model = nnx.eval_shape(lambda: MoETransformer(cfg, jnp_dtype(dtype), nnx.Rngs(0)))
    return nnx.split(model, nnx.Param)


__all__ = ["MoETransformer", "build_random", "build_abstract", "split_model", "abstract_graphdef", "jax"]
