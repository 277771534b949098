"""Kernel-level profile of one jitted decode step on the GPU (CUPTI through torch.profiler):
the kernels that take the time, how many launch per step, and the optimized HLO.

    python benchmarks/profile_step.py --preset qwen3-30b-a3b --batch 1 --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_fused_decode import PRESETS  # noqa: E402

from freetoken_jax import EngineConfig, FreeTokenEngine  # noqa: E402
from freetoken_jax.runtime.steps import DecodeBatch, DecodeState, Sampling, decode_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (0: the preset's)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    if args.layers:
        import dataclasses

        cfg = dataclasses.replace(cfg, num_layers=args.layers, moe_layers=())
    B = args.batch
    engine = FreeTokenEngine(cfg, EngineConfig(dtype="bfloat16", max_context=256, max_batch=B, page_size=16))
    pages = [engine.pages.allocate(200) for _ in range(B)]
    table, _ = engine._page_table(pages, B)
    step = jax.jit(functools.partial(decode_step), donate_argnums=(1,))
    batch = DecodeBatch(jnp.asarray(table), jnp.ones((B,), bool), Sampling.greedy(B))
    state = DecodeState(engine.cache, jnp.arange(B, dtype=jnp.int32), jnp.full((B,), 64, jnp.int32))
    hlo = step.lower(engine.weights, state, batch).compile().as_text()
    with open(os.path.join(args.out, f"decode_b{B}.hlo.txt"), "w") as f:
        f.write(hlo)
    for _ in range(3):
        tok, state = step(engine.weights, state, batch)
    tok.block_until_ready()
    t = time.perf_counter()
    for _ in range(10):
        tok, state = step(engine.weights, state, batch)
    tok.block_until_ready()
    print(f"step {(time.perf_counter() - t) / 10 * 1e3:.3f} ms (wall, 10 steps)")
    # Host-side dispatch cost alone: a jitted no-op over the same weights pytree.
    noop = jax.jit(lambda w: w.params["norm"]["weight"][...][0])
    noop(engine.weights).block_until_ready()
    t = time.perf_counter()
    for _ in range(50):
        noop(engine.weights)
    print(f"dispatch of the weights pytree: {(time.perf_counter() - t) / 50 * 1e3:.3f} ms")
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            tok, state = step(engine.weights, state, batch)
        tok.block_until_ready()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in events) / 5
    print(f"kernels per step: {len(events) / 5:.0f}; summed kernel time per step {total / 1e3:.3f} ms")
    agg: dict[str, list[float]] = {}
    for e in events:
        agg.setdefault(e.name[:90], []).append(e.device_time)
    rows = sorted(agg.items(), key=lambda kv: -sum(kv[1]))
    for name, ts in rows[:30]:
        print(f"{sum(ts) / 5 / 1e3:8.3f} ms/step {len(ts) / 5:6.0f}x {np.mean(ts):8.1f} us  {name}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
