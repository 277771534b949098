"""Fill in the middle: the completions API's `suffix` written as the model was trained to read
it. A code model marks the text before and after the gap with special tokens of its own, and
writes the middle after them; which ones, and in which order, is found in its vocabulary:

    qwen       <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>      Qwen2.5-Coder, Qwen3-Coder
    starcoder  <fim_prefix>P<fim_suffix>S<fim_middle>           StarCoder, and models that took its tokens
    deepseek   <｜fim▁begin｜>P<｜fim▁hole｜>S<｜fim▁end｜>       DeepSeek-Coder (V2 is a DeepSeek-V2 MoE)
    mistral    [SUFFIX]S[PREFIX]P                               Codestral (suffix first)

P and S are encoded apart (no BOS; the prompt's BOS, where the tokenizer adds one, goes first),
as llama.cpp's infill does. The middle ends at the end-of-sequence token; the format's own
markers (and Qwen's `<|fim_pad|>`, `<|file_sep|>`, `<|repo_name|>`) stop it too: none belongs in
a middle."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FimFormat:
    name: str
    prefix: str
    suffix: str
    middle: str | None  # None: the prefix comes last (suffix first), and the middle follows it
    extra_stops: tuple[str, ...] = ()

    def ids(self, tokenizer, prefix: str, suffix: str) -> list[int]:
        """The prompt's ids: the tokenizer's BOS where it adds one, then the marked parts."""
        bos = tokenizer.prompt_start()
        tid = tokenizer.token_id
        p, s = tokenizer.encode(prefix, add_bos=False), tokenizer.encode(suffix, add_bos=False)
        if self.middle is None:
            return bos + [tid(self.suffix), *s, tid(self.prefix), *p]
        return bos + [tid(self.prefix), *p, tid(self.suffix), *s, tid(self.middle)]

    def stops(self, tokenizer) -> tuple[int, ...]:
        """The ids that end a middle besides the end-of-sequence token."""
        names = (self.prefix, self.suffix, self.middle, *self.extra_stops)
        return tuple(i for i in (tokenizer.token_id(n) for n in names if n) if i is not None)


FORMATS = (
    FimFormat("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>")),
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<fim_pad>", "<file_sep>")),
    FimFormat("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimFormat("mistral", "[PREFIX]", "[SUFFIX]", None),
)


def detect(tokenizer) -> FimFormat | None:
    """The first format whose markers are all single tokens of `tokenizer`'s vocabulary, or None."""
    if tokenizer is None:
        return None
    for f in FORMATS:
        if all(tokenizer.token_id(t) is not None for t in (f.prefix, f.suffix, f.middle) if t):
            return f
    return None
