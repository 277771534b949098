"""Tokenizers: the demo model's byte-level tokenizer, and Hugging Face `tokenizer.json` files."""

from __future__ import annotations

import json
import os


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is BOS, 257 is EOS."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` (Hugging Face tokenizers), with BOS from `tokenizer_config.json`."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg_path = os.path.join(path, "tokenizer_config.json")
        cfg = json.load(open(cfg_path)) if os.path.isfile(cfg_path) else {}
        bos = cfg.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        self.bos_token_id = self._tok.token_to_id(bos) if bos else None
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path: str):
    """The tokenizer stored with a checkpoint, or None if it has none."""
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            if json.load(f).get("freetoken_tokenizer") == "bytes":
                return ByteTokenizer()
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    return None
