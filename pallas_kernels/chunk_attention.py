"""A prefill chunk's attention to its own keys (causal) or to a cached prefix, with each query's
log-sum-exp.

`attention(q_BTHd, k_BSKd, v_BSKe, *, scale, window=0, lengths_B=None, implementation)` over
the chunk's own keys (S = T) is, for row b, query t and query head h (of kv head h // G),

    o[b, t, h] = Σ_{s ≤ t} p_s v[b, s],  p = softmax over s ≤ t (and s > t - window when
    `window`) of scale · q[b, t, h] · k[b, s],
    lse[b, t, h] = log Σ_s exp(scale · q[b, t, h] · k[b, s]) over the same s,

both in float32: the chunk's tokens sit at consecutive positions, so token t reads its own keys
0 … t. With `lengths_B` the keys are a cached prefix gathered from the pages and every query
reads keys 0 … lengths_B[b] − 1 (the positions before the chunk). `models.attention.attend_chunk`
joins the parts through `lse`.

"cudnn" is cuDNN's flash attention (jax's cuDNN fused attention, its causal or padding mask,
the log-sum-exp it keeps for the backward pass): no [T, T] score matrix is stored and the upper
triangle is skipped — an 8192-token chunk's scores would be 8 GiB of float32 a layer at 32 heads.
Its value heads are padded to the query's width where they are narrower (MLA: 128 against 192).
It takes float16/bfloat16 and head widths up to 256 (`cudnn_fits`). "ref" is the jnp reference:
the whole score matrix, a float32 softmax, the probabilities cast to the values' dtype before
their matmul (as `models.attention.attend`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def cudnn_fits(dtype, d_qk: int, d_v: int) -> bool:
    """Whether cuDNN's flash attention takes these operands (and this jax has it)."""
    shapes = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and max(d_qk, d_v) <= 256 and d_qk % 8 == 0
    return shapes and _cudnn() is not None


@functools.cache
def _cudnn():
    """jax's cuDNN fused attention (`dot_product_attention`, `MaskType`), or None where this jax
    has moved it (its module is jax-internal): the callers then keep the blocked attention."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as f

        return f.dot_product_attention, f.MaskType
    except (ImportError, AttributeError):
        return None


def attention(q_BTHd, k_BSKd, v_BSKe, *, scale: float, window: int = 0, lengths_B=None, implementation: str = "ref"):
    """(o [B, T, H, e] float32, lse [B, T, H] float32) over the chunk's own keys (S = T, causal),
    or with `lengths_B` over a cached prefix: every query against keys 0 … lengths_B[b] − 1 (no
    window; a row of length 0 gives o = 0 and lse = −1e30, which weighs nothing where it is
    joined). `implementation` "cudnn" or "ref"."""
    if lengths_B is not None and window:
        raise ValueError("a cached prefix's attention takes no window")
    if implementation == "ref":
        return attention_ref(q_BTHd, k_BSKd, v_BSKe, scale=scale, window=window, lengths_B=lengths_B)
    if implementation != "cudnn":
        raise ValueError(f"implementation {implementation!r}: use 'cudnn' or 'ref'")
    (B, T, _, d), e = q_BTHd.shape, v_BSKe.shape[-1]
    if not cudnn_fits(q_BTHd.dtype, d, e):
        raise ValueError(f"cuDNN attention takes float16/bfloat16 heads of at most 256 (in a jax that has it): got {q_BTHd.dtype}, {d}/{e}")
    cudnn_attention, MaskType = _cudnn()
    v = v_BSKe if e == d else jnp.pad(v_BSKe, ((0, 0), (0, 0), (0, 0), (0, d - e)))
    if lengths_B is None:
        how = dict(mask_type=MaskType.CAUSAL, sliding_window_length=window or None)
    else:  # padding masks: every query, the first max(length, 1) keys (a row of none is zeroed below)
        lengths_B = jnp.asarray(lengths_B, jnp.int32)
        how = dict(q_seqlen=jnp.full((B,), T, jnp.int32), kv_seqlen=jnp.maximum(lengths_B, 1), mask_type=MaskType.PADDING)
    o, lse_BHT = cudnn_attention(q_BTHd, k_BSKd, v.astype(q_BTHd.dtype), scale=scale, return_residual=True, **how)
    o, lse = o[..., :e].astype(jnp.float32), jnp.swapaxes(lse_BHT, 1, 2).astype(jnp.float32)
    if lengths_B is None:
        return o, lse
    empty = (lengths_B <= 0)[:, None, None]
    return jnp.where(empty[..., None], 0.0, o), jnp.where(empty, -1e30, lse)


def attention_ref(q_BTHd, k_BSKd, v_BSKe, *, scale: float, window: int = 0, lengths_B=None):
    B, T, H, _ = q_BTHd.shape
    S, K = k_BSKd.shape[1:3]
    q = q_BTHd.reshape(B, T, K, H // K, -1)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k_BSKd, preferred_element_type=jnp.float32) * scale
    t, j = jnp.arange(T), jnp.arange(S)
    if lengths_B is None:
        read = (j[None, :] <= t[:, None]) & ((j[None, :] > t[:, None] - window) if window else True)
    else:
        read = jnp.broadcast_to((j < jnp.asarray(lengths_B)[:, None])[:, None, None, None, :], s.shape)
    s = jnp.where(read, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, K, G, T]; -inf where a query reads nothing
    empty = lse == -jnp.inf
    p = jnp.exp(s - jnp.where(empty, 0.0, lse)[..., None])
    o = jnp.einsum("bkgts,bske->btkge", p.astype(v_BSKe.dtype), v_BSKe, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, -1), jnp.moveaxis(jnp.where(empty, -1e30, lse), 3, 1).reshape(B, T, H)
