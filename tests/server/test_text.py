"""The incremental detokenizer (`text.TextStream`) against decoding every token at once: random
token sequences of a byte-level BPE with special and added tokens, of a Llama-style
SentencePiece tokenizer (byte fallback, a decoder that strips the leading space) and of the demo's
byte tokenizer, split characters and invalid bytes included; stop strings against the text's
first occurrence; and how many tokens a token late in a long reply decodes."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from freetoken_jax.server.text import TextStream
from freetoken_jax.tokenizer import ByteTokenizer, load_tokenizer

SPECIAL, ADDED = ["<|im_end|>", "<|start|>"], ["<tool_call>", "</tool_call>"]
TEXT = 'Hello wörld, 日本語 🙂 — tabs\tand  spaces.\n<tool_call>{"a": 1}</tool_call> end'


def byte_pieces() -> dict[int, str]:
    """GPT-2's byte -> character map of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {b: chr(b) for b in keep} | {b: chr(256 + k) for k, b in enumerate(extra)}


def byte_level(path) -> object:
    piece = byte_pieces()
    vocab = {piece[b]: b for b in range(256)}
    for w in ("He", "llo", "lö", "ö,", " 日", "本語", "🙂"):  # whole words and pieces of characters' bytes, as ids to decode
        data = w.encode()
        for cut in {len(data), max(1, len(data) - 1)}:
            vocab.setdefault("".join(piece[b] for b in data[:cut]), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(ADDED)
    return save(tok, path)


def sentencepiece_style(path) -> object:
    """Llama / Mistral's tokenizer.json shape: '▁' for spaces, byte fallback, a decoder that
    strips the first space it writes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ("▁", "▁H", "ello", "▁w", "ö", "rld", ",", "▁日", "本", "語", "▁—", ".", "\t", "a", "b", "▁a", "▁b"):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return save(tok, path)


def save(tok, path):
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIAL[0]}))
    return load_tokenizer(str(path))


@pytest.fixture(params=["byte_level", "sentencepiece", "demo"])
def tokenizer(request, tmp_path):
    return {"byte_level": byte_level, "sentencepiece": sentencepiece_style, "demo": lambda p: ByteTokenizer()}[request.param](tmp_path)


WORDS = ["Hello", " wörld", ",", " 日本語", " 🙂", " —", "\t", " a", "b", "  ", "\n", "x", "<tool_call>", "<|im_end|>"]


def sequences(tok, rng):
    """Token sequences: encoded random text (characters split across tokens, byte fallback), and
    random ids (any bytes, special tokens among them) — not for byte fallback, whose decoder
    turns every byte of a run into U+FFFD once the run is not valid UTF-8, so that a stream's
    earlier characters cannot be those of the whole decode."""
    fallback = tok.token_id("<0x00>") is not None
    for _ in range(20):
        yield tok.encode("".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24))), add_bos=False)
        if not fallback:
            yield [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]


def stream(tok, ids, stops=(), keep_special=False):
    ts = TextStream(tok, list(stops), keep_special)
    out, stopped = [], False
    for t in ids:
        delta, stopped = ts.push(t)
        out.append(delta)
        if stopped:
            break
    if not stopped:
        out.append(ts.flush())
    return "".join(out), stopped


def test_token_text_names_the_token(tokenizer):
    for t in range(tokenizer.vocab_size):
        text = tokenizer.token_text(t)
        if isinstance(tokenizer, ByteTokenizer):
            assert text == (chr(t) if t < 128 else None) and tokenizer.encode(text or "", add_bos=False) == ([t] if text else [])
        else:
            assert text is not None and tokenizer.token_id(text) == t


@pytest.mark.parametrize("keep_special", [False, True])
def test_deltas_add_up_to_the_whole_decode(tokenizer, keep_special):
    rng = random.Random(1)
    for ids in sequences(tokenizer, rng):
        want = tokenizer.decode(ids, skip_special_tokens=not keep_special)
        got, _ = stream(tokenizer, ids, keep_special=keep_special)
        assert got == want, ids


def test_stop_strings_end_the_text_at_their_first_occurrence(tokenizer):
    rng = random.Random(2)
    ids = tokenizer.encode(TEXT, add_bos=False)
    full = tokenizer.decode(ids)
    for _ in range(30):
        a = rng.randrange(len(full) - 1)
        stop = full[a : a + rng.randint(1, 4)]
        if "\ufffd" in stop:
            continue
        got, stopped = stream(tokenizer, ids, [stop])
        assert stopped and got == full[: full.find(stop)], stop
    got, stopped = stream(tokenizer, ids, ["never there", "zz"])
    assert not stopped and got == full


def test_a_token_late_in_a_long_reply_decodes_as_few_tokens_as_an_early_one(tmp_path):
    tok = byte_level(tmp_path)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 🙂 " * 600, add_bos=False)  # 30 000 tokens
    decoded = []
    real = tok.decode
    tok.decode = lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw)
    ts = TextStream(tok, ["STOP"])
    out = [ts.push(t)[0] for t in ids] + [ts.flush()]
    assert "".join(out) == real(ids)
    assert max(decoded) <= 8 and sum(decoded) <= 4 * len(ids)  # every token so far at each token: 4.5e8 ids
