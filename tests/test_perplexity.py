"""`freetoken-jax perplexity`: llama-perplexity's windows and terms (against a plain-Python model
of them), and the figure against float64 arithmetic over `engine.logits` of each window."""

import json
import math

import jax
import numpy as np
import pytest

from freetoken_jax.cli import main
from freetoken_jax.perplexity import perplexity, scored_terms, windows

TEXT = (
    "The return statement leaves the current function call with the expression list (or None) as return value. "
    "When return passes control out of a try statement with a finally clause, that finally clause is executed "
    "before really leaving the function. In a generator function, the return statement indicates that the "
    "generator is done and will cause StopIteration to be raised. "
) * 3


def test_windows_and_terms_are_llama_perplexitys():
    ids = list(range(100, 137))  # 37 tokens: 4 windows of 8, 5 left out
    ws = windows(ids, 8, bos=1)
    assert ws == [[1] + ids[8 * k + 1 : 8 * k + 8] for k in range(4)]
    assert windows(ids, 8, bos=None, max_windows=2) == [ids[0:8], ids[8:16]]
    lp = np.arange(7.0)  # entry j: token j + 1's
    assert scored_terms(lp, 8).tolist() == [4.0, 5.0, 6.0]  # tokens 5, 6, 7: j from ctx/2 to ctx-2
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(ids, 64, bos=None)
    with pytest.raises(ValueError, match="at least 4"):
        windows(ids, 2, bos=None)


def test_perplexity_equals_float64_over_the_logits(demo_engine):
    tok = demo_engine.tokenizer
    ids = tok.encode(TEXT, add_bos=False)
    ctx = 48
    done = []
    r = perplexity(demo_engine, ids, ctx, max_windows=5, on_window=lambda: done.append(1))
    assert (r.windows, r.tokens, len(done)) == (5, 5 * (ctx - 1 - ctx // 2), 5)
    nll = []
    for k in range(5):
        w = [tok.bos_token_id] + ids[k * ctx + 1 : (k + 1) * ctx]
        lp = np.asarray(jax.nn.log_softmax(np.asarray(demo_engine.logits(w), np.float64), axis=-1))
        nll += [-lp[j, w[j + 1]] for j in range(ctx // 2, ctx - 1)]
    assert r.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)
    assert r.error == pytest.approx(r.ppl * np.std(nll, ddof=1) / math.sqrt(len(nll)), rel=1e-3)


def test_perplexity_command(tmp_path, capsys):
    f = tmp_path / "text.txt"
    f.write_text(TEXT)
    out = tmp_path / "ppl.json"
    argv = ["perplexity", "--model", "demo", "--file", str(f), "--ctx", "64", "--max-windows", "4", "--dtype", "f32", "--batch", "2",
            "--json", str(out), "--no-compile-cache"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    got = json.loads(out.read_text())
    assert got["windows"] == 4 and got["tokens"] == 4 * 31 and f"perplexity {got['ppl']:.4f} ± {got['error']:.4f}" in printed
    assert main(["perplexity", "--model", "demo", "--file", str(f), "--ctx", "4096", "--no-compile-cache"]) == 2
    assert "fewer than one window" in capsys.readouterr().err
