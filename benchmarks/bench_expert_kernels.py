"""Time one decode layer's routed experts on 4-bit slots (q4_0 by default): XLA's fused gather-and-reduce
(`routed_experts(impl="gather")`, the default; for q4_0 also over the bytes and over 16-bit words,
`ExpertLayout.words`) against the Pallas kernels of
`pallas_kernels/gathered_experts.py` at several rows per program and warp counts; for q4_0 also
the kernels over the slots' 16-bit words (`words ...`: the words made once, outside the timed
function), XLA reducing each row's words at once (`xla flat words`), each pair's routing weight
folded into its h so that the down rows and the sum over pairs are one reduction (`xla fold`,
the engine's `_gathered`; `xla fold once` the same written as one sum), and q4_0 split into
planes (codes as 32-bit words, scales apart: `xla split` and the kernels `split ...`, made once
outside the timed function; a layout of this benchmark only), and q4_0's code bytes as planes
of 8-, 16- or 32-bit words with the scales apart (`xla planes uint8|uint16|uint32`, folded as
`xla fold`; every row of codes whole aligned words; `xla planes in rows`: the same planes inside
each expert's row of one array, gathered as 32-bit words).

    python benchmarks/bench_expert_kernels.py [--format q4_0|mxfp4] [--experts 128] [--k 8] [--ffn 768] [--hidden 2048] [--steps 64]
        [--rows 1 2 4 8] [--warps 2 4 8] [--only words "xla words"]

Each variant runs `steps` layers in one jitted function (the loop unrolled: as a GPU loop each
iteration cost about 20-40 µs whatever it read, benchmarks/RESULTS.md), every layer's output feeding the next
layer's input and its experts the next 8 of the bank (so that the slots read, 2.65 MB an expert
at the default shape, come from HBM and not from L2). Prints µs a layer and the stored bytes read
per second, and on a GPU with torch each kernel's device time a layer (CUDA's profiler, kernels
of one name summed, the six heaviest); the bound is the device copy bandwidth (`bench decode`
prints it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_norm_matvec import device_times
from jax.experimental import pallas as pl

from freetoken_jax.config import ACTIVATIONS
from freetoken_jax.models.routed import routed_experts
from freetoken_jax.quant.formats import get_format
from freetoken_jax.quant.layout import ExpertLayout
from pallas_kernels import call_params, gathered_experts


def looped(fn, steps: int, K: int, E: int):
    """`steps` layers of fn(x, ids) in one jitted function, unrolled (straight-line, as the decode
    step's layers are): each layer's output, normalised, the next one's input; layer i's experts
    the next K of the bank's E."""

    @jax.jit
    def run(x):
        def body(i, x):
            ids = ((jnp.arange(K, dtype=jnp.int32) + i * K) % E)[None]
            y = fn(x, ids).astype(jnp.float32)
            return (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(x.dtype)

        return jax.lax.fori_loop(0, steps, body, x, unroll=True)

    return run


def flat_matvec(b, x, O: int, I: int):
    """q4_0 words [..., O·I/32·9] times x [..., I] → float32 [..., O], each row reduced over all its
    words at once: every word's four codes against the x values of their weights (0 for the
    scale word, whose bits then add nothing), times its block's scale."""
    nb = I // 32
    blk = b.reshape(*b.shape[:-1], O, nb, 9)
    s = jax.lax.bitcast_convert_type(blk[..., :1], jnp.float16).astype(jnp.float32)
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], 1, nb, 2, 8, 2)  # weight 16·half + 2i + parity
    xw = jnp.stack([xb[..., 0, :, 0], xb[..., 1, :, 0], xb[..., 0, :, 1], xb[..., 1, :, 1]], axis=-1)  # [..., 1, nb, 8, 4]
    xw = jnp.concatenate([jnp.zeros_like(xw[..., :1, :]), xw], axis=-2)  # [..., 1, nb, 9, 4]
    t = sum((((blk >> (4 * n)) & 15).astype(jnp.float32) - 8.0) * xw[..., n] for n in range(4))
    return jnp.sum(s * t, axis=(-2, -1))


# q4_0 split into planes (benchmark only): codes uint32 [E, O, 4, nb] (word (j, b)'s nibble n is
# weight 32·b + 8·j + n, unsigned) and scales f16 [E, O, nb]: the same 0.5625 bytes a weight, each
# plane read in whole contiguous tiles.
def split_q4_0(bank, O: int, I: int):
    """q4_0 rows uint8 [E, O·I/32·18] → (codes uint32 [E, O, 4, nb], scales float16 [E, O, nb])."""
    nb = I // 32
    blk = bank.reshape(bank.shape[0], O, nb, 18)
    scales = jax.lax.bitcast_convert_type(blk[..., :2], jnp.float16)  # [E, O, nb]
    q = blk[..., 2:].astype(jnp.uint32)
    nib = jnp.concatenate([q & 15, q >> 4], axis=-1).reshape(bank.shape[0], O, nb, 4, 8)  # weight 32b + 8j + n
    codes = sum(nib[..., n] << (4 * n) for n in range(8)).astype(jnp.uint32)  # [E, O, nb, 4]
    return jnp.swapaxes(codes, -1, -2), scales


def split_matvec(c, s, x):
    """XLA: codes [..., O, 4, nb], scales [..., O, nb] times x [..., I] → float32 [..., O]."""
    nb = c.shape[-1]
    xw = x.astype(jnp.float32).reshape(*x.shape[:-1], 1, nb, 4, 8)
    xw = jnp.swapaxes(xw, -3, -2)  # [..., 1, 4, nb, 8]
    v = (((c[..., None] >> (4 * jnp.arange(8, dtype=jnp.uint32))) & 15).astype(jnp.float32) - 8.0) * xw
    return jnp.sum(jnp.sum(v, axis=(-3, -1)) * s.astype(jnp.float32), axis=-1)


def planes_q4_0(bank, O: int, I: int, dtype):
    """q4_0 rows uint8 [E, O·I/32·18] → (codes [E, O, nb, 16 / itemsize] in `dtype` (uint8, uint16
    or uint32): each block's 16 code bytes as they are stored, scales float16 [E, O, nb]): the
    same bytes, the scales apart so that every row of codes is whole aligned words."""
    nb = I // 32
    blk = bank.reshape(bank.shape[0], O, nb, 18)
    scales = jax.lax.bitcast_convert_type(blk[..., :2], jnp.float16)
    n = jnp.dtype(dtype).itemsize
    codes = blk[..., 2:] if n == 1 else jax.lax.bitcast_convert_type(blk[..., 2:].reshape(bank.shape[0], O, nb, 16 // n, n), dtype)
    return codes, scales


def planes_matvec(c, s, x):
    """XLA: planes [..., O, nb, w] (w words of 16 / w bytes), scales [..., O, nb] times x [..., I] →
    float32 [..., O]: nibble m of word i is byte i·(16 / w) + m // 2 of the block, its low nibble
    weight byte, its high weight byte + 16."""
    nb, w = c.shape[-2:]
    per = 32 // w  # nibbles a word
    m = np.arange(per)
    at = (np.arange(w)[:, None] * (16 // w) + m[None, :] // 2 + 16 * (m[None, :] % 2)).reshape(-1)  # [w·per]: each nibble's weight
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], 1, nb, 32)[..., at].reshape(*x.shape[:-1], 1, nb, w, per)
    q = c.astype(jnp.uint32)
    t = sum((((q >> (4 * j)) & 15).astype(jnp.float32) - 8.0) * xb[..., j] for j in range(per))
    return jnp.sum(s.astype(jnp.float32)[..., None] * t, axis=(-2, -1))


def planar_rows(bank, O: int, I: int):
    """q4_0 rows uint8 [E, O·I/32·18] → the same bytes reordered in each row, every block's 16 code
    bytes first, then every block's scale, viewed as uint32 [E, O·I/32·18 / 4] (a bank as the
    step would hold it: one array, its rows gathered whole)."""
    nb = I // 32
    blk = bank.reshape(bank.shape[0], O * nb, 18)
    rows = jnp.concatenate([blk[..., 2:].reshape(bank.shape[0], -1), blk[..., :2].reshape(bank.shape[0], -1)], axis=-1)
    return jax.lax.bitcast_convert_type(rows.reshape(bank.shape[0], -1, 4), jnp.uint32)


def planar_matvec(r, x, O: int, I: int):
    """XLA: gathered planar rows uint32 [..., O·I/32·18 / 4] times x [..., I] → float32 [..., O]."""
    nb = I // 32
    c = r[..., : O * nb * 4].reshape(*r.shape[:-1], O, nb, 4)
    sc = jax.lax.bitcast_convert_type(r[..., O * nb * 4 :], jnp.float16).reshape(*r.shape[:-1], O, nb)
    return planes_matvec(c, sc, x)


def _split_dot(c_ref, s_ref, slot, row0, R: int, v_ref, vrow, nb: int):
    """float32 [R]: rows row0.. of slot `slot` (split planes) against row vrow of v_ref."""
    acc = jnp.zeros((R,), jnp.float32)
    for b0, n in gathered_experts._pieces(nb):
        c = c_ref[slot, pl.ds(row0, R), :, pl.ds(b0, n)]  # [R, 4, n] uint32
        sc = s_ref[slot, pl.ds(row0, R), pl.ds(b0, n)].astype(jnp.float32)  # [R, n]
        b = b0 + jnp.arange(n, dtype=jnp.int32)
        base = 32 * b[None, :] + 8 * jnp.arange(4, dtype=jnp.int32)[:, None]  # [4, n]
        t, xs = 0.0, 0.0
        for m in range(8):
            xm = v_ref[vrow, base + m].astype(jnp.float32)
            t = t + ((c >> (4 * m)) & 15).astype(jnp.float32) * xm[None]
            xs = xs + xm
        acc = acc + jnp.sum(jnp.sum(t - 8.0 * xs[None], axis=1) * sc, axis=1)
    return acc


def _split_gate_up(ids_ref, x_ref, gc, gs, uc, us, h_ref, *, K: int, R: int, nb: int, act):
    p, r = pl.program_id(0), pl.program_id(1)
    s, t = ids_ref[p], p // K
    g = _split_dot(gc, gs, s, r * R, R, x_ref, t, nb)
    u = _split_dot(uc, us, s, r * R, R, x_ref, t, nb)
    h_ref[p, pl.ds(r * R, R)] = act(g, u).astype(h_ref.dtype)


def _split_down(ids_ref, w_ref, h_ref, dc, ds, y_ref, *, K: int, R: int, nb: int):
    t, r = pl.program_id(0), pl.program_id(1)
    acc = jnp.zeros((R,), jnp.float32)
    for k in range(K):
        p = t * K + k
        w = w_ref[p]
        acc = acc + jnp.where(w != 0, w * _split_dot(dc, ds, ids_ref[p], r * R, R, h_ref, p, nb), 0.0)
    y_ref[t, pl.ds(r * R, R)] = acc.astype(y_ref.dtype)


def split_experts(x, ids, w, gate, up, down, *, F: int, D: int, act, interpret: bool, rows: int, warps: int):
    """The routed experts over split planes (each of gate, up, down a (codes, scales) pair)."""
    T, K = ids.shape
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    params = call_params(interpret, warps)
    ids = ids.reshape(-1).astype(jnp.int32)
    h = pl.pallas_call(
        functools.partial(_split_gate_up, K=K, R=rows, nb=D // 32, act=act),
        grid=(T * K, F // rows),
        in_specs=[any_spec] * 6,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((T * K, F), x.dtype),
        name="split_gate_up",
        **params,
    )(ids, x, *gate, *up)
    return pl.pallas_call(
        functools.partial(_split_down, K=K, R=rows, nb=F // 32),
        grid=(T, D // rows),
        in_specs=[any_spec] * 5,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((T, D), x.dtype),
        name="split_down",
        **params,
    )(ids, w.reshape(-1).astype(jnp.float32), h, *down)


def time_variants(variants, x0, one, ref, nbytes: int, steps: int, K: int, E: int, width: int = 22) -> None:
    """Prints each variant's µs a layer (the best of 5 calls of `looped`), GB/s of `nbytes` a
    layer and its largest difference from `ref` at experts `one`."""
    print(f"{'variant':>{width}} {'us/layer':>9} {'GB/s':>8} {'max |diff|':>11}")
    for name, fn in variants:
        try:
            diff = float(np.abs(np.asarray(fn(x0, one), np.float32) - ref).max())
            run = looped(fn, steps, K, E)
            run(x0).block_until_ready()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                run(x0).block_until_ready()
                ts.append((time.perf_counter() - t) / steps)
            t = min(ts)
            print(f"{name:>{width}} {t * 1e6:9.1f} {nbytes / t / 1e9:8.1f} {diff:11.2e}", flush=True)
            kernels = {}
            for k, us in (device_times(run, (x0,), 3) or {}).items():  # by kernel, its numbering dropped
                kernels[re.sub(r"[_.]*\d+$", "", k)] = kernels.get(re.sub(r"[_.]*\d+$", "", k), 0.0) + us / steps
            if kernels:
                print(" " * (width + 1) + "  ".join(f"{k[:40]} {us:.1f}" for k, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]))
        except Exception as e:  # a variant that does not compile is reported, the others still run
            print(f"{name:>{width}} failed: {str(e).splitlines()[0][:150]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="q4_0", choices=sorted(gathered_experts.FORMATS))
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--only", nargs="+", default=None, help="time only the variants whose names contain one of these (e.g. words)")
    ap.add_argument("--hlo", help="a folder: write each XLA variant's optimized HLO (one layer) there and count its kernels")
    a = ap.parse_args()
    E, K, F, D = a.experts, a.k, a.ffn, a.hidden
    q, rng = get_format(a.format), np.random.default_rng(0)
    banks = tuple(q.quantize(jnp.asarray(rng.standard_normal((E, o, i)).astype(np.float32) * 0.03)) for o, i in ((F, D), (F, D), (D, F)))
    layout = ExpertLayout((a.format,) * 3, F, D, "silu")
    x0 = jnp.asarray(rng.standard_normal((1, D)), jnp.bfloat16)
    w = jnp.full((1, K), 1.0 / K, jnp.float32)
    interpret = jax.default_backend() == "cpu"

    def xla(x, ids):
        return routed_experts(x, ids, w, banks, layout, impl="gather")

    def xla_as(words):
        return lambda x, ids: routed_experts(x, ids, w, banks, dataclasses.replace(layout, words=words), impl="gather")

    words = tuple(q.words(b) for b in banks) if a.format == "q4_0" else None

    def kernel(x, ids, rows, warps, slots=banks):
        return gathered_experts.experts(a.format, x, ids, w, *slots, F=F, D=D, act=ACTIVATIONS["silu"], interpret=interpret,
                                             block_rows=rows, num_warps=warps)  # fmt: skip

    def flat(x, ids):  # XLA over words, each row's 9·nb words reduced at once (the scale word weighted 0)
        g, u, d = (b[ids] for b in words)
        xk = jnp.broadcast_to(x[:, None, :], (*ids.shape, D))
        h = jax.nn.silu(flat_matvec(g, xk, F, D)) * flat_matvec(u, xk, F, D)
        return jnp.einsum("tkd,tk->td", flat_matvec(d, h.astype(x.dtype), D, F), w).astype(x.dtype)

    nbytes = K * sum(b.shape[1] for b in banks)
    one = jnp.asarray(rng.integers(0, E, (1, K)), jnp.int32)
    ref = np.asarray(xla(x0, one), np.float32)
    print(
        f"{jax.devices()[0].device_kind}: {a.format} experts {K} of {E}, F={F} D={D}: {nbytes / 1e6:.2f} MB a layer, {a.steps} layers a call"
    )
    xla_variants = [("xla gather", xla)] + ([("xla bytes", xla_as(False)), ("xla words", xla_as(True))] if a.format == "q4_0" else [])
    if a.hlo:
        import pathlib

        out = pathlib.Path(a.hlo)
        out.mkdir(parents=True, exist_ok=True)
        for name, fn in xla_variants:
            text = jax.jit(fn).lower(x0, one).compile().as_text()
            (out / f"{name.replace(' ', '_')}.hlo.txt").write_text(text)
            entry = text[text.index("ENTRY") :]
            print(f"{name}: {entry.count(' fusion(') + entry.count('custom-call(')} kernels in the entry computation")
    if a.format == "q4_0":
        xla_variants.append(("xla flat words", flat))
        planes = tuple(split_q4_0(b, o, i) for b, (o, i) in zip(banks, ((F, D), (F, D), (D, F))))

        def xla_split(x, ids):
            (gc, gs), (uc, us), (dc, ds) = ((c[ids], s[ids]) for c, s in planes)
            xk = jnp.broadcast_to(x[:, None, :], (*ids.shape, D))
            h = jax.nn.silu(split_matvec(gc, gs, xk)) * split_matvec(uc, us, xk)
            return jnp.einsum("tkd,tk->td", split_matvec(dc, ds, h.astype(x.dtype)), w).astype(x.dtype)

        xla_variants.append(("xla split", xla_split))

        def folded(x, ids, at_once: bool):  # each pair's routing weight folded into its h (as routed._dense does)
            lay = dataclasses.replace(layout, words=True)
            g, u, d = (lay.gather(k, b, ids) for k, b in enumerate(banks))
            xk = jnp.broadcast_to(x[:, None, :], (*ids.shape, D))
            h = (jax.nn.silu(lay.matvec(0, g, xk)) * lay.matvec(1, u, xk) * w[..., None]).astype(x.dtype)
            if not at_once:
                return jnp.sum(lay.matvec(2, d, h), axis=1).astype(x.dtype)
            blk = d.reshape(*d.shape[:-1], D, F // 32, 9)  # the down rows' words: one reduction over (k, block, word)
            sc = jax.lax.bitcast_convert_type(blk[..., 0], jnp.float16).astype(jnp.float32)[..., None]
            hb = h.astype(jnp.float32).reshape(*h.shape[:-1], 1, F // 32, 2, 8, 2)
            code = lambda n: ((blk[..., 1:] >> (4 * n)) & 15).astype(jnp.float32) - 8.0  # noqa: E731
            t = code(0) * hb[..., 0, :, 0] + code(1) * hb[..., 1, :, 0] + code(2) * hb[..., 0, :, 1] + code(3) * hb[..., 1, :, 1]
            return jnp.sum(sc * t, axis=(1, -2, -1)).astype(x.dtype)

        xla_variants += [("xla fold", functools.partial(folded, at_once=False)), ("xla fold once", functools.partial(folded, at_once=True))]

        def planar(dtype):  # q4_0 as code planes and scales apart (made once, outside the timed function), the pairs' sum folded
            ps = tuple(planes_q4_0(b, o, i, dtype) for b, (o, i) in zip(banks, ((F, D), (F, D), (D, F))))

            def fn(x, ids):
                (gc, gs), (uc, us), (dc, ds) = ((c[ids], sc[ids]) for c, sc in ps)
                xk = jnp.broadcast_to(x[:, None, :], (*ids.shape, D))
                h = (jax.nn.silu(planes_matvec(gc, gs, xk)) * planes_matvec(uc, us, xk) * w[..., None]).astype(x.dtype)
                return jnp.sum(planes_matvec(dc, ds, h), axis=1).astype(x.dtype)

            return fn

        xla_variants += [(f"xla planes {jnp.dtype(t).name}", planar(t)) for t in (jnp.uint8, jnp.uint16, jnp.uint32)]
        rowed = tuple(planar_rows(b, o, i) for b, (o, i) in zip(banks, ((F, D), (F, D), (D, F))))

        def planar_fold(x, ids):  # the planes inside each expert's row (one array a projection), the pairs' sum folded
            g, u, d = (r[ids] for r in rowed)
            xk = jnp.broadcast_to(x[:, None, :], (*ids.shape, D))
            h = (jax.nn.silu(planar_matvec(g, xk, F, D)) * planar_matvec(u, xk, F, D) * w[..., None]).astype(x.dtype)
            return jnp.sum(planar_matvec(d, h, D, F), axis=1).astype(x.dtype)

        xla_variants.append(("xla planes in rows", planar_fold))
    variants = xla_variants + [
        (f"kernel rows={r} warps={nw}", functools.partial(kernel, rows=r, warps=nw)) for r in a.rows for nw in a.warps
    ]
    if words is not None:
        variants += [
            (f"words rows={r} warps={nw}", functools.partial(kernel, rows=r, warps=nw, slots=words)) for r in a.rows for nw in a.warps
        ]
    if a.format == "q4_0":
        act = ACTIVATIONS["silu"]
        variants += [
            (f"split rows={r} warps={nw}",
             functools.partial(split_experts, w=w, gate=planes[0], up=planes[1], down=planes[2], F=F, D=D, act=act, interpret=interpret,
                               rows=r, warps=nw))
            for r in a.rows for nw in a.warps
        ]  # fmt: skip
    if a.only:
        variants = [(n, f) for n, f in variants if any(o in n for o in a.only)]
    time_variants(variants, x0, one, ref, nbytes, a.steps, K, E)


if __name__ == "__main__":
    main()
