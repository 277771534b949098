"""Greedy tokens and prompt logits of every strategy on one preset's seeded weights (optionally a
few layers, optionally quantized experts): the correctness check a GPU run starts with.

    python benchmarks/check_strategies.py --preset qwen3-30b-a3b --layers 2 --expert-format q4_0
    python benchmarks/check_strategies.py --layers 3 --expert-format q4_k --down-format q6_k  # Q4_K_M's mix
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.bench.presets import preset_config


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--expert-format", default=None)
    ap.add_argument("--strategies", nargs="+", default=["fused", "offload", "hybrid", "cpu"])
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--down-format", default=None, help="the down projections of every other MoE layer in this format (per-layer formats)")
    args = ap.parse_args()
    cfg = preset_config(args.preset, args.layers)
    if args.down_format:
        f, d = args.expert_format, args.down_format
        cfg = dataclasses.replace(
            cfg, expert_format=f, expert_formats=tuple((f, f, d if m % 2 == 0 else f) for m in range(cfg.num_moe_layers))
        )
        args.expert_format = None  # the model's own formats
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, 24)]
    runs = {}
    for s in args.strategies:
        ecfg = EngineConfig(moe_strategy=s, max_context=128, max_batch=1, expert_format=args.expert_format, hybrid_q=0.5,
                            expert_slots=4 * cfg.top_k if s in ("offload", "hybrid") else None)  # fmt: skip
        eng = FreeTokenEngine(cfg, ecfg)
        tokens = list(eng.generate(prompt, max_new_tokens=args.tokens, ignore_eos=True))
        runs[s] = (tokens, np.asarray(eng.logits(prompt)))
        eng.runner.close()
        print(f"{s:8s} {tokens}", flush=True)
    first, (want, ref) = args.strategies[0], runs[args.strategies[0]]
    ok = True
    for s, (tokens, logits) in runs.items():
        diff = float(np.abs(logits - ref).max())
        print(f"{s:8s} tokens {'==' if tokens == want else '!='} {first}; max |logit - {first}| {diff:.2e}")
        ok &= tokens == want
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
