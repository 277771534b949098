"""Supported model families: which Hugging Face architectures map to which config parser and
tensor-name map."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from freetoken_jax.config import ConfigError, MoEModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """One family: its `architectures` names, how to read its config, and how its tensors are named.

    `renames` maps a segment of our parameter path to the checkpoint's (e.g. Mixtral's MoE block
    is `block_sparse_moe`); `expert_names` names the gate/up/down projections of one expert;
    `interleaved_gate_up`: see below.
    """

    name: str
    architectures: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any]], MoEModelConfig]
    renames: tuple[tuple[str, str], ...] = ()
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # A fused `gate_up_proj` bank with gate and up rows alternating (gpt-oss) rather than in two
    # halves; unquantized, its banks are stored [E, in, out] (transposed).
    interleaved_gate_up: bool = False

    def parse(self, hf_config: dict[str, Any]) -> MoEModelConfig:
        """`config_from_hf`, with a missing key reported as a `ConfigError` that names it."""
        try:
            return self.config_from_hf(hf_config)
        except KeyError as e:
            raise ConfigError(f"config.json lacks the key {e.args[0]!r} that {self.name} models need") from e


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    _load_builtin()
    return dict(_FAMILIES)


def supported_architectures() -> list[str]:
    return sorted(a for f in families().values() for a in f.architectures)


def family_for(hf_config: dict[str, Any]) -> Family:
    """The family of a parsed `config.json`, by `architectures` (or FreeToken's own `family`)."""
    fams = families()
    if "freetoken_family" in hf_config:
        return fams["generic"]
    archs = hf_config.get("architectures") or []
    for fam in fams.values():
        if any(a in fam.architectures for a in archs):
            return fam
    raise ConfigError(
        f"unsupported architecture {archs or hf_config.get('model_type')!r}; supported: " + ", ".join(supported_architectures())
    )


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory (or the file itself)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"no config.json at {path!s}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e


def config_from_hf(path_or_dict: str | os.PathLike | dict) -> MoEModelConfig:
    """A model config from a Hugging Face `config.json` (a directory, the file, or its parsed
    dict), parsed by its family (`architectures`)."""
    d = path_or_dict if isinstance(path_or_dict, dict) else read_hf_config(path_or_dict)
    return family_for(d).parse(d)


def family_named(name: str) -> Family:
    fams = families()
    if name not in fams:
        raise ConfigError(f"unknown model family {name!r}; known: {sorted(fams)}")
    return fams[name]


def _load_builtin() -> None:
    # Importing a family module registers it; imports are cached, so this is cheap after the first.
    from freetoken_jax.models import deepseek, generic, glm, gpt_oss, mixtral, qwen_moe  # noqa: F401
