"""OpenAI's Responses API over the chat path: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`.

A request's `instructions` and `input` items (messages, `function_call`, `function_call_output`,
`reasoning`) become the chat messages the model's template renders, its function `tools` and
`tool_choice` the chat path's `Tools`, `text.format` its structured output and `reasoning.effort`
the template's `reasoning_effort`. The reply is read by the chat path's `Reply` and comes back as
output items — `reasoning` (its text whole in `content`; no summary is written), `message`
(`output_text`) and `function_call` — or, streamed, as the API's typed events, each with its
`sequence_number`. Responses are kept in memory (`store`, the last `STORED` of them) so that
`previous_response_id` continues a conversation and `GET /v1/responses/{id}` returns one.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import threading
import time
import types

from fastapi import Request
from fastapi.responses import StreamingResponse

from freetoken_jax.server import schemas as S
from freetoken_jax.server.chat import Reply, Tools, call_arguments, content_text, render_messages, template_vars
from freetoken_jax.server.http import SAMPLING_FIELDS, Generation, _dump, _grammar, cached_tokens, sse
from freetoken_jax.server.logprobs import chat_logprobs
from freetoken_jax.server.service import ApiError, Service

STORED = 256  # responses kept for previous_response_id and GET, the oldest dropped first


class ResponseStore:
    """The last `size` stored responses: each its response object and the conversation it ends
    (the input items it continued and the output items it added; not its instructions, which
    OpenAI does not carry over either)."""

    def __init__(self, size: int = STORED):
        self.size, self._lock = size, threading.Lock()
        self._kept: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()

    def put(self, response: dict, items: list[dict]) -> None:
        with self._lock:
            self._kept[response["id"]] = (response, items)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        with self._lock:
            kept = self._kept.get(rid)
        if kept is None:
            raise ApiError(404, f"no stored response {rid!r} (this server keeps the last {self.size} in memory)", "not_found_error", param)
        return kept

    def delete(self, rid: str) -> None:
        self.get(rid)
        with self._lock:
            self._kept.pop(rid, None)


# Input items -> chat messages --------------------------------------------------------------------
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _field(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise ApiError(400, f"{where}: a {item.get('type')} item needs '{key}' (a string)", param=f"{where}.{key}")
    return v


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Input items as template messages: a `function_call` joins the assistant message before it
    (or opens one), a `function_call_output` is a tool message, a `reasoning` item's text goes to
    the next assistant message as its reasoning (gpt-oss's template reads it as `thinking`)."""
    msgs = [] if instructions is None else [{"role": "system", "content": instructions}]
    reasoning = ""

    def assistant(content: str) -> dict:
        nonlocal reasoning
        msg = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = msg["thinking"] = reasoning
            reasoning = ""
        msgs.append(msg)
        return msg

    for k, it in enumerate(items):
        where = f"input.{k}"
        if not isinstance(it, dict):
            raise ApiError(400, f"{where}: an input item is an object", param=where)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role: {role!r} is not one of user, assistant, system, developer", param=f"{where}.role")
            text = content_text(it.get("content"), f"{where}.content", TEXT_PARTS)
            if role == "assistant":
                assistant(text)
            else:
                msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _field(it, "call_id", where), "type": "function",
                    "function": {"name": _field(it, "name", where), "arguments": call_arguments(it.get("arguments", ""), f"{where}.arguments")}}  # fmt: skip
            last = msgs[-1] if msgs else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = assistant("")
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = content_text(it.get("output"), f"{where}.output", kinds=("input_text", "text"))
            msgs.append({"role": "tool", "tool_call_id": _field(it, "call_id", where), "content": output})
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            reasoning += content_text(parts, f"{where}.content", kinds=("reasoning_text", "summary_text"))
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported", param=f"{where}.type")
    return msgs


def _tools(s: Service, body: S.ResponsesRequest) -> Tools | None:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.parameters or {"type": "object", "properties": {}}}} for t in body.tools or []]  # fmt: skip
    choice = body.tool_choice
    if isinstance(choice, S.ResponsesToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    return Tools.of(tools, choice, body.parallel_tool_calls, s.tool_format)


def _format(body: S.ResponsesRequest) -> S.ResponseFormat | None:
    """`text.format` as the chat path's `response_format`."""
    f = body.text.format if body.text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return S.ResponseFormat(type="json_object")
    return S.ResponseFormat(
        type="json_schema", json_schema=S.JsonSchemaFormat.model_validate(f.model_dump(by_alias=True, exclude={"type"}))
    )


# Reply events -> output items --------------------------------------------------------------------
class OutputItems:
    """The reply's events (`chat.Reply`) as output items, and the stream's events that build them:
    an item opens when the kind of text changes (reasoning, message, each function call) and
    closes when the next opens or the reply ends."""

    def __init__(self):
        self.items: list[dict] = []
        self.seq = 0
        self.records: list[tuple] = []  # log-probability records not yet sent with a text delta
        self.all_records: list[tuple] = []
        self._call = None  # the index (in the reply) of the open function call
        self.logprobs = None  # a callable: records -> the API's list, when asked for

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    @property
    def _open(self) -> dict | None:
        return self.items[-1] if self.items and self.items[-1]["status"] == "in_progress" else None

    def push(self, ev: tuple) -> list[str]:
        kind = {"reasoning": "reasoning", "content": "message"}.get(ev[0], "function_call")
        item, out = self._open, []
        if item is None or item["type"] != kind or (kind == "function_call" and ev[0] == "call"):
            out += self.close()
            out += self._start(kind, ev)
            item = self._open
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if ev[0] == "content":
            item["content"][0]["text"] += ev[1]
            lp = self._take_records()
            out.append(self.event("response.output_text.delta", **where, content_index=0, delta=ev[1], logprobs=lp))
        elif ev[0] == "reasoning":
            item["content"][0]["text"] += ev[1]
            out.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=ev[1]))
        elif ev[0] == "arguments":
            item["arguments"] += ev[2]
            out.append(self.event("response.function_call_arguments.delta", **where, delta=ev[2]))
        return out

    def add_records(self, records: list[tuple]) -> None:
        """Log-probability records of tokens generated since the last call."""
        self.records += records
        self.all_records += records

    def _take_records(self) -> list:
        recs, self.records = self.records, []
        return self.logprobs(recs) if self.logprobs else []

    def _start(self, kind: str, ev: tuple) -> list[str]:
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {
                "id": "msg_" + secrets.token_hex(12),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [part],
            }
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            item = {"id": "rs_" + secrets.token_hex(12), "type": "reasoning", "summary": [], "status": "in_progress", "content": [part]}
        else:
            c = ev[2]
            item = {"id": "fc_" + secrets.token_hex(12), "type": "function_call", "call_id": c.id, "name": c.name, "arguments": "",
                    "status": "in_progress"}  # fmt: skip
        self.items.append(item)
        where = {"output_index": len(self.items) - 1}
        out = [self.event("response.output_item.added", **where, item={**item, "content": []} if kind != "function_call" else dict(item))]
        if kind != "function_call":
            out.append(
                self.event("response.content_part.added", **where, item_id=item["id"], content_index=0, part=dict(item["content"][0]))
            )
        return out

    def close(self, status: str = "completed") -> list[str]:
        """Closes the open item (`status` "incomplete" when the reply was cut at its length)."""
        item = self._open
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] = self.logprobs(self.all_records) if self.logprobs else []
            out.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=part["logprobs"]))
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=item["content"][0]["text"]))
        else:
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]))
        if item["type"] != "function_call":
            out.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return out


# The routes --------------------------------------------------------------------------------------
def install(app, body_of, limits: S.Limits) -> None:
    """Adds the Responses routes to `app` (`body_of`: the app's body reader)."""
    s: Service = app.state.service
    store = app.state.responses = ResponseStore()

    @app.post("/v1/responses")
    async def create(request: Request):
        body = await body_of(request, S.ResponsesRequest)
        items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else list(body.input)
        if body.previous_response_id is not None:
            items = store.get(body.previous_response_id, "previous_response_id")[1] + items
        if len(items) > limits.max_messages:
            raise ApiError(400, f"at most {limits.max_messages} input items (with the previous response's)", param="input")
        tools = _tools(s, body)
        level = body.reasoning.effort if body.reasoning is not None else None
        text = render_messages(
            s.template, chat_messages(items, body.instructions), tools, **template_vars(level, body.chat_template_kwargs)
        )
        ids = s.encode(text)
        logprobs = "message.output_text.logprobs" in (body.include or ())
        if body.top_logprobs and not logprobs:
            raise ApiError(400, "'top_logprobs' needs include ['message.output_text.logprobs']", param="top_logprobs")
        max_tokens = body.max_output_tokens or max(1, s.max_context - len(ids))
        params = s.params(body.model_dump(include=SAMPLING_FIELDS), max_tokens, (body.top_logprobs or 0) if logprobs else None)
        fmt = _format(body)
        grammar = await asyncio.to_thread(
            _grammar, s, types.SimpleNamespace(response_format=fmt, **{f: getattr(body, f) for f in S.GUIDED}), tools
        )
        gen = Generation(app.state, request, ids, params, [], grammar, keep_special=(tools is not None and tools.parse) or s.harmony)
        reply = Reply(tools, s.reasoning_parser, text.rstrip().endswith("<think>"), s.harmony)
        out = OutputItems()
        if logprobs:
            out.logprobs = lambda recs: chat_logprobs(s.tokenizer, recs)["content"]
        rid, created = "resp_" + secrets.token_hex(12), time.time()

        def response(status: str, error: dict | None = None) -> dict:
            done = status in ("completed", "incomplete")
            used = (gen.out.usage or {}).get("completion_tokens", 0)
            return {
                "id": rid, "object": "response", "created_at": created, "completed_at": time.time() if done else None, "status": status,
                "model": s.model_name, "output": out.items, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
                "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": body.previous_response_id,
                "reasoning": _dump(body.reasoning) or {"effort": None, "summary": None}, "store": body.store,
                "temperature": params.temperature, "top_p": params.top_p, "text": {"format": _dump(body.text.format) if body.text and body.text.format else {"type": "text"}},
                "tool_choice": _dump(body.tool_choice) or "auto", "tools": [_dump(t) for t in body.tools or []], "truncation": "disabled",
                "usage": {"input_tokens": len(ids), "input_tokens_details": {"cached_tokens": cached_tokens(gen)}, "output_tokens": used,
                          "total_tokens": len(ids) + used} if done else None,
            }  # fmt: skip

        def feed(events) -> list[str]:
            return [e for ev in events for e in out.push(ev)]

        def finished() -> tuple[dict, list[str]]:
            """The last events of the reply, the open item closed; the response, stored if asked."""
            status = "incomplete" if gen.out.finish == "length" else "completed"
            events = feed(reply.finish())
            if not out.items:  # an empty reply is an empty message
                events += out.push(("content", ""))
            events += out.close(status)
            r = response(status)
            if body.store:
                store.put(r, items + [dict(i) for i in out.items])
            return r, events

        if not body.stream:
            text_out = await gen.text(limits.request_timeout_s)
            out.add_records(gen.out.records)
            feed(reply.push(text_out))
            return finished()[0]

        async def stream():
            yield out.event("response.created", response=response("in_progress"))
            yield out.event("response.in_progress", response=response("in_progress"))
            try:
                async for d in gen.deltas():
                    out.add_records(gen.new_records())
                    for e in feed(reply.push(d)):
                        yield e
            except ApiError as e:
                yield out.event("error", code=e.kind, message=e.message, param=e.param)
                yield out.event("response.failed", response=response("failed", {"code": e.kind, "message": e.message}))
                return
            r, events = finished()
            for e in events:
                yield e
            yield out.event(f"response.{r['status']}", response=r)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str):
        return store.get(rid)[0]

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str):
        store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}
