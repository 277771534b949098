"""Qwen1.5/Qwen2-MoE (`Qwen2MoeForCausalLM`: QKV bias, a sigmoid-gated shared expert) and
Qwen3-MoE (`Qwen3MoeForCausalLM`: per-head q/k RMSNorm, no shared expert)."""

from __future__ import annotations

from typing import Any

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.models.hf_config import common_fields, every_layer_if
from freetoken_jax.models.registry import Family, register


def _moe_layers(d: dict[str, Any]) -> tuple[bool, ...]:
    n, step = d["num_hidden_layers"], d.get("decoder_sparse_step", 1) or 1
    only_mlp = set(d.get("mlp_only_layers") or ())
    return tuple(i not in only_mlp and (i + 1) % step == 0 for i in range(n))


def _qwen2_sliding(d: dict[str, Any]) -> tuple[bool, ...] | None:
    """transformers' Qwen2-MoE rule: with `use_sliding_window`, layers 0, 2, 4, ... below
    `max_window_layers` slide."""
    if not d.get("use_sliding_window", False):
        return None
    return tuple(i % 2 == 0 and i < d.get("max_window_layers", 28) for i in range(d["num_hidden_layers"]))


def qwen2_config(d: dict[str, Any]) -> MoEModelConfig:
    return MoEModelConfig(
        **common_fields(d, _qwen2_sliding),
        family="qwen2_moe",
        intermediate_dim=d["intermediate_size"],
        moe_intermediate_dim=d["moe_intermediate_size"],
        num_experts=d["num_experts"],
        top_k=d["num_experts_per_tok"],
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        qkv_bias=bool(d.get("qkv_bias", True)),
        shared_expert_dim=d.get("shared_expert_intermediate_size", 0) or 0,
        shared_expert_gate=bool(d.get("shared_expert_intermediate_size")),
        moe_layers=_moe_layers(d),
    )


def qwen3_config(d: dict[str, Any]) -> MoEModelConfig:
    bias = bool(d.get("attention_bias", False))
    return MoEModelConfig(
        **common_fields(d, lambda d: every_layer_if(d.get("use_sliding_window", False), d)),
        family="qwen3_moe",
        intermediate_dim=d["intermediate_size"],
        moe_intermediate_dim=d["moe_intermediate_size"],
        num_experts=d.get("num_experts", d.get("num_local_experts")),
        top_k=d["num_experts_per_tok"],
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        moe_layers=_moe_layers(d),
    )


QWEN2 = register(Family("qwen2_moe", ("Qwen2MoeForCausalLM",), qwen2_config, renames=(("shared_experts", "shared_expert"),)))
QWEN3 = register(Family("qwen3_moe", ("Qwen3MoeForCausalLM",), qwen3_config))
