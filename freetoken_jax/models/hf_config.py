"""Fields that every Hugging Face decoder config spells the same way."""

from __future__ import annotations

from typing import Any

from freetoken_jax.config import ConfigError

_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def rope_parameters(d: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from either the v5 `rope_parameters` or the older `rope_theta` +
    `rope_scaling` keys."""
    rp = dict(d.get("rope_parameters") or {})
    theta = rp.pop("rope_theta", d.get("rope_theta", 10000.0))
    if not rp and d.get("rope_scaling"):
        rp = dict(d["rope_scaling"])
    if rp.get("rope_type", rp.get("type", "default")) == "default":
        rp = {}
    return float(theta), rp


def check_no_window(d: dict[str, Any]) -> None:
    """Refuses a config whose sliding-window attention would be active (the engine attends to the
    whole context, so past the window it would compute something else): `layer_types` naming
    sliding layers, or a `sliding_window` shorter than `max_position_embeddings` that no
    `use_sliding_window: false` turns off."""
    if "sliding_attention" in (d.get("layer_types") or ()):
        raise ConfigError("sliding-window attention layers (layer_types) are not supported yet")
    w = d.get("sliding_window")
    on = d.get("use_sliding_window", isinstance(w, int) and not isinstance(w, bool))
    if on and (not isinstance(w, int) or w < d.get("max_position_embeddings", 32768)):
        raise ConfigError(
            f"sliding-window attention (sliding_window={w!r}, shorter than max_position_embeddings="
            f"{d.get('max_position_embeddings', 32768)}) is not supported yet"
        )


def common_fields(d: dict[str, Any]) -> dict[str, Any]:
    check_no_window(d)
    act = d.get("hidden_act", "silu")
    if act not in _ACT:
        raise ConfigError(f"hidden_act {act!r} is not supported; supported: {sorted(_ACT)}")
    theta, scaling = rope_parameters(d)
    heads = d["num_attention_heads"]
    eos = d.get("eos_token_id")
    return dict(
        vocab_size=d["vocab_size"],
        hidden_dim=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=tuple(scaling.items()),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        hidden_act=_ACT[act],
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
    )
