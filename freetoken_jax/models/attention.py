"""Attention over the paged KV cache (Flax NNX): grouped-query attention (Mixtral, Qwen2/3-MoE,
GLM, gpt-oss, generic) and multi-head latent attention (DeepSeek), and the functions they attend
with — `attend` over gathered entries, `attend_paged` through the page table in blocks,
`attend_chunk` for a prefill chunk (its own keys through flash attention), `attend_latent` for
MLA decode — with the switches that pick the kernels (`decode_attention_kernel`, `mla_decode`,
`prefill_attention`, `prefill_cached`).

Array names carry their shape as a suffix, as in `models/layers.py`: B batch, T tokens of this
step, S cached key positions, P pages, H heads, K KV heads, R latent rank. Softmax in float32;
products accumulate in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from freetoken_jax.config import MoEModelConfig, env_choice
from freetoken_jax.memory import kv_cache
from freetoken_jax.memory.kv_cache import KVView, LayerKV, gather_pages, page_size_of, take_pages
from freetoken_jax.models.layers import RMSNorm, apply_rope, linear, normed_projections, project, residual, softmax_scale, use_norm_matvec
from freetoken_jax.models.stacked import kernel_operand
from pallas_kernels import chunk_attention, decode_attention


def attend(q_BTHd, k_BSKd, v_BSKe, mask_BTS, scale: float, sinks_H=None) -> jax.Array:
    """Grouped-query attention over gathered cache entries; softmax in float32. `sinks_H`: a
    learned logit per head that joins every softmax's denominator and attends to nothing
    (gpt-oss)."""
    B, T, H, _ = q_BTHd.shape
    K = k_BSKd.shape[2]
    q = q_BTHd.reshape(B, T, K, H // K, -1)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k_BSKd, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask_BTS[:, None, None], s, -1e30)
    if sinks_H is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sink = sinks_H.astype(jnp.float32).reshape(1, K, H // K, 1, 1)
        m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
        e = jnp.exp(s - m)
        p = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))
    o = jnp.einsum("bkgts,bske->btkge", p.astype(v_BSKe.dtype), v_BSKe, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, -1).astype(q_BTHd.dtype)


def attend_latent(q_nope_BTHd, q_rot_BTHr, lat_BSR, rot_BSr, w_uk_HdR, w_uv_HeR, mask_BTS, scale: float) -> jax.Array:
    """Multi-head latent attention over cached latents `lat_BSR` and rotated shared keys
    `rot_BSr`, with the key and value up-projections (`kv_b_proj`'s rows, [H, d, R] and
    [H, e, R]) taken into the query and the output: each head's query moves into the latent
    space (q_nope · W_uk), attends over the latents themselves, and its latent output comes back
    through W_uv — as `attend` over the keys and values expanded from every cached latent (S · H ·
    R · (d + e) products a step to expand them, where this takes H · R · (d + e) + S · H · (2R +
    r)). Softmax in float32; products of the model's dtype accumulated in float32."""
    dt = lat_BSR.dtype
    f32 = dict(preferred_element_type=jnp.float32)
    q_lat = to_latent(q_nope_BTHd, w_uk_HdR, dt)
    s = jnp.einsum("bthr,bsr->bhts", q_lat, lat_BSR, **f32) + jnp.einsum("bthr,bsr->bhts", q_rot_BTHr, rot_BSr, **f32)
    s = jnp.where(mask_BTS[:, None], s * scale, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    o_lat = jnp.einsum("bhts,bsr->bthr", p.astype(dt), lat_BSR, **f32).astype(dt)
    return from_latent(o_lat, w_uv_HeR, q_nope_BTHd.dtype)


def to_latent(q_nope_BTHd, w_uk_HdR, dtype) -> jax.Array:
    """Each head's query in the latent space (q_nope · W_uk), float32 products rounded to `dtype`."""
    return jnp.einsum("bthd,hdr->bthr", q_nope_BTHd, w_uk_HdR, preferred_element_type=jnp.float32).astype(dtype)


def from_latent(o_lat_BTHR, w_uv_HeR, dtype) -> jax.Array:
    """Each head's latent output back through W_uv, float32 products rounded to `dtype`."""
    return jnp.einsum("bthr,her->bthe", o_lat_BTHR, w_uv_HeR, preferred_element_type=jnp.float32).astype(dtype)


def attend_paged(
    q_BTHd, pages: tuple, view: KVView, scale: float, kv_of, sinks_H=None, window: int = 0, layer: int | None = None
) -> jax.Array:
    """`attend` over the entries `view` gathers from `pages` (one pool per stored tensor; with
    `layer`, pool `layer` of each of the stacked pools a `kv_cache.LayerKV` holds) that
    `view.mask(window)` lets each token read, keys and values made by `kv_of(gathered)` ->
    (k_BSKd, v_BSKe). A step of one token per row, or a page table of at most
    `kv_cache.ATTN_BLOCK` positions, gathers everything and calls `attend`. A step of many tokens
    (prefill) goes through the table in blocks of that many positions with a running softmax,
    each block's mask made as it is read (`KVView.block_mask`), and stops after the last block
    that any of its queries may read, so that its cost follows the positions it reads rather
    than `max_context` (a 2048-token chunk in an 8192-token context reads a quarter of the table)."""
    if q_BTHd.shape[1] == 1 or view.page_table_BP.shape[1] <= kv_cache.attention_block_pages(page_size_of(pages[0], layer)):
        k, v = kv_of(tuple(gather_pages(p, view, layer) for p in pages))
        return attend(q_BTHd, k, v, view.mask(window), scale, sinks_H)
    _, den, acc = _fold_blocks(q_BTHd, pages, view, scale, kv_of, sinks_H, window, layer=layer)
    B, T, K, G, e = acc.shape
    return (acc / jnp.moveaxis(den, 3, 1)[..., None]).reshape(B, T, K * G, e).astype(q_BTHd.dtype)


def _fold_blocks(
    q_BTHd, pages: tuple, view: KVView, scale: float, kv_of, sinks_H=None, window: int = 0, below=None, layer: int | None = None
):
    """The running softmax of `attend_paged` over the table's blocks up to the last one any query
    reads (none when none is read; `below` [B]: only entries at positions under it): (max
    [B, K, G, T], denominator [B, K, G, T], numerator [B, T, K, G, e]), float32, the sink
    (gpt-oss) counted as one more key of value 0."""
    B, T = q_BTHd.shape[:2]
    P, page = view.page_table_BP.shape[1], page_size_of(pages[0], layer)
    bp = kv_cache.attention_block_pages(page)
    nb, W = -(-P // bp), bp * page
    table = jnp.pad(view.page_table_BP, ((0, 0), (0, nb * bp - P)))
    blocks = (view.entries_read(below) + W - 1) // W  # blocks up to the last position read

    def block(i):
        pg = jax.lax.dynamic_slice_in_dim(table, i * bp, bp, axis=1)
        k, v = kv_of(tuple(take_pages(p, pg, layer) for p in pages))
        K = k.shape[2]
        q = q_BTHd.reshape(B, T, K, q_BTHd.shape[2] // K, -1)
        sc = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
        m = view.block_mask(i * W, W, window, below)
        return jnp.where(m[:, None, None], sc, -1e30), v

    def fold(carry, sc, v):
        mx, den, acc = carry  # running max and denominator [B, K, G, T], numerator [B, T, K, G, e]
        new = jnp.maximum(mx, jnp.max(sc, axis=-1))
        p = jnp.exp(sc - new[..., None])
        corr = jnp.exp(mx - new)
        pv = jnp.einsum("bkgts,bske->btkge", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return new, den * corr + jnp.sum(p, axis=-1), acc * jnp.moveaxis(corr, 3, 1)[..., None] + pv

    sc, v = jax.eval_shape(block, 0)
    K, G = sc.shape[1:3]
    # a sink is one more key of value 0: it starts the running max and denominator
    sink = -1e30 if sinks_H is None else sinks_H.astype(jnp.float32).reshape(1, K, G, 1)
    mx = jnp.broadcast_to(jnp.asarray(sink, jnp.float32), sc.shape[:-1])
    den = jnp.full(sc.shape[:-1], 0.0 if sinks_H is None else 1.0, jnp.float32)
    acc = jnp.zeros((B, T, K, G, v.shape[-1]), jnp.float32)
    return jax.lax.fori_loop(0, blocks, lambda i, c: fold(c, *block(i)), (mx, den, acc))


def prefill_attention(cfg: MoEModelConfig, dtype) -> str:
    """How a step of many tokens (a prefill chunk) attends (FREETOKEN_PREFILL_ATTENTION):
    "blocked" — `attend_paged` over the page table, the chunk's own positions included;
    "flash" — `attend_chunk`: the chunk's own keys through `pallas_kernels/chunk_attention.py`
    (cuDNN's flash attention on a GPU, its jnp reference elsewhere), the positions cached before
    the chunk through `attend_paged`'s blocks; "auto" (unset) — "flash" on a GPU where cuDNN
    takes the model's heads and dtype, else "blocked"."""
    how = env_choice("FREETOKEN_PREFILL_ATTENTION", "auto", ("auto", "blocked", "flash"))
    if how == "auto":
        mla = cfg.attention == "mla"
        d_qk, d_v = (cfg.qk_head_dim, cfg.v_head_dim) if mla else (cfg.head_dim, cfg.head_dim)
        fits = chunk_attention.cudnn_fits(dtype, d_qk, d_v)
        return "flash" if fits and jax.default_backend() == "gpu" else "blocked"
    return how


def prefill_cached() -> str:
    """How a chunk under the "flash" prefill attention reads the positions cached before it
    (FREETOKEN_PREFILL_CACHED): "blocks" (the default) — `attend_paged`'s blocks, up to the last
    one read; "flash" — the page table gathered whole and `chunk_attention` with each row's
    prefix length (cuDNN's padding mask on a GPU). "flash" serves GQA/MHA layers without a window;
    MLA (whose keys would be expanded from every cached latent) and windowed layers keep the blocks."""
    return env_choice("FREETOKEN_PREFILL_CACHED", "blocks", ("blocks", "flash"))


def attend_chunk(q_BTHd, k_BTKd, v_BTKe, pages: tuple, view: KVView, scale: float, kv_of, sinks_H=None, window: int = 0,
                 cached: str = "blocks", layer: int | None = None):  # fmt: skip
    """`attend_paged` for a prefill chunk whose row b holds its tokens at consecutive positions
    from `view.positions_BT[b, 0]` (`PrefillBatch.chunk`), given the chunk's own keys and values
    `k_BTKd`, `v_BTKe` (as `kv_of` makes them): the chunk against itself through
    `chunk_attention` (cuDNN's flash attention on a GPU where it takes the heads, else the jnp
    reference); the positions cached before the chunk (none for a prompt's first chunk) through
    `attend_paged`'s blocks, or with `cached` "flash" (no window; `view` in position order)
    through `chunk_attention` over the whole table gathered, each row reading its prefix; the
    softmaxes (and a sink's logit) joined by their log-sum-exps. The chunk's own entries are read
    from `k_BTKd` and `v_BTKe`, not from the pages. `layer`: as `attend_paged` takes it."""
    B, T, H = q_BTHd.shape[:3]

    def impl(k, v):
        fits = chunk_attention.cudnn_fits(q_BTHd.dtype, q_BTHd.shape[-1], v.shape[-1]) and k.dtype == q_BTHd.dtype
        return "cudnn" if fits and jax.default_backend() == "gpu" else "ref"

    o, lse = chunk_attention.attention(q_BTHd, k_BTKd, v_BTKe, scale=scale, window=window, implementation=impl(k_BTKd, v_BTKe))
    total = (lse, jnp.ones_like(lse), o)
    if cached == "flash" and not window:
        k, v = kv_of(tuple(gather_pages(p, view, layer) for p in pages))
        o_c, lse_c = chunk_attention.attention(q_BTHd, k, v, scale=scale, lengths_B=view.positions_BT[:, 0], implementation=impl(k, v))
        total = _merge(total, (lse_c, jnp.ones_like(lse_c), o_c))
        if sinks_H is not None:  # a sink is one more logit, of value 0
            sink = jnp.broadcast_to(sinks_H.astype(jnp.float32), lse.shape)
            total = _merge(total, (sink, jnp.ones_like(sink), jnp.zeros_like(o)))
    else:
        mx, den, acc = _fold_blocks(q_BTHd, pages, view, scale, kv_of, sinks_H, window, below=view.positions_BT[:, 0], layer=layer)
        mx, den = (jnp.moveaxis(a, 3, 1).reshape(B, T, H) for a in (mx, den))
        total = _merge(total, (mx, den, acc.reshape(B, T, H, -1)))
    _, den, num = total
    return (num / den[..., None]).astype(q_BTHd.dtype)


def _merge(a, b):
    """Two softmaxes' running (max, denominator, numerator) as one: the numerator and
    denominator are relative to the max."""
    (ma, da, na), (mb, db, nb) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return m, da * ca + db * cb, na * ca[..., None] + nb * cb[..., None]


class Attention(nnx.Module):
    """Grouped-query attention (Mixtral, Qwen2-MoE, Qwen3-MoE, generic) over a paged KV cache."""

    def __init__(self, cfg: MoEModelConfig, dtype, rngs: nnx.Rngs, window: int = 0):
        D, H, K, hd = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = linear(D, H * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = linear(D, K * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = linear(D, K * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = linear(H * hd, D, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.sinks = nnx.Param(jnp.zeros((H,), jnp.float32)) if cfg.attention_sinks else None
        self.cfg, self.window = cfg, window

    def __call__(self, x_BTD, cos_sin, kv: LayerKV, view: KVView, norm: RMSNorm | None = None, add=None):
        """(output, its group's KV pools with this step written, the residual stream x_BTD + add). `norm`: the layer's input
        norm, applied here to that stream so that a step of one token a row may compute the add,
        the norm and the projections in one kernel (`norm_matvec_kernel`)."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if norm is not None and use_norm_matvec(B, T, x_BTD.shape[2], [p.weight.shape[0] for p in projs]):
            biases = [None if p.bias is None else p.bias[...] for p in projs]
            q, k, v, *s = normed_projections(
                norm, x_BTD[:, 0], [p.weight[...] for p in projs], biases, add_BD=None if add is None else add[:, 0]
            )
            q, k, v = (a[:, None] for a in (q, k, v))
            stream = s[0][:, None] if s else x_BTD
        else:
            stream = residual(x_BTD, add)
            x_BTD = stream if norm is None else norm(stream)
            q, k, v = (p(x_BTD) for p in projs)
        q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        sinks = None if self.sinks is None else self.sinks[...]
        how = decode_attention_kernel(cfg) if T == 1 else "xla"
        if how == "fused":  # norms, rotation, page writes and attention in one kernel
            fresh = decode_attention.Fresh(k[:, 0], v[:, 0], view.write_page_BT[:, 0], view.write_off_BT[:, 0], cos_sin[0][:, 0], cos_sin[1][:, 0],
                                           None if self.q_norm is None else kernel_operand(self.q_norm.weight[...]),
                                           None if self.k_norm is None else kernel_operand(self.k_norm.weight[...]), cfg.rms_norm_eps,
                                           cfg.rope_interleave)  # fmt: skip
            o, *pools = decode_attention.attention(q[:, 0], *kv.pools, view.page_table_BP, view.mask(self.window)[:, 0], scale=softmax_scale(cfg),
                                                   sinks_H=kernel_operand(sinks), fresh=fresh, layer=kv.index, interpret=jax.default_backend() == "cpu")  # fmt: skip
            return project(self.o_proj, o.reshape(B, T, -1)), tuple(pools), stream
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rd = cfg.rope_dim  # partial rotary: the rest of each head passes as it is
        rope = lambda x: apply_rope(x, *cos_sin, cfg.rope_interleave)  # noqa: E731
        q, k = (rope(a) if rd == cfg.head_dim else jnp.concatenate([rope(a[..., :rd]), a[..., rd:]], axis=-1) for a in (q, k))
        pages, layer = kv.write(view, k, v)
        if how == "kernel":
            o = decode_attention.attention(q[:, 0], *pages, view.page_table_BP, view.mask(self.window)[:, 0], scale=softmax_scale(cfg),
                                           sinks_H=kernel_operand(sinks), layer=layer, interpret=jax.default_backend() == "cpu")[:, None]  # fmt: skip
        elif T > 1 and prefill_attention(cfg, q.dtype) == "flash":
            own = tuple(a.astype(p.dtype) for a, p in zip((k, v), pages))
            o = attend_chunk(q, *own, pages, view, softmax_scale(cfg), lambda kv: kv, sinks, self.window, prefill_cached(), layer)
        else:
            o = attend_paged(q, pages, view, softmax_scale(cfg), lambda kv: kv, sinks, self.window, layer)
        return project(self.o_proj, o.reshape(B, T, -1)), pages, stream


def decode_attention_kernel(cfg: MoEModelConfig) -> str:
    """How a step of one token per row attends (FREETOKEN_DECODE_ATTENTION): "xla" — XLA's
    norms, rotations, page writes, gather, matmuls and softmax, ten to twelve kernels a layer;
    "kernel" — the attention in one kernel of `pallas_kernels/decode_attention.py`, where it takes
    the model's heads; "fused" — norms, rotation and page writes in that kernel too, where the
    whole head is rotated (else "kernel"); "auto" (unset) — "fused" on a GPU where it fits (on the
    H200 it took a 24-layer Qwen3-30B-A3B step from 2.74 to 2.54 ms: benchmarks/RESULTS.md), else
    "xla". MLA decoding in the latent space: "kernel" and "fused" attend over the latent and
    rotated key pages in the kernel where their widths fit; "auto" keeps XLA's (the kernel not
    yet measured on a GPU)."""
    how = env_choice("FREETOKEN_DECODE_ATTENTION", "auto", ("auto", "xla", "kernel", "fused"))
    if cfg.attention == "mla":  # in the latent space (`mla_decode`): one kv head, its key's latent and rotated parts
        fits = decode_attention.fits(cfg.num_heads, 1, (cfg.kv_lora_rank, cfg.qk_rope_head_dim), cfg.kv_lora_rank)
        return "kernel" if how in ("kernel", "fused") and fits else "xla"
    fits = decode_attention.fits(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    fresh = fits and decode_attention.fresh_fits(cfg.head_dim, cfg.rope_dim)
    if how == "auto":
        return "fused" if fresh and jax.default_backend() == "gpu" else "xla"
    if how == "xla" or not fits:
        return "xla"
    return "fused" if how == "fused" and fresh else "kernel"


def mla_decode() -> str:
    """How a step of one token a row attends under MLA (FREETOKEN_MLA_DECODE): "latent" (the
    default) — `attend_latent`, the up-projections taken into the query and the output;
    "expanded" — every cached entry's key and value expanded from its latent, then `attend`."""
    return env_choice("FREETOKEN_MLA_DECODE", "latent", ("latent", "expanded"))


class MLAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2/V3). The cache holds the normalised latent
    [R] and the rotated shared rope key per token. A step of many tokens expands keys and values
    from the latents it reads (`attend_paged`); a step of one token a row attends in the latent
    space (`attend_latent`, `mla_decode`)."""

    def __init__(self, cfg: MoEModelConfig, dtype, rngs: nnx.Rngs):
        D, H = cfg.hidden_dim, cfg.num_heads
        if cfg.q_lora_rank:
            self.q_a_proj = linear(D, cfg.q_lora_rank, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False, dtype=dtype, rngs=rngs)
            self.q_proj = None
        else:
            self.q_proj = linear(D, H * cfg.qk_head_dim, bias=False, dtype=dtype, rngs=rngs)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, dtype=dtype, rngs=rngs)
        self.o_proj = linear(H * cfg.v_head_dim, D, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        self.cfg = cfg

    def __call__(self, x_BTD, cos_sin, kv: LayerKV, view: KVView, norm: RMSNorm | None = None, add=None):
        """(output, its group's latent and rotated key pools with this step written, the residual
        stream x_BTD + add); `norm`: the layer's input
        norm, applied to that stream first (as `Attention` takes them)."""
        stream = residual(x_BTD, add)
        x_BTD = stream if norm is None else norm(stream)
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        H, dn, dr, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q = q.reshape(B, T, H, dn + dr)
        q_nope, q_rot = q[..., :dn], q[..., dn:]
        ckv = self.kv_a_proj_with_mqa(x_BTD)
        latent_BTR = self.kv_a_layernorm(ckv[..., : cfg.kv_lora_rank])
        k_rot = ckv[..., cfg.kv_lora_rank :].reshape(B, T, 1, dr)
        q_rot = apply_rope(q_rot, *cos_sin, cfg.rope_interleave)
        k_rot = apply_rope(k_rot, *cos_sin, cfg.rope_interleave)[:, :, 0]
        pages, layer = kv.write(view, latent_BTR, k_rot)
        lat_pages, rot_pages = pages

        def kv_of(gathered):  # keys and values of gathered entries, expanded from the latent
            lat_BSR, rot_BSr = gathered
            S = lat_BSR.shape[1]
            kvb = self.kv_b_proj(lat_BSR).reshape(B, S, H, dn + dv)
            return jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(rot_BSr[:, :, None], (B, S, H, dr))], axis=-1), kvb[..., dn:]

        if T == 1 and mla_decode() == "latent":  # decode: attention in the latent space, no key or value expanded
            w = self.kv_b_proj.weight[...].reshape(H, dn + dv, cfg.kv_lora_rank)
            if decode_attention_kernel(cfg) == "kernel":  # the latent and rotated key read from their pages in one kernel
                q = jnp.concatenate([to_latent(q_nope, w[:, :dn], lat_pages.dtype), q_rot.astype(lat_pages.dtype)], axis=-1)
                lat, rot = lat_pages[..., None, :], rot_pages[..., None, :]  # one kv head
                o_lat = decode_attention.attention(q[:, 0], (lat, rot), lat, view.page_table_BP, view.mask_BTS[:, 0], scale=softmax_scale(cfg),
                                                   layer=layer, interpret=jax.default_backend() == "cpu")  # fmt: skip
                o = from_latent(o_lat[:, None], w[:, dn:], q_nope.dtype)
            else:
                lat, rot = gather_pages(lat_pages, view, layer), gather_pages(rot_pages, view, layer)
                o = attend_latent(q_nope, q_rot, lat, rot, w[:, :dn], w[:, dn:], view.mask_BTS, softmax_scale(cfg))
        else:
            q_BTHd = jnp.concatenate([q_nope, q_rot], axis=-1)
            scale = softmax_scale(cfg)
            if T > 1 and prefill_attention(cfg, q.dtype) == "flash":
                k_new, v_new = kv_of((latent_BTR.astype(lat_pages.dtype), k_rot.astype(rot_pages.dtype)))
                o = attend_chunk(q_BTHd, k_new, v_new, pages, view, scale, kv_of, layer=layer)
            else:
                o = attend_paged(q_BTHd, pages, view, scale, kv_of, layer=layer)
        return project(self.o_proj, o.reshape(B, T, -1)), pages, stream
