"""Decode's grouped-query attention over the paged KV cache in one kernel.

`attention(q_BHd, k_pages, v_pages, table_BP, mask_BS, *, scale, sinks_H=None)` is one query
token per row against the entries its page table gathers: for row b and query head h (of kv head
h // G),

    o[b, h] = Σ_s p_s v[s],  p = softmax over s of (scale · q[b, h] · k[s], masked to -1e30
    where mask[b, s] is false; with `sinks_H`, one more logit per head that joins the denominator
    and attends to nothing),

where entry s is offset s % page of page table[b, s // page]. XLA computes this as six kernels a
layer (the pages gathered into a copy, the scores' matmul, the softmax's max and sum, the cast,
the values' matmul); here one program per (row, kv head, span of `SPAN` entries) walks its
entries in blocks of `BLOCK` with a running softmax (the G query heads of a kv head at once, as
rows of a [Gp, hd] matmul padded to Gp ≥ 16 rows), reads each key and value once from the pages
in place, and stops after the row's last unmasked entry (`limit_B`), so that a step's cost follows
the positions it reads rather than the table's width. A table wider than one span gives each row
several programs whose partial sums are combined in jnp.

`attention_ref` is the jnp reference: the pages gathered, the scores and a float32 softmax, the
probabilities cast to the values' dtype before their matmul (as `models.layers.attend`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK = 64  # entries a step of a program's loop reads
SPAN = 512  # entries a program covers at most
NUM_WARPS = 4
NEG = -1e30  # a masked score (finite: a row with nothing to read stays finite)


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def fits(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int) -> bool:
    """Whether the kernel computes attention of these shapes (Triton's arrays have power-of-two
    sizes: the head dimensions; query heads a whole multiple of the kv heads)."""
    return num_heads % num_kv_heads == 0 and _pow2(head_dim) and _pow2(v_head_dim) and head_dim >= 16 and v_head_dim >= 16


def _kernel(table_ref, mask_ref, limit_ref, q_ref, k_ref, v_ref, sinks_ref, o_ref, m_ref, l_ref, *, page, S, K, G, Gp, scale, direct):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hd, dv = q_ref.shape[1], v_ref.shape[1]
    H = K * G
    g = jnp.minimum(jnp.arange(Gp, dtype=jnp.int32), G - 1)  # rows past G repeat the last head (never kept)
    d, e = jnp.arange(hd, dtype=jnp.int32), jnp.arange(dv, dtype=jnp.int32)
    q = q_ref[(b * H + h * G + g)[:, None], d[None, :]]  # [Gp, hd]
    lo = j * SPAN
    hi = jnp.minimum(lo + SPAN, limit_ref[b])
    blocks = jnp.maximum(hi - lo + BLOCK - 1, 0) // BLOCK
    if sinks_ref is None:
        m0, l0 = jnp.full((Gp,), NEG, jnp.float32), jnp.zeros((Gp,), jnp.float32)
    else:  # the sink joins the first span's denominator only
        sink = sinks_ref[h * G + g].astype(jnp.float32)
        first = jnp.full((Gp,), j, jnp.int32) == 0
        m0 = jnp.where(first, sink, jnp.full((Gp,), NEG, jnp.float32))
        l0 = jnp.where(first, jnp.ones((Gp,), jnp.float32), jnp.zeros((Gp,), jnp.float32))

    def body(i, carry):
        m, l, acc = carry
        s = lo + i * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)
        sc = jnp.minimum(s, S - 1)
        row = (table_ref[b, sc // page] * page + sc % page) * K + h  # each entry's row of the [pages·page·K, hd] pool
        k = k_ref[row[:, None], d[None, :]]  # [BLOCK, hd]
        v = v_ref[row[:, None], e[None, :]]  # [BLOCK, dv]
        ok = (s < hi) & (mask_ref[b, sc] != 0)
        v = jnp.where(ok[:, None], v, jnp.zeros_like(v))  # a masked entry adds 0, whatever its page holds
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale  # [Gp, BLOCK]
        scores = jnp.where(ok[None, :], scores, NEG)
        new = jnp.maximum(m, jnp.max(scores, axis=1))
        p = jnp.exp(scores - new[:, None])
        corr = jnp.exp(m - new)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + pv

    m, l, acc = jax.lax.fori_loop(0, blocks, body, (m0, l0, jnp.zeros((Gp, dv), jnp.float32)))
    if direct:  # one span: the output itself (a row with nothing to read gets zeros)
        o_ref[(b * H + h * G + g)[:, None], e[None, :]] = jnp.where(l[:, None] > 0, acc / l[:, None], 0.0).astype(o_ref.dtype)
    else:
        p = (b * K + h) * pl.num_programs(2) + j
        o_ref[(p * Gp + jnp.arange(Gp, dtype=jnp.int32))[:, None], e[None, :]] = acc
        m_ref[p * Gp + jnp.arange(Gp, dtype=jnp.int32)] = m
        l_ref[p * Gp + jnp.arange(Gp, dtype=jnp.int32)] = l


def _params(interpret: bool, num_warps: int) -> dict:
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps)}


def limits(mask_BS) -> jax.Array:
    """Each row's entries up to its last unmasked one (0 for a row with none): [B] int32."""
    S = mask_BS.shape[1]
    return jnp.max(jnp.where(mask_BS, jnp.arange(1, S + 1, dtype=jnp.int32), 0), axis=1)


def attention(q_BHd, k_pages, v_pages, table_BP, mask_BS, *, scale: float, sinks_H=None, limit_B=None, interpret: bool = False,
              num_warps: int = NUM_WARPS) -> jax.Array:  # fmt: skip
    """[B, H, dv] in q's dtype (module docstring). k_pages [N, page, K, hd], v_pages [N, page, K,
    dv]; table_BP int32 [B, P]; mask_BS bool [B, P·page]; `limit_B`: each row's entries to read
    (`limits(mask_BS)` when None; a caller whose layers share a mask computes it once)."""
    B, H, hd = q_BHd.shape
    N, page, K, hd_k = k_pages.shape
    dv = v_pages.shape[3]
    P = table_BP.shape[1]
    S = P * page
    if hd_k != hd or v_pages.shape[:3] != (N, page, K) or not fits(H, K, hd, dv):
        raise ValueError(f"no decode attention kernel for q {q_BHd.shape}, k pages {k_pages.shape}, v pages {v_pages.shape}")
    if mask_BS.shape != (B, S):
        raise ValueError(f"mask {mask_BS.shape} is not [{B}, {S}] (the table's entries)")
    G = H // K
    Gp = max(16, pl.next_power_of_2(G))
    NS = pl.cdiv(S, SPAN)
    direct = NS == 1
    limit = limits(mask_BS) if limit_B is None else limit_B.astype(jnp.int32)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    if direct:
        out_shape = [jax.ShapeDtypeStruct((B * H, dv), q_BHd.dtype)] + [jax.ShapeDtypeStruct((1,), jnp.float32)] * 2
    else:
        R = B * K * NS * Gp
        out_shape = [
            jax.ShapeDtypeStruct((R, dv), jnp.float32),
            jax.ShapeDtypeStruct((R,), jnp.float32),
            jax.ShapeDtypeStruct((R,), jnp.float32),
        ]
    args = [table_BP.astype(jnp.int32), mask_BS.astype(jnp.int8), limit, q_BHd.reshape(B * H, hd), k_pages.reshape(N * page * K, hd),
            v_pages.reshape(N * page * K, dv)]  # fmt: skip
    kernel = functools.partial(_kernel, page=page, S=S, K=K, G=G, Gp=Gp, scale=float(scale), direct=direct)
    if sinks_H is None:  # the kernel's sinks_ref is None
        kernel = functools.partial(lambda *refs, kernel: kernel(*refs[:6], None, *refs[6:]), kernel=kernel)
    else:
        args.append(sinks_H.astype(jnp.float32))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, NS),
        in_specs=[any_spec] * len(args),
        out_specs=[any_spec] * 3,
        out_shape=out_shape,
        name="decode_attention",
        **_params(interpret, num_warps),
    )(*args)
    if direct:
        return o.reshape(B, H, dv)
    o, m, l = o.reshape(B, K, NS, Gp, dv), m.reshape(B, K, NS, Gp), l.reshape(B, K, NS, Gp)
    top = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - top)
    den = jnp.sum(l * w, axis=2)
    num = jnp.sum(o * w[..., None], axis=2)
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return out[:, :, :G].reshape(B, H, dv).astype(q_BHd.dtype)


def attention_ref(q_BHd, k_pages, v_pages, table_BP, mask_BS, *, scale: float, sinks_H=None) -> jax.Array:
    """Reference: every row's entries gathered from the pages, a float32 softmax over them."""
    B, H, hd = q_BHd.shape
    K = k_pages.shape[2]
    k, v = (p[table_BP].reshape(B, -1, *p.shape[2:]) for p in (k_pages, v_pages))  # [B, S, K, d]
    q = q_BHd.reshape(B, K, H // K, hd)
    s = jnp.einsum("bkgd,bskd->bkgs", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask_BS[:, None, None], s, NEG)
    if sinks_H is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sink = sinks_H.astype(jnp.float32).reshape(1, K, H // K, 1)
        mx = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
        ex = jnp.exp(s - mx)
        p = ex / (jnp.sum(ex, axis=-1, keepdims=True) + jnp.exp(sink - mx))
    o = jnp.einsum("bkgs,bske->bkge", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, H, -1).astype(q_BHd.dtype)
