"""Time decode's `norm_matvec` kernel (`pallas_kernels/norm_matvec.py`) over its launch settings:
the weight values a program holds (`tile`, so rows a program: tile / D) and Triton's warps a
program, against XLA's compilation of its reference. Shapes of the Qwen3-30B-A3B layer by default:
the attention's q, k, v (2048 → 4096 + 512 + 512, bf16) and the router (2048 → 128, float32).

    python benchmarks/bench_norm_matvec.py [--layers 24] [--tiles 4096 8192 16384 32768] [--warps 2 4 8] [--reps 20]

Each call runs the kernel for `layers` layers in one jitted function (unrolled, each layer's own
weights: more bytes than the H200's L2), each call's sum and normalised row the next one's inputs,
so the calls run one after another as in a step. Prints µs a call and the weights' GB/s by the
wall clock (which, for 24 chained Pallas calls on the H200, sat 7-9 µs a call above the kernels'
own time inside a decode step: benchmarks/RESULTS.md) and, on a GPU with torch, by the kernels'
device time (CUDA's profiler), which ranks the settings.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp

from freetoken_jax.bench.measure import median_time
from pallas_kernels.norm_matvec import norm_matvec, norm_matvec_ref

SHAPES = {  # name: (D, output rows of each weight, weight dtype, output dtype)
    "qkv": (2048, (4096, 512, 512), jnp.bfloat16, jnp.bfloat16),
    "router": (2048, (128,), jnp.float32, jnp.float32),
}


def chain(layers: int, fn):
    """`layers` calls of fn(x, add, weights) one after another: each call's sum and normalised row
    are the next one's x and pending term."""

    def run(x, a, g, ws):
        acc = []
        for w in ws:
            ys, h, s = fn(x, g, w, a)
            x, a = s, h
            acc.append(ys[-1][:, :1])
        return x, jnp.concatenate(acc, axis=1)

    return jax.jit(run)


def _ready(fn, args):
    return jax.block_until_ready(fn(*args))


def device_times(fn, args, reps: int) -> dict[str, float] | None:
    """Each kernel's device time in µs a call of fn, by kernel name (CUDA's profiler through torch,
    as `profile_step.py` reads it); None off a GPU, without torch, or with BENCH_NO_PROFILER set
    (under Nsight Compute, which holds the profiling interface itself)."""
    if jax.default_backend() != "gpu" or os.environ.get("BENCH_NO_PROFILER"):
        return None
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    jax.block_until_ready(fn(*args))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.device_time / reps
    return out


def device_us(fn, args, reps: int, name: str) -> float | None:
    """The device time in seconds of a call's kernels named `name` (`device_times`), summed."""
    times = device_times(fn, args, reps)
    hit = [t for n, t in (times or {}).items() if name in n]
    return sum(hit) * 1e-6 if hit else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tiles", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    interpret = jax.default_backend() == "cpu"
    rows = []
    for name, (D, F, wdt, odt) in SHAPES.items():
        key = jax.random.split(jax.random.key(0), args.layers + 2)
        x = jax.random.normal(key[0], (1, D), jnp.bfloat16)
        g = 1.0 + 0.1 * jax.random.normal(key[1], (D,), jnp.bfloat16)
        ws = [
            tuple((0.02 * jax.random.normal(k2, (f, D), jnp.float32)).astype(wdt) for k2, f in zip(jax.random.split(k, len(F)), F))
            for k in key[2:]
        ]
        nbytes = sum(f * D for f in F) * jnp.dtype(wdt).itemsize
        odts = [odt] * len(F)
        ref = chain(args.layers, lambda x, g, w, a, odts=odts: norm_matvec_ref(x, g, 1e-6, w, out_dtypes=odts, keep_h=True, add_BD=a))
        want = ref(x, x, g, ws)
        dt = median_time(functools.partial(_ready, ref, (x, x, g, ws)), args.reps) / args.layers
        rows.append((name, "xla", "", dt))
        for tile in args.tiles:
            for nw in args.warps:
                fn = chain(args.layers, lambda x, g, w, a, t=tile, n=nw, odts=odts: norm_matvec(
                    x, g, 1e-6, w, out_dtypes=odts, keep_h=True, add_BD=a, interpret=interpret, num_warps=n, tile=t))  # fmt: skip
                got = fn(x, x, g, ws)
                err = float(jnp.max(jnp.abs(got[1].astype(jnp.float32) - want[1].astype(jnp.float32))))
                dt = median_time(functools.partial(_ready, fn, (x, x, g, ws)), args.reps) / args.layers
                dev = device_us(fn, (x, x, g, ws), args.reps, "norm_matvec")
                rows.append((name, f"tile {tile}", f"{nw}", dt, err, None if dev is None else dev / args.layers))
        print(f"== {name}: D {D}, rows {F}, {nbytes / 1e6:.1f} MB of weights a call")
    print(f"{'shape':8} {'variant':12} {'warps':>5} {'us/call':>8} {'GB/s':>7} {'max |err|':>9} {'kernel us':>9} {'GB/s':>7}")
    for r in rows:
        D, F, wdt, _ = SHAPES[r[0]]
        nbytes = sum(F) * D * jnp.dtype(wdt).itemsize
        err = f"{r[4]:9.2e}" if len(r) > 4 else " " * 9
        dev = f"{r[5] * 1e6:9.2f} {nbytes / r[5] / 1e9:7.0f}" if len(r) > 5 and r[5] else ""
        print(f"{r[0]:8} {r[1]:12} {r[2]:>5} {r[3] * 1e6:8.2f} {nbytes / r[3] / 1e9:7.0f} {err} {dev}")


if __name__ == "__main__":
    main()
