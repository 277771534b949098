"""DeepSeek-V2 (`DeepseekV2ForCausalLM`) and DeepSeek-V3 (`DeepseekV3ForCausalLM`).

Both use multi-head latent attention (with or without a low-rank query, `q_lora_rank`), shared
experts and `first_k_dense_replace` dense layers. V2 routes by softmax, optionally limited to the
best groups by their top score; V3 by sigmoid scores plus `e_score_correction_bias` for the choice
only, groups ranked by the sum of their two best, weights renormalised and scaled by
`routed_scaling_factor`. Rotary pairs are interleaved (V2 always, V3 when `rope_interleave`).
"""

from __future__ import annotations

from typing import Any

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.models.hf_config import common_fields
from freetoken_jax.models.registry import Family, register


def _common(d: dict[str, Any]) -> dict[str, Any]:
    n = d["num_hidden_layers"]
    first_dense = d.get("first_k_dense_replace", 0) or 0
    freq = d.get("moe_layer_freq", 1) or 1
    fields = common_fields(d)
    fields.update(
        attention="mla",
        intermediate_dim=d["intermediate_size"],
        moe_intermediate_dim=d["moe_intermediate_size"],
        num_experts=d["n_routed_experts"],
        top_k=d["num_experts_per_tok"],
        q_lora_rank=d.get("q_lora_rank") or None,
        kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"],
        v_head_dim=d["v_head_dim"],
        head_dim=d["qk_nope_head_dim"] + d["qk_rope_head_dim"],
        qkv_bias=bool(d.get("attention_bias", False)),
        o_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        shared_expert_dim=(d.get("n_shared_experts") or 0) * d["moe_intermediate_size"],
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0) or 1.0),
        moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(n)),
    )
    return fields


def v2_config(d: dict[str, Any]) -> MoEModelConfig:
    method = d.get("topk_method", "greedy")
    grouped = method == "group_limited_greedy"
    return MoEModelConfig(
        **_common(d),
        family="deepseek_v2",
        rope_interleave=True,
        router_scoring="softmax",
        norm_topk_prob=False,  # the V2 reference never renormalises the chosen weights
        topk_method=method,
        n_group=d.get("n_group") or 1 if grouped else 1,
        topk_group=d.get("topk_group") or 1 if grouped else 1,
    )


def v3_routing(d: dict[str, Any]) -> dict[str, Any]:
    """V3's router (GLM-4.5 routes the same way): sigmoid scores, `e_score_correction_bias` for
    the choice, groups ranked by their two best, weights renormalised unless `norm_topk_prob` is false."""
    return dict(
        router_scoring="sigmoid",
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        topk_method="noaux_tc",
        n_group=d.get("n_group") or 1,
        topk_group=d.get("topk_group") or 1,
        score_correction_bias=True,
    )


def v3_config(d: dict[str, Any]) -> MoEModelConfig:
    return MoEModelConfig(**_common(d), family="deepseek_v3", rope_interleave=bool(d.get("rope_interleave", True)), **v3_routing(d))


V2 = register(Family("deepseek_v2", ("DeepseekV2ForCausalLM",), v2_config))
V3 = register(Family("deepseek_v3", ("DeepseekV3ForCausalLM",), v3_config))
