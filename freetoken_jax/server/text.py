"""Text around the token stream: chat templates, incremental detokenization and stop strings."""

from __future__ import annotations

import json
import os

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat_template(model_path: str | None) -> str:
    """The `chat_template` of the model's tokenizer_config.json, or a plain role-tagged default."""
    if model_path:
        p = os.path.join(model_path, "tokenizer_config.json")
        if os.path.isfile(p):
            with open(p) as f:
                t = json.load(f).get("chat_template")
            if isinstance(t, list):  # named templates
                t = next((x["template"] for x in t if x.get("name") == "default"), t[0]["template"] if t else None)
            if t:
                return t
    return DEFAULT_CHAT_TEMPLATE


def render_chat(template: str, messages: list[dict], **extra) -> str:
    """The template rendered as Hugging Face renders chat templates: its sandbox, loop controls,
    `raise_exception`, `strftime_now`, and a `tojson` that keeps key order and non-ASCII text."""
    import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def raise_exception(msg):
        raise ValueError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **extra)


class TextStream:
    """Turns generated token ids into text deltas, holding back what might still become a stop
    string or an incomplete UTF-8 character. `push` returns (delta, stopped). `keep_special`:
    special tokens are text too (tool-call markers that are special tokens), but for those in
    `drop` (the request's stop tokens).

    Text is decoded incrementally, as Hugging Face's text-generation-inference does: each token
    decodes the few tokens since the last complete character (`prefix` .. the end) and keeps what
    they add to the text of `prefix` .. `read` — a token costs the same at the end of a long reply
    as at its start (decoding every token so far each time cost 3.5 ms a token by 30 000 tokens),
    and both decodes start at the same token, so a tokenizer that drops a leading space at the
    start of what it decodes does so in both."""

    def __init__(self, tokenizer, stops: list[str], keep_special: bool = False, drop: frozenset = frozenset()):
        self.tok, self.stops = tokenizer, [s for s in stops if s]
        self.skip_special, self.drop = not keep_special, drop
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decode to the end of `text`; ids[read:] to nothing whole yet
        self.text = ""  # the text of ids[:read]
        self.sent = 0
        self.stop_string: str | None = None

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def _advance(self, last: bool = False) -> None:
        """Adds to `text` what the ids since `read` complete (with `last`, whatever they decode to)."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and (last or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)

    def push(self, token: int) -> tuple[str, bool]:
        if token in self.drop:
            return "", False
        self.ids.append(token)
        self._advance()
        text = self.text
        for s in self.stops:
            k = text.find(s, max(0, self.sent - len(s)))
            if k >= 0:
                self.stop_string = s
                delta = text[self.sent : k] if k > self.sent else ""
                self.sent = max(self.sent, k)
                return delta, True
        hold = len(text)
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = min(hold, len(text) - n)
                    break
        delta = text[self.sent : hold] if hold > self.sent else ""
        self.sent = max(self.sent, hold)
        return delta, False

    def flush(self) -> str:
        if self.stop_string is not None:
            return ""
        self._advance(last=True)
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta
