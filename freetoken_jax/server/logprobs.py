"""Log-probabilities in the shapes of the OpenAI APIs: chat's `logprobs.content` entries and the
completions API's parallel lists. A record is (token, its log-probability, [(token,
log-probability)] most likely first), as `service.Output` collects them; an echoed prompt's
first token is (token, None, None)."""

from __future__ import annotations


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer, records: list[tuple]) -> dict:
    def entry(t, lp):
        s = _piece(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(u, v) for u, v in top]} for t, lp, top in records]}


def completion_logprobs(tokenizer, records: list[tuple], offset: int = 0) -> dict:
    """`offset`: where in the choice's text the first record's token starts."""
    tokens, offsets = [], []
    for t, _, _ in records:
        offsets.append(offset)
        tokens.append(_piece(tokenizer, t))
        offset += len(tokens[-1])
    tops = []
    for _, _, top in records:  # None: a prompt's first token, which has no log-probability
        tops.append(None if top is None else {})
        for u, v in top or ():  # keyed by text: of tokens that read the same, the most likely's
            tops[-1].setdefault(_piece(tokenizer, u), v)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in records], "top_logprobs": tops, "text_offset": offsets}
