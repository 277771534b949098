"""The `freetoken-jax` command line: `generate` (more subcommands come with the server and bench)."""

from __future__ import annotations

import argparse
import sys
import time


def _engine_config(args):
    from freetoken_jax import EngineConfig

    return EngineConfig(dtype=args.dtype, max_context=args.max_context, max_batch=1)


def cmd_generate(args) -> int:
    from freetoken_jax import FreeTokenEngine

    engine = FreeTokenEngine.from_pretrained(args.model, _engine_config(args))
    tok = engine.tokenizer
    if tok is None:
        print(f"error: {args.model} has no tokenizer (tokenizer.json); cannot encode a text prompt", file=sys.stderr)
        return 2
    ids = tok.encode(args.prompt)
    print(args.prompt, end="", flush=True)
    t0, out = time.perf_counter(), []
    for t in engine.generate(
        ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    ):
        out.append(t)
        print(tok.decode([t]), end="", flush=True)
    dt = time.perf_counter() - t0
    m = engine.get_metrics()
    print(
        f"\n[{len(out)} tokens in {dt:.2f} s; decode {m['decode_tokens_per_second']:.1f} tok/s; prompt {len(ids)} tokens]", file=sys.stderr
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freetoken-jax", description="MoE serving beyond GPU memory, on JAX/XLA.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", required=True, help="checkpoint directory, or 'demo'")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--max-context", type=int, default=4096)
    g.set_defaults(fn=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from freetoken_jax.checkpoint.safetensors_io import CheckpointError
    from freetoken_jax.config import ConfigError
    from freetoken_jax.engine import RequestError

    try:
        return args.fn(args)
    except (ConfigError, CheckpointError, RequestError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
