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


def test_sliding_window_is_refused():
    d = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 8,
        "moe_intermediate_size": 8,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "use_sliding_window": True,
    }
    with pytest.raises(ConfigError, match="sliding"):
        config_from_hf(d)
    # Every family: a window shorter than the positions, or sliding layers, is refused; one that a
    # flag turns off, or that covers every position, is not.
    mixtral = {"architectures": ["MixtralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
               "num_attention_heads": 2, "intermediate_size": 8, "num_local_experts": 2, "num_experts_per_tok": 1,
               "max_position_embeddings": 32768}  # fmt: skip
    for bad in ({"sliding_window": 4096}, {"layer_types": ["sliding_attention"]}, {"use_sliding_window": True}):
        with pytest.raises(ConfigError, match="sliding"):
            config_from_hf({**mixtral, **bad})
    for ok in ({"sliding_window": None}, {"sliding_window": 32768}, {"sliding_window": 4096, "use_sliding_window": False},
               {"layer_types": ["full_attention"]}):  # fmt: skip
        assert config_from_hf({**mixtral, **ok}).family == "mixtral"
    qwen_off = {**d, "use_sliding_window": False, "sliding_window": 4096}
    assert config_from_hf(qwen_off).family == "qwen3_moe"
