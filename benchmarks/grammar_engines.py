"""llguidance against xgrammar: the host's cost per generated token (compute the next token's
bitmask, then advance past a token the mask allows) for one JSON schema over a vocabulary of
151936 tokens (`bench_structured.made_up_tokenizer`), each engine walking its own 300 random
allowed tokens. Only the engine's calls are timed (not the unpacking of the mask to choose the
next token).

    pip install --no-deps xgrammar apache-tvm-ffi   # xgrammar is not a dependency (it needs torch)
    python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_structured import SCHEMA, made_up_tokenizer  # noqa: E402

V, STEPS = 151936, 300


def walk(fill, accept, words: np.ndarray, rng) -> float:
    """Microseconds per token of `fill(words)` + `accept(token)` along a random allowed walk."""
    spent = 0.0
    for _ in range(STEPS):
        t = time.perf_counter()
        fill(words)
        spent += time.perf_counter() - t
        x = int(rng.choice(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:V])))
        t = time.perf_counter()
        ok = accept(x)
        spent += time.perf_counter() - t
        if not ok:
            raise RuntimeError("a token the mask allowed was refused")
    return spent / STEPS * 1e6


def main() -> None:
    import llguidance

    tok = made_up_tokenizer(V)
    words = np.full((V + 31) // 32, -1, np.int32)
    lt = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=V, eos_token=[V - 1])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    ll = walk(lambda w: m.unsafe_compute_mask_ptr(w.ctypes.data, w.size * 4), m.consume_token, words, np.random.default_rng(0))
    print(f"llguidance: {ll:.0f} us per token", flush=True)
    try:
        import transformers
        import xgrammar
    except ImportError:
        print("xgrammar: not installed")
        return
    info = xgrammar.TokenizerInfo.from_huggingface(transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok), vocab_size=V,
                                                   stop_token_ids=[V - 1])  # fmt: skip
    xm = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    bm = xgrammar.allocate_token_bitmask(1, V)

    def fill(w):
        xm.fill_next_token_bitmask(bm)
        w[:] = bm[0].numpy()  # a view's copy: a few microseconds

    xg = walk(fill, xm.accept_token, words, np.random.default_rng(0))
    print(f"xgrammar: {xg:.0f} us per token", flush=True)


if __name__ == "__main__":
    main()
