"""The incremental detokenizer's cost per token (`server.text.TextStream`, what every streamed
reply goes through on the server's event loop) over a long reply, against decoding every token so
far at each token (as it did before).

    python benchmarks/bench_detokenize.py [--tokens 1000 10000 30000]

A byte-level BPE of single bytes (a token a byte: the most tokens for a text), one stop string.
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


if __name__ == "__main__":
    main()
