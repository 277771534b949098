"""What a streamed reply costs the server's host beyond the model: the incremental detokenizer
(`server.text.TextStream`) per token over a long reply, against decoding every token so far at
each token (as it did before); then each tool-call format's stream (`server.tools.ToolStream`)
reading one long call (write_file with 66 KB of code), then forty calls at once (write_file
with 1.5 KB each), in deltas of 4 characters.

    python benchmarks/bench_detokenize.py [--tokens 1000 10000 30000]

The detokenizer's tokenizer: a byte-level BPE of single bytes (a token a byte: the most tokens
for a text), one stop string.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from freetoken_jax.server.text import TextStream
from freetoken_jax.tokenizer import load_tokenizer


class WholeDecode(TextStream):
    """The text of every token so far, decoded again at each token."""

    def _advance(self, last: bool = False) -> None:
        text = self._decode(self.ids)
        self.text = text if last or not text.endswith("\ufffd") else self.text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 10000, 30000])
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.save(os.path.join(d, "tokenizer.json"))
    json.dump({}, open(os.path.join(d, "tokenizer_config.json"), "w"))
    tok = load_tokenizer(d)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. héllo 🙂 " * 2000, add_bos=False)
    print(f"{'tokens':>8} {'incremental us/token':>21} {'whole decode us/token':>22}")
    for n in args.tokens:
        row = []
        for cls in (TextStream, WholeDecode):
            ts, t0 = cls(tok, ["STOP"]), time.perf_counter()
            out = [ts.push(t)[0] for t in ids[:n]] + [ts.flush()]
            row.append((time.perf_counter() - t0) / n * 1e6)
            assert "".join(out) == tok.decode(ids[:n])
        print(f"{n:>8} {row[0]:>21.1f} {row[1]:>22.1f}")
    tool_calls()


def tool_calls() -> None:
    from freetoken_jax.server.tools import FORMATS, ToolCall, ToolStream

    one = [{"name": "write_file", "arguments": {"path": "a.py", "content": "def f(x):\n    return x + 1  # a line of code\n" * 1500}}]
    many = [
        {"name": "write_file", "arguments": {"path": f"f{i}.py", "content": "def f(x):\n    return x + 1  # a line\n" * 40}}
        for i in range(40)
    ]
    print(f"{'format':>12} {'calls':>5} {'chars':>7} {'s for the calls':>16} {'us a delta':>11}")
    for calls in (one, many):
        for fmt in ("hermes", "mistral", "deepseek_v3", "glm45"):
            text = "Writing it." + FORMATS[fmt].write([ToolCall(c["name"], json.dumps(c["arguments"])) for c in calls])
            ts, t0, events = ToolStream(FORMATS[fmt]), time.perf_counter(), []
            for k in range(0, len(text), 4):
                events += ts.push(text[k : k + 4])
            events += ts.finish()[0]
            dt = time.perf_counter() - t0
            for i, c in enumerate(calls):
                assert json.loads("".join(e[2] for e in events if e[0] == "arguments" and e[1] == i)) == c["arguments"]
            print(f"{fmt:>12} {len(calls):>5} {len(text):>7} {dt:>16.2f} {dt / (len(text) / 4) * 1e6:>11.1f}")


if __name__ == "__main__":
    main()
