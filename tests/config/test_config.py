import dataclasses

import jax
import jax.numpy as jnp
import pytest

from freetoken_jax import ConfigError, EngineConfig, MoEModelConfig
from freetoken_jax.models.registry import config_from_hf


def test_generic_short_form_defaults():
    cfg = MoEModelConfig(vocab_size=32000, hidden_dim=2048, intermediate_dim=5632, num_layers=12, num_experts=16, top_k=2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (16, 16, 128)
    assert cfg.moe_intermediate_dim == 5632 and cfg.moe_layers == (True,) * 12
    assert cfg.expert_params == 3 * 2048 * 5632


def test_config_is_a_static_jit_argument():
    cfg = MoEModelConfig(vocab_size=10, hidden_dim=8, intermediate_dim=8, num_layers=1, num_experts=2, top_k=1, num_heads=2)
    f = jax.jit(lambda c, x: x * c.hidden_dim, static_argnums=0)
    assert int(f(cfg, jnp.int32(2))) == 16
    assert int(f(dataclasses.replace(cfg), jnp.int32(3))) == 24
    assert f._cache_size() == 1  # equal configs hash alike


def test_unsupported_architecture_names_supported_ones():
    with pytest.raises(ConfigError) as e:
        config_from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    for name in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert name in str(e.value)


def test_missing_key_is_reported():
    with pytest.raises(ConfigError, match="num_local_experts"):
        config_from_hf(
            {
                "architectures": ["MixtralForCausalLM"],
                "vocab_size": 10,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 8,
                "num_experts_per_tok": 1,
            }
        )


@pytest.mark.parametrize(
    "kw", [dict(top_k=0), dict(top_k=5), dict(num_experts=0), dict(hidden_act="relu6"), dict(num_heads=3, num_kv_heads=2)]
)
def test_invalid_model_configs(kw):
    base = dict(vocab_size=10, hidden_dim=8, intermediate_dim=8, num_layers=1, num_experts=4, top_k=2, num_heads=2)
    with pytest.raises(ConfigError):
        MoEModelConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "kw", [dict(dtype="int8"), dict(moe_strategy="magic"), dict(page_size=0), dict(prefill_chunk=48), dict(kv_pages=1)]
)
def test_invalid_engine_configs(kw):
    with pytest.raises(ConfigError):
        EngineConfig(**kw)


def test_sliding_windows_are_read_as_transformers_reads_them():
    qwen3 = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4,
             "num_attention_heads": 2, "intermediate_size": 8, "moe_intermediate_size": 8, "num_experts": 2, "num_experts_per_tok": 1}  # fmt: skip
    mixtral = {**qwen3, "architectures": ["MixtralForCausalLM"], "num_local_experts": 2}
    qwen2 = {**qwen3, "architectures": ["Qwen2MoeForCausalLM"]}

    def windows(d):
        cfg = config_from_hf(d)
        return [cfg.window_of(i) for i in range(cfg.num_layers)]

    assert windows({**mixtral, "sliding_window": 7}) == [7] * 4  # Mistral's: every layer when set
    assert windows({**mixtral, "sliding_window": None}) == [0] * 4
    assert windows({**qwen3, "sliding_window": 7}) == [0] * 4  # Qwen: only with use_sliding_window
    assert windows({**qwen3, "sliding_window": 7, "use_sliding_window": True}) == [7] * 4
    assert windows({**qwen2, "sliding_window": 7, "use_sliding_window": True, "max_window_layers": 3}) == [7, 0, 7, 0]
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    assert windows({**mixtral, "sliding_window": 7, "layer_types": types}) == [7, 0, 0, 7]  # listed layer types win
    for bad, match in (({"layer_types": types}, "sliding_window"), ({"layer_types": types[:2], "sliding_window": 3}, "entries"),
                       ({"layer_types": ["chunked_attention"] * 4, "sliding_window": 3}, "not supported"),
                       ({"sliding_window": -2}, "sliding_window")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            config_from_hf({**mixtral, **bad})
    mla = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 8, "moe_intermediate_size": 8, "n_routed_experts": 2, "num_experts_per_tok": 1, "kv_lora_rank": 4,
           "qk_rope_head_dim": 2, "qk_nope_head_dim": 2, "v_head_dim": 2, "layer_types": ["sliding_attention"] * 2, "sliding_window": 3}  # fmt: skip
    with pytest.raises(ConfigError, match="MLA"):  # refused with the reason, never ignored
        config_from_hf(mla)
