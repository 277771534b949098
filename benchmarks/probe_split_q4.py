"""Probe: would decode's q4_0 experts read faster from slots whose rows keep the nibbles apart
from the scales? A q4_0 row is blocks of 18 bytes (an f16 scale, 16 bytes of nibbles: GGUF's
layout, what the host banks, the fetch and the CPU executor share), so no load of a block's
nibbles is aligned beyond 2 bytes. Here the same rows rearranged — each row's nibbles first, as
32-bit words (4 a block, 8 weights a word: nibble k of word i holds weight 16·(k mod 2) + 4i +
k div 2 of its block), then its scales — and the input vector permuted once to the words' order,
so that a block's 8 weights of a word meet their 8 inputs side by side.

Variants, one decode layer's routed experts each (gate/up, the activation, down, the weighted
sum over the token's experts), timed as `bench_expert_kernels.py` times them (`steps` layers in
one jitted function, unrolled, every layer's output the next one's input and its experts the next
8 of the bank):

- `xla words`: the engine's default on a GPU (`routed_experts(impl="gather")` over 16-bit words);
- `xla split`: XLA's fusion of the same computation over the split rows;
- `pallas split R/W`: two Triton kernels over the split rows (gate/up writing h in the words'
  order; down), R rows a program, W warps.

    python benchmarks/probe_split_q4.py [--steps 64] [--rows 2 4 8] [--warps 4 8]

Prints µs a layer, the stored bytes read per second and each variant's largest difference from
the float32 reference of the same weights.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from bench_expert_kernels import time_variants
from jax.experimental import pallas as pl

from freetoken_jax.models.routed import routed_experts
from freetoken_jax.quant.formats import get_format
from freetoken_jax.quant.layout import ExpertLayout
from pallas_kernels import call_params
from pallas_kernels.gathered_experts import _down, _pieces


def split_rows(bank: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A q4_0 bank [E, rows · blocks · 18 bytes] → (nibbles as uint32 [E, rows, blocks · 4],
    scales float16 [E, rows, blocks])."""
    E, nb = bank.shape[0], cols // 32
    blocks = bank.reshape(E, rows, nb, 18)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    words = np.ascontiguousarray(blocks[..., 2:]).view(np.uint32).reshape(E, rows, nb * 4)
    return words, scales


def word_order(n: int) -> np.ndarray:
    """Index j of the words' order → the weight it holds: j = 32·block + 8i + k holds weight
    32·block + 16·(k mod 2) + 4i + k div 2."""
    j = np.arange(n)
    blk, i, k = j // 32, (j % 32) // 8, j % 8
    return blk * 32 + 16 * (k % 2) + 4 * i + k // 2


def _dot(c_ref, s_ref, e, rows, v_ref, vrow, nb: int):
    """float32 [R]: rows `rows` of expert e (split) against row `vrow` of v (in the words' order)."""
    acc = jnp.zeros(rows.shape, jnp.float32)
    kk = jnp.arange(8, dtype=jnp.int32)
    for w0, n in _pieces(nb * 4):
        c = w0 + jnp.arange(n, dtype=jnp.int32)
        words = c_ref[e, rows[:, None], c[None, :]]  # [R, n] uint32
        nib = ((words[:, :, None] >> (4 * kk).astype(jnp.uint32)[None, None, :]) & jnp.uint32(15)).astype(jnp.int32) - 8
        v = v_ref[vrow, c[:, None] * 8 + kk[None, :]].astype(jnp.float32)  # [n, 8]
        part = jnp.sum(nib.astype(jnp.float32) * v[None], axis=2)  # [R, n]
        sc = s_ref[e, rows[:, None], (c // 4)[None, :]].astype(jnp.float32)
        acc = acc + jnp.sum(part * sc, axis=1)
    return acc


def _gate_up(ids_ref, x_ref, gc, gs, uc, us, h_ref, *, K: int, R: int, nb: int):
    p, r = pl.program_id(0), pl.program_id(1)
    e, t = ids_ref[p], p // K
    f = r * R + jnp.arange(R, dtype=jnp.int32)
    g, u = _dot(gc, gs, e, f, x_ref, t, nb), _dot(uc, us, e, f, x_ref, t, nb)
    pos = (f // 32) * 32 + ((f % 16) // 4) * 8 + (f % 4) * 2 + (f % 32) // 16  # row f's place in the words' order
    h_ref[p, pos] = (g * jax.nn.sigmoid(g) * u).astype(h_ref.dtype)


def pallas_split(x_TD, ids_TK, w_TK, banks, *, F: int, D: int, R: int, warps: int, interpret: bool):
    T, K = ids_TK.shape
    (gc, gs), (uc, us), (dc, ds) = banks
    xp = x_TD[:, word_order(D)]
    ids = ids_TK.reshape(-1).astype(jnp.int32)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    h = pl.pallas_call(
        functools.partial(_gate_up, K=K, R=R, nb=D // 32),
        grid=(T * K, F // R),
        in_specs=[any_spec] * 6,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((T * K, F), x_TD.dtype),
        **call_params(interpret, warps),
    )(ids, xp, gc, gs, uc, us)
    return pl.pallas_call(
        functools.partial(_down, K=K, R=R, dot=lambda refs, e, rows, v, p: _dot(*refs, e, rows, v, p, F // 32)),
        grid=(T, D // R),
        in_specs=[any_spec] * 5,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((T, D), x_TD.dtype),
        **call_params(interpret, warps),
    )(ids, w_TK.reshape(-1).astype(jnp.float32), h, dc, ds)


def _xla_matvec(words, scales, v):
    """[..., rows] float32: split rows (words [..., rows, nb·4], scales [..., rows, nb]) against v
    [..., nb·32] in the words' order, as one reduction XLA fuses with the rows' gather."""
    nb = scales.shape[-1]
    shifts = (4 * jnp.arange(8, dtype=jnp.uint32)).reshape(1, 1, 8)
    nib = ((words[..., None] >> shifts) & jnp.uint32(15)).astype(jnp.int32) - 8  # [..., rows, nb·4, 8]
    nib = nib.reshape(*nib.shape[:-2], nb, 32).astype(jnp.float32)
    vb = v.reshape(*v.shape[:-1], 1, nb, 32).astype(jnp.float32)
    return jnp.sum(nib * vb * scales[..., None].astype(jnp.float32), axis=(-2, -1))


def xla_split(x_TD, ids_TK, w_TK, banks, *, F: int, D: int):
    T, K = ids_TK.shape
    (gc, gs), (uc, us), (dc, ds) = banks
    xp = jnp.broadcast_to(x_TD[:, word_order(D)][:, None, :], (T, K, D))
    g, u = _xla_matvec(gc[ids_TK], gs[ids_TK], xp), _xla_matvec(uc[ids_TK], us[ids_TK], xp)
    h = (g * jax.nn.sigmoid(g) * u).astype(x_TD.dtype)[..., word_order(F)]
    y = jnp.where((w_TK != 0)[..., None], _xla_matvec(dc[ids_TK], ds[ids_TK], h), 0.0)
    return jnp.einsum("tkd,tk->td", y, w_TK).astype(x_TD.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    a = ap.parse_args()
    E, K, F, D = a.experts, a.k, a.ffn, a.hidden
    q, rng = get_format("q4_0"), np.random.default_rng(0)
    shapes = ((F, D), (F, D), (D, F))
    banks = tuple(q.quantize(jnp.asarray(rng.standard_normal((E, o, i)).astype(np.float32) * 0.03)) for o, i in shapes)
    split = tuple(tuple(jnp.asarray(z) for z in split_rows(np.asarray(b), o, i)) for b, (o, i) in zip(banks, shapes))
    layout = ExpertLayout(("q4_0",) * 3, F, D, "silu")
    x0 = jnp.asarray(rng.standard_normal((1, D)), jnp.bfloat16)
    w = jnp.full((1, K), 1.0 / K, jnp.float32)
    interpret = jax.default_backend() == "cpu"
    one = jnp.asarray(rng.integers(0, E, (1, K)), jnp.int32)

    g, u, d = (q.dequantize(b[one[0]], o, i) for b, (o, i) in zip(banks, shapes))  # float32 reference
    x = x0.astype(jnp.float32)[0]
    hg, hu = jnp.einsum("kfd,d->kf", g, x), jnp.einsum("kfd,d->kf", u, x)
    h = (hg * jax.nn.sigmoid(hg) * hu).astype(jnp.bfloat16).astype(jnp.float32)
    ref = np.asarray(jnp.einsum("kdf,kf,k->d", d, h, w[0]))[None]

    variants = [
        ("xla words", lambda x, ids: routed_experts(x, ids, w, banks, layout, impl="gather")),
        ("xla split", lambda x, ids: xla_split(x, ids, w, split, F=F, D=D)),
    ] + [
        (f"pallas split {r}/{nw}", functools.partial(lambda x, ids, r, nw: pallas_split(x, ids, w, split, F=F, D=D, R=r, warps=nw, interpret=interpret), r=r, nw=nw))
        for r in a.rows
        for nw in a.warps
    ]  # fmt: skip

    nbytes = K * sum(b.shape[1] for b in banks)
    print(f"{jax.devices()[0].device_kind}: q4_0 experts {K} of {E}, F={F} D={D}: {nbytes / 1e6:.2f} MB a layer, {a.steps} layers a call")
    time_variants(variants, x0, one, ref, nbytes, a.steps, K, E, width=20)


if __name__ == "__main__":
    main()
