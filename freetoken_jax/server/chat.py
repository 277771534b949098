"""Chat requests of both APIs as the model's template takes them, and replies read back out of
the generated text.

`openai_messages` / `anthropic_messages` turn a request's messages (tool calls, tool results,
Anthropic's content blocks) into the Hugging Face form chat templates expect; `Tools` holds a
request's tools and `tool_choice` (which calls are parsed, which forced by a grammar); `Reply`
splits the text as it streams into reasoning, content, tool calls and their argument deltas.
"""

from __future__ import annotations

import dataclasses
import json

from freetoken_jax.server.harmony import HarmonyStream
from freetoken_jax.server.service import ApiError
from freetoken_jax.server.tools import ThinkStream, ToolCall, ToolFormat, ToolStream, template_takes_tools

ROLES = ("system", "developer", "user", "assistant", "tool")


def content_text(content, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A message's content: a string, or a list of parts whose `type` is one of `kinds`, joined
    (a "refusal" part's text is its `refusal`). Else a 400 naming the part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content must be a string or a list of text parts", param=where)
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in kinds:
            raise ApiError(400, f"{where}.{j}: content parts of type {kind!r} are not supported (text only)", param=f"{where}.{j}")
        text = p.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise ApiError(400, f"{where}.{j}: a {kind} part needs its text", param=f"{where}.{j}")
        out.append(text)
    return "".join(out)


def call_arguments(args, where: str):
    """Tool-call arguments as templates take them: an object (OpenAI sends JSON text)."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise ApiError(400, f"{where}: arguments are not valid JSON: {e}", param=where) from e
    if isinstance(args, dict):
        return args
    raise ApiError(400, f"{where}: arguments must be a JSON object or its text", param=where)


def openai_messages(messages) -> list[dict]:
    out = []
    for k, m in enumerate(messages):
        where = f"messages.{k}"
        if m.role not in ROLES:
            raise ApiError(400, f"{where}.role: {m.role!r} is not one of {', '.join(ROLES)}", param=f"{where}.role")
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content_text(m.content or "", f"{where}.content")}
        extra = m.model_extra or {}
        if m.role == "assistant" and extra.get("tool_calls"):
            calls = extra["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
                raise ApiError(
                    400, f"{where}.tool_calls: a list of {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where
                )
            msg["tool_calls"] = [
                {"id": c.get("id"), "type": "function",
                 "function": {"name": c["function"].get("name"), "arguments": call_arguments(c["function"].get("arguments", {}), f"{where}.tool_calls.{i}")}}
                for i, c in enumerate(calls)
            ]  # fmt: skip
        if m.role == "tool":
            if not isinstance(extra.get("tool_call_id"), str):
                raise ApiError(400, f"{where}: a tool message needs 'tool_call_id'", param=f"{where}.tool_call_id")
            msg["tool_call_id"] = extra["tool_call_id"]
        for key in ("name", "reasoning_content"):
            if isinstance(extra.get(key), str):
                msg[key] = extra[key]
        if "reasoning_content" in msg:
            msg["thinking"] = msg["reasoning_content"]  # the field gpt-oss's template reads
        out.append(msg)
    return out


def anthropic_messages(messages, system: str | None) -> list[dict]:
    """Anthropic turns as template messages: `tool_use` blocks become the assistant's tool calls,
    `tool_result` blocks tool messages, `thinking` blocks its reasoning."""
    out = [] if system is None else [{"role": "system", "content": system}]
    for k, m in enumerate(messages):
        where = f"messages.{k}.content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        text, calls, reasoning = [], [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(
                    {
                        "id": b.get("id"),
                        "type": "function",
                        "function": {"name": b.get("name"), "arguments": call_arguments(b.get("input", {}), f"{where}.{j}")},
                    }
                )
            elif kind == "tool_result" and m.role == "user":
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                content = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": content_text(content, f"{where}.{j}.content")})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                reasoning.append(b.get("thinking", ""))
            else:
                raise ApiError(400, f"{where}.{j}: a {kind!r} block is not supported in a {m.role} message", param=where)
        if text or calls or not out or out[-1]["role"] != "tool":
            msg = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = msg["thinking"] = "".join(reasoning)
            out.append(msg)
    return out


def render_messages(template: str, messages: list[dict], tools: Tools | None, **extra) -> str:
    """The prompt text: the template rendered with the messages and (if it takes them) the tools;
    a template that does not is given the tools in a system message in the tool format's words."""
    from freetoken_jax.server.text import render_chat

    if tools is not None and tools.render:
        if template_takes_tools(template):
            extra["tools"] = tools.tools
        else:
            note = tools.fmt.system_prompt(tools.tools)
            if messages and messages[0]["role"] == "system":
                messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + note}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": note}, *messages]
    try:
        return render_chat(template, messages, **extra)
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        raise ApiError(400, f"the chat template rejected the messages: {type(e).__name__}: {e}") from e


def template_kwargs(text: str | None, param: str) -> dict | None:
    """Template variables given as the text of a JSON object (gRPC's `template_kwargs_json`, the
    CLI's `--template-kwargs`); None for none. Errors name `param`."""
    if not text:
        return None
    try:
        kwargs = json.loads(text)
    except ValueError as e:
        raise ApiError(400, f"{param} is not valid JSON: {e}", param=param) from e
    if not isinstance(kwargs, dict):
        raise ApiError(400, f"{param} must be a JSON object", param=param)
    return kwargs


def template_vars(effort: str | None = None, kwargs: dict | None = None, param: str = "chat_template_kwargs") -> dict:
    """The variables a request gives the chat template besides its messages and tools: its
    reasoning effort as `reasoning_effort` (gpt-oss's template writes it into its system message)
    and vLLM's `chat_template_kwargs` (Qwen3's template reads `enable_thinking`). A template that
    does not read one renders as without it."""
    out = dict(kwargs or {})
    taken = sorted({"messages", "tools", "add_generation_prompt"} & out.keys())
    if taken:
        raise ApiError(400, f"{param} cannot set {', '.join(taken)}", param=param)
    if effort is not None:
        out["reasoning_effort"] = effort
    return out


@dataclasses.dataclass
class Tools:
    """A request's tools (OpenAI's form) and what `tool_choice` asks: `render` them into the
    prompt, `parse` calls out of the reply, `forced` (None, or the tools one of which must be
    called, through a grammar), `many` calls allowed."""

    tools: list[dict]
    fmt: ToolFormat
    render: bool = True
    parse: bool = True
    forced: list[dict] | None = None
    many: bool = True

    @classmethod
    def of(cls, tools, choice, parallel, fmt: ToolFormat, param: str = "tool_choice") -> Tools | None:
        """From OpenAI fields (`tools` a list of {"type": "function", "function": {...}}; `choice`
        "none" / "auto" / "required" / {"type": "function", "function": {"name"}})."""
        if not tools:
            if choice not in (None, "none", "auto"):
                raise ApiError(400, f"'{param}' {json.dumps(choice)} needs 'tools'", param=param)
            return None
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) < len(names):
            raise ApiError(400, "tool names must be unique", param="tools")
        t = cls(tools, fmt, many=parallel is not False)
        if choice == "none":
            t.render = t.parse = False
        elif choice == "required":
            t.forced = tools
        elif isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if name not in names:
                raise ApiError(400, f"'{param}' names a tool that is not in 'tools': {name!r}", param=param)
            t.forced, t.many = [tools[names.index(name)]], False
        elif choice not in (None, "auto"):
            raise ApiError(400, f"'{param}' must be 'none', 'auto', 'required' or a named function", param=param)
        return t

    @staticmethod
    def from_anthropic(tools, choice, fmt: ToolFormat) -> Tools | None:
        oa_tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                      "parameters": t.get("input_schema") or {"type": "object"}}} for t in tools or []]  # fmt: skip
        kind = (choice or {}).get("type", "auto")
        parallel = not (choice or {}).get("disable_parallel_tool_use", False)
        oa_choice = {"auto": "auto", "none": "none", "any": "required"}.get(kind)
        if kind == "tool":
            oa_choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif oa_choice is None:
            raise ApiError(400, "tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice")
        return Tools.of(oa_tools, oa_choice, parallel, fmt)


class Reply:
    """Text deltas of one reply in, events out: ("reasoning", text), ("content", text), ("call",
    index, ToolCall), ("arguments", index, text); `finish()` adds the last events and sets
    `content`, `reasoning` and `calls`."""

    def __init__(self, tools: Tools | None, reasoning: bool, reasoning_open: bool = False, harmony: bool = False):
        """`harmony`: the reply is gpt-oss's messages (`harmony.HarmonyStream`), its text
        decoded with special tokens."""
        parse = tools is not None and tools.parse
        self.harmony = HarmonyStream(calls=parse) if harmony else None
        self.think = ThinkStream(reasoning_open) if reasoning and not harmony else None
        self.tools = ToolStream(tools.fmt) if parse and not harmony else None
        self.reasoning, self.content, self.calls = "", "", []

    def _answer(self, text: str) -> list[tuple]:
        if not text:
            return []
        return self.tools.push(text) if self.tools is not None else [("content", text)]

    def push(self, delta: str) -> list[tuple]:
        if self.harmony is not None:
            return self._record(self.harmony.push(delta))
        if self.think is None:
            return self._record(self._answer(delta))
        r, a = self.think.push(delta)
        return self._record(([("reasoning", r)] if r else []) + self._answer(a))

    def finish(self) -> list[tuple]:
        if self.harmony is not None:
            self.calls = self.harmony.calls
            return self._record(self.harmony.finish())
        ev = []
        if self.think is not None:
            r, a = self.think.flush()
            ev += ([("reasoning", r)] if r else []) + self._answer(a)
        ev = self._record(ev)
        if self.tools is not None:
            last, _, calls = self.tools.finish()
            self._record(last)
            ev += last
            self.calls = calls
        return ev

    def _record(self, ev: list[tuple]) -> list[tuple]:
        for e in ev:
            if e[0] == "reasoning":
                self.reasoning += e[1]
            elif e[0] == "content":
                self.content += e[1]
        return ev


__all__ = ["Reply", "ToolCall", "Tools", "anthropic_messages", "openai_messages", "render_messages", "template_kwargs", "template_vars"]
