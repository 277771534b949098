"""The decoder-only MoE transformer that every supported family instantiates.

Families differ only in configuration (attention kind, router, shared experts, dense layers);
their files map Hugging Face configs and tensor names onto this one module tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.memory.kv_cache import KVCache, KVView, LayerKV, layer_places
from freetoken_jax.models.attention import Attention, MLAttention
from freetoken_jax.models.layers import _INIT, MLP, ExpertFn, MoEBlock, RMSNorm, linear, residual, rope_cos_sin


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: MoEModelConfig, index: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_dim, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAttention(cfg, dtype, rngs) if cfg.attention == "mla" else Attention(cfg, dtype, rngs, cfg.window_of(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_dim, cfg.rms_norm_eps, dtype)
        self.is_moe = cfg.moe_layers[index]
        moe_index = sum(cfg.moe_layers[:index])  # m: this layer's place among the MoE layers
        self.mlp = MoEBlock(cfg, dtype, rngs, moe_index) if self.is_moe else MLP(cfg, cfg.intermediate_dim, dtype, rngs)

    def __call__(self, x_BTD, cos_sin, kv: LayerKV, view: KVView, expert_fn: ExpertFn | None, add=None):
        """The layer on the residual stream x_BTD + add (`add`: the previous layer's output, not
        yet added): (x, m, pools) with the stream after it x + m, m left for the next layer (or
        the final norm) to add, and its group's KV pools with this step's entries written. Each add
        goes with the norm that reads its sum: one kernel with the projections that follow in a
        step of one token a row (`layers.norm_matvec_kernel`)."""
        with jax.named_scope("attention"):
            a, kv, x_BTD = self.self_attn(x_BTD, cos_sin, kv, view, norm=self.input_layernorm, add=add)
        with jax.named_scope("moe" if self.is_moe else "mlp"):
            if self.is_moe:
                m, x_BTD = self.mlp(x_BTD, expert_fn, norm=self.post_attention_layernorm, add=a)
            else:
                x_BTD = x_BTD + a
                m = self.mlp(self.post_attention_layernorm(x_BTD))
        return x_BTD, m, kv


class MoETransformer(nnx.Module):
    def __init__(self, cfg: MoEModelConfig, dtype, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_dim, dtype=dtype, param_dtype=dtype, embedding_init=_INIT, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_dim, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else linear(cfg.hidden_dim, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        self.cfg = cfg

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array,
        view: KVView,
        cache: KVCache,
        expert_fns: Sequence[ExpertFn | None] | None = None,
        ring_view: KVView | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Runs the layers over this step's tokens, reading and extending the paged cache
        (sliding-window layers through `ring_view` when their KV is kept in rings).
        Returns the final-normed hidden states [B, T, D] and the new cache (its groups of
        layers as `kv_cache.kv_groups` makes them, in either layout)."""
        x, add = self.embed(tokens_BT), None
        cos_sin = rope_cos_sin(self.cfg, positions_BT)
        rings = tuple(ring_view is not None and self.cfg.window_of(i) > 0 for i in range(self.cfg.num_layers))
        where = layer_places(rings, cache)
        pools = list(cache)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer{i}"):
                g, j = where[i]
                x, add, pools[g] = layer(x, cos_sin, LayerKV(pools[g], j), ring_view if rings[i] else view,
                                         None if expert_fns is None else expert_fns[i], add)  # fmt: skip
        return self.norm(residual(x, add)), tuple(pools)

    def logits(self, h_TD: jax.Array) -> jax.Array:
        if self.lm_head is None:
            w = self.embed.embedding[...]
            return jnp.einsum("...d,vd->...v", h_TD, w, preferred_element_type=jnp.float32)
        return jnp.einsum("...d,vd->...v", h_TD, self.lm_head.weight[...], preferred_element_type=jnp.float32)
