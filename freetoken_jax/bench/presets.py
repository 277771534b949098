"""Named model shapes for `python -m freetoken_jax.bench decode|prefill` (seeded random weights of
the real architecture's shape: no checkpoint needed). "demo" is the shape of the engine's built-in demo model (random weights, as every preset)."""

from __future__ import annotations

import dataclasses

from freetoken_jax.config import MoEModelConfig

# gpt-oss's shape and numerics (the 120b and 20b differ in depth and experts; layers 0, 2, ... slide);
# MXFP4 experts as released.
GPT_OSS = dict(
    vocab_size=201088, hidden_dim=2880, intermediate_dim=2880, top_k=4, num_heads=64, num_kv_heads=8, head_dim=64, qkv_bias=True,
    o_bias=True, attention_sinks=True, router_bias=True, expert_bias=True, hidden_act="swiglu_oai", sliding_window=128,
    rope_theta=150000.0, rope_scaling=(("rope_type", "yarn"), ("factor", 32.0), ("beta_fast", 32.0), ("beta_slow", 1.0),
                                       ("truncate", False), ("original_max_position_embeddings", 4096)),
    max_position_embeddings=131072, rms_norm_eps=1e-5, family="gpt_oss", expert_format="mxfp4",
)  # fmt: skip

PRESETS: dict[str, MoEModelConfig | None] = {
    "qwen3-30b-a3b": MoEModelConfig(
        vocab_size=151936, hidden_dim=2048, intermediate_dim=6144, moe_intermediate_dim=768, num_layers=48, num_experts=128,
        top_k=8, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True, rope_theta=1e6, family="qwen3_moe",
        max_position_embeddings=40960,
    ),
    "qwen3-235b-a22b": MoEModelConfig(
        vocab_size=151936, hidden_dim=4096, intermediate_dim=12288, moe_intermediate_dim=1536, num_layers=94, num_experts=128,
        top_k=8, num_heads=64, num_kv_heads=4, head_dim=128, qk_norm=True, rope_theta=1e6, family="qwen3_moe",
        max_position_embeddings=40960,
    ),
    "deepseek-v2-lite": MoEModelConfig(
        vocab_size=102400, hidden_dim=2048, intermediate_dim=10944, moe_intermediate_dim=1408, num_layers=27, num_experts=64,
        top_k=6, attention="mla", num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        shared_expert_dim=2 * 1408, moe_layers=(False,) + (True,) * 26, norm_topk_prob=False, family="deepseek_v2",
        max_position_embeddings=163840,
    ),
    "mixtral-8x7b": MoEModelConfig(
        vocab_size=32000, hidden_dim=4096, intermediate_dim=14336, moe_intermediate_dim=14336, num_layers=32, num_experts=8,
        top_k=2, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-5, family="mixtral",
        max_position_embeddings=32768,
    ),
    "gpt-oss-120b": MoEModelConfig(**GPT_OSS, num_layers=36, num_experts=128, sliding_layers=(True, False) * 18),
    "gpt-oss-20b": MoEModelConfig(**GPT_OSS, num_layers=24, num_experts=32, sliding_layers=(True, False) * 12),
    "glm-4.5-air": MoEModelConfig(
        vocab_size=151552, hidden_dim=4096, intermediate_dim=10944, moe_intermediate_dim=1408, num_layers=46, num_experts=128,
        top_k=8, num_heads=96, num_kv_heads=8, head_dim=128, rotary_dim=64, qkv_bias=True, shared_expert_dim=1408,
        moe_layers=(False,) + (True,) * 45, router_scoring="sigmoid", topk_method="noaux_tc", score_correction_bias=True,
        rope_theta=1e6, rms_norm_eps=1e-5, family="glm4_moe", max_position_embeddings=131072,
    ),
    "demo": None,
}  # fmt: skip


def preset_config(name: str, layers: int | None = None) -> MoEModelConfig:
    """The preset's shape; `layers`: only its first layers (a quick check of the full width)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    if PRESETS[name] is None:
        from freetoken_jax.demo import DEMO_CONFIG

        cfg = DEMO_CONFIG
    else:
        cfg = PRESETS[name]
    if layers is None:
        return cfg
    return dataclasses.replace(cfg, num_layers=layers, moe_layers=cfg.moe_layers[:layers], sliding_layers=cfg.sliding_layers[:layers])
