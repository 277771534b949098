"""Time one decode layer's routed experts on 4-bit slots (q4_0 by default): XLA's fused gather-and-reduce
(`routed_experts(impl="gather")`, the default; for q4_0 also over the bytes and over 16-bit words,
`ExpertLayout.words`) against the Pallas kernels of
`pallas_kernels/gathered_experts.py` at several rows per program and warp counts; for q4_0 also
the kernels over the slots' 16-bit words (`words ...`: the words made once, outside the timed
function), XLA reducing each row's words at once (`xla flat words`), the banks read as 32-bit
words, two blocks in 9 (`xla words32`: one load for 8 codes), and the engine's words with
each code made a float by an integer-to-float conversion instead of by its bits (`xla words
i2f`: `formats.small_ints` replaced while it traces), and the words matvec replaced by two
alternatives that lost on an H100 (benchmarks/RESULTS.md, twelfth session): each code set into the
mantissa of 1.0 so that a weight is one multiply-add, the x side made apart (`xla words ones`,
`ones nobar`, `ones2`), and bfloat16 x read as uint32 pairs (`xla words pairs`); and the
engine's words with x laid out by word first, a word's four inputs side by side (`xla words xw`,
made apart behind an optimization barrier; `xw nobar` without it: both lost on an H100,
sixteenth session). (More, shorter
reductions — the down projection's pairs summed in groups, each row of words in parts — lost too,
thirteenth session; q4_0 rows with the codes apart from the scales: benchmarks/probe_split_q4.py.)

    python benchmarks/bench_expert_kernels.py [--format q4_0|mxfp4] [--experts 128] [--k 8] [--ffn 768] [--hidden 2048] [--steps 64]
        [--rows 1 2 4 8] [--warps 2 4 8] [--only words "xla words"] [--exact]

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

from freetoken_jax.config import ACTIVATIONS
from freetoken_jax.models.routed import activation, routed_experts, weighted
from freetoken_jax.quant import formats
from freetoken_jax.quant.formats import get_format
from freetoken_jax.quant.layout import ExpertLayout
from pallas_kernels import gathered_experts


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
    nb, (blk, s) = I // 32, formats._q4_0_word_blocks(b, O, I)
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], 1, nb, 2, 8, 2)  # weight 16·half + 2i + parity
    xw = jnp.stack([xb[..., 0, :, 0], xb[..., 1, :, 0], xb[..., 0, :, 1], xb[..., 1, :, 1]], axis=-1)  # [..., 1, nb, 8, 4]
    xw = jnp.concatenate([jnp.zeros_like(xw[..., :1, :]), xw], axis=-2)  # [..., 1, nb, 9, 4]
    t = sum((((blk >> (4 * n)) & 15).astype(jnp.float32) - 8.0) * xw[..., n] for n in range(4))
    return jnp.sum(s * t, axis=(-2, -1))


ENGINE_WORDS = formats._q4_0_words_matvec  # (the variants below replace it while they trace)


def pairs_matvec(b, x, O: int, I: int):
    """The engine's q4_0 words matvec with bfloat16 x read as uint32 pairs (a free bitcast: pair j
    holds the inputs of weights 2j and 2j + 1, a word's byte's two codes), each half made a
    float32 by a shift or a mask — one load for two inputs."""
    if x.dtype != jnp.bfloat16:
        return ENGINE_WORDS(b, x, O, I)
    nb, (blk, s) = I // 32, formats._q4_0_word_blocks(b, O, I)
    q = blk[..., 1:]
    xp = jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], I // 2, 2), jnp.uint32).reshape(*x.shape[:-1], 1, nb, 2, 8)
    lo, hi = (jax.lax.bitcast_convert_type(v, jnp.float32) for v in (xp << 16, xp & jnp.uint32(0xFFFF0000)))
    xs = (lo[..., 0, :], lo[..., 1, :], hi[..., 0, :], hi[..., 1, :])  # the inputs of nibbles 0-3
    t = sum(formats.small_ints((q >> (4 * n)) & 15, 8.0) * v for n, v in enumerate(xs))
    return jnp.sum(s * t, axis=(-2, -1))


def ones_matvec(b, x, O: int, I: int, shifts: int = 4, barrier: bool = True):
    """q4_0 words [..., O·I/32·9] times x [..., I] → float32 [..., O] with each code c set into
    the mantissa of 1.0 (F = 1 + c/16, or 1 + c/256 for the codes that `shifts` 2 reads from the same
    shifted word as a neighbour): c − 8 = 16·F − 24 (or 256·F − 264), the x side scaled and
    the constant's sum made once per block position, outside the rows (behind an optimization
    barrier unless `barrier` is off) — one fused multiply-add a weight, no subtraction."""
    nb, (blk, s) = I // 32, formats._q4_0_word_blocks(b, O, I)
    q = blk[..., 1:].astype(jnp.uint32)
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], 1, nb, 2, 8, 2)
    xn = [xb[..., 0, :, 0], xb[..., 1, :, 0], xb[..., 0, :, 1], xb[..., 1, :, 1]]  # nibble n's weight
    if shifts == 2:  # nibbles 3, 2 at bits 19, 15 of q << 7; nibbles 1, 0 of q << 15
        hi, lo = q << 7, q << 15
        fs = [(lo, 0x78000, 256.0), (lo, 0x780000, 16.0), (hi, 0x78000, 256.0), (hi, 0x780000, 16.0)]
    else:  # every nibble at bits 19-22
        fs = [(q << (19 - 4 * n), 0x780000, 16.0) for n in range(4)]
    xs = [k * xv for (_, _, k), xv in zip(fs, xn)] + [sum((k + 8.0) * xv for (_, _, k), xv in zip(fs, xn))]
    if barrier:
        xs = jax.lax.optimization_barrier(xs)
    f = [jax.lax.bitcast_convert_type((v & jnp.uint32(m)) | jnp.uint32(0x3F800000), jnp.float32) for v, m, _ in fs]
    t = f[0] * xs[0] + f[1] * xs[1] + f[2] * xs[2] + f[3] * xs[3] - xs[4]
    return jnp.sum(s * t, axis=(-2, -1))


def xw_matvec(b, x, O: int, I: int, barrier: bool = True):
    """The engine's q4_0 words matvec with x laid out by word first: the four inputs a word's
    codes multiply side by side ([..., nb, 8, 4], made once outside the rows, behind an
    optimization barrier unless `barrier` is off), so that each word's inputs are one
    contiguous 16-byte read where the engine's are four reads 16 and 1 apart."""
    nb, (blk, s) = I // 32, formats._q4_0_word_blocks(b, O, I)
    q = blk[..., 1:]
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], 1, nb, 2, 8, 2)  # weight 16·half + 2i + parity
    xw = jnp.stack([xb[..., 0, :, 0], xb[..., 1, :, 0], xb[..., 0, :, 1], xb[..., 1, :, 1]], axis=-1)  # [..., 1, nb, 8, 4]
    if barrier:
        xw = jax.lax.optimization_barrier(xw)
    t = sum(formats.small_ints((q >> (4 * n)) & 15, 8.0) * xw[..., n] for n in range(4))
    return jnp.sum(s * t, axis=(-2, -1))


def words32_matvec(b32, x, O: int, I: int):
    """q4_0 rows as 32-bit words [..., O·I/64·9] (a free bitcast of a bank whose rows are a
    multiple of 4 bytes; I/32 even) times x [..., I] → float32 [..., O]: two blocks (36 bytes)
    are 9 words, the first block's scale the low half of word 0, the second's the high half of
    word 4; a word's 8 codes meet their inputs (0 at a scale's half) and each half its block's
    scale — one load for 8 codes where the engine's 16-bit words load 4."""
    nb = I // 32
    blk = b32.reshape(*b32.shape[:-1], O, nb // 2, 9)
    f16 = lambda v: jax.lax.bitcast_convert_type(v.astype(jnp.uint16), jnp.float16).astype(jnp.float32)  # noqa: E731
    s0, s1 = f16(blk[..., 0:1] & 0xFFFF), f16(blk[..., 4:5] >> 16)
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], 1, nb, 2, 8, 2)  # weight 16·half + 2i + parity
    xw = jnp.stack([xb[..., 0, :, 0], xb[..., 1, :, 0], xb[..., 0, :, 1], xb[..., 1, :, 1]], axis=-1)  # [..., 1, nb, 8, 4]
    xw = xw.reshape(*xw.shape[:-3], nb // 2, 16, 4)
    z = jnp.zeros_like(xw[..., :1, :])
    xw = jnp.concatenate([z, xw[..., :8, :], z, xw[..., 8:, :]], axis=-2).reshape(*xw.shape[:-2], 9, 2, 4)  # half m = 2j + h
    j = jnp.arange(9)
    s_lo, s_hi = jnp.where(j <= 4, s0, s1), jnp.where(j <= 3, s0, s1)
    code = lambda n: formats.small_ints((blk >> (4 * n)) & 15, 8.0)  # noqa: E731
    t_lo = sum(code(n) * xw[..., 0, n] for n in range(4))
    t_hi = sum(code(n + 4) * xw[..., 1, n] for n in range(4))
    return jnp.sum(s_lo * t_lo + s_hi * t_hi, axis=(-2, -1))


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
                k = re.sub(r"[_.]*\d+$", "", k)
                kernels[k] = kernels.get(k, 0.0) + us / steps
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
    ap.add_argument("--exact", action="store_true", help="--only names whole variants (`--only 'xla words' --exact`: the engine's alone)")
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

    def words32(x, ids):  # the engine's gathered experts over the banks' 32-bit words (words32_matvec)
        g, u, d = (jax.lax.bitcast_convert_type(b.reshape(E, -1, 4), jnp.uint32)[ids] for b in banks)
        xk = jnp.broadcast_to(x[:, None, :], (*ids.shape, D))
        h = activation(layout.act)(words32_matvec(g, xk, F, D), words32_matvec(u, xk, F, D))
        h = weighted(h, w[..., None]).astype(x.dtype)
        return jnp.sum(words32_matvec(d, h, D, F), axis=1).astype(x.dtype)

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
        xla_variants += [("xla flat words", flat), ("xla words32", words32)]

        def setting(fn, module, name, value):  # fn traced with module.name set to value
            def run(x, ids):
                was = getattr(module, name)
                setattr(module, name, value)
                try:
                    return fn(x, ids)
                finally:
                    setattr(module, name, was)

            return run

        converting = lambda c, minus=0.0: c.astype(jnp.float32) - minus  # noqa: E731  (as before formats.small_ints)
        xla_variants.append(("xla words i2f", setting(xla_as(True), formats, "small_ints", converting)))
        for name, mv in (("ones", ones_matvec), ("ones nobar", functools.partial(ones_matvec, barrier=False)),
                         ("ones2", functools.partial(ones_matvec, shifts=2)), ("pairs", pairs_matvec), ("xw", xw_matvec),
                         ("xw nobar", functools.partial(xw_matvec, barrier=False))):  # fmt: skip
            xla_variants.append((f"xla words {name}", setting(xla_as(True), formats, "_q4_0_words_matvec", mv)))
    variants = xla_variants + [
        (f"kernel rows={r} warps={nw}", functools.partial(kernel, rows=r, warps=nw)) for r in a.rows for nw in a.warps
    ]
    if words is not None:
        variants += [
            (f"words rows={r} warps={nw}", functools.partial(kernel, rows=r, warps=nw, slots=words)) for r in a.rows for nw in a.warps
        ]
    if a.only:
        variants = [(n, f) for n, f in variants if any(o == n if a.exact else o in n for o in a.only)]
    time_variants(variants, x0, one, ref, nbytes, a.steps, K, E)


if __name__ == "__main__":
    main()
