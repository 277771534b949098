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
    """A model module with seeded random weights from NNX's initialisers (the demo checkpoint's
    weights; engines built without a checkpoint use `random_params`)."""
    return MoETransformer(cfg, jnp_dtype(dtype), nnx.Rngs(seed))


def is_expert_path(path: tuple) -> bool:
    return len(path) >= 2 and path[-2] == "experts"


def random_params(cfg: MoEModelConfig, dtype: str = "float32", seed: int = 0, place=None) -> nnx.State:
    """Seeded random parameters built leaf by leaf (normal, std 0.02; norms at one, biases at
    zero). `place(path, array)` may move each leaf as soon as it exists (e.g. experts to host
    banks), so the device never holds more than one leaf beyond what stays there. With a
    quantized `cfg.expert_format`, the experts are those of the unquantized model of the same
    seed, quantized as they are made."""
    if cfg.expert_format != "bf16":
        import dataclasses

        from freetoken_jax.quant.banks import quantizing

        return random_params(dataclasses.replace(cfg, expert_format="bf16", expert_formats=()), dtype, seed, quantizing(place, cfg))
    abstract = build_abstract(cfg, dtype)
    key = jax.random.PRNGKey(seed)
    out = []
    for i, (path, var) in enumerate(abstract.flat_state()):
        sds = var.get_value()
        if path[-1] == "bias":
            a = jnp.zeros(sds.shape, sds.dtype)
        elif path[-1] == "weight" and len(sds.shape) == 1 and "norm" in str(path[-2]):
            a = jnp.ones(sds.shape, sds.dtype)
        else:
            a = (jax.random.normal(jax.random.fold_in(key, i), sds.shape, jnp.float32) * 0.02).astype(sds.dtype)
        out.append((path, var.replace(place(path, a) if place else a)))
    return nnx.State.from_flat_path(out)


def build_abstract(cfg: MoEModelConfig, dtype: str = "float32") -> nnx.State:
    """Shapes and dtypes of every parameter, allocating nothing."""
    model = nnx.eval_shape(lambda: MoETransformer(cfg, jnp_dtype(dtype), nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


def param_count(cfg: MoEModelConfig) -> dict[str, int]:
    """Parameter counts split into dense weights and routed experts."""
    counts = {"dense": 0, "experts": 0}
    for path, var in build_abstract(cfg, "float32").flat_state():
        counts["experts" if is_expert_path(path) else "dense"] += var.get_value().size
    return counts


def abstract_graphdef(cfg: MoEModelConfig, dtype: str = "float32"):
    model = nnx.eval_shape(lambda: MoETransformer(cfg, jnp_dtype(dtype), nnx.Rngs(0)))
    return nnx.split(model, nnx.Param)


__all__ = ["MoETransformer", "abstract_graphdef", "build_abstract", "build_random", "is_expert_path", "param_count", "random_params"]
