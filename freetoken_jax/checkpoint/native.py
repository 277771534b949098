"""The engine's own safetensors layout ("generic" family): `config.json` holds the
`MoEModelConfig`, tensors are named by parameter path (`layers/0/self_attn/q_proj/weight`)."""

from __future__ import annotations

import json
import os

import numpy as np

from freetoken_jax.checkpoint.safetensors_io import save_file
from freetoken_jax.config import MoEModelConfig
from freetoken_jax.models.generic import config_to_json


def save_native(cfg: MoEModelConfig, params, path: str, extra_files: dict[str, dict] | None = None) -> None:
    os.makedirs(path, exist_ok=True)
    tensors = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in params.flat_state()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    for name, content in {"config.json": config_to_json(cfg), **(extra_files or {})}.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(content, f, indent=1)
