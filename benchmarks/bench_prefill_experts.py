"""Time one prefill chunk's routed experts a layer by each many-pairs implementation of
`models/routed.py`: "grouped" (the plans' batched matmuls; "grouped untight" without the tight
ranked plan, "grouped broad" without the tight and steep ones, as before they were added),
"tiles" (the Triton kernels over groups of whole tiles, at several blocks, warps and stages) and
"ragged" (jax's Mosaic GPU grouped matmul over the unpadded groups).

    python benchmarks/bench_prefill_experts.py [--tokens 8192] [--experts 128] [--k 8] [--ffn 768] [--hidden 2048]
        [--format q4_0] [--skew 0 1] [--layers 4] [--configs 64,4,3:128,4,3 ...] [--only grouped "grouped untight" "grouped broad"]

`layers` layers run in one jitted function (straight-line), each with a bank of its own (so that
the weights come from HBM), each layer's output the next one's input; the banks are stored in
`format` and dequantized in the step as the engine does (bf16: used as they are). Routing: the
synthetic draw of `bench` (Zipf exponent `skew` over a layer's experts, 0 = uniform). Prints ms a
layer, the useful TFLOP/s (2 · 3 · T·K · D · F a layer: the routed pairs' products, no padding)
and the largest difference from "grouped". `--configs`: "tiles" variants, each gate/up's
`block_n,warps,stages`, optionally `:` down's.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.models import routed
from freetoken_jax.quant.formats import get_format
from freetoken_jax.quant.layout import ExpertLayout
from freetoken_jax.runtime.routing import synthetic_ids


def _kw(spec: str) -> dict:
    n, w, s = (int(v) for v in spec.split(","))
    return dict(block_n=n, num_warps=w, num_stages=s)


def with_plans(keep, *args, **kw):
    """`routed_experts` traced with those of grouped's plans that `keep(plan, T)` keeps."""
    plans = routed.group_plans
    routed.group_plans = lambda T, K, E: [p for p in plans(T, K, E) if keep(p, T)]
    try:
        return routed.routed_experts(*args, **kw)
    finally:
        routed.group_plans = plans


def untight(p, T: int) -> bool:
    """The plans before the tight one (a ranked plan whose busiest experts get under T rows)."""
    return not (p.ranked and p.tiers[0][1] < T)


def broad(p, T: int) -> bool:
    """The plans before the tight and steep ones (steep's first two tiers: as many experts each)."""
    return untight(p, T) and not (p.ranked and len(p.tiers) > 1 and p.tiers[1][0] == p.tiers[0][0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--format", default="q4_0", choices=["bf16", "q4_0", "q8_0", "mxfp4"])
    ap.add_argument("--skew", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--configs", nargs="*", default=["64,4,3:128,4,3", "64,8,3:128,8,3", "32,4,4:64,4,4", "128,8,3:128,8,4"])
    ap.add_argument("--only", nargs="+", default=None, help="time only the variants named (e.g. grouped 'grouped broad')")
    args = ap.parse_args()
    E, K, F, D, L = args.experts, args.k, args.ffn, args.hidden, args.layers
    rng = np.random.default_rng(0)
    fmts = (args.format,) * 3
    layout = ExpertLayout(fmts, F, D, "silu")
    banks = []
    for _ in range(L):
        layer = []
        for o, i in ((F, D), (F, D), (D, F)):
            w = jnp.asarray(rng.standard_normal((E, o, i), np.float32) * 0.02, jnp.bfloat16)
            layer.append(w if args.format == "bf16" else get_format(args.format).quantize(w.astype(jnp.float32)))
        banks.append(tuple(layer))
    print(f"{jax.devices()[0].device_kind}: {L} layers, E {E}, top-{K}, D {D}, F {F}, {args.format} banks", flush=True)

    for T in args.tokens:
        x0 = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
        flops = 2 * 3 * T * K * D * F
        for skew in args.skew:
            ids = [synthetic_ids(jnp.zeros((T, K), jnp.int32), jnp.arange(T), m, E, skew) for m in range(L)]
            w = jnp.full((T, K), 1.0 / K, jnp.float32)
            counts = np.bincount(np.asarray(ids[0]).reshape(-1), minlength=E)
            print(f"T {T}, skew {skew:g}: pairs an expert (layer 0) mean {counts.mean():.0f}, max {counts.max()}", flush=True)
            variants = [("grouped", functools.partial(routed.routed_experts, impl="grouped")),
                        ("grouped untight", functools.partial(with_plans, untight, impl="grouped")),
                        ("grouped broad", functools.partial(with_plans, broad, impl="grouped")),
                        ("tiles", functools.partial(routed.routed_experts, impl="tiles")),
                        ("ragged", functools.partial(routed.routed_experts, impl="ragged"))]  # fmt: skip
            for spec in args.configs:
                gu, _, dn = spec.partition(":")
                variants.append((f"tiles {spec}", functools.partial(routed._tiled, bias=None, gate_up_kw=_kw(gu), down_kw=dn and _kw(dn))))
            if args.only:
                variants = [(n, f) for n, f in variants if n in args.only]
            ref = None
            print(f"{'variant':>24} {'ms/layer':>9} {'TFLOP/s':>8} {'max |diff|':>11}", flush=True)
            for name, fn in variants:
                try:

                    @jax.jit
                    def run(x, ids, w, fn=fn):
                        for m in range(L):
                            y = fn(x, ids[m], w, banks[m], layout).astype(jnp.float32)
                            x = (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(jnp.bfloat16)
                        return x

                    out = np.asarray(run(x0, ids, w), np.float32)
                    ref = out if ref is None else ref
                    ts = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        run(x0, ids, w).block_until_ready()
                        ts.append((time.perf_counter() - t0) / L)
                    t = min(ts)
                    print(f"{name:>24} {t * 1e3:9.3f} {flops / t / 1e12:8.1f} {np.abs(out - ref).max():11.2e}", flush=True)
                except Exception as e:  # a variant that does not compile is reported, the others still run
                    print(f"{name:>24} failed: {str(e).splitlines()[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
