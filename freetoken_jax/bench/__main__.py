"""`python -m freetoken_jax.bench bw|decode|prefill|plot`: measure the machine, then the strategies.

    python -m freetoken_jax.bench bw [--json PATH] [--threshold 2.0] [--profile PATH]
    python -m freetoken_jax.bench decode --preset qwen3-30b-a3b --slots-gb 8 16 32 --batch 1 \
        --strategy offload hybrid naive --routing-skew 0 1 --json decode.json --plot decode.png
    python -m freetoken_jax.bench prefill --preset qwen3-30b-a3b --slots-gb 16 --prompt-len 2048 8192 --strategy offload stream per-token
    python -m freetoken_jax.bench plot skew0.json skew1.json --out decode.png   # decode runs drawn together
"""

from __future__ import annotations

import argparse
import json
import sys

from freetoken_jax.bench.compare import PREFILL_VARIANTS, VARIANTS
from freetoken_jax.bench.expert_impls import IMPLS
from freetoken_jax.bench.presets import PRESETS
from freetoken_jax.config import EXPERT_FORMATS


def main(argv: list[str] | None = None) -> int:
    from freetoken_jax.cli import HelpFormatter as fmt

    ap = argparse.ArgumentParser(prog="freetoken-jax bench", description="Measure the machine (bw), then the strategies (decode, prefill).",
                                 formatter_class=fmt)  # fmt: skip
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error (default: one line)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    bw = sub.add_parser("bw", help="measure host, CPU-executor and PCIe bandwidths; recommend a strategy", formatter_class=fmt)
    bw.add_argument("--json", default=None, help="also write the profile here")
    bw.add_argument("--profile", default=None, help="where the engine looks for it (default: the cache directory)")
    bw.add_argument("--threshold", type=float, default=2.0, help="hybrid only if CPU > threshold x PCIe")
    bw.add_argument("--working-set-gb", type=float, default=1.0)
    bw.add_argument("--host-read-gb", type=float, default=1.0)
    bw.add_argument("--hidden", type=int, default=2048)
    bw.add_argument("--ffn", type=int, default=768)
    bw.add_argument("--formats", nargs="*", default=[f for f in EXPERT_FORMATS if f != "bf16"], choices=[f for f in EXPERT_FORMATS if f != "bf16"],
                    help="quantized expert formats to measure the CPU executor on as well")  # fmt: skip
    for name, help_ in (
        ("decode", "decode tokens/s of several strategies side by side"),
        ("prefill", "prefill time of several strategies"),
    ):
        p = sub.add_parser(name, help=help_, formatter_class=fmt)
        src = p.add_mutually_exclusive_group()
        src.add_argument("--preset", dest="model", default="demo", choices=sorted(PRESETS), help="a named shape with seeded random weights")
        src.add_argument("--model", dest="model", help="a checkpoint directory (FTW, Hugging Face or native)")
        choices, default = (VARIANTS, ["offload", "hybrid", "naive"]) if name == "decode" else (PREFILL_VARIANTS, ["offload", "stream"])
        p.add_argument("--strategy", nargs="+", choices=choices, default=default)
        p.add_argument(
            "--slots-gb",
            type=float,
            nargs="+",
            default=[16.0],
            help="device memory for expert slots, GB = 1e9 bytes (offload, hybrid; one row per value)",
        )
        p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
        p.add_argument("--q", type=float, nargs="+", default=None,
                       help="hybrid's share of misses fetched over PCIe, fixed, one hybrid row per value (default: from q* = Bp / (Bp + Bh) "
                            "measured in this run, moved by the handoff's timing as the engine does; the row's q is where it ended)")  # fmt: skip
        p.add_argument("--json", default=None, help="write the figures here")
        p.add_argument("--layers", type=int, default=None, help="keep only a preset's first layers (the llama.cpp comparison uses 24)")
        p.add_argument("--expert-format", default=None, choices=list(EXPERT_FORMATS),
                       help="store the experts in this format (a preset's random weights are quantized as built; default: as the checkpoint)")  # fmt: skip
        p.add_argument("--expert-impl", default="auto", choices=IMPLS,
                       help="how the GPU computes routed experts (freetoken_jax/bench/expert_impls.py)")  # fmt: skip
        p.add_argument("--routing-skew", type=float, nargs="+", default=[None],
                       help="Zipf exponent of synthetic routing (0 = uniform), one set of rows per value; default: the model's own "
                            "router (a preset's random router sends most of a prompt's tokens to a few experts)")  # fmt: skip
        if name == "decode":
            p.add_argument("--batch", type=int, nargs="+", default=[1])
            p.add_argument("--prompt-len", type=int, default=64)
            p.add_argument("--gen-len", type=int, default=64, help="decode steps per row (the first quarter, at most 16, are warm-up)")
            p.add_argument("--layer-steps", type=int, default=8, help="decode steps of the `layer` baseline (each moves every expert)")
            p.add_argument("--plot", default=None, help="draw tokens/s against the VRAM budget into this PNG (needs matplotlib)")
            p.add_argument("--compile-workers", type=int, default=1,
                           help="compile the rows' decode steps ahead on this many threads (each row compiles its own otherwise)")  # fmt: skip
            p.add_argument("--prompt-by-decode", action="store_true",
                           help="feed the prompt through the decode step instead of a prefill (saves compiling one; no TTFT)")  # fmt: skip
        else:
            p.add_argument("--prompt-len", type=int, nargs="+", default=[256])
            p.add_argument("--chunk", type=int, nargs="+", default=[512],
                           help="prefill chunks (powers of two; one row per value); under offload every chunk streams the experts not resident")  # fmt: skip
    pl = sub.add_parser("plot", help="draw the rows of decode --json files together (needs matplotlib)", formatter_class=fmt)
    pl.add_argument("files", nargs="+")
    pl.add_argument("--out", required=True, help="the PNG to write")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--vram-gb" in argv:
        ap.error("bench takes --slots-gb (device memory for expert slots); --vram-gb is the whole device budget of generate/serve")
    args = ap.parse_args(argv)
    from freetoken_jax.cli import one_line_errors

    return one_line_errors(lambda: _run(args), args.debug)


def _run(args) -> int:
    if args.cmd == "plot":
        from freetoken_jax.bench.compare import plot, plot_title

        rows, titles = [], []
        for path in args.files:
            with open(path) as f:
                d = json.load(f)
            if d.get("kind") != "decode":
                raise SystemExit(f"{path}: not the JSON of a `bench decode` run")
            rows += d["rows"]
            titles.append(plot_title(d))
        plot(rows, args.out, "; ".join(dict.fromkeys(titles)))
        print(f"{len(rows)} rows drawn into {args.out}")
        return 0
    if args.cmd in ("decode", "prefill"):
        from freetoken_jax.bench.compare import run

        if args.cmd == "decode" and args.plot:  # before the run, not after it
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                print("error: --plot needs matplotlib (pip install 'freetoken_jax[plot]')", file=sys.stderr)
                return 2
        run(args)
        return 0
    from freetoken_jax.bench.bw import run_bw
    from freetoken_jax.runtime.choice import profile_path

    prof = run_bw(path=args.profile, json_path=args.json, threshold=args.threshold, working_set_gb=args.working_set_gb,
                  host_read_gb=args.host_read_gb, hidden=args.hidden, ffn=args.ffn, formats=tuple(args.formats))  # fmt: skip
    print(json.dumps(prof["figures"], indent=1))
    r = prof["recommendation"]
    print(f"recommendation: {r['strategy']} (q* = {r['q']}): {r['reason']}\nwritten to {profile_path(args.profile)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
