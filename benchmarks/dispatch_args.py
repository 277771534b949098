"""What a jitted call costs the calling thread per argument buffer: a program that reads one value
of each of N small device arrays (and, with --donate, returns D of them updated in place, as a
decode step returns its donated KV cache), called back to back without waiting; the thread's time
per call is the dispatch cost a decode step of N weight arrays pays before any kernel runs.

    python benchmarks/dispatch_args.py --args 1 10 100 300 450 --donate 48
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--args", type=int, nargs="+", default=[1, 10, 100, 300, 450])
    ap.add_argument("--donate", type=int, default=0, help="of the arguments, how many are returned updated in place (donated)")
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    print(f"{jax.devices()[0].device_kind}: {a.calls} calls back to back, {a.donate} arguments donated")
    print(f"{'args':>6} {'µs a call':>10} {'µs an arg':>10}")
    for n in a.args:
        d = min(a.donate, n)
        kept = tuple(jnp.full((8,), i, jnp.float32) for i in range(n - d))
        donated = tuple(jnp.full((8,), i, jnp.float32) for i in range(d))

        def step(kept, donated):
            s = sum(x[0] for x in kept) if kept else jnp.float32(0)
            return s, tuple(x + s for x in donated)

        f = jax.jit(step, donate_argnums=1)
        for _ in range(3):
            s, donated = f(kept, donated)
        jax.block_until_ready(s)
        t0 = time.perf_counter()
        for _ in range(a.calls):
            s, donated = f(kept, donated)
        jax.block_until_ready((s, donated))
        us = (time.perf_counter() - t0) / a.calls * 1e6
        print(f"{n:>6} {us:>10.1f} {us / n:>10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
