"""Grammars that generated text must follow — JSON schemas, any JSON object, regular expressions,
Lark grammars (structured output, forced tool calls) — through llguidance.

`Grammars` compiles a request's grammar once per request for one tokenizer (errors are the
request's: `GrammarError`, before it is queued); its `Constraint` is the request's matcher: the
batcher fills the request's row of the step's token bitmask from it (`fill`) while the model half
of the step runs, and advances it with each token the row emits (`accept`).
"""

from __future__ import annotations

import json

import numpy as np


class GrammarError(ValueError):
    """A grammar (schema, regex, Lark text) that cannot be compiled; the message says why."""


class _ByteVocabulary:
    """The demo's byte tokenizer as llguidance's `TokenizerWrapper` takes one: ids 0-255 are
    bytes, the rest special."""

    def __init__(self, tokenizer, vocab_size: int):
        specials = {tokenizer.bos_token_id: b"<s>", tokenizer.eos_token_id: b"</s>"}
        self.tokens = [bytes([i]) if i < 256 else specials.get(i, b"<unused%d>" % i) for i in range(vocab_size)]
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.special_token_ids = list(range(256, vocab_size))
        self.is_tokenizer_wrapper = True

    def __call__(self, s) -> list[int]:
        return list(s.encode("utf-8") if isinstance(s, str) else s)


class Grammars:
    """Compiles grammars for one model's tokenizer (`vocab_size`: the model's vocabulary, which
    may have more rows than the tokenizer has tokens: those are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import llguidance

        self._ll = llguidance
        eos = list(eos_token_ids) or None
        if hasattr(tokenizer, "_tok"):  # a `tokenizers` tokenizer (Hugging Face, GGUF): its JSON
            self.tokenizer = llguidance.LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab_size, eos_token=eos)
        else:
            self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size)), n_vocab=vocab_size,
                                                    eos_token=eos)  # fmt: skip

    # Grammar texts ---------------------------------------------------------------------------------
    def json_schema(self, schema: dict | bool) -> str:
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object")
        try:
            return self._ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema cannot be used: {e}") from e

    def json_object(self) -> str:
        return self.json_schema({"type": "object"})

    def regex(self, pattern: str) -> str:
        return self._ll.LLMatcher.grammar_from_regex(pattern)

    def lark(self, text: str) -> str:
        return self._ll.LLMatcher.grammar_from_lark(text)

    def choice(self, values) -> str:
        """One of the strings `values`, each taken literally."""
        if isinstance(values, str) or not values or not all(isinstance(v, str) and v for v in values):
            raise GrammarError("a choice needs one or more non-empty strings")
        return self.lark("start: " + " | ".join(json.dumps(v) for v in values))

    def gbnf(self, text: str) -> str:
        """A llama.cpp GBNF grammar."""
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return self.lark(gbnf_to_lark(text))
        except Exception as e:  # noqa: BLE001 - the converter's errors are the grammar's
            raise GrammarError(f"the GBNF grammar cannot be read: {e}") from e

    # Matchers --------------------------------------------------------------------------------------
    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher of `grammar` (one of the texts above), or `GrammarError`."""
        ok, msgs = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if ok:  # (is_error, messages)
            raise GrammarError(f"the grammar cannot be compiled: {msgs[0] if msgs else 'unknown error'}")
        m = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {m.get_error()}")
        return Constraint(m)


_executor = None


def fill_masks(mask: np.ndarray, rows: list[tuple[Constraint, int]]) -> None:
    """Fills `mask[row]` from each (constraint, row), the rows in parallel on llguidance's
    thread pool."""
    global _executor
    if len(rows) == 1:
        rows[0][0].fill(mask, rows[0][1])
        return
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(c.m, row) for c, row in rows], mask.ctypes.data, mask.shape[1] * 4, mask.shape[0])


class Constraint:
    """One request's place in its grammar."""

    def __init__(self, matcher):
        self.m = matcher

    def fork(self) -> Constraint:
        """An independent copy at the same place (another choice of the same request)."""
        return Constraint(self.m.deep_copy())

    def fill(self, mask: np.ndarray, row: int) -> None:
        """Writes the tokens allowed next into `mask[row]` (int32 words, bit j of word w: token 32 w + j)."""
        v = mask[row]
        self.m.unsafe_compute_mask_ptr(v.ctypes.data, v.size * v.itemsize)

    def accept(self, token: int) -> bool:
        """Advances past `token`; False if the grammar does not allow it."""
        return bool(self.m.consume_token(token)) and not self.m.is_error()

    def finished(self) -> bool:
        """Nothing more may follow."""
        return self.m.is_stopped()

    def error(self) -> str:
        return self.m.get_error() or "token not allowed"
