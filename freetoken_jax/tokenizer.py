"""Tokenizers: the demo model's byte-level tokenizer, Hugging Face `tokenizer.json` files, and the
vocabulary inside a GGUF file (its BPE tokens and merges, rebuilt as a `tokenizers` BPE)."""

from __future__ import annotations

import json
import os


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is BOS, 257 is EOS."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.prompt_start(add_bos) + list(text.encode("utf-8"))

    def prompt_start(self, add_bos: bool = True) -> list[int]:
        """The ids a prompt starts with: BOS."""
        return [self.bos_token_id] if add_bos else []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_id(self, text: str) -> int | None:
        return None

    def token_text(self, token: int) -> str | None:
        """The token's text: an ASCII byte's character; None for BOS, EOS and the other bytes."""
        return chr(token) if 0 <= token < 128 else None


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer`, with BOS handling and the model's chat template."""

    def __init__(self, tok, bos_token_id: int | None = None, add_bos: bool = False, chat_template: str | None = None):
        self._tok, self.bos_token_id, self.add_bos, self.chat_template = tok, bos_token_id, add_bos, chat_template
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def from_dir(cls, path: str) -> HFTokenizer:
        """`tokenizer.json`, with BOS and the chat template from `tokenizer_config.json`."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg_path = os.path.join(path, "tokenizer_config.json")
        cfg = json.load(open(cfg_path)) if os.path.isfile(cfg_path) else {}
        bos = cfg.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        template = cfg.get("chat_template")
        return cls(
            tok,
            tok.token_to_id(bos) if bos else None,
            bool(cfg.get("add_bos_token", False)),
            template if isinstance(template, str) else None,
        )

    def save(self, path: str) -> None:
        """Writes `tokenizer.json` and `tokenizer_config.json` (BOS, chat template) into `path`."""
        self._tok.save(os.path.join(path, "tokenizer.json"))
        cfg = dict(
            add_bos_token=self.add_bos, bos_token=self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
        )
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.prompt_start(add_bos) + self._tok.encode(text, add_special_tokens=False).ids

    def prompt_start(self, add_bos: bool = True) -> list[int]:
        """The ids a prompt starts with: BOS where the model's tokenizer adds one, else none."""
        return [self.bos_token_id] if add_bos and self.add_bos and self.bos_token_id is not None else []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        """The id of the token that is exactly `text`, or None."""
        return self._tok.token_to_id(text)

    def token_text(self, token: int) -> str | None:
        """The token's own text in the vocabulary (`<|im_end|>`), or None."""
        return self._tok.id_to_token(token)


def load_tokenizer(path: str):
    """The tokenizer stored with a checkpoint, or None if it has none."""
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            if json.load(f).get("freetoken_tokenizer") == "bytes":
                return ByteTokenizer()
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer.from_dir(path)
    return None


# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre` (those of the models' tokenizer.json files),
# applied in turn (each split isolates its matches).
_GGUF_PRE = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    # gpt-oss (o200k): cased words with their contraction, numbers of up to three digits, ...
    "gpt-4o": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "gpt-2": (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
_GGUF_PRE["default"] = _GGUF_PRE["gpt-2"]
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # GGUF token types of the unknown, special and added tokens


def _bos(ck, tok) -> HFTokenizer:
    bos = ck.get("tokenizer.ggml.bos_token_id")
    return HFTokenizer(
        tok, None if bos is None else int(bos), bool(ck.get("tokenizer.ggml.add_bos_token", False)), ck.get("tokenizer.chat_template")
    )


def _added(tokens, types) -> list[dict]:
    return [dict(id=i, content=t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=ty == CONTROL)
            for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)]  # fmt: skip


def _gguf_sentencepiece(ck) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (`tokenizer.ggml.model` "llama": pieces, scores, types) as a
    `tokenizers` BPE the way Hugging Face converts SentencePiece models: merges from the pieces
    that two others concatenate, ranked by the merged piece's score; "▁" for spaces (and one in
    front, unless `add_space_prefix` is false); byte fallback to the <0xNN> pieces."""
    from tokenizers import Tokenizer

    tokens = list(ck.get("tokenizer.ggml.tokens") or [])
    scores = list(ck.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    types = list(ck.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: m[2], reverse=True)
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    prefix = bool(ck.get("tokenizer.ggml.add_space_prefix", True))
    normalizers = ([dict(type="Prepend", prepend="▁")] if prefix else []) + [dict(type="Replace", pattern=dict(String=" "), content="▁")]
    decoders = [dict(type="Replace", pattern=dict(String="▁"), content=" "), dict(type="ByteFallback"), dict(type="Fuse")]
    if prefix:
        decoders.append(dict(type="Strip", content=" ", start=1, stop=0))
    spec = dict(
        version="1.0",
        added_tokens=_added(tokens, types),
        normalizer=dict(type="Sequence", normalizers=normalizers),
        pre_tokenizer=None,
        post_processor=None,
        decoder=dict(type="Sequence", decoders=decoders),
        model=dict(type="BPE", dropout=None, unk_token=unk, continuing_subword_prefix=None, end_of_word_suffix=None, fuse_unk=True,
                   byte_fallback=True, ignore_merges=False, vocab=vocab, merges=[[a, b] for a, b, _ in merges]),
    )  # fmt: skip
    return _bos(ck, Tokenizer.from_str(json.dumps(spec)))


def gguf_tokenizer(ck) -> HFTokenizer | None:
    """The tokenizer stored in a GGUF file (`checkpoint.gguf_file.GGUFCheckpoint`): byte-level BPE
    (`tokenizer.ggml.model` "gpt2") from its tokens, merges and token types, the pre-tokenizer of
    `tokenizer.ggml.pre`, BOS / add-BOS and the chat template from the metadata. None for a file
    without a vocabulary ("no_vocab": prompts are token ids)."""
    from tokenizers import Tokenizer

    from freetoken_jax.config import ConfigError

    model = ck.get("tokenizer.ggml.model")
    if model in (None, "no_vocab", "none"):
        return None
    if model == "llama":
        return _gguf_sentencepiece(ck)
    if model != "gpt2":
        raise ConfigError(
            f"{ck.path}: GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and SentencePiece 'llama' are)"
        )
    pre = ck.get("tokenizer.ggml.pre") or "default"
    if pre not in _GGUF_PRE:
        raise ConfigError(f"{ck.path}: GGUF pre-tokenizer {pre!r} is not known; known: {', '.join(sorted(_GGUF_PRE))}")
    tokens = list(ck.get("tokenizer.ggml.tokens") or [])
    merges = [m.split(" ", 1) for m in ck.get("tokenizer.ggml.merges") or []]
    types = list(ck.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    added = _added(tokens, types)
    byte_level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=False, use_regex=False)
    spec = dict(
        version="1.0",
        added_tokens=added,
        normalizer=None,
        pre_tokenizer=dict(type="Sequence", pretokenizers=[
            *(dict(type="Split", pattern=dict(Regex=r), behavior="Isolated", invert=False) for r in _GGUF_PRE[pre]), byte_level]),
        post_processor=None,
        decoder=byte_level,
        model=dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None, fuse_unk=False,
                   byte_fallback=False, ignore_merges=False, vocab={t: i for i, t in enumerate(tokens)}, merges=merges),
    )  # fmt: skip
    return _bos(ck, Tokenizer.from_str(json.dumps(spec)))
