"""gpt-oss (`GptOssForCausalLM`): grouped-query attention with biases and a learned sink logit per
head, sliding-window (128) and full layers alternating, YaRN rope; a router with a bias and
softmax over its top-k logits; experts with biases and a clamped SwiGLU (`swiglu_oai`), stored in
checkpoints as one interleaved `gate_up_proj` (MXFP4 in the released ones)."""

from __future__ import annotations

from typing import Any

from freetoken_jax.config import SWIGLU_OAI, ConfigError, MoEModelConfig
from freetoken_jax.models.hf_config import common_fields
from freetoken_jax.models.registry import Family, register


def _alternating(d: dict[str, Any]) -> tuple[bool, ...]:
    """transformers' default `layer_types`: layers 0, 2, 4, ... slide."""
    return tuple(i % 2 == 0 for i in range(d["num_hidden_layers"]))


def config_from_hf(d: dict[str, Any]) -> MoEModelConfig:
    act = (d.get("swiglu_alpha", SWIGLU_OAI[0]), d.get("swiglu_limit", SWIGLU_OAI[1]))
    if tuple(map(float, act)) != SWIGLU_OAI:
        raise ConfigError(f"gpt-oss with swiglu_alpha/limit {act} is not supported (the released models use {SWIGLU_OAI})")
    fields = common_fields(d, _alternating)
    fields["hidden_act"] = "swiglu_oai"
    bias = bool(d.get("attention_bias", True))
    return MoEModelConfig(
        **fields,
        family="gpt_oss",
        intermediate_dim=d["intermediate_size"],
        num_experts=d["num_local_experts"],
        top_k=d["num_experts_per_tok"],
        norm_topk_prob=True,  # softmax over the top-k logits = softmax over all, renormalised over the top k
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        router_bias=True,
        expert_bias=True,
    )


GPT_OSS = register(Family("gpt_oss", ("GptOssForCausalLM",), config_from_hf, renames=(("gate", "router"),), interleaved_gate_up=True))
