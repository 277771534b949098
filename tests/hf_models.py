"""Tiny random checkpoints of every supported family, made with transformers (the oracle)."""

from __future__ import annotations

import os

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, initializer_range=0.05)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, moe_intermediate_size=32, num_key_value_heads=4)

VARIANTS = {
    "mixtral": lambda: MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=3,
        mlp_only_layers=[1],
    ),
    # five MoE layers: a buffered prefill's middle layers (neither the first nor the last two)
    "mixtral_deep": lambda: MixtralConfig(
        **{**COMMON, "num_hidden_layers": 5}, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2
    ),
    # sliding windows shorter than the test sequences: every layer (Mixtral), layers 0 and 2 (Qwen2's rule)
    "mixtral_swa": lambda: MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, sliding_window=5),
    "qwen2_moe_swa": lambda: Qwen2MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=3,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=3,
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=24, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False
    ),
    "qwen3_moe_norm": lambda: Qwen3MoeConfig(
        **COMMON, num_key_value_heads=1, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    ),
    # sizes that are whole K-quant super-blocks (256)
    "qwen3_moe_k": lambda: Qwen3MoeConfig(
        **{**COMMON, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2},
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    # alternating sliding (window 6) and full layers, sinks and every bias nonzero (set below), YaRN rope
    "gpt_oss": lambda: GptOssConfig(
        **{**COMMON, "intermediate_size": 32},
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=6,
        max_position_embeddings=4096,
    ),
    # partial rotary (a quarter of each head), q/k norm, q/k/v biases, a dense first layer, shared expert, V3-style grouped routing
    "glm4_moe": lambda: Glm4MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        use_qk_norm=True,
        attention_bias=True,
    ),
    "deepseek_v2": lambda: DeepseekV2Config(
        **COMMON, **MLA, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=None, first_k_dense_replace=1
    ),
    # a rotated key of 16 (the decode attention kernel's narrowest part)
    "deepseek_v2_rope16": lambda: DeepseekV2Config(
        **COMMON,
        **{**MLA, "qk_rope_head_dim": 16},
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        q_lora_rank=None,
        first_k_dense_replace=1,
    ),
    "deepseek_v2_qlora": lambda: DeepseekV2Config(
        **COMMON,
        **MLA,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        q_lora_rank=24,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
    "deepseek_v3": lambda: DeepseekV3Config(
        **COMMON,
        **MLA,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        q_lora_rank=24,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=512,
            mscale=1.0,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),
        max_position_embeddings=2048,
    ),
}


def make_checkpoint(name: str, root: str) -> str:
    """Creates (once) and returns the directory of variant `name`'s random checkpoint."""
    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(VARIANTS[name](), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) and not p.any():  # learned offsets a zero init would leave untested
                p.copy_(torch.randn_like(p) * (0.5 if name.endswith("sinks") else 0.05))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
            if gate is not None and hasattr(gate, "weight") and gate.weight.shape[0] > 1:
                gate.weight.mul_(40.0)  # routing margins far above float rounding
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias) * 0.3)
    model.save_pretrained(path)
    return path


def load_hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check_prompt_logits(name: str, root: str, seed: int, length: int, **engine_kw) -> None:
    """The engine's logits for a random prompt (float32, pages of 4, 96 positions unless
    `engine_kw` says otherwise) equal transformers' for checkpoint `name` within 1e-4."""
    import numpy as np

    from freetoken_jax import EngineConfig, FreeTokenEngine

    path = make_checkpoint(name, root)
    engine = FreeTokenEngine.from_pretrained(
        path, EngineConfig(**{"dtype": "float32", "max_context": 96, "max_batch": 2, "page_size": 4, **engine_kw})
    )
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 96, length)]
    with torch.no_grad():
        ref = load_hf(path)(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(engine.logits(prompt), ref, atol=1e-4, rtol=0, err_msg=name)
