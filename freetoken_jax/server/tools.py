"""Tool calls: the formats model families write them in, read back from generated text (whole or
as it streams), the grammars that force them (`tool_choice` "required" or a named tool), and the
reasoning text some models write before their answer.

A `ToolFormat` knows its markers, how to parse a finished section of calls, how far a section
still being written can be read (`partial`: a call's name as soon as it is complete, its
arguments as far as they are certain), and a Lark grammar that admits only well-formed calls to
the given tools (gpt-oss's harmony, where calls are messages among others, is read by
`harmony.HarmonyStream` instead). `FORMATS` is the registry (`serve --tool-parser`); `detect` picks one from the
chat template. `ToolStream` turns a response's text deltas into content, call starts and
argument deltas; `ThinkStream` splits `<think>…</think>` reasoning from the answer.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = dataclasses.field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclasses.dataclass
class PartialCall:
    name: str | None  # None until the name is complete
    arguments: str  # the part of the arguments' JSON text that can no longer change
    done: bool
    end: int | None = None  # a complete call's: where its text ends in the section read (a stream reads on from there)


_WS = re.compile(r"\s*")


def _json_value(text: str, start: int) -> tuple[object, int] | None:
    """The JSON value at `text[start:]` (after whitespace) and where it ends, or None."""
    m = _WS.match(text, start)
    try:
        return json.JSONDecoder().raw_decode(text, m.end())
    except ValueError:
        return None


# JSON inside tool-call grammars is written as json.dumps writes it (what models saw in training),
# without the free whitespace a grammar would otherwise allow.
_JSON_STYLE = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def _schema(s: dict | None) -> dict:
    return {**(s or {"type": "object"}), **_JSON_STYLE}


def _call_schema(tools: list[dict]) -> dict:
    """A JSON schema of one call object {"name": ..., "arguments": {...}} to any of `tools`."""
    return {**_JSON_STYLE, "anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                        "arguments": t["function"].get("parameters") or {"type": "object"}},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}  # fmt: skip


def _lit(text: str, token_id) -> str:
    """A marker in a Lark grammar: its token (`<[id]>`) where it is one, else its text."""
    t = token_id(text)
    return f"<[{t}]>" if t is not None else json.dumps(text)


class ToolFormat:
    """One family's way of writing tool calls (subclasses)."""

    name = ""
    start = ""  # the text that opens the section of calls
    # Text whose arrival may complete a call: a stream reads the section again only then, for a
    # format whose `partial` reads nothing before a call is complete (reading a long call's section
    # at every delta made its stream quadratic: 100 s for a 70 KB call of DeepSeek's form).
    closes: tuple[str, ...] = ()
    streams_arguments = False  # `partial` reads a call's arguments as they are written: read at every delta

    def parse(self, section: str) -> list[ToolCall]:
        """The calls of a finished section (text from `start` on); `ValueError` if malformed."""
        raise NotImplementedError

    def partial(self, section: str, memo: dict | None = None) -> list[PartialCall]:
        """What can be read of a section still being written: by default each call only once
        the whole section parses. `memo`: the format's own notes on this section between reads
        (a stream passes the same dict while the text it reads only grows)."""
        try:
            return [PartialCall(c.name, c.arguments, True) for c in self.parse(section)]
        except ValueError:
            return []

    def write(self, calls: list[ToolCall]) -> str:
        """`calls` as a section the model writes (what `parse` reads back)."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], many: bool, token_id=lambda text: None) -> str:
        """A Lark grammar of one call (or, with `many`, one or more) to `tools`; `token_id`:
        the id of a marker that is one (special) token of the vocabulary, else None."""
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        """How tools are described to a model whose chat template does not take them."""
        lines = "\n".join(json.dumps(t) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


class Hermes(ToolFormat):
    """Qwen2.5/Qwen3, Hermes and many others: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    streams_arguments = True

    def parse(self, section: str) -> list[ToolCall]:
        """What `partial` reads, every call complete and nothing after the last."""
        calls = self.partial(section)
        if not calls or not all(c.done for c in calls) or section[calls[-1].end :].strip():
            raise ValueError("unfinished or malformed tool call")
        return [ToolCall(c.name, c.arguments) for c in calls]

    def _call(self, body: str) -> PartialCall | None:
        """A complete call's name and its arguments' JSON text as written; None if malformed."""
        v = _json_value(body, 0)
        if v is None or not isinstance(v[0], dict) or not isinstance(v[0].get("name"), str):
            return None
        args = _ARGS.search(body)
        a = _json_value(body, args.end()) if args else None
        text = body[_WS.match(body, args.end()).end() : a[1]] if a is not None else json.dumps(v[0].get("arguments", {}))
        return PartialCall(v[0]["name"], text, True)

    def partial(self, section: str, memo: dict | None = None) -> list[PartialCall]:
        """Each call's object is scanned as JSON, a marker inside a string being text; `memo`
        keeps each object's scan, so that a stream scans each character once."""
        memo = {} if memo is None else memo
        out, at = [], 0
        while (k := section.find(self.start, at)) >= 0:
            j = _WS.match(section, k + len(self.start)).end()
            if j == len(section):
                out.append(PartialCall(None, "", False))
                break
            if section[j] != "{":
                return out  # malformed: stop here
            e = _object_end(section, j, memo)
            if e is None:  # still being written: its name once complete, then its arguments less what may close the object
                body = section[j:]
                name, args = _NAME.search(body), _ARGS.search(body)
                if name is None:
                    out.append(PartialCall(None, "", False))
                    break
                text = _rstrip_close(body[_WS.match(body, args.end()).end() :]) if args and name.start() < args.start() else ""
                out.append(PartialCall(json.loads(f'"{name.group(1)}"'), text, False))
                break
            call = self._call(section[j:e])
            if call is None:
                return out
            m = _WS.match(section, e).end()
            if section.startswith(self.end, m):
                call.end = at = m + len(self.end)
                out.append(call)
                continue
            if self.end.startswith(section[m:]):  # its end marker is still to come
                out.append(PartialCall(call.name, call.arguments, False))
                break
            return out  # something else after the object: malformed
        return out

    def write(self, calls: list[ToolCall]) -> str:
        return "".join(f'{self.start}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{self.end}\n' for c in calls)

    def grammar(self, tools: list[dict], many: bool, token_id=lambda text: None) -> str:
        more = ' ("\\n" call)*' if many else ""
        return f'start: call{more}\ncall: {_lit(self.start, token_id)} "\\n" body "\\n" {_lit(self.end, token_id)}\nbody: %json {json.dumps(_call_schema(tools))}\n'


class Mistral(ToolFormat):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or (newer) `[TOOL_CALLS]name[ARGS]{...}` per call."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    closes = ("]", "}")

    def parse(self, section: str) -> list[ToolCall]:
        calls, at = [], 0
        while (k := section.find(self.start, at)) >= 0:  # the JSON is read as JSON: a marker inside a string is text
            i = _WS.match(section, k + len(self.start)).end()
            if section.startswith("[", i):
                v = _json_value(section, i)
                if v is None or not isinstance(v[0], list):
                    raise ValueError("malformed [TOOL_CALLS] list")
                calls += [ToolCall(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)) for c in v[0]]
            else:
                j = section.find("[ARGS]", i)
                v = _json_value(section, j + len("[ARGS]")) if j >= 0 else None
                if v is None:
                    raise ValueError("malformed [TOOL_CALLS] call")
                calls.append(ToolCall(section[i:j].strip(), section[_WS.match(section, j + len("[ARGS]")).end() : v[1]]))
            at = v[1]
        if not calls:
            raise ValueError("no tool call")
        return calls

    def write(self, calls: list[ToolCall]) -> str:
        return self.start + "[" + ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls) + "]"

    def grammar(self, tools: list[dict], many: bool, token_id=lambda text: None) -> str:
        item = json.dumps(_call_schema(tools))
        return f"start: {_lit(self.start, token_id)} body\nbody: %json {json.dumps({'type': 'array', 'items': json.loads(item), 'minItems': 1, **({} if many else {'maxItems': 1})})}\n"


class DeepSeekV3(ToolFormat):
    """DeepSeek-V3/R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`
    (V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`)."""

    name = "deepseek_v3"
    start = "<｜tool▁calls▁begin｜>"
    closes = ("<｜tool▁call▁end｜>",)
    _call = re.compile(
        r"<｜tool▁call▁begin｜>(?:function)?(?:<｜tool▁sep｜>)?\s*([^\n<]*?)\s*(?:<｜tool▁sep｜>|\n```json\n)(.*?)(?:\n```)?<｜tool▁call▁end｜>",
        re.S,
    )

    def parse(self, section: str) -> list[ToolCall]:
        calls = [ToolCall(m.group(1).strip(), m.group(2).strip()) for m in self._call.finditer(section)]
        if not calls:
            raise ValueError("no tool call")
        for c in calls:
            json.loads(c.arguments)
        return calls

    def write(self, calls: list[ToolCall]) -> str:
        one = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
        return self.start + "".join(one.format(c.name, c.arguments) for c in calls) + "<｜tool▁calls▁end｜>"

    def grammar(self, tools: list[dict], many: bool, token_id=lambda text: None) -> str:
        lit = lambda t: _lit(t, token_id)  # noqa: E731
        fns = [
            f'{json.dumps(t["function"]["name"])} "\\n```json\\n" %json {json.dumps(_schema(t["function"].get("parameters")))}'
            for t in tools
        ]
        call = f'call: {lit("<｜tool▁call▁begin｜>")} "function" {lit("<｜tool▁sep｜>")} fn "\\n```" {lit("<｜tool▁call▁end｜>")}'
        more = " call*" if many else ""
        return f"start: {lit(self.start)} call{more} {lit('<｜tool▁calls▁end｜>')}\n{call}\nfn: {' | '.join(fns)}\n"


class Glm45(ToolFormat):
    """GLM-4.5/4.6: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n…</tool_call>`,
    each value JSON where it parses as JSON (numbers, booleans, objects), else the string as written."""

    name = "glm45"
    start = "<tool_call>"
    closes = ("</tool_call>",)
    marker = "<arg_key>"  # what tells its templates from Hermes' (the same <tool_call>)
    _name = re.compile(r"\s*([^\n<]+?)\s*(?:\n|(?=<arg_key>|</tool_call>))")
    _key = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)
    _close = re.compile(r"\s*</tool_call>")

    def parse(self, section: str) -> list[ToolCall]:
        """Pair by pair: a value runs to its `</arg_value>`, so a `</tool_call>` inside one is text."""
        calls, at = [], 0
        while (k := section.find(self.start, at)) >= 0:
            m = self._name.match(section, k + len(self.start))
            if m is None:
                raise ValueError("a tool call needs a name")
            args, at = {}, m.end()
            while (p := self._key.match(section, at)) is not None:
                end = section.find("</arg_value>", p.end())
                if end < 0:
                    raise ValueError("an unfinished argument")
                v = section[p.end() : end]
                try:
                    args[p.group(1).strip()] = json.loads(v)
                except ValueError:
                    args[p.group(1).strip()] = v
                at = end + len("</arg_value>")
            close = self._close.match(section, at)
            if close is None:
                raise ValueError("an unfinished or malformed tool call")
            calls.append(ToolCall(m.group(1).strip(), json.dumps(args, ensure_ascii=False)))
            at = close.end()
        if not calls or section[at:].strip():
            raise ValueError("no tool call, or an unfinished one")
        return calls

    def write(self, calls: list[ToolCall]) -> str:
        def value(v) -> str:  # a string as written, unless it would read back as another JSON value
            if isinstance(v, str):
                try:
                    json.loads(v)
                except ValueError:
                    return v
            return json.dumps(v, ensure_ascii=False)

        pairs = lambda a: "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{value(v)}</arg_value>\n" for k, v in a.items())  # noqa: E731
        return "".join(f"{self.start}{c.name}\n{pairs(json.loads(c.arguments))}</tool_call>" for c in calls)

    def grammar(self, tools: list[dict], many: bool, token_id=lambda text: None) -> str:
        """Each tool's name, then at most one `<arg_key>`/`<arg_value>` pair per property of its
        schema (values of up to 64 characters without '<'; their types are not checked)."""
        lit = lambda t: _lit(t, token_id)  # noqa: E731
        rules = []
        for i, t in enumerate(tools):
            props = list(_schema(t["function"].get("parameters")).get("properties", {}))
            keys = " | ".join(json.dumps(k) for k in props) or '""'
            pairs = " ".join(f"pair{i}?" for _ in props)
            rules.append(f'fn{i}: {json.dumps(t["function"]["name"])} "\\n" {pairs}\n'
                         f'pair{i}: "<arg_key>" ({keys}) "</arg_key>\\n<arg_value>" /[^<]{{0,64}}/ "</arg_value>\\n"')  # fmt: skip
        fns = " | ".join(f"fn{i}" for i in range(len(tools)))
        more = ' ("\\n" call)*' if many else ""
        return f"start: call{more}\ncall: {lit(self.start)} ({fns}) {lit('</tool_call>')}\n" + "\n".join(rules) + "\n"


class Harmony(ToolFormat):
    """gpt-oss: a call is a message to `functions.NAME` on the commentary channel,
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, ended by the
    `<|call|>` stop token; one call per turn."""

    name = "harmony"
    start = "<|channel|>"  # what a harmony chat template shows (`tools.detect`)
    closes = ("<|call|>",)

    def parse(self, section: str) -> list[ToolCall]:
        from freetoken_jax.server.harmony import HarmonyStream  # which reads messages with this module's ToolCall

        s = HarmonyStream()
        s.push(section)
        s.finish()
        if not s.calls:
            raise ValueError("no tool call")
        return s.calls

    def write(self, calls: list[ToolCall]) -> str:
        (c,) = calls  # one call a turn
        return f"{self.start}commentary to=functions.{c.name} <|constrain|>json<|message|>{c.arguments}<|call|>"

    def grammar(self, tools: list[dict], many: bool, token_id=lambda text: None) -> str:
        """One call (harmony has one per turn, whatever `many` says), straight away: no analysis first."""
        lit = lambda t: _lit(t, token_id)  # noqa: E731
        fns = [
            f'fn{i}: {json.dumps(t["function"]["name"] + " ")} {lit("<|constrain|>")} "json" {lit("<|message|>")} %json {json.dumps(_schema(t["function"].get("parameters")))}'
            for i, t in enumerate(tools)
        ]
        alts = " | ".join(f"fn{i}" for i in range(len(tools)))
        return f'start: {lit("<|channel|>")} "commentary to=functions." ({alts})\n' + "\n".join(fns) + "\n"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Mistral(), DeepSeekV3(), Glm45(), Harmony())}
FORMATS["qwen"] = FORMATS["hermes"]


def detect(template: str | None) -> ToolFormat:
    """The format a chat template writes tool calls in (Hermes when it shows none)."""
    if template and Harmony.start in template:
        return FORMATS["harmony"]
    if template and Glm45.marker in template:
        return FORMATS["glm45"]
    for f in (FORMATS["deepseek_v3"], FORMATS["mistral"], FORMATS["hermes"]):
        if template and f.start in template:
            return f
    return FORMATS["hermes"]


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


class ToolStream:
    """A response's text deltas in, events out: ("content", text), ("call", index, ToolCall with
    its name and id; arguments ""), ("arguments", index, text). Content that might be the start
    of the calls section is held back until it is known not to be."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.content_end, self.text = fmt, 0, ""
        self.section: int | None = None  # where the calls section starts in `text`
        self.calls: list[ToolCall] = []
        self.sent_args: list[str] = []
        self.looked = 0  # how far `text` was looked at for the format's `closes`
        self.read_from = self.calls_before = 0  # the section is read from here on, after this many calls
        self.memo: dict = {}  # the format's notes on the section read from `read_from`

    def _may_have_closed(self) -> bool:
        """Whether the section may hold a call that was not complete when last read: always for
        a format that streams arguments or names no `closes`, else when one of them arrived since."""
        if self.fmt.streams_arguments or not self.fmt.closes:
            return True
        back = max(map(len, self.fmt.closes), default=1) - 1
        new = self.text[max(self.section, self.looked - back) :]
        self.looked = len(self.text)
        return any(c in new for c in self.fmt.closes)

    def push(self, delta: str) -> list[tuple]:
        self.text += delta
        ev = []
        if self.section is None:
            k = self.text.find(self.fmt.start, self.content_end)
            if k >= 0:
                self.section = k
                if k > self.content_end:
                    ev.append(("content", self.text[self.content_end : k]))
                self.content_end = k
            else:
                hold = _held(self.text, self.fmt.start)
                if len(self.text) - hold > self.content_end:
                    ev.append(("content", self.text[self.content_end : len(self.text) - hold]))
                    self.content_end = len(self.text) - hold
                return ev
        if not self._may_have_closed():
            return ev
        start = self.section + self.read_from
        parts = self.fmt.partial(self.text[start:], self.memo)
        for j, p in enumerate(parts):
            if p.name is None:
                break
            i = self.calls_before + j
            if i == len(self.calls):
                self.calls.append(ToolCall(p.name, ""))
                self.sent_args.append("")
                ev.append(("call", i, self.calls[i]))
            if p.arguments.startswith(self.sent_args[i]) and len(p.arguments) > len(self.sent_args[i]):
                ev.append(("arguments", i, p.arguments[len(self.sent_args[i]) :]))
                self.sent_args[i] = p.arguments
        done = next((j for j, p in enumerate(parts) if not p.done), len(parts))
        if done and parts[done - 1].end:  # the complete calls are not read again
            self.read_from, self.calls_before, self.memo = self.read_from + parts[done - 1].end, self.calls_before + done, {}
        return ev

    def finish(self) -> tuple[list[tuple], str, list[ToolCall]]:
        """The last events, the whole content and the calls. A section that does not parse is
        content after all (as if no call was made), sent now if none of its calls was."""
        ev = []
        if self.section is None:
            if len(self.text) > self.content_end:
                ev.append(("content", self.text[self.content_end :]))
            return ev, self.text, []
        try:
            calls = self.fmt.parse(self.text[self.section :])
        except (ValueError, KeyError, TypeError):
            calls = None
        if calls is None or len(calls) < len(self.calls):
            if not self.calls:
                ev.append(("content", self.text[self.content_end :]))
                return ev, self.text, []
            calls = self.calls  # what was streamed stands
        for i, c in enumerate(calls):
            if i == len(self.calls):
                self.calls.append(ToolCall(c.name, "", c.id))
                self.sent_args.append("")
                ev.append(("call", i, self.calls[i]))
            if c.arguments.startswith(self.sent_args[i]) and len(c.arguments) > len(self.sent_args[i]):
                ev.append(("arguments", i, c.arguments[len(self.sent_args[i]) :]))
            self.calls[i].arguments = c.arguments if c.arguments.startswith(self.sent_args[i]) else self.sent_args[i]
        return ev, self.text[: self.section], self.calls


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"arguments"\s*:')
_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]]')


def _object_end(text: str, j: int, memo: dict) -> int | None:
    """Where the JSON object opening at `text[j]` ends (after its brace), or None while it is
    unfinished. Scans on from where `memo[j]` left off: (position, depth, inside a string)."""
    got = memo.get(j, (j, 0, False))
    if isinstance(got, int):
        return got
    i, depth, inside = got
    while True:
        m = (_IN_STRING if inside else _OUTSIDE).search(text, i)
        if m is None:
            memo[j] = (len(text), depth, inside)
            return None
        c = m.group()
        if c == "\\":
            if m.end() == len(text):  # the escaped character is still to come
                memo[j] = (m.start(), depth, inside)
                return None
            i = m.end() + 1
            continue
        i = m.end()
        if c == '"':
            inside = not inside
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                memo[j] = i
                return i


def _rstrip_close(text: str) -> str:
    """`text` without the whitespace and closing braces at its end (what may close the call's
    object rather than its arguments), looking at its end only."""
    n = len(text)
    while n and (text[n - 1].isspace() or text[n - 1] == "}"):
        n -= 1
    return text[:n]


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


class ThinkStream:
    """Splits `<think>…</think>` reasoning from the answer as text streams in: `push` returns
    (reasoning delta, answer delta). Reasoning is a section at the start of the output, or from
    the start when the prompt opened it (`inside`)."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, inside: bool = False):
        self.state, self.buf = "reasoning" if inside else "start", ""

    def push(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = answer = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(self.OPEN):
                self.state, self.buf = "reasoning", head[len(self.OPEN) :]
            elif self.OPEN.startswith(head):
                return "", ""  # whitespace or a part of <think> so far
            else:
                self.state = "answer"
        if self.state == "reasoning":
            k = self.buf.find(self.CLOSE)
            if k < 0:
                n = len(self.buf) - _held(self.buf, self.CLOSE)
                reasoning, self.buf = self.buf[:n], self.buf[n:]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:k], self.buf[k + len(self.CLOSE) :], "after"
        if self.state == "after":  # the newlines between the reasoning and the answer are neither
            self.buf = self.buf.lstrip("\n")
            if self.buf:
                self.state = "answer"
        if self.state == "answer":
            answer, self.buf = self.buf, ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        out, self.buf = self.buf, ""
        return (out, "") if self.state == "reasoning" else ("", out.lstrip() if self.state == "start" else out)
