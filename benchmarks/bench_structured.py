"""Decode throughput with a JSON-schema constraint against without, and the grammar engine's
per-token cost on the host.

    python benchmarks/bench_structured.py --preset qwen3-30b-a3b --batch 1 8 --strategy fused
    python benchmarks/bench_structured.py --preset demo --vocab 151936 --batch 1 8   # the CPU

A preset's random weights come without a tokenizer: one with the preset's vocabulary size is made
up (byte tokens plus random word pieces, with and without a leading space, digits and JSON
punctuation), so that the grammar engine computes masks over a vocabulary of the real size. The
schema (an object holding an array of at least 1000 integers) keeps every row generating for
the whole length, so every run decodes the same number of tokens. A third run asks for a
presence penalty only: the two halves without the host's wait for masks. Constrained rows decode in two
halves (`Batcher._decode`); the masks of step t+1 are computed while the model half of step t+1
runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}},
          "required": ["values"], "additionalProperties": False}  # fmt: skip


def made_up_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE vocabulary of `vocab_size` tokens (no merges: for masks, not encoding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from freetoken_jax.tokenizer import HFTokenizer

    rng = np.random.default_rng(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    pieces = ['",', '":', '{"', '"}', "],", "[", "]", "},", '": "', ", ", ",\n", "  ", "\n"] + [str(i) for i in range(1000)]
    for p in pieces:
        vocab.setdefault(p.replace(" ", "Ġ").replace("\n", "Ċ"), len(vocab))
    while len(vocab) < vocab_size - 2:
        w = "".join(rng.choice(letters, rng.integers(2, 10)))
        w = ("Ġ" + w) if rng.random() < 0.6 else w.capitalize() if rng.random() < 0.2 else w
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    return HFTokenizer(tok)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None, help="another vocabulary size (the demo's 320 tokens make masks trivially cheap)")
    ap.add_argument("--strategy", default="fused")
    ap.add_argument("--expert-slots", type=int, default=None, help="offload / hybrid")
    ap.add_argument("--expert-format", default=None, help="store the experts in this format (random weights quantized as built)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax

    from freetoken_jax import EngineConfig, FreeTokenEngine
    from freetoken_jax.bench.presets import preset_config

    cfg = preset_config(args.preset)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers, moe_layers=cfg.moe_layers[: args.layers])
    if args.vocab:
        cfg = dataclasses.replace(cfg, vocab_size=args.vocab)
    tokenizer = made_up_tokenizer(cfg.vocab_size)
    cfg = dataclasses.replace(cfg, eos_token_ids=(cfg.vocab_size - 1,))
    B = max(args.batch)
    ecfg = EngineConfig(dtype="bfloat16" if jax.default_backend() == "gpu" else "float32", max_context=64 + args.gen_len, max_batch=B,
                        page_size=16, prefill_chunk=64, moe_strategy=args.strategy, expert_slots=args.expert_slots,
                        expert_format=args.expert_format)  # fmt: skip
    t0 = time.perf_counter()
    engine = FreeTokenEngine(cfg, ecfg, tokenizer=tokenizer, name=args.preset)
    print(f"device {jax.devices()[0].device_kind}; {args.preset} ({cfg.num_layers} layers) {args.strategy} built in {time.perf_counter() - t0:.0f} s",
          flush=True)  # fmt: skip

    # the grammar engine on this vocabulary, per token: a mask, its unpacking by numpy to choose an
    # allowed token, an advance (benchmarks/grammar_engines.py times the engine's calls alone)
    g = engine.grammars
    c = g.constraint(g.json_schema(SCHEMA))
    mask = np.full((1, (cfg.vocab_size + 31) // 32), -1, np.int32)
    rng = np.random.default_rng(0)
    t, n = time.perf_counter(), 0
    while n < 300:
        c.fill(mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: cfg.vocab_size])
        if not c.accept(int(rng.choice(allowed))):
            break
        n += 1
    mask_us = (time.perf_counter() - t) / n * 1e6
    print(f"llguidance: {mask_us:.0f} us per token (mask, numpy unpack, advance) over {cfg.vocab_size} tokens", flush=True)

    rows = []
    prompts = [[int(t) for t in rng.integers(256, cfg.vocab_size - 2, 32)] for _ in range(B)]
    for b in args.batch:
        # plain; a presence penalty (the two halves, no host wait); the schema (the two halves, masks from the host)
        for mode in ("plain", "penalty", "schema"):
            constrained = mode == "schema"
            kw = dict(max_new_tokens=args.gen_len, temperature=1.0, ignore_eos=not constrained, json_schema=SCHEMA if constrained else None,
                      presence_penalty=0.1 if mode == "penalty" else 0.0)  # fmt: skip
            engine.generate_batch(prompts[:b], **kw)  # compile, warm
            before = engine.get_metrics()
            out = engine.generate_batch(prompts[:b], **kw)
            after = engine.get_metrics()
            toks = after["generated_tokens"] - before["generated_tokens"]
            secs = after["decode_seconds"] - before["decode_seconds"]
            if constrained:
                text = tokenizer.decode(out[0])
                assert text[:9] == '{"values"'[: len(text[:9])], text[:80]  # the schema held
            r = dict(
                batch=b, mode=mode, constrained=constrained, tokens=toks, tokens_per_s=toks / secs, ms_per_step=1e3 * secs / (toks / b)
            )
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'B':>3} {'rows':>8} {'tok/s':>9} {'ms/step':>8} {'ratio':>6}")
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["mode"] == "plain")
        r["ratio_to_unconstrained"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['batch']:>3} {r['mode']:>8} {r['tokens_per_s']:9.1f} {r['ms_per_step']:8.2f} {r['ratio_to_unconstrained']:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, preset=args.preset, strategy=args.strategy, mask_us_per_token=mask_us, rows=rows,
                           argv=sys.argv), f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
