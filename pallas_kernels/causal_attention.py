"""A prefill chunk's attention to its own keys: causal, with each query's log-sum-exp.

`attention(q_BTHd, k_BTKd, v_BTKe, *, scale, window=0, implementation)` is, for row b, query t
and query head h (of kv head h // G),

    o[b, t, h] = Σ_{s ≤ t} p_s v[b, s],  p = softmax over s ≤ t (and s > t - window when
    `window`) of scale · q[b, t, h] · k[b, s],
    lse[b, t, h] = log Σ_s exp(scale · q[b, t, h] · k[b, s]) over the same s,

both in float32: the chunk's tokens sit at consecutive positions, so token t reads its own keys
0 … t. `models.layers.attend_chunk` joins this with the positions cached before the chunk
through `lse`.

"cudnn" is cuDNN's flash attention (jax's cuDNN fused attention, its causal mask, the
log-sum-exp it keeps for the backward pass): no [T, T] score matrix is stored and the upper
triangle is skipped — an 8192-token chunk's scores would be 8 GiB of float32 a layer at 32 heads.
Its value heads are padded to the query's width where they are narrower (MLA: 128 against 192).
It takes float16/bfloat16 and head widths up to 256 (`cudnn_fits`). "ref" is the jnp reference:
the whole score matrix, a float32 softmax, the probabilities cast to the values' dtype before
their matmul (as `models.layers.attend`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cudnn_fits(dtype, d_qk: int, d_v: int) -> bool:
    """Whether cuDNN's flash attention takes these operands."""
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and max(d_qk, d_v) <= 256 and d_qk % 8 == 0


def attention(q_BTHd, k_BTKd, v_BTKe, *, scale: float, window: int = 0, implementation: str = "ref"):
    """(o [B, T, H, e] float32, lse [B, T, H] float32); `implementation` "cudnn" or "ref"."""
    if implementation == "ref":
        return attention_ref(q_BTHd, k_BTKd, v_BTKe, scale=scale, window=window)
    if implementation != "cudnn":
        raise ValueError(f"implementation {implementation!r}: use 'cudnn' or 'ref'")
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    d, e = q_BTHd.shape[-1], v_BTKe.shape[-1]
    if not cudnn_fits(q_BTHd.dtype, d, e):
        raise ValueError(f"cuDNN attention takes float16/bfloat16 heads of at most 256: got {q_BTHd.dtype}, {d}/{e}")
    v = v_BTKe if e == d else jnp.pad(v_BTKe, ((0, 0), (0, 0), (0, 0), (0, d - e)))
    o, lse_BHT = cudnn_attention(
        q_BTHd, k_BTKd, v.astype(q_BTHd.dtype), scale=scale, mask_type=MaskType.CAUSAL,
        sliding_window_length=window or None, return_residual=True,
    )  # fmt: skip
    return o[..., :e].astype(jnp.float32), jnp.swapaxes(lse_BHT, 1, 2).astype(jnp.float32)


def attention_ref(q_BTHd, k_BTKd, v_BTKe, *, scale: float, window: int = 0):
    B, T, H, _ = q_BTHd.shape
    K = k_BTKd.shape[2]
    q = q_BTHd.reshape(B, T, K, H // K, -1)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k_BTKd, preferred_element_type=jnp.float32) * scale
    t = jnp.arange(T)
    read = t[None, :] <= t[:, None]
    if window:
        read &= t[None, :] > t[:, None] - window
    s = jnp.where(read, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, K, G, T]
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bkgts,bske->btkge", p.astype(v_BTKe.dtype), v_BTKe, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, -1), jnp.moveaxis(lse, 3, 1).reshape(B, T, H)
