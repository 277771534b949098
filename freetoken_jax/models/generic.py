"""FreeToken's own generic family: a `MoEModelConfig` written out as JSON, tensors named by the
engine's parameter paths. The demo model and the engine's own exports use it."""

from __future__ import annotations

import dataclasses
from typing import Any

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.models.registry import Family, register


def config_to_json(cfg: MoEModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["rope_scaling"] = dict(cfg.rope_scaling)
    d["moe_layers"] = list(cfg.moe_layers)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return {"freetoken_family": cfg.family, "architectures": ["FreeTokenMoEForCausalLM"], "freetoken_config": d}


def config_from_json(d: dict[str, Any]) -> MoEModelConfig:
    kw = dict(d["freetoken_config"])
    kw["moe_layers"] = tuple(kw.get("moe_layers", ()))
    kw["eos_token_ids"] = tuple(kw.get("eos_token_ids", ()))
    kw["rope_scaling"] = tuple(dict(kw.get("rope_scaling") or {}).items())
    return MoEModelConfig(**kw)


GENERIC = register(Family("generic", ("FreeTokenMoEForCausalLM",), config_from_json))
