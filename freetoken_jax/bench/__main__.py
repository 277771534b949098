"""`python -m freetoken_jax.bench bw [--json PATH] [--threshold 2.0] [--profile PATH]`."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m freetoken_jax.bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    bw = sub.add_parser("bw", help="measure host, CPU-executor and PCIe bandwidths; recommend a strategy")
    bw.add_argument("--json", default=None, help="also write the profile here")
    bw.add_argument("--profile", default=None, help="where the engine looks for it (default: the cache directory)")
    bw.add_argument("--threshold", type=float, default=2.0, help="hybrid only if CPU > threshold x PCIe")
    bw.add_argument("--working-set-gb", type=float, default=1.0)
    bw.add_argument("--host-read-gb", type=float, default=1.0)
    bw.add_argument("--hidden", type=int, default=2048)
    bw.add_argument("--ffn", type=int, default=768)
    args = ap.parse_args(argv)
    from freetoken_jax.bench.bw import profile_path, run_bw

    prof = run_bw(path=args.profile, json_path=args.json, threshold=args.threshold, working_set_gb=args.working_set_gb,
                  host_read_gb=args.host_read_gb, hidden=args.hidden, ffn=args.ffn)  # fmt: skip
    print(json.dumps(prof["figures"], indent=1))
    r = prof["recommendation"]
    print(f"recommendation: {r['strategy']} (q* = {r['q']}): {r['reason']}\nwritten to {profile_path(args.profile)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
