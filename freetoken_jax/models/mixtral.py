"""Mixtral (`MixtralForCausalLM`): GQA, softmax top-k routing renormalised over the chosen experts;
`sliding_window` (Mistral's), when set, in every layer."""

from __future__ import annotations

from typing import Any

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.models.hf_config import common_fields, every_layer_if
from freetoken_jax.models.registry import Family, register


def config_from_hf(d: dict[str, Any]) -> MoEModelConfig:
    return MoEModelConfig(
        **common_fields(d, lambda d: every_layer_if(True, d)),  # `sliding_window` set: every layer slides
        family="mixtral",
        intermediate_dim=d["intermediate_size"],
        num_experts=d["num_local_experts"],
        top_k=d["num_experts_per_tok"],
        norm_topk_prob=True,
    )


MIXTRAL = register(
    Family(
        "mixtral",
        ("MixtralForCausalLM",),
        config_from_hf,
        renames=(("mlp", "block_sparse_moe"),),
        expert_names=("w1", "w3", "w2"),
    )
)
