"""Perplexity of a model over a text, as llama.cpp's `llama-perplexity` measures it: the text's
tokens cut into windows of `ctx` tokens (the first one BOS where the tokenizer adds one), each
window scored on its second half only (every scored token has at least ctx / 2 tokens before it),
PPL = exp(mean negative log-likelihood) with the standard error of that mean. The windows are
scored by `FreeTokenEngine.score`, several at once: a quantized model's figure against its bf16
original's (or llama.cpp's on the same GGUF file) says what the quantization costs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass
class Perplexity:
    ppl: float
    error: float  # ppl × the standard error of the mean negative log-likelihood
    tokens: int  # tokens scored
    windows: int
    ctx: int


def window_count(tokens: int, ctx: int, max_windows: int | None = None) -> int:
    """How many whole windows of `ctx` tokens a text of `tokens` gives (at most `max_windows`)."""
    return tokens // ctx if max_windows is None else min(tokens // ctx, max_windows)


def windows(ids: list[int], ctx: int, bos: int | None, max_windows: int | None = None) -> list[list[int]]:
    """The text's ids in whole windows of `ctx` tokens, each starting with `bos` in place of its
    first token when given (llama-perplexity's windows); the tail that fills no window is left out."""
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4, got {ctx}")
    n = window_count(len(ids), ctx, max_windows)
    if n < 1:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of {ctx}")
    out = [list(ids[k * ctx : (k + 1) * ctx]) for k in range(n)]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


def scored_terms(logprobs: np.ndarray, ctx: int) -> np.ndarray:
    """A window's terms that count: the log-probabilities of its tokens ctx / 2 + 1 … ctx − 1
    (`logprobs[j]` is token j + 1's, as `FreeTokenEngine.score` gives them)."""
    return logprobs[ctx // 2 : ctx - 1]


def perplexity(engine, ids: list[int], ctx: int = 512, max_windows: int | None = None, on_window=None) -> Perplexity:
    """The perplexity of `ids` (the text's tokens, no BOS) under `engine`'s model (module
    docstring); `on_window()` is called as each window is scored."""
    added = engine.tokenizer.prompt_start() if engine.tokenizer is not None else []  # the BOS a prompt starts with, if any
    ws = windows(ids, ctx, added[0] if added else None, max_windows)
    lps = engine.score(ws, on_done=None if on_window is None else lambda i: on_window())
    nll = -np.concatenate([scored_terms(lp.astype(np.float64), ctx) for lp in lps])
    mean = float(nll.mean())
    sem = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    ppl = math.exp(mean)
    return Perplexity(ppl, ppl * sem, len(nll), len(ws), ctx)
