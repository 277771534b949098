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


def sliding_windows(d: dict[str, Any], default_layers=None) -> dict[str, Any]:
    """`sliding_window` and `sliding_layers` as transformers reads them: the config's
    `layer_types` where it lists them (sliding layers use `sliding_window`), else
    `default_layers(d)`, the family's rule (a tuple of booleans per layer, or None: no window)."""
    types = d.get("layer_types")
    if types is not None:
        if len(types) != d["num_hidden_layers"]:
            raise ConfigError(f"layer_types has {len(types)} entries for {d['num_hidden_layers']} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ConfigError(f"layer_types {sorted(unknown)} are not supported (sliding_attention, full_attention)")
        layers = tuple(t == "sliding_attention" for t in types)
    else:
        layers = default_layers(d) if default_layers else None
    if not layers or not any(layers):
        return {}
    w = d.get("sliding_window")
    if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
        raise ConfigError(f"sliding-window layers need a positive integer sliding_window, got {w!r}")
    return dict(sliding_window=w, sliding_layers=layers)


def every_layer_if(on: bool, d: dict[str, Any]) -> tuple[bool, ...] | None:
    """Every layer sliding when `on` and the config sets a `sliding_window`."""
    return (True,) * d["num_hidden_layers"] if on and d.get("sliding_window") else None


def common_fields(d: dict[str, Any], default_sliding_layers=None) -> dict[str, Any]:
    """The fields every family reads alike; `default_sliding_layers(d)`: the family's sliding
    layers when the config lists no `layer_types` (`sliding_windows`)."""
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
        **sliding_windows(d, default_sliding_layers),
    )
