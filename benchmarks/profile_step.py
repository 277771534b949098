"""Kernel-level profile of the jitted decode step on the GPU (CUPTI through torch.profiler):
for each expert implementation and batch size, the
wall time per step, kernels launched per step, summed kernel time and the heaviest kernels.

    python benchmarks/profile_step.py --preset qwen3-30b-a3b --batch 1 8 --variants gather slices ragged

With `--strategies`, the same for host-bank strategies (experts in host RAM, as `bench decode`
builds them): offload, hybrid, naive, cpu at `--vram-gb` of slots and `--routing-skew`; the
steps run after `--warm` steps so the slot cache is in its steady state. Where wall time per
step exceeds summed kernel time, the stream sat idle (launch gaps, host functions, copies).

    python benchmarks/profile_step.py --preset qwen3-30b-a3b --strategies offload hybrid --vram-gb 16 --routing-skew 0

With `--prefill-tokens N`, one offload prefill chunk of N tokens through two borrowed layer
buffers, loading layers by `--prefill-load`, for each expert implementation in `--variants`:

    python benchmarks/profile_step.py --preset qwen3-30b-a3b --prefill-tokens 512 --vram-gb 16 --variants auto dense

`--no-profile` runs everything but the CUPTI profile (for a machine without CUDA).
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
from freetoken_jax.bench.presets import preset_config  # noqa: E402
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


def report(summary: list, B: int, name: str, wall: float, profile, compile_s: float) -> None:
    nk, ksum, top = profile if profile else (float("nan"), float("nan"), [])
    print(f"\n== B={B} {name}: {wall:.3f} ms/step wall, {nk:.0f} kernels/step, {ksum:.3f} ms summed kernel time, compile {compile_s:.0f} s")
    for ms, cnt, kname in top:
        print(f"   {ms:7.3f} ms {cnt:5.0f}x  {kname}")
    summary.append((B, name, wall, nk, ksum))


def host_bank_strategies(args) -> list:
    """Profiles the decode step of host-bank strategies on `bench decode`'s engine."""
    import numpy as np

    from freetoken_jax.bench.compare import Bench
    from freetoken_jax.memory.expert_cache import init_slot_cache

    bench = Bench(args.preset, dtype=args.dtype, max_batch=max(args.batch), max_context=256)
    q = bench.bp / (bench.bp + bench.bh)
    eng, cfg, summary = bench.engine, bench.cfg, []
    for B, s, sampling in [(B, s, m) for B in args.batch for s in args.strategies for m in args.sampling]:
        weights = bench.weights(s, q, args.routing_skew)
        use_sampling(bench, sampling)
        t = time.perf_counter()
        prompt_len, steps = 16, args.warm + 30
        compiled = bench.compile_decode(s, B, args.vram_gb, prompt_len, steps, q, args.routing_skew, weights)
        compile_s = time.perf_counter() - t
        slots = bench._decode_slots(s, B, args.vram_gb)
        pages = [eng.pages.allocate(bench._row_tokens(prompt_len, steps)) for _ in range(B)]
        table, _ = eng.page_table(pages, B)
        experts = None if slots is None else init_slot_cache(cfg, slots, bench.ecfg.max_batch, jnp.dtype(bench.ecfg.dtype))
        box = [DecodeState.start(eng.cache, np.arange(B), np.full(B, prompt_len), experts)]
        eng.cache = None
        batch = DecodeBatch(jnp.asarray(table), jnp.ones((B,), bool), Sampling.greedy(B))
        rng = np.random.default_rng(B)

        calls = []

        def run(n, box=box, compiled=compiled, batch=batch, weights=weights, rng=rng, B=B, calls=calls):
            for _ in range(n):  # a new input token each step, as in `bench decode`
                tok = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)
                t = time.perf_counter()
                _tok, box[0] = compiled(weights, box[0], batch, tok)
                calls.append(time.perf_counter() - t)
            box[0].tokens_B.block_until_ready()

        run(args.warm)
        calls.clear()
        t = time.perf_counter()
        run(10)
        wall = (time.perf_counter() - t) / 10 * 1e3
        print(f"B={B} {s} sampling={sampling}: the call returns after {sorted(calls)[len(calls) // 2] * 1e3:.3f} ms (median)")
        profile = None if args.no_profile else kernel_profile(run, top=args.top)
        with open(os.path.join(args.out, f"decode_b{B}_{s}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
        eng.cache = box[0].cache
        for p in pages:
            eng.pages.release(p)
        name = f"{s} {args.vram_gb:g}GB" if s in ("offload", "hybrid") else s
        report(summary, B, name if sampling == "where" else f"{name} {sampling}", wall, profile, compile_s)
    use_sampling(bench, "where")
    return summary


def use_sampling(bench, how: str) -> None:
    """Retraces `bench`'s decode step with the engine's sampler (`where`: both paths computed,
    each row selects), with that sampler behind a `lax.cond` that takes argmax when no row
    samples (`cond`: the engine's sampler before it lost the conditional), or greedy only."""
    import dataclasses

    from freetoken_jax.runtime import sampling, steps

    def sample(logits_BV, seeds_B, positions_B, temperature_B, top_k_B, top_p_B):
        greedy = lambda: jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)  # noqa: E731
        engine = lambda: sampling.sample(logits_BV, seeds_B, positions_B, temperature_B, top_k_B, top_p_B)  # noqa: E731
        if how == "greedy":
            return greedy()
        if how == "cond":
            return jax.lax.cond(jnp.any(temperature_B > 0), engine, greedy)
        return engine()

    steps.sample = sample
    bench._step = jax.jit(lambda w, s, b, t: steps.decode_step(w, dataclasses.replace(s, tokens_B=t), b), donate_argnums=(1,))


def prefill_chunk(args) -> list:
    """Profiles one prefill chunk of `--prefill-tokens` tokens under offload with `--vram-gb` of
    slots through two borrowed layer buffers, each layer's missing experts fetched by the Pallas
    kernel or copied whole (`--prefill-load`), for each expert implementation of `--variants`
    (`auto`: the engine's choice, `dense` at this size; `ragged`: grouped matmuls); writes
    each compiled step's HLO beside the profile."""
    import dataclasses

    import numpy as np

    from freetoken_jax.bench.compare import Bench
    from freetoken_jax.memory.expert_cache import init_slot_cache
    from freetoken_jax.runtime.steps import PrefillBatch, prefill_step_buffered

    T = args.prefill_tokens
    bench = Bench(args.preset, dtype=args.dtype, max_batch=1, max_context=T + 32, prefill_chunk=T)
    eng, cfg, summary = bench.engine, bench.cfg, []
    weights = dataclasses.replace(bench.weights("offload", 1.0, None), prefill_load=args.prefill_load)
    n = bench.slots_for(args.vram_gb, 1)
    box = [jax.device_put(init_slot_cache(cfg, n, 1, jnp.dtype(args.dtype)), jax.devices()[0])]
    if eng.prefill_step_for(weights, T, box[0]) is not eng._prefill_buffered:
        raise SystemExit(f"{n} slots at {args.vram_gb} GB: a {T}-token chunk would not take the buffered prefill")
    pages = [eng.pages.allocate(T + 1)]
    table, _ = eng.page_table(pages, 1)
    rng = np.random.default_rng(0)
    batch = PrefillBatch(jnp.asarray(rng.integers(0, cfg.vocab_size, (1, T)), jnp.int32), jnp.arange(T, dtype=jnp.int32)[None],
                         jnp.ones((1, T), bool), jnp.asarray(table), Sampling.greedy(1))  # fmt: skip
    for impl in args.variants:
        step = jax.jit(lambda *a: prefill_step_buffered(*a), donate_argnums=(1, 3))  # a fresh trace per implementation
        t = time.perf_counter()
        with layers.expert_impl(impl):
            compiled = step.lower(weights, eng.cache, batch, box[0]).compile()
        compile_s = time.perf_counter() - t
        with open(os.path.join(args.out, f"prefill_t{T}_{args.prefill_load}_{impl}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())

        def run(k, compiled=compiled):
            tok = None
            for _ in range(k):
                tok, eng.cache, box[0] = compiled(weights, eng.cache, batch, box[0])
            tok.block_until_ready()

        run(1)
        t = time.perf_counter()
        run(3)
        wall = (time.perf_counter() - t) / 3 * 1e3
        profile = None if args.no_profile else kernel_profile(run, n=2, top=args.top)
        report(summary, 1, f"prefill {T} {args.prefill_load} {impl}", wall, profile, compile_s)
    eng.pages.release(pages[0])
    return summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--variants", nargs="+", default=["auto"])
    ap.add_argument("--strategies", nargs="+", default=None, choices=["offload", "hybrid", "naive", "cpu"])
    ap.add_argument("--vram-gb", type=float, default=16.0)
    ap.add_argument("--routing-skew", type=float, default=0.0)
    ap.add_argument("--warm", type=int, default=16, help="steps before timing (host-bank strategies)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--no-profile", action="store_true", help="no CUPTI profile (wall time only)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--sampling", nargs="+", default=["where"], choices=["where", "cond", "greedy"],
                    help="host-bank strategies: how the sampler picks greedy or stochastic (see use_sampling)")  # fmt: skip
    ap.add_argument("--top", type=int, default=12, help="how many of the heaviest kernels to list")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="profile one offload prefill chunk of this many tokens instead")
    ap.add_argument("--prefill-load", default="auto", choices=["auto", "fetch", "copy"])
    args = ap.parse_args()
    if args.strategies or args.prefill_tokens:
        summary = prefill_chunk(args) if args.prefill_tokens else host_bank_strategies(args)
        print(f"\n{'B':>3} {'strategy':>14} {'wall ms':>8} {'kernels':>8} {'kern ms':>8}")
        for B, v, wall, nk, ksum in summary:
            print(f"{B:>3} {v:>14} {wall:8.3f} {nk:8.0f} {ksum:8.3f}")
        return 0
    cfg = preset_config(args.preset)
    Bmax = max(args.batch)
    engine = FreeTokenEngine(cfg, EngineConfig(dtype=args.dtype, max_context=256, max_batch=Bmax, page_size=16))
    summary = []
    for B in args.batch:
        pages = [engine.pages.allocate(200) for _ in range(B)]
        table, _ = engine.page_table(pages, B)
        batch = DecodeBatch(jnp.asarray(table), jnp.ones((B,), bool), Sampling.greedy(B))
        for variant in args.variants:
            impl = variant
            if impl == "slices" and B * cfg.top_k > 16:
                continue
            step = jax.jit(functools.partial(decode_step), donate_argnums=(1,))
            state = DecodeState(engine.cache, jnp.arange(B, dtype=jnp.int32), jnp.full((B,), 64, jnp.int32))
            engine.cache = None
            t = time.perf_counter()
            with layers.expert_impl(impl):
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
            profile = None if args.no_profile else kernel_profile(run, top=args.top)
            engine.cache = box[0].cache
            report(summary, B, variant, wall, profile, compile_s)
        for p in pages:
            engine.pages.release(p)
    print(f"\n{'B':>3} {'variant':>14} {'wall ms':>8} {'kernels':>8} {'kern ms':>8}")
    for B, v, wall, nk, ksum in summary:
        print(f"{B:>3} {v:>14} {wall:8.3f} {nk:8.0f} {ksum:8.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
