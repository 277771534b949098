"""How fast the Pallas expert fetch moves a decode step's misses from pinned host memory.

A jitted step of `--layers` layers, each fetching `--fetch` of `--slots-per-layer` masked rows
(Qwen3-30B-A3B expert shape by default) from three pinned host banks (gate, up, down) into
donated slot arrays, and nothing else: the offload step's PCIe part alone. Variants: the three
banks in one kernel (`one`, what the engine runs) or one kernel per bank (`three`), for each
block size (elements per program) and warp count given. Also the 1 GiB `device_put` rate that
the benchmarks' bounds use as Bp.

    python benchmarks/probe_fetch.py --layers 48 --fetch 6 --blocks 8192 16384 --warps 4 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.bench.compare import table
from freetoken_jax.bench.measure import h2d_bandwidth
from freetoken_jax.runtime.offload import host_memory_kind
from pallas_kernels.expert_fetch import fetch_rows_many


def build(args, kernels: str, block: int, warps: int):
    L, n, per = args.layers, args.fetch, args.slots_per_layer
    interpret = jax.default_backend() == "cpu"
    kw = dict(interpret=interpret, block_elems=block, num_warps=warps)

    def step(slots, banks, seed):
        slots = list(slots)
        E = banks[0].shape[0]
        for m in range(L):
            # distinct rows per layer and step, as uniform routing gives; slots reused per layer
            src = (seed * 7919 + m * per + jnp.arange(per, dtype=jnp.int32) * 13) % E
            dst = jnp.arange(per, dtype=jnp.int32) + (m % 2) * per
            ok = jnp.arange(per) < n
            if kernels == "one":
                slots = list(fetch_rows_many(banks, slots, src, dst, ok, **kw))
            else:
                slots = [fetch_rows_many((b,), (s,), src, dst, ok, **kw)[0] for b, s in zip(banks, slots)]
        return tuple(slots)

    return jax.jit(step, donate_argnums=(0,))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--experts", type=int, default=256, help="rows in each host bank")
    ap.add_argument("--fetch", type=int, default=6, help="rows fetched per layer")
    ap.add_argument("--slots-per-layer", type=int, default=8, help="rows per fetch, the rest masked (batch x top_k)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[8192])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--kernels", nargs="+", default=["one", "three"], choices=["one", "three"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.fetch > args.slots_per_layer:
        ap.error("--fetch must not exceed --slots-per-layer")
    dev = jax.devices()[0]
    kind = host_memory_kind()
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind) if kind else jax.sharding.SingleDeviceSharding(dev)
    R = args.hidden * args.ffn
    rng = np.random.default_rng(0)
    banks = tuple(jax.device_put(jnp.asarray(rng.standard_normal((args.experts, R), np.float32), jnp.bfloat16), host) for _ in range(3))
    bp = h2d_bandwidth() / 1e9
    print(json.dumps(dict(bp_gb_s=bp)), flush=True)
    step_bytes = args.layers * args.fetch * 3 * R * 2
    rows = []
    for kernels, block, warps in itertools.product(args.kernels, args.blocks, args.warps):
        f = build(args, kernels, block, warps)
        slots = tuple(jnp.zeros((2 * args.slots_per_layer, R), jnp.bfloat16) for _ in range(3))
        t = time.perf_counter()
        for s in range(3):
            slots = f(slots, banks, jnp.int32(s))
        jax.block_until_ready(slots)
        first_s = time.perf_counter() - t
        t = time.perf_counter()
        for s in range(args.steps):
            slots = f(slots, banks, jnp.int32(s + 3))
        jax.block_until_ready(slots)
        sec = (time.perf_counter() - t) / args.steps
        row = dict(kernels=kernels, block=block, warps=warps, ms_per_step=sec * 1e3, gb_s=step_bytes / sec / 1e9,
                   of_bp=step_bytes / sec / 1e9 / bp, first_s=first_s)  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=dev.device_kind, jax=jax.__version__, args=vars(args), bp_gb_s=bp, rows=rows), fh, indent=1)
    print(f"\nBp (device_put, 1 GiB) {bp:.1f} GB/s; {step_bytes / 1e9:.3f} GB per step")
    cols = [("kernels", "kernels", ""), ("block", "block", "d"), ("warps", "warps", "d"), ("ms_per_step", "ms/step", ".2f"),
            ("gb_s", "GB/s", ".1f"), ("of_bp", "of Bp", ".2f")]  # fmt: skip
    print(table(rows, cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
