"""Building blocks shared by every model family (Flax NNX).

Array names carry their shape as a suffix: B batch, T tokens of this step, S cached key
positions, P pages, D hidden, H heads, K KV heads (or top-k in routing code), F FFN width,
E experts, R latent rank, V vocabulary. Matmuls accumulate in float32; norms, softmax and
routing are computed in float32 whatever the parameter dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from freetoken_jax.config import ACTIVATIONS, MoEModelConfig, env_choice
from freetoken_jax.memory import kv_cache
from freetoken_jax.memory.kv_cache import KVView, gather_pages, write_pages
from freetoken_jax.models.grouping import GroupPlan, group_plans
from freetoken_jax.quant.layout import ExpertLayout
from pallas_kernels import chunk_attention, decode_attention, gathered_experts, norm_matvec, route_topk

_INIT = nnx.initializers.normal(0.02)


def activation(name: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The gated activation h(gate x, up x) of `name` (config.ACTIVATIONS)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; use one of {tuple(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class Linear(nnx.Module):
    """y = x Wᵀ + b with W stored [out, in] (the checkpoints' layout): a decode matvec then
    reduces along W's contiguous rows, which XLA fuses into one pass over the weights."""

    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_INIT(rngs.params(), (dout, din), dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...d,fd->...f", x, self.weight[...], preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype)


def linear(din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs) -> Linear:
    return Linear(din, dout, bias=bias, dtype=dtype, rngs=rngs)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


# Rotary position embedding ------------------------------------------------------------------------
def rope_frequencies(cfg: MoEModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rope_dim/2] and the cos/sin scale (YaRN's attention factor)."""
    dim, base = cfg.rope_dim, cfg.rope_theta
    rs = dict(cfg.rope_scaling)
    kind = rs.get("rope_type", rs.get("type", "default"))
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if kind == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    if kind == "linear":
        return (1.0 / pos_freqs / np.float32(rs["factor"])).astype(np.float32), 1.0
    if kind != "yarn":
        raise ValueError(f"rope scaling {kind!r} is not supported (default, linear and yarn are)")
    factor = rs.get("factor")
    orig = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
    if factor is None:
        factor = cfg.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv.astype(np.float32), float(attn_factor)


def softmax_scale(cfg: MoEModelConfig) -> float:
    scale = cfg.qk_head_dim**-0.5
    rs = dict(cfg.rope_scaling)
    if cfg.attention == "mla" and rs.get("rope_type", rs.get("type", "default")) != "default":
        m_all = rs.get("mscale_all_dim", 0)
        factor = rs.get("factor", 1.0)
        if m_all and factor > 1:
            m = 0.1 * m_all * math.log(factor) + 1.0
            scale *= m * m
    return scale


def rope_cos_sin(cfg: MoEModelConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    inv_freq, scale = rope_frequencies(cfg)
    freqs = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x_BTHd: jax.Array, cos_BTd: jax.Array, sin_BTd: jax.Array, interleave: bool) -> jax.Array:
    """Rotates the last axis. With `interleave`, pairs are (x0, x1), (x2, x3), ... and the output
    lists the rotated first elements, then the second ones (the same layout for queries and keys,
    so dot products equal those of the interleaved form)."""
    dtype = x_BTHd.dtype
    x = x_BTHd.astype(jnp.float32)
    cos, sin = cos_BTd[:, :, None, :], sin_BTd[:, :, None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)


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


def attend_paged(q_BTHd, pages: tuple, view: KVView, mask_BTS, scale: float, kv_of, sinks_H=None) -> jax.Array:
    """`attend` over the entries `view` gathers from `pages` (one pool per stored tensor), keys
    and values made by `kv_of(gathered)` -> (k_BSKd, v_BSKe). A step of one token per row, or a
    page table of at most `kv_cache.ATTN_BLOCK` positions, gathers everything and calls `attend`.
    A step of many tokens (prefill) goes through the table in blocks of that many positions with a running
    softmax and stops after the last block that any of its queries may read, so that its cost
    follows the positions it reads rather than `max_context` (a 2048-token chunk in an 8192-token
    context reads a quarter of the table)."""
    if q_BTHd.shape[1] == 1 or view.page_table_BP.shape[1] <= kv_cache.attention_block_pages(pages[0].shape[1]):
        k, v = kv_of(tuple(gather_pages(p, view) for p in pages))
        return attend(q_BTHd, k, v, mask_BTS, scale, sinks_H)
    _, den, acc = _fold_blocks(q_BTHd, pages, view, mask_BTS, scale, kv_of, sinks_H)
    B, T, K, G, e = acc.shape
    return (acc / jnp.moveaxis(den, 3, 1)[..., None]).reshape(B, T, K * G, e).astype(q_BTHd.dtype)


def _fold_blocks(q_BTHd, pages: tuple, view: KVView, mask_BTS, scale: float, kv_of, sinks_H=None):
    """The running softmax of `attend_paged` over the table's blocks up to the last one any query
    reads (none when none is read): (max [B, K, G, T], denominator [B, K, G, T], numerator
    [B, T, K, G, e]), float32, the sink (gpt-oss) counted as one more key of value 0."""
    B, T = q_BTHd.shape[:2]
    P, page = view.page_table_BP.shape[1], pages[0].shape[1]
    bp = kv_cache.attention_block_pages(page)
    nb, W = -(-P // bp), bp * page
    table = jnp.pad(view.page_table_BP, ((0, 0), (0, nb * bp - P)))
    mask = jnp.pad(mask_BTS, ((0, 0), (0, 0), (0, nb * W - P * page)))
    read = jnp.any(mask, axis=(0, 1))
    blocks = (jnp.max(jnp.where(read, jnp.arange(1, nb * W + 1), 0)) + W - 1) // W  # blocks up to the last position read

    def block(i):
        pg = jax.lax.dynamic_slice_in_dim(table, i * bp, bp, axis=1)
        k, v = kv_of(tuple(p[pg].reshape(B, W, *p.shape[2:]) for p in pages))
        K = k.shape[2]
        q = q_BTHd.reshape(B, T, K, q_BTHd.shape[2] // K, -1)
        sc = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
        m = jax.lax.dynamic_slice_in_dim(mask, i * W, W, axis=2)
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


def attend_chunk(q_BTHd, k_BTKd, v_BTKe, pages: tuple, view: KVView, mask_BTS, scale: float, kv_of, sinks_H=None, window: int = 0,
                 cached: str = "blocks"):  # fmt: skip
    """`attend_paged` for a prefill chunk whose row b holds its tokens at consecutive positions
    from `view.positions_BT[b, 0]` (`PrefillBatch.chunk`), given the chunk's own keys and values
    `k_BTKd`, `v_BTKe` (as `kv_of` makes them): the chunk against itself through
    `chunk_attention` (cuDNN's flash attention on a GPU where it takes the heads, else the jnp
    reference); the positions cached before the chunk (none for a prompt's first chunk) through
    `attend_paged`'s blocks, or with `cached` "flash" (no window; `view` in position order)
    through `chunk_attention` over the whole table gathered, each row reading its prefix; the
    softmaxes (and a sink's logit) joined by their log-sum-exps. The chunk's own entries are read
    from `k_BTKd` and `v_BTKe`, not from the pages."""
    B, T, H = q_BTHd.shape[:3]

    def impl(k, v):
        fits = chunk_attention.cudnn_fits(q_BTHd.dtype, q_BTHd.shape[-1], v.shape[-1]) and k.dtype == q_BTHd.dtype
        return "cudnn" if fits and jax.default_backend() == "gpu" else "ref"

    o, lse = chunk_attention.attention(q_BTHd, k_BTKd, v_BTKe, scale=scale, window=window, implementation=impl(k_BTKd, v_BTKe))
    total = (lse, jnp.ones_like(lse), o)
    if cached == "flash" and not window:
        k, v = kv_of(tuple(gather_pages(p, view) for p in pages))
        o_c, lse_c = chunk_attention.attention(q_BTHd, k, v, scale=scale, lengths_B=view.positions_BT[:, 0], implementation=impl(k, v))
        total = _merge(total, (lse_c, jnp.ones_like(lse_c), o_c))
        if sinks_H is not None:  # a sink is one more logit, of value 0
            sink = jnp.broadcast_to(sinks_H.astype(jnp.float32), lse.shape)
            total = _merge(total, (sink, jnp.ones_like(sink), jnp.zeros_like(o)))
    else:
        before = mask_BTS & (view.cached_pos_BS[:, None, :] < view.positions_BT[:, :1, None])
        mx, den, acc = _fold_blocks(q_BTHd, pages, view, before, scale, kv_of, sinks_H)
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

    def __call__(self, x_BTD, cos_sin, kv: tuple[jax.Array, jax.Array], view: KVView, norm: RMSNorm | None = None, add=None):
        """(output, new KV pages, the residual stream x_BTD + add). `norm`: the layer's input
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
                                           None if self.q_norm is None else self.q_norm.weight[...],
                                           None if self.k_norm is None else self.k_norm.weight[...], cfg.rms_norm_eps, cfg.rope_interleave)  # fmt: skip
            o, k_pages, v_pages = decode_attention.attention(q[:, 0], kv[0], kv[1], view.page_table_BP, view.mask(self.window)[:, 0],
                                                             scale=softmax_scale(cfg), sinks_H=sinks, fresh=fresh,
                                                             interpret=jax.default_backend() == "cpu")  # fmt: skip
            return self.o_proj(o.reshape(B, T, -1)), (k_pages, v_pages), stream
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rd = cfg.rope_dim  # partial rotary: the rest of each head passes as it is
        rope = lambda x: apply_rope(x, *cos_sin, cfg.rope_interleave)  # noqa: E731
        q, k = (rope(a) if rd == cfg.head_dim else jnp.concatenate([rope(a[..., :rd]), a[..., rd:]], axis=-1) for a in (q, k))
        k_pages, v_pages = write_pages(kv[0], view, k), write_pages(kv[1], view, v)
        mask = view.mask(self.window)
        if how == "kernel":
            o = decode_attention.attention(q[:, 0], k_pages, v_pages, view.page_table_BP, mask[:, 0], scale=softmax_scale(cfg), sinks_H=sinks,
                                           interpret=jax.default_backend() == "cpu")[:, None]  # fmt: skip
        elif T > 1 and prefill_attention(cfg, q.dtype) == "flash":
            own = k.astype(k_pages.dtype), v.astype(v_pages.dtype)
            o = attend_chunk(
                q, *own, (k_pages, v_pages), view, mask, softmax_scale(cfg), lambda kv: kv, sinks, self.window, prefill_cached()
            )
        else:
            o = attend_paged(q, (k_pages, v_pages), view, mask, softmax_scale(cfg), lambda kv: kv, sinks)
        return self.o_proj(o.reshape(B, T, -1)), (k_pages, v_pages), stream


def norm_matvec_kernel() -> str:
    """How a step of one token a row computes an RMSNorm and the projections that read it (the
    attention's q, k and v; the MoE router), FREETOKEN_NORM_MATVEC: "kernel" — in one kernel of
    `pallas_kernels/norm_matvec.py` where it fits; "xla" — two kernels for the norm and one or
    two for the projections; "auto" (unset) — the kernel on a GPU (on the H200 it took q4_0
    hybrid decode at the 30B shape from 164.9 to 171.3 tok/s: benchmarks/RESULTS.md), else XLA."""
    how = env_choice("FREETOKEN_NORM_MATVEC", "auto", ("auto", "xla", "kernel"))
    if how == "auto":
        return "kernel" if jax.default_backend() == "gpu" else "xla"
    return how


def use_norm_matvec(B: int, T: int, D: int, F) -> bool:
    return T == 1 and norm_matvec_kernel() == "kernel" and norm_matvec.fits(B, D, tuple(F))


def normed_projections(norm: RMSNorm, x_BD, weights, biases=None, out_dtypes=None, keep_h: bool = False, add_BD=None):
    """`norm(x_BD + add_BD)` (x_BD alone where `add_BD` is None) times each of `weights`
    ([F_i, D], + its bias where given) in one kernel: (their outputs [B, F_i], the normed rows
    where `keep_h`, the sum x_BD + add_BD where given)."""
    ys, h, s = norm_matvec.norm_matvec(x_BD, norm.weight[...], norm.eps, weights, biases, out_dtypes, keep_h, add_BD,
                                       interpret=jax.default_backend() == "cpu")  # fmt: skip
    return (*ys, *[a for a in (h, s) if a is not None])


def residual(x_BTD, add_BTD):
    """The residual stream x + add (x where nothing is pending)."""
    return x_BTD if add_BTD is None else x_BTD + add_BTD


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

    def __call__(self, x_BTD, cos_sin, kv: tuple[jax.Array, jax.Array], view: KVView, norm: RMSNorm | None = None, add=None):
        """(output, new latent pages, the residual stream x_BTD + add); `norm`: the layer's input
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
        lat_pages, rot_pages = write_pages(kv[0], view, latent_BTR), write_pages(kv[1], view, k_rot)

        def kv_of(gathered):  # keys and values of gathered entries, expanded from the latent
            lat_BSR, rot_BSr = gathered
            S = lat_BSR.shape[1]
            kvb = self.kv_b_proj(lat_BSR).reshape(B, S, H, dn + dv)
            return jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(rot_BSr[:, :, None], (B, S, H, dr))], axis=-1), kvb[..., dn:]

        if T == 1 and mla_decode() == "latent":  # decode: attention in the latent space, no key or value expanded
            w = self.kv_b_proj.weight[...].reshape(H, dn + dv, cfg.kv_lora_rank)
            if decode_attention_kernel(cfg) == "kernel":  # the latent and rotated key read from their pages in one kernel
                q = jnp.concatenate([to_latent(q_nope, w[:, :dn], lat_pages.dtype), q_rot.astype(lat_pages.dtype)], axis=-1)
                lat, rot = lat_pages[:, :, None], rot_pages[:, :, None]  # one kv head
                o_lat = decode_attention.attention(q[:, 0], (lat, rot), lat, view.page_table_BP, view.mask_BTS[:, 0], scale=softmax_scale(cfg),
                                                   interpret=jax.default_backend() == "cpu")  # fmt: skip
                o = from_latent(o_lat[:, None], w[:, dn:], q_nope.dtype)
            else:
                lat, rot = gather_pages(lat_pages, view), gather_pages(rot_pages, view)
                o = attend_latent(q_nope, q_rot, lat, rot, w[:, :dn], w[:, dn:], view.mask_BTS, softmax_scale(cfg))
        else:
            q_BTHd = jnp.concatenate([q_nope, q_rot], axis=-1)
            pages, scale = (lat_pages, rot_pages), softmax_scale(cfg)
            if T > 1 and prefill_attention(cfg, q.dtype) == "flash":
                k_new, v_new = kv_of((latent_BTR.astype(lat_pages.dtype), k_rot.astype(rot_pages.dtype)))
                o = attend_chunk(q_BTHd, k_new, v_new, pages, view, view.mask_BTS, scale, kv_of)
            else:
                o = attend_paged(q_BTHd, pages, view, view.mask_BTS, scale, kv_of)
        return self.o_proj(o.reshape(B, T, -1)), (lat_pages, rot_pages), stream


class MLP(nnx.Module):
    def __init__(self, cfg: MoEModelConfig, width: int, dtype, rngs: nnx.Rngs):
        D = cfg.hidden_dim
        self.gate_proj = linear(D, width, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.up_proj = linear(D, width, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = linear(width, D, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.down_proj(activation(self.act)(self.gate_proj(x), self.up_proj(x)))


# Routing and experts ----------------------------------------------------------------------------
class Router(nnx.Module):
    """Top-k expert choice. Returns expert ids [T, k] and their combine weights [T, k] (float32)."""

    def __init__(self, cfg: MoEModelConfig, rngs: nnx.Rngs):
        # Router weights stay float32 whatever the model dtype (as the reference models keep them).
        self.weight = nnx.Param(_INIT(rngs.params(), (cfg.num_experts, cfg.hidden_dim), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32)) if cfg.score_correction_bias else None
        self.logit_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32)) if cfg.router_bias else None
        self.cfg = cfg

    def __call__(self, x_TD: jax.Array, draw=None) -> tuple[jax.Array, jax.Array]:
        logits_TE = jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), self.weight[...], precision=jax.lax.Precision.HIGHEST)
        return self.choose(logits_TE, draw)

    def choose(self, logits_TE: jax.Array, draw=None) -> tuple[jax.Array, jax.Array]:
        """The routing of logits x·Wᵀ (float32 [T, E]); `draw`: `route`'s."""
        if self.logit_bias is not None:
            logits_TE = logits_TE + self.logit_bias[...]
        bias = None if self.bias is None else self.bias[...]
        return route(self.cfg, logits_TE, bias, draw)


ROUTER_KERNEL_ROWS = 64  # "auto" takes the router kernel for steps of up to this many rows (decode)


def router_kernel(cfg: MoEModelConfig, T: int) -> str:
    """How a step of T rows chooses its experts (FREETOKEN_ROUTER): "xla" — the softmax or
    sigmoid, `lax.top_k` and the gather as XLA compiles them, four kernels a layer; "kernel" —
    `pallas_kernels/route_topk.py`, one kernel, for greedy routers; "auto" (unset) — the kernel on
    a GPU for steps of up to `ROUTER_KERNEL_ROWS` rows, else "xla"."""
    how = env_choice("FREETOKEN_ROUTER", "auto", ("auto", "xla", "kernel"))
    if cfg.topk_method != "greedy" or how == "xla":
        return "xla"
    if how == "auto":
        return "kernel" if jax.default_backend() == "gpu" and T <= ROUTER_KERNEL_ROWS else "xla"
    return "kernel"


def route(cfg: MoEModelConfig, logits_TE: jax.Array, bias_E: jax.Array | None = None, draw=None):
    """(ids [T, k], weights [T, k]) of the router's logits. `draw` (a benchmark's synthetic
    routing, `runtime/routing.Draw`) puts its ids in place of the router's, the weights kept."""
    T, E = logits_TE.shape
    if router_kernel(cfg, T) == "kernel":
        return route_topk.route(logits_TE, cfg.top_k, scoring=cfg.router_scoring, norm=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor,
                                bias_E=bias_E, draw=None if draw is None else draw.kernel(), interpret=jax.default_backend() == "cpu")  # fmt: skip
    ids_TK, w_TK = _xla_route(cfg, logits_TE, bias_E)
    return (ids_TK, w_TK) if draw is None else (draw.ids(ids_TK, w_TK), w_TK)


def _xla_route(cfg: MoEModelConfig, logits_TE: jax.Array, bias_E: jax.Array | None):
    T, E = logits_TE.shape
    scores = jax.nn.sigmoid(logits_TE) if cfg.router_scoring == "sigmoid" else jax.nn.softmax(logits_TE, axis=-1)
    choice = scores if bias_E is None else scores + bias_E
    if cfg.topk_method != "greedy":
        grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], top_groups].set(True)
        keep = jnp.repeat(keep, E // cfg.n_group, axis=1)
        # V3 masks excluded experts out of the choice; V2 zeroes their scores (same top-k unless
        # fewer than k positive scores remain, which softmax scores never allow).
        choice = jnp.where(keep, choice, -jnp.inf if cfg.topk_method == "noaux_tc" else 0.0)
    _, ids_TK = jax.lax.top_k(choice, cfg.top_k)
    w_TK = jnp.take_along_axis(scores, ids_TK, axis=-1)
    if cfg.norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(-1, keepdims=True) + (1e-20 if cfg.router_scoring == "sigmoid" else 0.0))
    return ids_TK, w_TK * cfg.routed_scaling_factor


class Experts(nnx.Module):
    """The routed experts of one layer, stacked in the checkpoints' [out, in] layout:
    gate/up [E, F, D], down [E, D, F]; with a quantized `expert_format`, one row of bytes per
    expert and projection ([E, nbytes], `quant/formats.py`)."""

    def __init__(self, cfg: MoEModelConfig, dtype, rngs: nnx.Rngs, m: int = 0):
        E, D, F = cfg.num_experts, cfg.hidden_dim, cfg.moe_intermediate_dim
        layout = ExpertLayout.of(cfg, m)  # m: the MoE layer (its formats)
        if layout.quantized:
            rows = layout.row_sizes()
            self.gate, self.up, self.down = (nnx.Param(jnp.zeros((E, r), jnp.uint8)) for r in rows)
        else:
            self.gate = nnx.Param(_INIT(rngs.params(), (E, F, D), dtype))
            self.up = nnx.Param(_INIT(rngs.params(), (E, F, D), dtype))
            self.down = nnx.Param(_INIT(rngs.params(), (E, D, F), dtype))
        # Per-expert biases (gpt-oss), float32 and small: they stay on the device (and are copied
        # for the CPU executor) whatever the strategy; not banks.
        zeros = lambda *shape: nnx.Param(jnp.zeros(shape, jnp.float32))  # noqa: E731
        self.bias = nnx.Dict(gate=zeros(E, F), up=zeros(E, F), down=zeros(E, D)) if cfg.expert_bias else None

    def biases(self):
        """(gate [E, F], up [E, F], down [E, D]) float32 biases, or None."""
        return None if self.bias is None else tuple(self.bias[k][...] for k in ("gate", "up", "down"))


def pair_biases(bias, ids_TK):
    """The biases of each token's chosen experts: (gate [T, K, F], up [T, K, F], down [T, K, D]),
    from per-expert `bias` (`Experts.biases`); None without."""
    return None if bias is None else tuple(b[ids_TK] for b in bias)


# "dense" computes at most this many bytes of float32 expert activations at once (a 512-token
# chunk of Qwen3-30B-A3B needs 0.4 GB and goes in one piece).
DENSE_SLICE_BYTES = 1 << 30


def routed_experts(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, impl: str = "auto", bias=None) -> jax.Array:
    """Σ_k w[t,k] · down(act(gate(x_t), up(x_t))) over each token's chosen experts, from `banks`
    (gate, up, down of every expert, `layout`); `bias`: each pair's biases (`pair_biases`), added
    to the gate, up and down projections, or None.

    - "gather" (few token-expert pairs: decode): one fused gather-and-reduce per projection over
      the chosen experts, dequantizing what it gathers — only the chosen experts' stored bytes
      are read;
    - "dense" (many pairs): every token through every expert, weighted by its routing weights
      (0 where not routed): E/K times the work of the pairs, but plain batched matmuls over the
      bank (dequantized once into a scratch of the activations' dtype). On the H200 a 512-token
      chunk's experts took 2.2 ms per layer dense against 8.2 ms through `ragged_dot_general`
      (benchmarks/RESULTS.md);
    - "grouped" (many pairs: prefill): the pairs sorted by expert into groups of rows, then the
      same batched matmuls as "dense" over the groups' rows instead of E·T (`group_plans`): C
      rows per expert (C: twice the mean pairs an expert gets, rounded up to a power of two; E /
      2K times less work than dense, 8 × for 128 experts, top-8) where no expert gets more, or
      2C; else, ranking the experts by their pairs, T rows for the busiest E/32, T/2 for the
      next E/16 and 2C for the rest (3.5 × less work than dense at 128 experts, top-8), which
      holds skewed routing (at 128 experts, top-8: synthetic Zipf routing up to an exponent of
      about 1.5; trained routers are nearer 1). Where no plan holds, the layer runs "dense"
      (`lax.switch` on the counts). On the H200 under spread routing a 2048-token q4_0 chunk of
      24 Qwen3-30B-A3B layers took 236 ms against 329 ms dense (benchmarks/RESULTS.md; the
      ranked plan is not measured there yet);
    - "kernel": as "auto", but the few-pairs case through the two Pallas kernels of
      `pallas_kernels/gathered_experts.py` (q4_0 or mxfp4 experts without biases; `kernel_fits`
      says which layers): each gathered block's scale and codes read together;
    - "auto": gather when T·k ≤ E, else grouped.
    """
    T, K = ids_TK.shape
    E = banks[0].shape[0]
    if impl == "kernel":
        if not kernel_fits(layout, bias):
            raise ValueError(f"the 'kernel' expert implementation takes {'/'.join(gathered_experts.FORMATS)} experts without "
                             f"biases, not {layout.fmts} {layout.act}{' with biases' if bias is not None else ''}")  # fmt: skip
        if T * K <= E:
            return gathered_experts.experts(layout.fmt, x_TD, ids_TK, w_TK, *banks, F=layout.F, D=layout.D, act=activation(layout.act),
                                            interpret=jax.default_backend() == "cpu")  # fmt: skip
        impl = "grouped"
    if impl == "auto":
        impl = "gather" if T * K <= E else "grouped"
    if impl == "gather":
        return _gathered(x_TD, ids_TK, w_TK, banks, layout, bias)
    if impl not in ("dense", "grouped"):
        raise ValueError(f"unknown expert implementation {impl!r}: auto, kernel, gather, dense or grouped")
    if impl == "dense":
        return _dense(x_TD, ids_TK, w_TK, layout.matrices(banks, x_TD.dtype), layout, bias)
    plans = group_plans(T, K, E)
    if not plans:  # so few tokens that a group is as large as the chunk
        return _dense(x_TD, ids_TK, w_TK, layout.matrices(banks, x_TD.dtype), layout, bias)
    counts = jnp.zeros((E,), jnp.int32).at[ids_TK.reshape(-1)].add(1)  # pairs per expert
    fits = jnp.stack([plan.fits(counts) for plan in plans])
    which = jnp.where(fits.any(), jnp.argmax(fits), len(plans))  # the first plan that holds every group, else dense
    grouped = [lambda x, i, w, bk, b, n, plan=plan: _grouped(x, i, w, bk, layout, b, n, plan) for plan in plans]
    dense = lambda x, i, w, bk, b, n: _dense(x, i, w, layout.matrices(bk, x.dtype), layout, b)  # noqa: E731
    return jax.lax.switch(which, [*grouped, dense], x_TD, ids_TK, w_TK, tuple(banks), bias, counts)


def kernel_fits(layout: ExpertLayout, bias=None) -> bool:
    """Whether the "kernel" implementation computes this layer's experts: gate, up and down in one
    format of `gathered_experts.FORMATS`, no biases, an activation the kernels lower (not exact-erf
    "gelu")."""
    return (layout.fmt in gathered_experts.FORMATS and layout.fmts == (layout.fmt,) * 3 and not layout.mixed and bias is None and layout.act in gathered_experts.ACTS
            and not layout.F % gathered_experts.BLOCK_ROWS and not layout.D % gathered_experts.BLOCK_ROWS)  # fmt: skip


def _gathered(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, bias) -> jax.Array:
    # Written as multiply + reduce over the weights' contiguous rows so that XLA fuses the
    # gather (and the dequantization) into one reduction per projection: each chosen expert is
    # read once, in place.
    T, K = ids_TK.shape
    f, dt = activation(layout.act), x_TD.dtype
    g, u, d = (layout.gather(k, b, ids_TK) for k, b in enumerate(banks))
    bg, bu, bd = bias or (0.0, 0.0, 0.0)
    xk = jnp.broadcast_to(x_TD[:, None, :], (T, K, x_TD.shape[1]))
    h = f(layout.matvec(0, g, xk) + bg, layout.matvec(1, u, xk) + bu).astype(dt)
    y = jnp.where((w_TK != 0)[..., None], layout.matvec(2, d, h) + bd, 0.0)  # an unrouted pair adds exactly 0
    return jnp.einsum("tkd,tk->td", y, w_TK).astype(dt)


def _dense(x_TD, ids_TK, w_TK, mats, layout: ExpertLayout, bias) -> jax.Array:
    # The routing weight scales each expert's hidden activations (0 where not routed), so the
    # down projection and the sum over experts are one matmul contracting (e, f). Tokens go
    # through in slices whose float32 activations [E, t, F] (gate and up) stay within
    # DENSE_SLICE_BYTES.
    T = x_TD.shape[0]
    gate_EFD, up_EFD, down_EDF = mats
    E = gate_EFD.shape[0]
    f, dt, mm = activation(layout.act), x_TD.dtype, dict(preferred_element_type=jnp.float32)
    w_ET = jnp.zeros((E, T), jnp.float32).at[ids_TK, jnp.arange(T)[:, None]].add(w_TK.astype(jnp.float32))
    step = max(1, DENSE_SLICE_BYTES // (2 * 4 * E * layout.F))

    def dense(t0, t1):
        x, w = x_TD[t0:t1], w_ET[:, t0:t1]
        g, u = jnp.einsum("td,efd->etf", x, gate_EFD, **mm), jnp.einsum("td,efd->etf", x, up_EFD, **mm)
        if bias is not None:  # each pair's gate/up biases in place; other (expert, token) pairs get weight 0 below
            at = (ids_TK[t0:t1], jnp.arange(t1 - t0)[:, None])
            g, u = g.at[at].add(bias[0][t0:t1]), u.at[at].add(bias[1][t0:t1])
        h = f(g, u)
        h = jnp.where(w[:, :, None] != 0, h * w[:, :, None], 0.0)  # an unrouted pair adds exactly 0
        y = jnp.einsum("etf,edf->td", h.astype(dt), down_EDF, **mm)
        if bias is not None:
            y = y + jnp.einsum("tkd,tk->td", bias[2][t0:t1], w_TK[t0:t1].astype(jnp.float32))
        return y.astype(dt)

    return jnp.concatenate([dense(t, min(T, t + step)) for t in range(0, T, step)])


def _grouped(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, bias, counts, plan: GroupPlan) -> jax.Array:
    # Pair p (token t, k) sorted by expert goes to row `rank` of its expert's group (every group
    # fits: `routed_experts` checked `counts`, the pairs per expert, against the plan); empty rows
    # carry zeros and weight 0. Rows are filled and results collected by gathers (only int32
    # maps are scattered), and each token sums its K results in order: no float scatter-add, so
    # the result does not depend on the order in which a GPU's atomics land. A tier's experts
    # go through in slices whose float32 activations [e, C, F] stay within DENSE_SLICE_BYTES;
    # a ranked plan dequantizes each slice's experts as it gathers them from the banks.
    T, K = ids_TK.shape
    E, D, R = counts.shape[0], x_TD.shape[1], plan.rows
    f, dt, mm = activation(layout.act), x_TD.dtype, dict(preferred_element_type=jnp.float32)
    order_E = plan.order(counts)  # expert at each place of the plan
    starts = jnp.asarray(plan.starts())
    start_E = jnp.zeros((E,), jnp.int32).at[order_E].set(starts) if plan.ranked else starts  # first row of each expert
    flat = ids_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    e_sorted = flat[order]
    rank = jnp.arange(T * K, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[e_sorted]
    row = start_E[e_sorted] + rank  # the row of the i-th pair in expert order
    pair_of_row = jnp.full((R,), T * K, jnp.int32).at[row].set(order.astype(jnp.int32))  # T·K: empty
    filled = pair_of_row < T * K
    pair = jnp.where(filled, pair_of_row, 0)

    def place(v, at):  # rows `at` of v in the filled rows, zeros in the empty ones, as [R, ...]
        return jnp.where(filled.reshape(-1, *(1,) * (v.ndim - 1)), v[at], 0)

    x_RD = place(x_TD, pair // K)
    w_R = place(w_TK.reshape(-1).astype(jnp.float32), pair)
    b = None if bias is None else tuple(place(v.reshape(T * K, -1), pair) for v in bias)
    mats = None if plan.ranked else layout.matrices(banks, dt)

    def group(r0, e0, n, C):  # experts e0 .. e0+n of the plan's order, C rows each from row r0
        if plan.ranked:
            gate_EFD, up_EFD, down_EDF = layout.matrices(tuple(bk[order_E[e0 : e0 + n]] for bk in banks), dt)
        else:
            gate_EFD, up_EFD, down_EDF = (m[e0 : e0 + n] for m in mats)
        rows = slice(r0, r0 + n * C)
        x, w = x_RD[rows].reshape(n, C, D), w_R[rows].reshape(n, C, 1)
        g, u = jnp.einsum("ecd,efd->ecf", x, gate_EFD, **mm), jnp.einsum("ecd,efd->ecf", x, up_EFD, **mm)
        if b is not None:
            g, u = g + b[0][rows].reshape(n, C, -1), u + b[1][rows].reshape(n, C, -1)
        h = f(g, u)
        h = jnp.where(w != 0, h * w, 0.0)  # an unrouted pair (and an empty row) adds exactly 0
        y = jnp.einsum("ecf,edf->ecd", h.astype(dt), down_EDF, **mm)
        y = y if b is None else y + jnp.where(w != 0, b[2][rows].reshape(n, C, -1) * w, 0.0)
        return y.reshape(n * C, D)

    parts, r0, e0 = [], 0, 0
    for n, C in plan.tiers:
        step = max(1, DENSE_SLICE_BYTES // (2 * 4 * C * layout.F))
        for e in range(0, n, step):
            m = min(step, n - e)
            parts.append(group(r0 + e * C, e0 + e, m, C))
        r0, e0 = r0 + n * C, e0 + n
    y_RD = jnp.concatenate(parts)
    row_of_pair = jnp.zeros((T * K,), jnp.int32).at[order].set(row)
    return y_RD[row_of_pair].reshape(T, K, D).sum(1).astype(dt)


# fn(x_TD, ids_TK, w_TK, bias) -> y_TD; `bias`: the layer's per-expert biases (`Experts.biases`) or None.
ExpertFn = Callable[..., jax.Array]


class MoEBlock(nnx.Module):
    """Router + routed experts + optional (gated) shared expert. How the routed experts are
    computed is pluggable: `expert_fn(x_TD, ids_TK, w_TK, bias)`; by default from this layer's own
    resident weights (strategy "fused")."""

    def __init__(self, cfg: MoEModelConfig, dtype, rngs: nnx.Rngs, m: int = 0):
        self.gate = Router(cfg, rngs)
        self.experts = Experts(cfg, dtype, rngs, m)
        self.shared_experts = MLP(cfg, cfg.shared_expert_dim, dtype, rngs) if cfg.shared_expert_dim else None
        self.shared_expert_gate = linear(cfg.hidden_dim, 1, bias=False, dtype=dtype, rngs=rngs) if cfg.shared_expert_gate else None
        self.layout = ExpertLayout.of(cfg, m)

    def expert_fn(self, compute=None) -> ExpertFn:
        """This layer's routed experts computed from its own resident banks by `compute(x_TD,
        ids_TK, w_TK, banks, layout)` (default `routed_experts`)."""
        e, layout = self.experts, self.layout
        return lambda x, ids, w, bias=None: (compute or routed_experts)(
            x, ids, w, (e.gate[...], e.up[...], e.down[...]), layout, bias=pair_biases(bias, ids)
        )

    def __call__(self, x_BTD: jax.Array, expert_fn: ExpertFn | None = None, norm: RMSNorm | None = None, add=None):
        """(output, the residual stream x_BTD + add). `norm`: the layer's post-attention norm,
        applied here to that stream so that a step of one token a row may compute the add, the
        norm and the router in one kernel (`norm_matvec_kernel`)."""
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        draw = getattr(expert_fn, "draw", None)  # a benchmark's synthetic routing (`runtime/routing.py`)
        if norm is not None and use_norm_matvec(B, T, D, [self.gate.weight.shape[0]]):
            pending = None if add is None else add.reshape(B * T, D)
            logits, x_TD, *s = normed_projections(
                norm, x_TD, [self.gate.weight[...]], out_dtypes=[jnp.float32], keep_h=True, add_BD=pending
            )
            stream = s[0].reshape(B, T, D) if s else x_BTD
            ids, w = self.gate.choose(logits, draw)
        else:
            stream = residual(x_BTD, add)
            x_TD = stream.reshape(B * T, D)
            x_TD = x_TD if norm is None else norm(x_TD)
            ids, w = self.gate(x_TD, draw)
        out = (expert_fn or self.expert_fn())(x_TD, ids, w, self.experts.biases())
        if self.shared_experts is not None:
            shared = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x_TD)) * shared
            out = out + shared
        return out.reshape(B, T, D), stream
