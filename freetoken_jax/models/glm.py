"""GLM-4.5 / 4.6 MoE (`Glm4MoeForCausalLM`, the Air models too): grouped-query attention with
q/k/v biases, optional per-head q/k RMSNorm and partial rotary (the first half of each head by
default); `first_k_dense_replace` dense layers, then MoE layers with shared experts and DeepSeek-V3's
routing (sigmoid scores plus `e_score_correction_bias` for the choice, groups ranked by the sum of
their two best, weights renormalised and scaled by `routed_scaling_factor`). The checkpoints'
next-token-prediction layers (`num_nextn_predict_layers`, stored after the last layer) are not
loaded."""

from __future__ import annotations

import logging
from typing import Any

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.models.deepseek import v3_routing
from freetoken_jax.models.hf_config import common_fields
from freetoken_jax.models.registry import Family, register

log = logging.getLogger("freetoken_jax")


def config_from_hf(d: dict[str, Any]) -> MoEModelConfig:
    n, first_dense = d["num_hidden_layers"], d.get("first_k_dense_replace", 1) or 0
    fields = common_fields(d)
    factor = d.get("partial_rotary_factor", (d.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))
    mtp = d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0
    if mtp:
        log.info("GLM: %d next-token-prediction layer(s) after layer %d are not loaded (used only for speculative decoding)", mtp, n - 1)
    return MoEModelConfig(
        **fields,
        family="glm4_moe",
        intermediate_dim=d["intermediate_size"],
        moe_intermediate_dim=d["moe_intermediate_size"],
        num_experts=d["n_routed_experts"],
        top_k=d["num_experts_per_tok"],
        rotary_dim=int(fields["head_dim"] * factor),
        qkv_bias=bool(d.get("attention_bias", False)),
        qk_norm=bool(d.get("use_qk_norm", False)),
        shared_expert_dim=(d.get("n_shared_experts") or 0) * d["moe_intermediate_size"],
        **v3_routing(d),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0) or 1.0),
        moe_layers=tuple(i >= first_dense for i in range(n)),
    )


GLM4_MOE = register(Family("glm4_moe", ("Glm4MoeForCausalLM",), config_from_hf))
