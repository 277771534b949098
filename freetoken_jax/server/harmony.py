"""gpt-oss's harmony format, read as it streams: messages `<|start|>{header}<|message|>{content}`
ending in `<|end|>` (or the stop tokens `<|return|>` / `<|call|>`). The header names the channel
(`<|channel|>analysis`, `final`, `commentary`) and, for a tool call, its recipient
(`to=functions.NAME`, in the role or the channel part) and content type (`<|constrain|>json`).

`HarmonyStream` turns the generated text (special tokens kept) into the events of
`chat.Reply`: analysis and calls to built-in tools (browser, python) are reasoning, final and
commentary without a recipient (preambles) are content, and messages to `functions.NAME` are
tool calls whose arguments stream as they are written. The prompt side is the model's own chat
template, which renders harmony (its `thinking` field carries earlier reasoning back).
"""

from __future__ import annotations

import re

from freetoken_jax.server.tools import ToolCall, _held

START, CHANNEL, MESSAGE, END, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
STOPS = ("<|return|>", "<|call|>")  # stop tokens: usually dropped from the text before it gets here
_ENDS = (END, *STOPS, START)
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyStream:
    """Text deltas of one harmony reply in, `chat.Reply` events out (module docstring).
    `calls`: messages to functions are tool calls (else their text is content)."""

    def __init__(self, calls: bool = True):
        self.parse_calls, self.buf, self.state, self.kind = calls, "", "header", "content"
        self.calls: list[ToolCall] = []

    def push(self, delta: str) -> list[tuple]:
        self.buf += delta
        ev: list[tuple] = []
        while True:
            if self.state == "between":  # after a message: the next one's <|start|>, or stray text
                self.buf = self.buf.lstrip()
                if self.buf.startswith(START):
                    self.buf, self.state = self.buf[len(START) :], "header"
                elif not self.buf or START.startswith(self.buf):
                    return ev
                else:
                    self.state, self.kind = "content", "content"
            if self.state == "header":
                k = self.buf.find(MESSAGE)
                if k < 0:
                    return ev
                ev += self._open(self.buf[:k])
                self.buf, self.state = self.buf[k + len(MESSAGE) :], "content"
            ends = [(k, m) for m in _ENDS if (k := self.buf.find(m)) >= 0]
            if not ends:
                n = len(self.buf) - max(_held(self.buf, m) for m in _ENDS)
                ev += self._text(self.buf[:n])
                self.buf = self.buf[n:]
                return ev
            k, m = min(ends)
            ev += self._text(self.buf[:k])
            self.buf = self.buf[k + len(m) :]
            self.state = "header" if m == START else "between"

    def finish(self) -> list[tuple]:
        """The events of what is left: the end of the last message (a header never completed
        is content)."""
        rest, self.buf = self.buf, ""
        if self.state == "header" and rest:
            self.kind = "content"
        return self._text(rest) if self.state != "between" else []

    def _open(self, header: str) -> list[tuple]:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        channel = channel.group(1) if channel else ""
        if recipient and recipient.group(1).startswith("functions.") and self.parse_calls:
            self.kind = "call"
            self.calls.append(ToolCall(recipient.group(1)[len("functions.") :], ""))
            return [("call", len(self.calls) - 1, self.calls[-1])]
        self.kind = "reasoning" if channel == "analysis" or recipient else "content"
        return []

    def _text(self, text: str) -> list[tuple]:
        if not text:
            return []
        if self.kind == "call":
            self.calls[-1].arguments += text
            return [("arguments", len(self.calls) - 1, text)]
        return [(self.kind, text)]
