"""Loading a Hugging Face safetensors checkpoint into the engine's parameter tree.

Each parameter path of the model (e.g. `layers/3/self_attn/q_proj/weight`) maps to one checkpoint
tensor, in the same [out, in] layout, or, for expert banks, to the per-expert tensors of a layer
stacked into `[E, ...]` (or the fused `gate_up_proj` / `down_proj` banks of newer exports).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from freetoken_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir
from freetoken_jax.config import MoEModelConfig
from freetoken_jax.models import build_abstract
from freetoken_jax.models.registry import Family


def _hf_prefix(path: tuple, fam: Family) -> str:
    renames = dict(fam.renames)
    return ".".join(str(renames.get(p, p)) if not isinstance(p, int) else str(p) for p in path)


def read_param(ckpt: SafetensorsDir, path: tuple, fam: Family, cfg: MoEModelConfig) -> np.ndarray:
    """The checkpoint tensor(s) of one parameter path, in the engine's layout (not yet cast)."""
    if fam.name == "generic":
        return ckpt.get("/".join(map(str, path)))
    head, leaf = path[:-1], path[-1]
    if path == ("embed", "embedding"):
        return ckpt.get("model.embed_tokens.weight")
    if path == ("lm_head", "weight"):
        return ckpt.get("lm_head.weight")
    name = ("model." if path[0] in ("layers", "norm") else "") + _hf_prefix(head, fam)
    if head[-1] == "experts":
        gate_n, up_n, down_n = fam.expert_names
        fused = name + ".gate_up_proj"
        if fused in ckpt:  # [E, 2F, D] / [E, D, F]
            F = cfg.moe_intermediate_dim
            if leaf == "down":
                return ckpt.get(name + ".down_proj")
            gu = ckpt.get(fused)
            return gu[:, :F] if leaf == "gate" else gu[:, F:]
        proj = {"gate": gate_n, "up": up_n, "down": down_n}[leaf]
        return np.stack([ckpt.get(f"{name}.{e}.{proj}.weight") for e in range(cfg.num_experts)])
    if head[-1] == "gate" and head[-2] == "mlp" and leaf == "bias":  # V3's routing correction
        return ckpt.get(name + ".e_score_correction_bias")
    return ckpt.get(f"{name}.{leaf}")


def load_params(path: str, cfg: MoEModelConfig, fam: Family, dtype: str, place=None):
    """The parameter state of `cfg` filled from the safetensors checkpoint at `path`.

    Every tensor is read and shape-checked before any device array is made, so a bad
    checkpoint raises `CheckpointError` with nothing allocated. `place(path, host_array)`, when
    given, makes the array of a leaf (e.g. a host bank for experts) instead of the device."""
    ckpt = SafetensorsDir(path)
    abstract = build_abstract(cfg, dtype)
    host = {}
    for p, var in abstract.flat_state():
        want = var.get_value()
        a = read_param(ckpt, p, fam, cfg)
        if tuple(a.shape) != tuple(want.shape):
            raise CheckpointError(f"{path}: {'/'.join(map(str, p))} has shape {tuple(a.shape)}, the config needs {tuple(want.shape)}")
        host[p] = a
    flat = []
    for p, var in abstract.flat_state():
        dt = var.get_value().dtype
        a = host[p]
        a = a if a.dtype == dt else np.asarray(np.asarray(a, np.float32), dtype=dt)
        flat.append((p, var.replace(place(p, a) if place else jnp.asarray(a))))
    return nnx.State.from_flat_path(flat)
