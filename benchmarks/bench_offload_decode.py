"""Decode with the experts in pinned host RAM (strategy "offload") against its bound and two
baselines run in the same process on the same weights:

- cached: the unified slot cache with the given expert budget (LRU across layers);
- naive: every routed expert fetched every step, no cache (a slot cache of exactly B × k slots,
  which every layer evicts completely);
- layer: every MoE layer's whole bank streamed to the device every step (accelerate-style);
- hybrid: the slot cache, with fetch_count(M, q*) of each layer's M misses fetched and the rest
  computed by the CPU executor where they lie, handed over by the split FFI submit/wait
  (hybrid-cb: by jax.pure_callback; hybrid-q1: q = 1, so the CPU job is empty and the step time
  minus the cached step's is the cost of the handoff itself).

q* = Bp / (Bp + Bh) from Bp (pinned→device) and Bh (the CPU executor at batch 1 over the
engine's own host banks), both measured in the same run, unless --q is given.

Bound of a step: bytes fetched over PCIe / pinned→device bandwidth + bytes read on the device
(dense weights, the experts computed, KV pages) / device copy bandwidth, both bandwidths measured
in the same run; for hybrid, the missed bytes / (Bp + Bh) in place of the first term. Random routers spread tokens almost uniformly: the worst case for a cache.

    python benchmarks/bench_offload_decode.py --preset qwen3-30b-a3b --expert-gb 16 --batch 1 4 --steps 256 --check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_fused_decode import PRESETS, copy_bandwidth  # noqa: E402

from freetoken_jax import EngineConfig, FreeTokenEngine  # noqa: E402
from freetoken_jax.memory.expert_cache import init_slot_cache  # noqa: E402
from freetoken_jax.runtime.kv_cache import init_cache  # noqa: E402
from freetoken_jax.runtime.offload import host_bank_views  # noqa: E402
from freetoken_jax.runtime.steps import DecodeBatch, DecodeState, Sampling, decode_step  # noqa: E402


def h2d_bandwidth(gib: float = 1.0) -> float:
    """pinned_host -> device `device_put`, bytes per second (median of 5)."""
    dev = jax.devices()[0]
    kind = "pinned_host" if jax.default_backend() == "gpu" else None
    n = int(gib * (1 << 30)) // 2
    host = jax.device_put(np.arange(n, dtype=np.float32).astype(jnp.bfloat16), jax.sharding.SingleDeviceSharding(dev, memory_kind=kind))
    ts = []
    for _ in range(6):
        t = time.perf_counter()
        jax.device_put(host, jax.sharding.SingleDeviceSharding(dev, memory_kind="device")).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * n / float(np.median(ts[1:]))


def executor_bandwidth(engine, seconds: float = 3.0) -> float:
    """The CPU executor at batch 1 (one token, top-k experts per call) over the engine's own host
    banks, rotating through every layer: bytes of expert weights read per second."""
    from freetoken_jax.runtime.cpu_executor import shared_executor
    from freetoken_jax.runtime.offload import host_bank_views

    cfg = engine.model_config
    views = host_bank_views(engine.weights.params)
    ex = shared_executor()
    x = np.random.default_rng(0).standard_normal((1, cfg.hidden_dim), dtype=np.float32)
    k, E = cfg.top_k, cfg.num_experts
    n, t0, i = 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        layer = views[i % len(views)]
        ex.run(x, [0] * k, [(i * k + j) % E for j in range(k)], [1.0 / k] * k, *layer, cfg.hidden_act)
        n, i = n + k, i + 1
    return n * cfg.expert_params * 2 / (time.perf_counter() - t0)


def run_variant(engine, name, B, slots, prompt_len, steps, bp, hbm, weights=None, bh=0.0):
    cfg, ecfg = engine.model_config, engine.engine_config
    rng = np.random.default_rng(7 + B)
    prompts = [list(rng.integers(0, cfg.vocab_size, prompt_len)) for _ in range(B)]
    pages = [engine.pages.allocate(prompt_len + steps + 8) for _ in range(B)]
    table, _ = engine._page_table(pages, B)
    # Random weights give logits so peaked that even sampled tokens repeat, and the routing of a
    # repeated token never changes, which would make every cache look perfect. Each step therefore
    # reads a seeded random input token per row instead of the sampled one: routing then varies
    # from step to step as much as random routers spread it (near-uniform).
    sampling = Sampling(
        jnp.arange(B, dtype=jnp.uint32) + 11, jnp.ones((B,), jnp.float32), jnp.zeros((B,), jnp.int32), jnp.ones((B,), jnp.float32)
    )
    first = None
    for _s, _t, tok in engine._prefill_chunks(prompts, table, sampling, engine._prefill):
        first = tok
    experts = (
        None if slots is None else jax.device_put(init_slot_cache(cfg, slots, ecfg.max_batch, jnp.dtype(ecfg.dtype)), jax.devices()[0])
    )
    state = DecodeState(engine.cache, jnp.copy(first), jnp.full((B,), prompt_len, jnp.int32), experts)
    engine.cache = None
    batch = DecodeBatch(jnp.asarray(table), jnp.ones((B,), bool), sampling)
    weights = weights or engine.weights
    inputs = list(jnp.asarray(rng.integers(0, cfg.vocab_size, (steps, B)), jnp.int32))  # on the device before timing
    step_fn = jax.jit(lambda w, s, b, t: decode_step(w, dataclasses.replace(s, tokens_B=t), b), donate_argnums=(1,))
    it = iter(range(1 << 30))
    step = lambda w, s, b: step_fn(w, s, b, inputs[next(it) % steps])  # noqa: E731
    t0 = time.perf_counter()
    tok, state = step(weights, state, batch)
    tok.block_until_ready()
    compile_s = time.perf_counter() - t0
    warm = min(16, steps // 4)
    for _ in range(warm - 1):
        tok, state = step(weights, state, batch)
    tok.block_until_ready()
    counters = lambda c: np.array([np.asarray(a).sum() for a in (c.hits_L, c.misses_L, c.cpu_L)])  # noqa: E731
    before = None if slots is None else counters(state.experts)
    n = steps - warm
    from freetoken_jax import _cpu_ext

    _cpu_ext.handoff_stats(True)
    t0 = time.perf_counter()
    for _ in range(n):
        tok, state = step(weights, state, batch)
    tok.block_until_ready()
    dt = (time.perf_counter() - t0) / n
    hs = _cpu_ext.handoff_stats(True)
    expert_bytes = cfg.expert_params * jnp.dtype(ecfg.dtype).itemsize
    L, E = cfg.num_moe_layers, cfg.num_experts
    on_cpu = 0.0
    if slots is None:
        fetched_per_step, hit_rate, distinct = L * E, 0.0, float(E)
    else:
        hits, misses, cpu = counters(state.experts) - before
        fetched_per_step, on_cpu, hit_rate = misses / n, cpu / n, hits / max(1, hits + misses + cpu)
        distinct = (hits + misses + cpu) / n / L
    engine.cache = state.cache
    for p in pages:
        engine.pages.release(p)
    plan = engine.plan
    kv = cfg.num_layers * B * table.shape[1] * ecfg.page_size * sum(int(np.prod(s)) for s in cfg.kv_entry_shapes()) * 2
    resident = plan.dense_bytes - cfg.vocab_size * cfg.hidden_dim * 2 + L * (distinct - on_cpu / L) * expert_bytes + kv
    missed = (fetched_per_step + on_cpu) * expert_bytes
    bound = missed / (bp + (bh if on_cpu else 0.0)) + resident / hbm
    r = dict(
        variant=name, batch=B, slots=slots, ms_per_step=dt * 1e3, tokens_per_s=B / dt, hit_rate=float(hit_rate),
        gb_fetched_per_token=fetched_per_step * expert_bytes / B / 1e9, experts_fetched_per_step=float(fetched_per_step),
        experts_on_cpu_per_step=float(on_cpu), bound_ms=bound * 1e3, ratio_to_bound=bound / dt, compile_s=compile_s,
        q=weights.hybrid_q, handoff=weights.handoff if weights.strategy == "hybrid" else None,
    )  # fmt: skip
    if hs["count"]:
        c = hs["count"]
        r.update(handoffs_per_step=c / n, handoff_window_us=hs["window_s"] / c * 1e6, handoff_gpu_side_us=hs["gpu_s"] / c * 1e6,
                 handoff_cpu_side_us=hs["cpu_s"] / c * 1e6, handoff_exposed_us=(hs["window_s"] - hs["ideal_s"]) / c * 1e6)  # fmt: skip
    return r


def check_against_fused(cfg, ecfg, offload_engine, hybrid_weights, n=12) -> dict:
    """Greedy tokens of the same seeded weights under "fused", "offload" and "hybrid" (FFI)."""
    fused = FreeTokenEngine(cfg, ecfg.replace(moe_strategy="fused", expert_slots=None, total_vram_gb=None))
    prompt = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 40))
    a = list(fused.generate(prompt, max_new_tokens=n, ignore_eos=True))
    del fused
    b = list(offload_engine.generate(prompt, max_new_tokens=n, ignore_eos=True))
    plain, offload_engine.weights = offload_engine.weights, hybrid_weights
    try:
        offload_engine.slots = jax.device_put(init_slot_cache(cfg, ecfg.expert_slots, ecfg.max_batch, jnp.bfloat16), jax.devices()[0])
        c = list(offload_engine.generate(prompt, max_new_tokens=n, ignore_eos=True))
    finally:
        offload_engine.weights = plain
    prefix = lambda x, y: next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), n)  # noqa: E731
    return dict(
        offload_equal=a == b, offload_matching_prefix=prefix(a, b), hybrid_equal=a == c, hybrid_matching_prefix=prefix(a, c), tokens=n
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(k for k in PRESETS if PRESETS[k] is not None) + ["demo"])
    ap.add_argument("--expert-gb", type=float, default=16.0, help="device memory for expert slots (GB, 1e9 bytes)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--layer-steps", type=int, default=16, help="steps for the layer-streaming baseline (each moves every expert)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["cached", "hybrid", "hybrid-cb", "hybrid-q1", "naive", "layer"])
    ap.add_argument("--q", type=float, default=None, help="hybrid q* (default: Bp / (Bp + Bh) measured in this run)")
    ap.add_argument("--check", action="store_true", help="first compare greedy tokens and logits with the fused strategy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.preset == "demo":
        from freetoken_jax.demo import DEMO_CONFIG as cfg
    else:
        cfg = PRESETS[args.preset]
    expert_bytes = cfg.expert_params * 2
    slots = int(args.expert_gb * 1e9 // expert_bytes)
    ecfg = EngineConfig(dtype="bfloat16", moe_strategy="offload", expert_slots=max(slots, max(args.batch) * cfg.top_k),
                        max_context=args.prompt_len + args.steps + 16, max_batch=max(args.batch), page_size=16, prefill_chunk=64)  # fmt: skip
    t0 = time.perf_counter()
    engine = FreeTokenEngine(cfg, ecfg)
    print(f"device {jax.devices()[0].device_kind}; built in {time.perf_counter() - t0:.0f} s; {engine.plan.describe()}", flush=True)
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, preset=args.preset, argv=sys.argv, plan=engine.plan.describe())
    hbm = copy_bandwidth(4.0 if jax.default_backend() == "gpu" else 0.25)
    bp = h2d_bandwidth(1.0 if jax.default_backend() == "gpu" else 0.1)
    bh = executor_bandwidth(engine, 3.0 if jax.default_backend() == "gpu" else 0.5)
    q = args.q if args.q is not None else bp / (bp + bh)
    out.update(copy_bw_tb_s=hbm / 1e12, h2d_gb_s=bp / 1e9, executor_gb_s=bh / 1e9, q=q)
    print(
        f"copy bandwidth {hbm / 1e12:.3f} TB/s; pinned->device {bp / 1e9:.1f} GB/s; CPU executor {bh / 1e9:.1f} GB/s; q* {q:.3f}",
        flush=True,
    )
    views = host_bank_views(engine.weights.params)
    hybrid = lambda q, h: dataclasses.replace(engine.weights, strategy="hybrid", host_banks=views, hybrid_q=q, handoff=h)  # noqa: E731
    weights = {"hybrid": hybrid(q, "ffi"), "hybrid-cb": hybrid(q, "callback"), "hybrid-q1": hybrid(1.0, "ffi")}
    if args.check:
        out["check"] = check_against_fused(cfg, ecfg, engine, weights["hybrid"])
        print("check against fused:", out["check"], flush=True)
    rows = []
    for B in args.batch:
        for v in args.variants:
            s = {"naive": B * cfg.top_k, "layer": None}.get(v, ecfg.expert_slots)
            try:
                r = run_variant(
                    engine, v, B, s, args.prompt_len, args.layer_steps if v == "layer" else args.steps, bp, hbm, weights.get(v), bh
                )
            except Exception as e:  # one failing variant must not hide the others' figures
                print(f"variant {v} at batch {B} failed: {type(e).__name__}: {e}", flush=True)
                if engine.cache is None:
                    engine.cache = init_cache(cfg, ecfg, jnp.bfloat16)
                continue
            print(json.dumps(r), flush=True)
            rows.append(r)
            out["rows"] = rows
            if args.json:  # after every row, so a run stopped by a time limit keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
    print(
        f"\n{'variant':>9} {'B':>2} {'slots':>6} {'ms/step':>8} {'tok/s':>7} {'hit':>5} {'GB/tok':>7} {'cpu/st':>6} {'bound':>7} {'ratio':>5} {'exp_us':>6}"
    )
    for r in rows:
        print(f"{r['variant']:>9} {r['batch']:>2} {str(r['slots']):>6} {r['ms_per_step']:8.2f} {r['tokens_per_s']:7.2f} {r['hit_rate']:5.2f} "
              f"{r['gb_fetched_per_token']:7.3f} {r['experts_on_cpu_per_step']:6.1f} {r['bound_ms']:7.2f} {r['ratio_to_bound']:5.2f} "
              f"{r.get('handoff_exposed_us', 0):6.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
