"""Kernel-level profile of the jitted decode step on the GPU (CUPTI through torch.profiler):
for each expert implementation and batch size, the
wall time per step, kernels launched per step, summed kernel time and the heaviest kernels.

    python benchmarks/profile_step.py --preset qwen3-30b-a3b --batch 1 8 --variants gather slices ragged
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from freetoken_jax import EngineConfig, FreeTokenEngine  # noqa: E402
from freetoken_jax.bench.presets import PRESETS  # noqa: E402
from freetoken_jax.models import layers  # noqa: E402
from freetoken_jax.runtime.steps import DecodeBatch, DecodeState, Sampling, decode_step  # noqa: E402


def kernel_profile(run, n=5, top=8):
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(n)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    agg: dict[str, list[float]] = {}
    for e in events:
        agg.setdefault(e.name[:80], []).append(e.device_time)
    rows = sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:top]
    return len(events) / n, sum(e.device_time for e in events) / n / 1e3, [(sum(t) / n / 1e3, len(t) / n, k) for k, t in rows]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--variants", nargs="+", default=["auto"])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    Bmax = max(args.batch)
    engine = FreeTokenEngine(cfg, EngineConfig(dtype="bfloat16", max_context=256, max_batch=Bmax, page_size=16))
    summary = []
    for B in args.batch:
        pages = [engine.pages.allocate(200) for _ in range(B)]
        table, _ = engine._page_table(pages, B)
        batch = DecodeBatch(jnp.asarray(table), jnp.ones((B,), bool), Sampling.greedy(B))
        for variant in args.variants:
            impl = variant
            if impl == "slices" and B * cfg.top_k > 16:
                continue
            layers.EXPERT_IMPL = impl
            step = jax.jit(functools.partial(decode_step), donate_argnums=(1,))
            state = DecodeState(engine.cache, jnp.arange(B, dtype=jnp.int32), jnp.full((B,), 64, jnp.int32))
            engine.cache = None
            t = time.perf_counter()
            compiled = step.lower(engine.weights, state, batch).compile()
            compile_s = time.perf_counter() - t
            with open(os.path.join(args.out, f"decode_b{B}_{impl}.hlo.txt"), "w") as f:
                f.write(compiled.as_text())
            box = [state]

            def run(n, box=box, compiled=compiled, batch=batch):
                tok = None
                for _ in range(n):
                    tok, box[0] = compiled(engine.weights, box[0], batch)
                tok.block_until_ready()

            run(3)
            t = time.perf_counter()
            run(20)
            wall = (time.perf_counter() - t) / 20 * 1e3
            nk, ksum, top = kernel_profile(run)
            engine.cache = box[0].cache
            print(
                f"\n== B={B} {variant}: {wall:.3f} ms/step wall, {nk:.0f} kernels/step, {ksum:.3f} ms summed kernel time, compile {compile_s:.0f} s"
            )
            for ms, cnt, name in top:
                print(f"   {ms:7.3f} ms {cnt:5.0f}x  {name}")
            summary.append((B, variant, wall, nk, ksum))
        for p in pages:
            engine.pages.release(p)
    print(f"\n{'B':>3} {'variant':>14} {'wall ms':>8} {'kernels':>8} {'kern ms':>8}")
    for B, v, wall, nk, ksum in summary:
        print(f"{B:>3} {v:>14} {wall:8.3f} {nk:8.0f} {ksum:8.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
