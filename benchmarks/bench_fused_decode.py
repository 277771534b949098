"""Decode throughput with every weight resident on the device (strategy "fused"), against the
HBM bound: bytes one decode step must read (dense weights, the distinct experts the step routes
to, the KV pages it attends over) divided by the device's copy bandwidth measured in the same run.

    python benchmarks/bench_fused_decode.py --preset qwen3-30b-a3b --batch 1 8 --impl auto slices

Routing comes from seeded random routers: tokens spread almost uniformly over experts, so at
batch 8 a step touches close to the most distinct experts it can (the bound counts the
distinct experts actually routed to, measured on the benchmark's own tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.bench.expert_impls import named
from freetoken_jax.bench.measure import copy_bandwidth
from freetoken_jax.bench.presets import PRESETS
from freetoken_jax.memory.kv_cache import KVView
from freetoken_jax.runtime.experts import Fused
from freetoken_jax.runtime.runner import ModelRunner
from freetoken_jax.runtime.steps import DecodeBatch, PrefillBatch, Sampling


def routed_ids(engine, state, batch):
    """Expert ids [L_moe, B, k] of one decode step on the current state (run on a copy)."""
    graphdef = engine.weights.graphdef

    @jax.jit
    def f(params, cache, tokens, positions, active, table):
        m = nnx.merge(graphdef, params)
        ids = []
        fns = []
        for layer in m.layers:
            if layer.is_moe:
                fused = layer.mlp.expert_fn()

                def fn(x, i, w, fused=fused):
                    ids.append(i)
                    return fused(x, i, w)

                fns.append(fn)
            else:
                fns.append(None)
        view = KVView.build(positions[:, None], active[:, None], table, cache[0][0].shape[2])
        m(tokens[:, None], positions[:, None], view, cache, fns)
        return jnp.stack(ids)

    return np.asarray(f(engine.weights.params, state.cache, state.tokens_B, state.positions_B, batch.active_B, batch.page_table_BP))


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def bench(engine: FreeTokenEngine, B: int, prompt_len: int, steps: int, impl: str, copy_bw: float) -> dict:
    cfg, ecfg = engine.model_config, engine.engine_config
    rng = np.random.default_rng(B)
    prompts = [list(rng.integers(0, cfg.vocab_size, prompt_len)) for _ in range(B)]
    # A runner of B rows over the engine's weights: prefill, then its decode step, timed.
    runner = ModelRunner(cfg, ecfg.replace(max_batch=B), engine.weights, Fused(named(impl)), engine.plan)
    table = np.zeros((B, ecfg.pages_per_sequence), np.int32)
    for b in range(B):
        pages = runner.pages.allocate(prompt_len + steps + 2)
        table[b, : len(pages)] = pages
    sampling = Sampling.greedy(B)
    t0 = time.perf_counter()
    for start in range(0, prompt_len, ecfg.prefill_chunk):
        T = min(ecfg.prefill_chunk, prompt_len - start)
        first = runner.prefill(PrefillBatch.chunk([p[start : start + T] for p in prompts], [start] * B, table, T, sampling))
    jax.block_until_ready(first)
    ttft_incl_compile = time.perf_counter() - t0
    runner.set_rows(np.arange(B), first, np.full(B, prompt_len))
    batch = DecodeBatch(jnp.asarray(table), jnp.ones((B,), bool), sampling)
    ids = routed_ids(engine, runner.state, batch)  # [L_moe, B, k]
    distinct = np.mean([len(np.unique(ids[i])) for i in range(ids.shape[0])])
    t0 = time.perf_counter()
    runner.decode(batch).block_until_ready()
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        runner.decode(batch)
    n = steps - 4
    runner.state.tokens_B.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(n):
        runner.decode(batch)
    runner.state.tokens_B.block_until_ready()
    dt = (time.perf_counter() - t0) / n
    runner.close()

    # Bytes one step reads: every dense weight but the embedding table (B rows of it), the distinct
    # routed experts, and the KV pages attended over (the page-table bucket).
    params = engine.weights.params
    expert_bytes_each = cfg.expert_params * jnp.dtype(ecfg.dtype).itemsize
    total = nbytes(params)
    experts_all = cfg.num_moe_layers * cfg.num_experts * expert_bytes_each
    embed = cfg.vocab_size * cfg.hidden_dim * jnp.dtype(ecfg.dtype).itemsize
    dense = total - experts_all - embed + B * cfg.hidden_dim * 2
    experts = cfg.num_moe_layers * distinct * expert_bytes_each
    per_token_kv = sum(int(np.prod(s)) for s in cfg.kv_entry_shapes()) * jnp.dtype(ecfg.dtype).itemsize
    kv = cfg.num_layers * B * table.shape[1] * ecfg.page_size * per_token_kv
    read = dense + experts + kv
    bound = read / copy_bw
    return dict(
        impl=impl,
        batch=B,
        ms_per_step=dt * 1e3,
        tokens_per_s=B / dt,
        bound_ms=bound * 1e3,
        ratio_to_bound=bound / dt,
        gb_read_per_step=read / 1e9,
        dense_gb=dense / 1e9,
        experts_gb=experts / 1e9,
        kv_gb=kv / 1e9,
        distinct_experts_per_layer=float(distinct),
        decode_compile_s=compile_s,
        first_prefill_s_incl_compile=ttft_incl_compile,
    )


def engine_generate(engine: FreeTokenEngine, B: int, prompt_len: int, steps: int) -> dict:
    """The user-facing path: generate_batch (prefill, then the pipelined decode loop)."""
    rng = np.random.default_rng(100 + B)
    prompts = [list(rng.integers(0, engine.model_config.vocab_size, prompt_len)) for _ in range(B)]
    engine.generate_batch(prompts, max_new_tokens=steps, ignore_eos=True)  # compile
    before = engine.get_metrics()
    engine.generate_batch(prompts, max_new_tokens=steps, ignore_eos=True)
    after = engine.get_metrics()
    toks = after["generated_tokens"] - before["generated_tokens"]
    secs = after["decode_seconds"] - before["decode_seconds"]
    return dict(impl="engine.generate_batch", batch=B, tokens_per_s=toks / secs, ms_per_step=secs / (toks / B) * 1e3)


def cfg_topk(engine) -> int:
    return engine.model_config.top_k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--impl", nargs="+", default=["auto"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per row, the first 4 (compile and warm-up) untimed; at least 5")
    ap.add_argument("--no-engine-path", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.steps < 5:
        ap.error(f"--steps must be at least 5 (the first 4 are not timed), got {args.steps}")
    cfg = PRESETS[args.preset]
    ecfg = EngineConfig(
        dtype="bfloat16", max_context=args.prompt_len + args.steps + 16, max_batch=max(args.batch), page_size=16, prefill_chunk=128
    )
    t0 = time.perf_counter()
    engine = FreeTokenEngine.from_pretrained("demo", ecfg) if cfg is None else FreeTokenEngine(cfg, ecfg)
    jax.block_until_ready(engine.weights.params)
    print(
        f"device {jax.devices()[0].device_kind}; weights {nbytes(engine.weights.params) / 1e9:.1f} GB built in {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    bw = copy_bandwidth(4.0 if jax.default_backend() == "gpu" else 0.25)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    for B in args.batch:
        for impl in args.impl:
            if impl == "slices" and B * cfg_topk(engine) > 16:
                print(f"skipping slices at batch {B}: one unrolled matvec per token-expert pair is for decode of few rows", flush=True)
                continue
            r = bench(engine, B, args.prompt_len, args.steps, impl, bw)
            print(json.dumps(r), flush=True)
            rows.append(r)
        if not args.no_engine_path:
            r = engine_generate(engine, B, args.prompt_len, args.steps)
            print(json.dumps(r), flush=True)
            rows.append(r)
    out = dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, preset=args.preset, copy_bw_tb_s=bw / 1e12, rows=rows, argv=sys.argv
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"\n{'impl':>22} {'B':>3} {'ms/step':>9} {'tok/s':>9} {'bound ms':>9} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['impl']:>22} {r['batch']:>3} {r['ms_per_step']:9.3f} {r['tokens_per_s']:9.1f} {r.get('bound_ms', float('nan')):9.3f} {r.get('ratio_to_bound', float('nan')):6.2f}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
