"""Time decode's gathered-expert matvec per expert format: `Format.matvec` (what the decode step
runs) against dequantizing the gathered rows to [out, in] and summing (what it ran before
commit a38e5a3, here with the scale bytes composed as `Format.dequantize` now does).
One projection of the Qwen3-30B-A3B shape by default: 8 experts gathered from a bank of 128
(113 MB of q4_0: more than the H200's 50 MB L2).

    python benchmarks/bench_matvec.py [--formats q4_0 q8_0 ...] [--out 768] [--in 2048] [--reps 20] [--loop 64]

Each call runs `loop` matvecs in one jitted function (the loop unrolled: as a GPU loop each
iteration cost 23-38 µs whatever it read, benchmarks/RESULTS.md), each on the next 8 experts of the bank and the
previous one's output folded into its input (one launch per call would time the launch on a GPU:
0.05-0.1 ms whatever the format). Prints ms per matvec and the stored bytes' rate for each; on a
GPU the rate's bound is the device copy bandwidth (`bench decode` prints it).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.quant.formats import FORMATS, get_format


def timed(fn, *args, reps: int) -> float:
    fn(*args).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t) / reps


def looped(matvec, k: int, experts: int, n: int):
    """`n` matvecs in one jitted loop: the i-th on experts i·k .. i·k + k - 1 (mod the bank), its
    input x plus a 1e-3 share of the previous output's first columns (a dependency, so that XLA
    neither hoists nor merges them)."""

    @jax.jit
    def run(b, x):
        def body(i, carry):
            x, acc = carry
            ids = (jnp.arange(k) + i * k) % experts
            y = matvec(b, ids, x)
            cols = min(y.shape[-1], x.shape[-1])
            return x.at[:, :cols].add(1e-3 * y[:, :cols]), acc + jnp.sum(y)

        return jax.lax.fori_loop(0, n, body, (x, jnp.float32(0)), unroll=True)[1]

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["q4_0", "q8_0", "fp8", "mxfp4", "nvfp4", "q4_k", "q6_k"], choices=sorted(FORMATS))
    ap.add_argument("--out", type=int, default=768)
    ap.add_argument("--in", dest="inp", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--loop", type=int, default=64, help="matvecs a call (1: one jitted matvec a call)")
    a = ap.parse_args()
    O, I, rng = a.out, a.inp, np.random.default_rng(0)
    ids = jnp.asarray(rng.permutation(a.experts)[: a.k])
    x = jnp.asarray(rng.standard_normal((a.k, I)).astype(np.float32))
    print(f"{jax.devices()[0].device_kind}: {a.k} of {a.experts} experts, [{O}, {I}] each")
    print(f"{'format':>7} {'MB':>7} {'matvec ms':>10} {'GB/s':>7} {'dequantize ms':>14} {'GB/s':>7} {'max |diff|':>11}")
    for name in a.formats:
        f = get_format(name)
        bank = f.quantize(jnp.asarray(rng.standard_normal((a.experts, O, I)).astype(np.float32) * 0.02))
        new = jax.jit(lambda b, i, x, f=f: f.matvec(b[i], x, O, I))
        old = jax.jit(lambda b, i, x, f=f: jnp.sum(x[:, None, :] * f.dequantize(b[i], O, I), axis=-1))
        diff = float(jnp.max(jnp.abs(new(bank, ids, x) - old(bank, ids, x))))
        if a.loop > 1:
            t_new = timed(looped(lambda b, i, x, f=f: f.matvec(b[i], x, O, I), a.k, a.experts, a.loop), bank, x, reps=a.reps) / a.loop
            t_old = timed(looped(lambda b, i, x, f=f: jnp.sum(x[:, None, :] * f.dequantize(b[i], O, I), axis=-1), a.k, a.experts, a.loop),
                          bank, x, reps=a.reps) / a.loop  # fmt: skip
        else:
            t_new, t_old = timed(new, bank, ids, x, reps=a.reps), timed(old, bank, ids, x, reps=a.reps)
        mb = a.k * f.nbytes(O, I) / 1e6
        print(f"{name:>7} {mb:7.2f} {t_new * 1e3:10.3f} {mb / t_new / 1e3:7.1f} {t_old * 1e3:14.3f} {mb / t_old / 1e3:7.1f} {diff:11.2e}")


if __name__ == "__main__":
    main()
