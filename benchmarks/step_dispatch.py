"""A decode step's host cost by the shape of its arguments: a model of tiny widths and many layers
(its kernels take microseconds), decoded back to back, under each layout of the KV cache and the
weights (`KV:WEIGHTS`: FREETOKEN_KV_LAYOUT and FREETOKEN_WEIGHTS, each `stacked` — the layers'
arrays stacked into a few — or `layers` — arrays of one layer each), each in a process of its
own. The time a step is what the calling thread and the runtime spend on a step of that many
weight and cache arrays.

    python benchmarks/step_dispatch.py --layers 48 --variants layers:layers stacked:layers stacked:stacked
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def one(variant: str, layers: int, steps: int, reps: int) -> None:
    os.environ["FREETOKEN_KV_LAYOUT"], os.environ["FREETOKEN_WEIGHTS"] = variant.split(":")
    import jax
    import jax.numpy as jnp

    from freetoken_jax import EngineConfig, FreeTokenEngine
    from freetoken_jax.config import MoEModelConfig
    from freetoken_jax.runtime.steps import DecodeBatch, Sampling

    cfg = MoEModelConfig(vocab_size=64, hidden_dim=32, intermediate_dim=32, num_layers=layers, num_experts=4, top_k=2, num_heads=4,
                         num_kv_heads=2, head_dim=8)  # fmt: skip
    ec = EngineConfig(dtype="float32", max_context=64, max_batch=1, page_size=16, prefill_chunk=16, moe_strategy="fused")
    runner = FreeTokenEngine(cfg, ec).runner
    batch = DecodeBatch(jnp.zeros((1, ec.pages_per_sequence), jnp.int32), jnp.asarray([True]), Sampling.greedy(1))
    for _ in range(20):
        tok = runner.decode(batch)
    jax.block_until_ready(tok)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = runner.decode(batch)
        jax.block_until_ready(tok)
        times.append((time.perf_counter() - t0) / steps * 1e6)
    times.sort()
    kv, weights = len(jax.tree.leaves(runner.state.cache)), len(jax.tree.leaves(runner.weights))
    print(f"{variant:>16} {layers:>6} {weights:>8} {kv:>9} {times[0]:>9.0f} {times[len(times) // 2]:>9.0f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--variants", nargs="+", default=["layers:layers", "stacked:layers", "stacked:stacked"], help="KV:WEIGHTS layouts")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one(a.one, a.layers, a.steps, a.reps)
        return 0
    import jax

    print(f"{jax.devices()[0].device_kind}: {a.steps} decode steps back to back, {a.reps} times; µs a step")
    print(f"{'KV:weights':>16} {'layers':>6} {'weights':>8} {'KV arrays':>9} {'min':>9} {'median':>9}", flush=True)
    for variant in a.variants:
        cmd = [sys.executable, __file__, "--one", variant, "--layers", str(a.layers), "--steps", str(a.steps), "--reps", str(a.reps)]
        subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
