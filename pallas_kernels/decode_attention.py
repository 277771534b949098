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
in place, and stops after the row's last unmasked entry (`limits`), so that a step's cost follows
the positions it reads rather than the table's width. A table wider than one span gives each row
several programs whose partial sums are combined in jnp. A kv head with more than `MAX_HEADS`
query heads shares them among programs (`head_splits`).

A key may be kept in parts, each in a pool of its own (`k_pages` a tuple; q's columns meet them in
order): MLA decoding in the latent space is one kv head whose key is the cached latent beside
the rotated shared key, and whose value is the latent itself (`models.attention.MLAttention`).

With `fresh` (`Fresh`: this step's raw key and value, where they are stored, the rotation's
cos/sin and the q/k RMSNorm weights) q is the query as its projection gives it: each program
norms and rotates its query heads and the step's key (as `models.layers.RMSNorm` and `apply_rope`
do, rounding where they round), the first span's program stores key and value in their page and
folds them into its softmax from registers, and no program reads that entry from the pages —
XLA's four to six kernels of norms, rotations and page writes before attention, in this one.

With `layer`, the pools are stacked `[L, N, page, K, d]` (`memory.kv_cache.LayerKV`: one array
holds every layer's pool) and the kernel reads and writes pool `layer` of them in place.

`attention_ref` is the jnp reference: the pages gathered, the scores and a float32 softmax, the
probabilities cast to the values' dtype before their matmul (as `models.attention.attend`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import call_params, rows_of, value

BLOCK = 64  # entries a step of a program's loop reads
SPAN = 512  # entries a program covers at most
NUM_WARPS = 4
NEG = -1e30  # a masked score (finite: a row with nothing to read stays finite)
MAX_HEADS = 32  # query heads a program takes at most (`head_splits`)


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def fits(num_heads: int, num_kv_heads: int, head_dim, v_head_dim: int) -> bool:
    """Whether the kernel computes attention of these shapes (Triton's arrays have power-of-two
    sizes: the head dimensions, or each part of a key kept in pools of its own — `head_dim` a
    tuple, MLA's latent and rotated key; query heads a whole multiple of the kv heads)."""
    parts = head_dim if isinstance(head_dim, tuple) else (head_dim,)
    return num_heads % num_kv_heads == 0 and all(_pow2(d) and d >= 16 for d in (*parts, v_head_dim))


def head_splits(G: int) -> int:
    """Programs that share a kv head's G query heads equally, `MAX_HEADS` each at most where a
    divisor of G allows (MLA: one kv head for all query heads; a program's accumulator is
    [heads, dv] float32)."""
    return next(s for s in range(-(-G // MAX_HEADS), G + 1) if G % s == 0)


def _kernel(*refs, names, keys, page, S, K, G, Gp, scale, direct, fresh, eps, base, offsets):
    r = dict(zip(names, refs))
    b, hs, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # hs: a kv head's share of query heads
    h = hs // (pl.num_programs(1) // K)  # the kv head
    q_ref, v_ref = r["q"], r["v"]
    hd, dv = q_ref.shape[1], v_ref.shape[1]
    H = pl.num_programs(1) * G  # G: the query heads of one program
    g = jnp.minimum(jnp.arange(Gp, dtype=jnp.int32), G - 1)  # rows past G repeat the last head (never kept)
    qrows = (b * H + hs * G + g)[:, None]
    e = jnp.arange(dv, dtype=jnp.int32)
    if fresh is None:  # q as it is, its columns in parts against the key pools' rows
        pieces, at = [], 0
        for name, width in keys:
            d = jnp.arange(width, dtype=jnp.int32)
            pieces.append((q_ref[qrows, (at + d)[None, :]], name, d))  # (queries [Gp, n], their pool, its columns)
            at += width
    else:  # q and this step's key normed and rotated here: rotated halves meet the stored halves
        half = jnp.arange(hd // 2, dtype=jnp.int32)
        stored = (half, half + hd // 2)
        raw = (2 * half, 2 * half + 1) if fresh == "interleave" else stored

        def rotate(load, name):  # the two rotated halves of raw rows `load(columns)`, f32
            x1, x2 = load(raw[0]).astype(jnp.float32), load(raw[1]).astype(jnp.float32)
            if name in r:  # RMSNorm over the whole head, rounded to the model's dtype, times its weight
                dt, at = q_ref.dtype, offsets[name]
                inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=-1, keepdims=True) + jnp.sum(x2 * x2, axis=-1, keepdims=True)) / hd + eps)
                x1 = (r[name][at + raw[0]] * (x1 * inv).astype(dt)).astype(jnp.float32)
                x2 = (r[name][at + raw[1]] * (x2 * inv).astype(dt)).astype(jnp.float32)
            cos, sin = r["cos"][b, half], r["sin"][b, half]
            return (x1 * cos - x2 * sin).astype(q_ref.dtype), (x2 * cos + x1 * sin).astype(q_ref.dtype)

        q1, q2 = rotate(lambda c: q_ref[qrows, c[None, :]], "q_norm")
        pieces = [(q1, "k", stored[0]), (q2, "k", stored[1])]
        kn = rotate(lambda c: r["k_new"][b * K + h, c], "k_norm")  # two [hd/2]
        vn = r["v_new"][b * K + h, e]
        wrow = base + (r["write_page"][b] * page + r["write_off"][b]) * K + h

        @pl.when(j == 0)
        def _():  # this step's entry into its page (no program reads it there: it is folded in below)
            r["k_out"][wrow, stored[0]] = kn[0]
            r["k_out"][wrow, stored[1]] = kn[1]
            r["v_out"][wrow, e] = vn.astype(r["v_out"].dtype)

        me = r["self"][b]  # the entry's place in the table's order (-1: none)
    lo = j * SPAN
    hi = jnp.minimum(lo + SPAN, r["limit"][b])
    blocks = jnp.maximum(hi - lo + BLOCK - 1, 0) // BLOCK
    first = jnp.full((Gp,), j, jnp.int32) == 0
    m0, l0 = jnp.full((Gp,), NEG, jnp.float32), jnp.zeros((Gp,), jnp.float32)
    if "sinks" in r:  # the sink joins the first span's denominator only
        m0 = jnp.where(first, r["sinks"][offsets["sinks"] + hs * G + g].astype(jnp.float32), m0)
        l0 = jnp.where(first, jnp.ones((Gp,), jnp.float32), l0)
    acc0 = jnp.zeros((Gp, dv), jnp.float32)
    if fresh is not None:  # the first span folds in this step's entry
        own = first & (me >= 0) & (r["mask"][b, jnp.maximum(me, 0)] != 0)
        sc = sum(jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32)[None, :], axis=1) for (q, _, _), k in zip(pieces, kn)) * scale
        new = jnp.where(own, jnp.maximum(m0, sc), m0)
        p = jnp.where(own, jnp.exp(sc - new), 0.0)
        l0 = l0 * jnp.where(own, jnp.exp(m0 - new), 1.0) + p
        acc0 = p.astype(vn.dtype).astype(jnp.float32)[:, None] * vn.astype(jnp.float32)[None, :]
        m0 = new

    def body(i, carry):
        m, l, acc = carry
        s = lo + i * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)
        sc = jnp.minimum(s, S - 1)
        row = base + (r["table"][b, sc // page] * page + sc % page) * K + h  # each entry's row of the [(layers·)pages·page·K, hd] pools
        ok = (s < hi) & (r["mask"][b, sc] != 0)
        if fresh is not None:
            ok = ok & (s != me)
        v = v_ref[row[:, None], e[None, :]]  # [BLOCK, dv]
        v = jnp.where(ok[:, None], v, jnp.zeros_like(v))  # a masked entry adds 0, whatever its page holds
        scores = sum(
            jax.lax.dot_general(q, r[pool][row[:, None], c[None, :]], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            for q, pool, c in pieces
        )  # [Gp, BLOCK]
        scores = jnp.where(ok[None, :], scores * scale, NEG)
        new = jnp.maximum(m, jnp.max(scores, axis=1))
        p = jnp.exp(scores - new[:, None])
        corr = jnp.exp(m - new)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + pv

    m, l, acc = jax.lax.fori_loop(0, blocks, body, (m0, l0, acc0))
    o_ref = r["o"]
    if direct:  # one span: the output itself (a row with nothing to read gets zeros)
        o_ref[qrows, e[None, :]] = jnp.where(l[:, None] > 0, acc / l[:, None], 0.0).astype(o_ref.dtype)
    else:
        p = (b * pl.num_programs(1) + hs) * pl.num_programs(2) + j
        rows = p * Gp + jnp.arange(Gp, dtype=jnp.int32)
        o_ref[rows[:, None], e[None, :]] = acc
        r["m"][rows] = m
        r["l"][rows] = l


def limits(mask_BS) -> jax.Array:
    """Each row's entries up to its last unmasked one (0 for a row with none): [B] int32."""
    S = mask_BS.shape[1]
    return jnp.max(jnp.where(mask_BS, jnp.arange(1, S + 1, dtype=jnp.int32), 0), axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fresh:
    """This step's token as its projections give it, for `attention` to norm and rotate its query
    and key, store its key and value, and attend to it: k_BKd / v_BKe the raw keys and values;
    the page and offset it is stored at (page 0 for a row that writes nothing); cos/sin [B, hd/2]
    (`models.layers.rope_cos_sin`, the whole head rotated); q_norm / k_norm the per-head RMSNorm
    weights [hd] (None: no norm; arrays or `Stacked` operands, as `sinks_H` may be)."""

    k_BKd: jax.Array
    v_BKe: jax.Array
    write_page_B: jax.Array
    write_off_B: jax.Array
    cos_Bh: jax.Array
    sin_Bh: jax.Array
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    eps: float = dataclasses.field(default=1e-6, metadata=dict(static=True))
    interleave: bool = dataclasses.field(default=False, metadata=dict(static=True))


def fresh_fits(head_dim: int, rope_dim: int) -> bool:
    """Whether `attention` can take this step's token raw (`Fresh`): the whole head rotated, each
    half at least 16 wide (the rows of Triton's matmuls)."""
    return _pow2(head_dim) and head_dim >= 32 and rope_dim == head_dim


def attention(q_BHd, k_pages, v_pages, table_BP, mask_BS, *, scale: float, sinks_H=None, fresh: Fresh | None = None,
              layer: int | None = None, interpret: bool = False, num_warps: int = NUM_WARPS):  # fmt: skip
    """[B, H, dv] in q's dtype (module docstring). k_pages [N, page, K, hd], or a tuple of pools
    [N, page, K, d_i] that hold a key's parts (Σ d_i = hd: q's columns meet them in that order;
    MLA's latent and rotated key); v_pages [N, page, K, dv] (may be one of the key pools: MLA's
    latent is its value too); table_BP int32 [B, P]; mask_BS bool [B, P·page]. With `layer`, every
    pool has a leading layer axis ([L, N, page, K, d]) and pool `layer` of each is read (and, with
    `fresh`, written; the whole stacked arrays are returned). A kv head's query heads are shared
    by `head_splits` programs.

    With `fresh`, q_BHd is the query as its projection gives it and the kernel also norms and
    rotates it and this step's key, stores the key and value in the pages (the rows' entries there
    are read from registers, not the pages) and returns (o, k_pages, v_pages) — XLA's four to six
    kernels of norms, rotations and page writes before attention, in the same kernel."""
    pools = k_pages if isinstance(k_pages, tuple) else (k_pages,)
    B, H, hd = q_BHd.shape
    lead = 0 if layer is None else 1
    L = 1 if layer is None else pools[0].shape[0]
    N, page, K = pools[0].shape[lead : lead + 3]
    widths = tuple(p.shape[-1] for p in pools)
    dv = v_pages.shape[-1]
    P = table_BP.shape[1]
    S = P * page
    same = all(p.ndim == lead + 4 and p.shape[: lead + 3] == pools[0].shape[: lead + 3] for p in (*pools, v_pages))
    if layer is not None and not 0 <= layer < L:
        raise ValueError(f"layer {layer} of pools of {L} layers")
    if not same or sum(widths) != hd or not fits(H, K, widths, dv) or (fresh is not None and (len(pools) > 1 or not fresh_fits(hd, hd))):
        raise ValueError(f"no decode attention kernel for q {q_BHd.shape}, k pages {[p.shape for p in pools]}, v pages {v_pages.shape}")
    if mask_BS.shape != (B, S):
        raise ValueError(f"mask {mask_BS.shape} is not [{B}, {S}] (the table's entries)")
    splits = 1 if fresh is not None else head_splits(H // K)
    G = H // (K * splits)  # query heads a program
    Gp = max(16, pl.next_power_of_2(G))
    NS = pl.cdiv(S, SPAN)
    direct = NS == 1
    keys = tuple(("k" if i == 0 else f"k{i}", w) for i, w in enumerate(widths))
    ins = dict(table=table_BP.astype(jnp.int32), mask=mask_BS.astype(jnp.int8), limit=limits(mask_BS), q=q_BHd.reshape(B * H, hd),
               **{name: p.reshape(L * N * page * K, w) for (name, w), p in zip(keys, pools)}, v=v_pages.reshape(L * N * page * K, dv))  # fmt: skip
    offsets = {}  # the first row of a `Stacked` operand (a layer's among every layer's) in its array
    if sinks_H is not None:
        sinks, offsets["sinks"] = rows_of(sinks_H)
        ins["sinks"] = sinks.astype(jnp.float32)
    if direct:
        outs = dict(
            o=jax.ShapeDtypeStruct((B * H, dv), q_BHd.dtype),
            m=jax.ShapeDtypeStruct((1,), jnp.float32),
            l=jax.ShapeDtypeStruct((1,), jnp.float32),
        )
    else:
        R = B * K * splits * NS * Gp
        outs = dict(
            o=jax.ShapeDtypeStruct((R, dv), jnp.float32),
            m=jax.ShapeDtypeStruct((R,), jnp.float32),
            l=jax.ShapeDtypeStruct((R,), jnp.float32),
        )
    aliases = {}
    if fresh is not None:
        hit = table_BP == fresh.write_page_B[:, None]
        own = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) * page + fresh.write_off_B, -1)
        ins.update(k_new=fresh.k_BKd.reshape(B * K, hd).astype(q_BHd.dtype), v_new=fresh.v_BKe.reshape(B * K, dv), self=own.astype(jnp.int32),
                   write_page=fresh.write_page_B.astype(jnp.int32), write_off=fresh.write_off_B.astype(jnp.int32),
                   cos=fresh.cos_Bh.astype(jnp.float32), sin=fresh.sin_Bh.astype(jnp.float32))  # fmt: skip
        for name, w in (("q_norm", fresh.q_norm), ("k_norm", fresh.k_norm)):
            if w is not None:
                ins[name], offsets[name] = rows_of(w)
        aliases = {list(ins).index("k"): 3, list(ins).index("v"): 4}  # the pages, written in place
        outs.update(k_out=jax.ShapeDtypeStruct(ins["k"].shape, k_pages.dtype), v_out=jax.ShapeDtypeStruct(ins["v"].shape, v_pages.dtype))
    names = list(ins) + list(outs)
    kernel = functools.partial(_kernel, names=names, keys=keys, page=page, S=S, K=K, G=G, Gp=Gp, scale=float(scale), direct=direct,
                               fresh=None if fresh is None else ("interleave" if fresh.interleave else "half"),
                               eps=1e-6 if fresh is None else float(fresh.eps), base=(layer or 0) * N * page * K,
                               offsets=offsets)  # fmt: skip
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    res = pl.pallas_call(
        kernel,
        grid=(B, K * splits, NS),
        in_specs=[any_spec] * len(ins),
        out_specs=[any_spec] * len(outs),
        out_shape=list(outs.values()),
        input_output_aliases=aliases,
        name="decode_attention",
        **call_params(interpret, num_warps),
    )(*ins.values())
    o, m, l = res[:3]
    if not direct:
        o, m, l = o.reshape(B, K * splits, NS, Gp, dv), m.reshape(B, K * splits, NS, Gp), l.reshape(B, K * splits, NS, Gp)
        top = jnp.max(m, axis=2, keepdims=True)
        w = jnp.exp(m - top)
        den = jnp.sum(l * w, axis=2)
        num = jnp.sum(o * w[..., None], axis=2)
        o = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)[:, :, :G]
    o = o.reshape(B, H, dv).astype(q_BHd.dtype)
    if fresh is None:
        return o
    return o, res[3].reshape(k_pages.shape), res[4].reshape(v_pages.shape)


def _norm_rotate_ref(x, w, f: Fresh):
    """x [..., hd]: RMSNorm (float32, rounded to x's dtype, times w) and the rotation, as
    `models.layers.RMSNorm` and `apply_rope` compute them."""
    dt = x.dtype
    if w is not None:
        xf = x.astype(jnp.float32)
        x = w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + f.eps)).astype(dt)
    x = x.astype(jnp.float32)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if f.interleave else jnp.split(x, 2, axis=-1)
    cos, sin = f.cos_Bh[:, None, :], f.sin_Bh[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dt)


def attention_ref(q_BHd, k_pages, v_pages, table_BP, mask_BS, *, scale: float, sinks_H=None, fresh: Fresh | None = None,
                  layer: int | None = None):  # fmt: skip
    """Reference: every row's entries gathered from the pages, a float32 softmax over them. With
    `fresh`: q and this step's key normed and rotated, key and value written to their pages
    first; returns (o, k_pages, v_pages). `layer`: pool `layer` of stacked pools, as `attention`
    takes them. The norms and sinks may be `Stacked` operands."""
    sinks_H = value(sinks_H)
    if fresh is not None:
        fresh = dataclasses.replace(fresh, q_norm=value(fresh.q_norm), k_norm=value(fresh.k_norm))
    if layer is not None:
        pick = lambda p: tuple(a[layer] for a in p) if isinstance(p, tuple) else p[layer]  # noqa: E731
        out = attention_ref(q_BHd, pick(k_pages), pick(v_pages), table_BP, mask_BS, scale=scale, sinks_H=sinks_H, fresh=fresh)
        if fresh is None:
            return out
        return out[0], k_pages.at[layer].set(out[1]), v_pages.at[layer].set(out[2])
    if fresh is not None:
        q = _norm_rotate_ref(q_BHd, fresh.q_norm, fresh)
        k = _norm_rotate_ref(fresh.k_BKd.astype(q_BHd.dtype), fresh.k_norm, fresh)
        at = (fresh.write_page_B, fresh.write_off_B)
        k_pages, v_pages = k_pages.at[at].set(k.astype(k_pages.dtype)), v_pages.at[at].set(fresh.v_BKe.astype(v_pages.dtype))
        return attention_ref(q, k_pages, v_pages, table_BP, mask_BS, scale=scale, sinks_H=sinks_H), k_pages, v_pages
    B, H, hd = q_BHd.shape
    pools = k_pages if isinstance(k_pages, tuple) else (k_pages,)
    K = pools[0].shape[2]
    k = jnp.concatenate([p[table_BP].reshape(B, -1, *p.shape[2:]) for p in pools], axis=-1)  # [B, S, K, hd]
    v = v_pages[table_BP].reshape(B, -1, *v_pages.shape[2:])
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
