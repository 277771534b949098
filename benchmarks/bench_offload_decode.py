"""Decode with the experts in pinned host RAM (strategy "offload") against its bound and two
baselines run in the same process on the same weights:

- cached: the unified slot cache with the given expert budget (LRU across layers);
- naive: every routed expert fetched every step, no cache (a slot cache of exactly B × k slots,
  which every layer evicts completely);
- layer: every MoE layer's whole bank streamed to the device every step (accelerate-style).

Bound of a step: bytes fetched over PCIe / pinned→device bandwidth + bytes read on the device
(dense weights, the experts computed, KV pages) / device copy bandwidth, both bandwidths measured
in the same run. Random routers spread tokens almost uniformly: the worst case for a cache.

    python benchmarks/bench_offload_decode.py --preset qwen3-30b-a3b --expert-gb 16 --batch 1 4 --steps 256 --check
"""

from __future__ import annotations

import argparse
import functools
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


def run_variant(engine, name, B, slots, prompt_len, steps, bp, hbm):
    cfg, ecfg = engine.model_config, engine.engine_config
    rng = np.random.default_rng(7 + B)
    prompts = [list(rng.integers(0, cfg.vocab_size, prompt_len)) for _ in range(B)]
    pages = [engine.pages.allocate(prompt_len + steps + 8) for _ in range(B)]
    table, _ = engine._page_table(pages, B)
    # Sampled at temperature 1 (seeded): greedy decoding of random weights falls into repeating
    # tokens whose routing never changes, which would make every cache look perfect.
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
    step = jax.jit(functools.partial(decode_step), donate_argnums=(1,))
    t0 = time.perf_counter()
    tok, state = step(engine.weights, state, batch)
    tok.block_until_ready()
    compile_s = time.perf_counter() - t0
    warm = min(16, steps // 4)
    for _ in range(warm - 1):
        tok, state = step(engine.weights, state, batch)
    tok.block_until_ready()
    before = None if slots is None else (np.asarray(state.experts.hits_L).sum(), np.asarray(state.experts.misses_L).sum())
    n = steps - warm
    t0 = time.perf_counter()
    for _ in range(n):
        tok, state = step(engine.weights, state, batch)
    tok.block_until_ready()
    dt = (time.perf_counter() - t0) / n
    expert_bytes = cfg.expert_params * jnp.dtype(ecfg.dtype).itemsize
    L, E = cfg.num_moe_layers, cfg.num_experts
    if slots is None:
        fetched_per_step, hit_rate, distinct = L * E, 0.0, float(E)
    else:
        hits = np.asarray(state.experts.hits_L).sum() - before[0]
        misses = np.asarray(state.experts.misses_L).sum() - before[1]
        fetched_per_step, hit_rate = misses / n, hits / max(1, hits + misses)
        distinct = (hits + misses) / n / L
    engine.cache = state.cache
    for p in pages:
        engine.pages.release(p)
    plan = engine.plan
    kv = cfg.num_layers * B * table.shape[1] * ecfg.page_size * sum(int(np.prod(s)) for s in cfg.kv_entry_shapes()) * 2
    resident = plan.dense_bytes - cfg.vocab_size * cfg.hidden_dim * 2 + L * distinct * expert_bytes + kv
    bound = fetched_per_step * expert_bytes / bp + resident / hbm
    return dict(
        variant=name, batch=B, slots=slots, ms_per_step=dt * 1e3, tokens_per_s=B / dt, hit_rate=float(hit_rate),
        gb_fetched_per_token=fetched_per_step * expert_bytes / B / 1e9, experts_fetched_per_step=float(fetched_per_step),
        bound_ms=bound * 1e3, ratio_to_bound=bound / dt, compile_s=compile_s,
    )  # fmt: skip


def check_against_fused(cfg, ecfg, offload_engine, n=12) -> dict:
    """Greedy tokens of the same seeded weights under "fused" and under "offload"."""
    fused = FreeTokenEngine(cfg, ecfg.replace(moe_strategy="fused", expert_slots=None, total_vram_gb=None))
    prompt = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 40))
    a = list(fused.generate(prompt, max_new_tokens=n, ignore_eos=True))
    del fused
    b = list(offload_engine.generate(prompt, max_new_tokens=n, ignore_eos=True))
    return dict(greedy_tokens_equal=a == b, matching_prefix=next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n), tokens=n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(k for k in PRESETS if PRESETS[k] is not None) + ["demo"])
    ap.add_argument("--expert-gb", type=float, default=16.0, help="device memory for expert slots (GB, 1e9 bytes)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--layer-steps", type=int, default=16, help="steps for the layer-streaming baseline (each moves every expert)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["cached", "naive", "layer"])
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
    if args.check:
        out["check"] = check_against_fused(cfg, ecfg, engine)
        print("check against fused:", out["check"], flush=True)
    hbm = copy_bandwidth(4.0 if jax.default_backend() == "gpu" else 0.25)
    bp = h2d_bandwidth(1.0 if jax.default_backend() == "gpu" else 0.1)
    out.update(copy_bw_tb_s=hbm / 1e12, h2d_gb_s=bp / 1e9)
    print(f"copy bandwidth {hbm / 1e12:.3f} TB/s; pinned->device {bp / 1e9:.1f} GB/s", flush=True)
    rows = []
    for B in args.batch:
        for v in args.variants:
            s = {"cached": ecfg.expert_slots, "naive": B * cfg.top_k, "layer": None}[v]
            r = run_variant(engine, v, B, s, args.prompt_len, args.layer_steps if v == "layer" else args.steps, bp, hbm)
            print(json.dumps(r), flush=True)
            rows.append(r)
    out["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"\n{'variant':>8} {'B':>2} {'slots':>6} {'ms/step':>8} {'tok/s':>7} {'hit':>5} {'GB/tok':>7} {'bound':>7} {'ratio':>5}")
    for r in rows:
        print(f"{r['variant']:>8} {r['batch']:>2} {str(r['slots']):>6} {r['ms_per_step']:8.2f} {r['tokens_per_s']:7.2f} {r['hit_rate']:5.2f} "
              f"{r['gb_fetched_per_token']:7.3f} {r['bound_ms']:7.2f} {r['ratio_to_bound']:5.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
