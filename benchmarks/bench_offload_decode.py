"""Decode with the experts in pinned host RAM against its bound, with the baselines and the
hybrid variants in the same process on the same weights (built on `freetoken_jax.bench.compare`):

- cached: strategy "offload", the unified slot cache with the given expert budget;
- hybrid: the slot cache, fetch_count(M, q*) of each layer's M misses fetched and the rest
  computed by the CPU executor, handed over by the split FFI submit/wait; hybrid-cb: by
  jax.pure_callback; hybrid-q1: q = 1, so the CPU jobs are empty and the step time minus the
  cached step's is the cost of the handoff itself; suffixes of hybrid variants: "-ng" (handoff
  "ffi_nograph": the FFI pair kept out of XLA's CUDA graphs), "-hf" (signals by host functions
  instead of stream memory operations; give it its own executable, e.g. with -ng, since a graph
  keeps the operations it was recorded with);
- naive: every routed expert fetched every step; layer: every bank streamed every step.

    python benchmarks/bench_offload_decode.py --preset qwen3-30b-a3b --expert-gb 16 --batch 1 4 --steps 256 --check

`--check` first compares greedy tokens of fused, offload and hybrid on the same seeded weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from freetoken_jax.bench.compare import Bench  # noqa: E402
from freetoken_jax.bench.presets import PRESETS  # noqa: E402
from freetoken_jax.runtime.routing import SyntheticRouting  # noqa: E402


def check_against_fused(bench: Bench, hybrid, n=12) -> dict:
    """Greedy tokens of the same seeded weights under "fused", "offload" and "hybrid"."""
    from freetoken_jax import FreeTokenEngine

    cfg, ecfg, eng = bench.cfg, bench.ecfg, bench.engine
    fused = FreeTokenEngine(cfg, ecfg.replace(moe_strategy="fused", expert_slots=None))
    prompt = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 40))
    a = list(fused.generate(prompt, max_new_tokens=n, ignore_eos=True))
    del fused
    b = list(eng.generate(prompt, max_new_tokens=n, ignore_eos=True))
    plain = eng.experts
    try:
        eng.use(hybrid)
        c = list(eng.generate(prompt, max_new_tokens=n, ignore_eos=True))
    finally:
        eng.use(plain)
    return dict(offload_equal=a == b, hybrid_equal=a == c, tokens=n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--expert-gb", type=float, default=16.0, help="device memory for expert slots (GB, 1e9 bytes)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--layer-steps", type=int, default=16, help="steps for the layer-streaming baseline (each moves every expert)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["cached", "hybrid", "hybrid-cb", "hybrid-q1", "naive", "layer"],
                    help="cached hybrid hybrid-cb hybrid-q1 naive layer; hybrid variants take the suffixes -ng, -hf")  # fmt: skip
    ap.add_argument("--q", type=float, default=None, help="hybrid q* (default: Bp / (Bp + Bh) measured in this run)")
    ap.add_argument("--routing-skew", type=float, default=None, help="Zipf exponent of synthetic routing (default: the model's router)")
    ap.add_argument("--prefill", action="store_true",
                    help="prefill the prompt (compiles a prefill step) instead of feeding it through the decode step")  # fmt: skip
    ap.add_argument("--compile-workers", type=int, default=1, help="compile the variants' decode steps ahead on this many threads")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="keep only the preset's first layers (a quick --check)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    bench = Bench(args.preset, dtype="bfloat16", max_batch=max(args.batch), max_context=max(args.prompt_len + args.steps, 64) + 32,
                  layers=args.layers)  # fmt: skip
    q = args.q if args.q is not None else bench.bp / (bench.bp + bench.bh)
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, argv=sys.argv, copy_bw_tb_s=bench.hbm / 1e12,
               h2d_gb_s=bench.bp / 1e9, executor_gb_s=bench.bh / 1e9, q=q, rows=[])  # fmt: skip
    hybrid = bench.variant("hybrid", q, None)[1]

    def skewed(experts):
        return experts if args.routing_skew is None else SyntheticRouting(experts, float(args.routing_skew))

    own = {
        "hybrid": hybrid,
        "hybrid-cb": dataclasses.replace(hybrid, handoff="callback"),
        "hybrid-q1": hybrid.with_q(1.0),
    }
    if args.check:
        out["check"] = check_against_fused(bench, hybrid)
        print("check against fused:", out["check"], flush=True)
    from freetoken_jax import _cpu_ext

    def parse(v: str) -> tuple[str, bool, bool]:
        """(base variant, host functions, outside the graphs)"""
        hf, base = v.endswith("-hf"), v.removesuffix("-hf")
        return base.removesuffix("-ng"), hf, base.endswith("-ng")

    def row(v: str, B: int) -> dict:
        base, _, nograph = parse(v)
        strategy = {"cached": "offload", "hybrid-cb": "hybrid", "hybrid-q1": "hybrid"}.get(base, base)
        steps = args.layer_steps if v == "layer" else args.steps
        experts = own.get(base)
        if nograph and experts is not None:
            experts = dataclasses.replace(experts, handoff="ffi_nograph")
        return dict(variant=strategy, B=B, slots_gb=args.expert_gb, prompt_len=args.prompt_len, steps=steps, q=q,
                    skew=args.routing_skew, experts=None if experts is None else skewed(experts), label=v)  # fmt: skip

    if args.compile_workers > 1:
        bench.precompile([row(v, B) for B in args.batch for v in args.variants], args.compile_workers)
    for B in args.batch:
        for v in args.variants:
            _cpu_ext.handoff_sync("host_function" if parse(v)[1] else "stream_memops")  # nothing is in flight here
            try:
                by_decode = not args.prefill and v != "layer"  # a layer step moves every expert: prefill its prompt
                r = bench.decode(**row(v, B), prompt_by_decode=by_decode)
            except Exception as e:  # one failing variant must not hide the others' figures
                print(f"variant {v} at batch {B} failed: {type(e).__name__}: {e}", flush=True)
                continue
            print(json.dumps(r), flush=True)
            out["rows"].append(r)
            if args.json:  # after every row, so a run stopped by a time limit keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
    print(
        f"\n{'variant':>9} {'B':>2} {'ms/tok':>8} {'tok/s':>7} {'hit':>5} {'GB/tok':>7} {'cpu/st':>6} {'bound':>7} {'ratio':>5} {'cpu_us':>6}"
    )
    for r in out["rows"]:
        print(f"{r['strategy']:>9} {r['batch']:>2} {r['ms_per_token']:8.2f} {r['tokens_per_s']:7.2f} {r['hit_rate']:5.2f} "
              f"{r['gb_fetched_per_token']:7.3f} {r['experts_on_cpu_per_step']:6.1f} {r['bound_ms']:7.2f} {r['ratio_to_bound']:5.2f} "
              f"{r.get('handoff_cpu_side_us', 0):6.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
