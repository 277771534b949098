"""The OpenAI/Anthropic-compatible HTTP front end: FastAPI routes served by uvicorn.

Routes: `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions` and
`POST /v1/chat/completions` (OpenAI, SSE streaming with usage), OpenAI's Responses API
(`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`: `responses.py`), `POST /v1/messages` and
`POST /v1/messages/count_tokens` (Anthropic), `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` (vLLM's),
`GET /metrics` (Prometheus), `GET /v1/metrics` (JSON), and the admin routes `GET /v1/cache/status`,
`POST /v1/cache/rebuild`.

Every error that can be known before generation (a body that is not valid JSON or fails its
model in `schemas.py`, a prompt over the context, a full queue, a resize, a key) is answered with
its status before a stream starts, in the API's own error shape; an error during a stream ends it
with the API's error event (OpenAI: an `error` object then `[DONE]`; Anthropic: `event: error`).
A client that goes away cancels its request, streaming or not, which frees its KV pages at the
next step. `Guard` (outermost, pure ASGI) checks keys, origins, content types and body sizes and
writes one log line per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from freetoken_jax.server import schemas as S
from freetoken_jax.server.chat import Reply, Tools, anthropic_messages, content_text, openai_messages, render_messages, template_vars
from freetoken_jax.server.logprobs import chat_logprobs, completion_logprobs
from freetoken_jax.server.metrics import ServerMetrics
from freetoken_jax.server.service import ApiError, Output, Service

log = logging.getLogger("freetoken_jax.http")
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "min_tokens"}  # fmt: skip

_ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip
_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
           "/v1/responses", "/tokenize", "/detokenize", "/tokenizer_info", "/v1/metrics", "/v1/cache/status", "/v1/cache/rebuild")  # fmt: skip


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, e: ApiError) -> dict:
    if _is_anthropic(path):
        kind = "overloaded_error" if e.kind == "overloaded_error" else _ANTHROPIC_KINDS.get(e.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": e.message}}
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}


def error_response(path: str, e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse(error_body(path, e), e.status, headers=headers)


# Guard: keys, origins, content types, body size, the request log -----------------------------------
class Guard:
    """Pure ASGI middleware around the app (no response buffering, so streams and disconnects
    pass through). `api_key` is asked of every route but `/health`; the admin routes
    (`/v1/cache/*`) ask `admin_key`, else `api_key`, else a loopback client. A request from an
    `Origin` not in `allowed_origins` is refused (browsers send it with every cross-origin
    request: a page elsewhere cannot drive this server), and so is a POST that is not JSON."""

    def __init__(self, app, *, limits: S.Limits, metrics: ServerMetrics, api_key=None, admin_key=None, allowed_origins=()):
        self.app, self.limits, self.metrics = app, limits, metrics
        self.api_key, self.admin_key, self.origins = api_key, admin_key, set(allowed_origins)

    @staticmethod
    def _key(headers: dict) -> str | None:
        auth = headers.get("authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key")

    def _check(self, scope, headers: dict) -> None:
        path, method = scope["path"], scope["method"]
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins:
            raise ApiError(403, f"requests from origin {origin!r} are not allowed (serve --allowed-origins)", "permission_error")
        given = self._key(headers)
        if path.startswith("/v1/cache/"):
            want = self.admin_key or self.api_key
            if want is None and (scope.get("client") or ("",))[0] not in ("127.0.0.1", "::1", "localhost"):
                raise ApiError(403, "the admin routes answer loopback clients only unless serve --admin-key is set", "permission_error")
            if want is not None and not (given and secrets.compare_digest(given, want)):
                raise ApiError(401, "the admin routes need the admin key (Authorization: Bearer KEY)", "authentication_error")
        elif path != "/health" and self.api_key is not None and not (given and secrets.compare_digest(given, self.api_key)):
            raise ApiError(401, "a valid API key is needed (Authorization: Bearer KEY or x-api-key: KEY)", "authentication_error")
        if method == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                raise ApiError(415, f"the body must be application/json, not {ctype or 'missing'!r}")
            n = headers.get("content-length")
            if n is not None and (not n.isdigit() or int(n) > self.limits.max_body_bytes):
                raise ApiError(413, f"the body may be at most {self.limits.max_body_bytes} bytes (serve --max-body-bytes)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        rid = secrets.token_hex(6)
        scope.setdefault("state", {})["rid"] = rid
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check(scope, headers)
        except ApiError as e:
            await error_response(scope["path"], e)(scope, receive, send_status)
        else:
            await self.app(scope, receive, send_status)
        finally:
            route = scope["path"] if scope["path"] in _ROUTES else "other"
            self.metrics.requests.labels(route, str(status[0])).inc()
            st = scope["state"]
            log.info("%s %s %s %d %.1f ms prompt_tokens=%s completion_tokens=%s", rid, scope["method"], scope["path"], status[0],
                     1000 * (time.perf_counter() - t0), st.get("prompt_tokens", "-"), st.get("completion_tokens", "-"))  # fmt: skip


# Bodies --------------------------------------------------------------------------------------------
def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON number")


async def read_body(request: Request, model: type[BaseModel], limits: S.Limits) -> BaseModel:
    """The body, within the size limit and its timeout, parsed (strict JSON: no NaN, no lone
    surrogates) and validated by `model`; `ApiError` 400/408/413 otherwise."""
    chunks, size = [], 0

    async def receive_all():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise ApiError(413, f"the body may be at most {limits.max_body_bytes} bytes (serve --max-body-bytes)")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive_all(), limits.body_timeout_s)
    except TimeoutError as e:
        raise ApiError(408, f"the body did not arrive within {limits.body_timeout_s:.0f} s") from e
    try:
        obj = json.loads(b"".join(chunks) or b"null", parse_constant=_reject_constant)
        json.dumps(obj, ensure_ascii=False).encode()  # lone surrogates ("\ud800") fail here
    except (ValueError, RecursionError, UnicodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from e
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        where, msg = ".".join(str(p) for p in err["loc"]), err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {msg}" if where else msg, param=where or None) from e


# Generation ----------------------------------------------------------------------------------------
async def events(handle):
    """The request's events as the scheduler's loop thread queues them, without a thread here."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    handle.notify = lambda: loop.call_soon_threadsafe(ready.set)
    while True:
        ready.clear()
        try:
            ev = handle.queue.get_nowait()
        except queue.Empty:
            await ready.wait()
            continue
        yield ev
        if ev.kind in ("done", "error"):
            return


class Generation:
    """One submitted request: its `Output`, its arrival time and the deltas it yields."""

    def __init__(self, app_state, request: Request, ids: list[int], params, stops: list[str], grammar=None, keep_special: bool = False,
                 after: Generation | None = None):  # fmt: skip
        """`after`: the first choice of the same prompt (its KV pages are shared)."""
        self.s: Service = app_state.service
        self.metrics: ServerMetrics = app_state.metrics
        self.request, self.arrived = request, time.perf_counter()
        self.prompt_tokens = len(ids)
        self.handle = self.s.submit(ids, params, grammar, after.handle if after else None)  # ApiError (400/429/503) before anything is sent
        self.sent_records = 0  # log-probability records already sent in a stream
        self.out: Output = self.s.output(self.handle, stops, keep_special)

    async def deltas(self):
        """Text deltas; the request is cancelled if this stops early (a client gone, an error)."""
        try:
            async for ev in events(self.handle):
                try:
                    delta = self.out.feed(ev)
                except ApiError:
                    raise
                except Exception as e:  # noqa: BLE001 - detokenizing this request failed: it alone ends
                    log.exception("request %s", self.request.scope["state"]["rid"])
                    raise ApiError(500, f"internal error: {type(e).__name__}: {e}", "api_error") from e
                if delta:
                    yield delta
            self.metrics.finished(self.arrived, self.out, time.perf_counter())
            st = self.request.scope["state"]
            st["prompt_tokens"], st["completion_tokens"] = self.prompt_tokens, (self.out.usage or {}).get("completion_tokens", 0)
        finally:
            if not self.out.done:
                self.handle.cancel()

    async def text(self, timeout: float) -> str:
        """The whole text (non-streaming); a client that disconnects meanwhile cancels it."""
        return (await texts([self], timeout))[0]

    def new_records(self) -> list[tuple]:
        """The log-probability records not sent yet (streaming)."""
        recs = self.out.records[self.sent_records :]
        self.sent_records = len(self.out.records)
        return recs


async def texts(gens: list[Generation], timeout: float) -> list[str]:
    """The whole texts of several generations of one request (non-streaming); a client that
    disconnects meanwhile, a timeout or a failure cancels them all."""
    request = gens[0].request

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for g in gens:
            g.handle.cancel()

    async def collect(g):
        return "".join([d async for d in g.deltas()])

    watcher = asyncio.create_task(watch())
    try:
        return await asyncio.wait_for(asyncio.gather(*(collect(g) for g in gens)), timeout)
    except TimeoutError as e:
        raise ApiError(504, f"the request did not finish within {timeout:.0f} s", "timeout_error") from e
    finally:
        watcher.cancel()
        for g in gens:
            if not g.out.done:
                g.handle.cancel()


async def merged(gens: list[Generation]):
    """(choice index, text delta) of several streaming generations as they come, and (index,
    None) when a choice ends; raises the first failure (the rest are cancelled)."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, g):
        try:
            async for d in g.deltas():
                await q.put((i, d, None))
            await q.put((i, None, None))
        except ApiError as e:
            await q.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, d, err = await q.get()
            if err is not None:
                raise err
            left -= d is None
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            if not g.out.done:
                g.handle.cancel()


def sse(obj, event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def cached_tokens(gen: Generation) -> int:
    """The prompt tokens a finished generation read from the prefix cache (whole pages)."""
    return (gen.out.usage or {}).get("prefix_hit_tokens", 0)


def _dump(x):
    return None if x is None else x.model_dump(exclude_none=True, by_alias=True) if isinstance(x, BaseModel) else x


def _chat_prompt(s: Service, body) -> tuple[list[int], Tools | None, bool]:
    """An OpenAI chat body's prompt ids, its `Tools` and whether the prompt opened a reasoning
    section (the template ended it with <think>)."""
    tools = Tools.of([_dump(t) for t in body.tools or []], _dump(body.tool_choice), body.parallel_tool_calls, s.tool_format)
    text = render_messages(
        s.template, openai_messages(body.messages), tools, **template_vars(body.reasoning_effort, body.chat_template_kwargs)
    )
    return s.encode(text), tools, text.rstrip().endswith("<think>")


def thinks(body) -> bool:
    """Whether an Anthropic request asks for extended thinking."""
    return body.thinking is not None and body.thinking.type == "enabled"


def _anthropic_prompt(s: Service, body) -> tuple[list[int], Tools | None, bool]:
    system = body.system
    if system is not None:
        system = content_text(system, "system")
    tools = (
        Tools.from_anthropic([_dump(t) for t in body.tools or []], body.tool_choice, s.tool_format)
        if body.tools or body.tool_choice
        else None
    )
    enable = None if body.thinking is None else {"enable_thinking": thinks(body)}
    text = render_messages(s.template, anthropic_messages(body.messages, system), tools, **template_vars(kwargs=enable))
    return s.encode(text), tools, text.rstrip().endswith("<think>")


def _grammar(s: Service, body, tools) -> object:
    """The request's grammar: its structured-output fields' or the forced tool call's (not both)."""
    g, forced = s.grammar(body), s.tool_grammar(tools)
    if g is not None and forced is not None:
        raise ApiError(400, "a forced tool call (tool_choice) and a structured output format cannot be combined", param="tool_choice")
    return g or forced


# The app -------------------------------------------------------------------------------------------
def create_app(service: Service, *, limits: S.Limits | None = None, api_key: str | None = None, admin_key: str | None = None,
               allowed_origins: Sequence[str] = (), log_prompts: bool = False):  # fmt: skip
    """The ASGI app: FastAPI routes inside `Guard` (and CORS when `allowed_origins` are given)."""
    limits = limits or S.Limits()
    app = FastAPI(title="freetoken_jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service, app.state.metrics, app.state.limits = service, ServerMetrics(service), limits
    s = service

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(request.url.path, e)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("internal error")
        return error_response(request.url.path, ApiError(500, f"internal error: {type(e).__name__}", "api_error"))

    async def body_of(request: Request, model):
        body = await read_body(request, model, limits)
        s.check_model(body.model)
        if log_prompts:
            log.info("%s body %s", request.scope["state"]["rid"], body.model_dump_json()[:4000])
        return body

    @app.get("/health")
    async def health():
        problem = s.scheduler.failed or (None if s.scheduler.thread.is_alive() else "the scheduler thread has stopped")
        if problem:
            return JSONResponse({"status": "failed", "model": s.model_name, "detail": problem}, 503)
        return {"status": "ok", "model": s.model_name}

    def model_card():
        return {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "freetoken_jax", "max_model_len": s.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        s.check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/metrics")
    async def metrics_json():
        return {**s.engine.get_metrics(), **s.scheduler.get_metrics()}

    @app.get("/v1/cache/status")
    async def cache_status():
        return s.scheduler.status()

    @app.post("/v1/cache/rebuild")
    async def rebuild(request: Request):
        from freetoken_jax.config import ConfigError
        from freetoken_jax.runtime.runner import RebuildFailed
        from freetoken_jax.scheduler.batcher import Busy

        body = await body_of(request, S.RebuildRequest)
        try:
            return await asyncio.to_thread(s.scheduler.rebuild_cache, body.expert_slots, body.kv_pages, drain=body.drain)
        except ConfigError as e:
            raise ApiError(400, str(e)) from e
        except Busy as e:
            raise ApiError(409, str(e), "busy", retry_after=5) from e
        except RebuildFailed as e:
            raise ApiError(500, str(e), "api_error") from e

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request, S.TokenizeRequest)
        if body.messages is not None:
            text = render_messages(s.template, openai_messages(body.messages), None, **template_vars(kwargs=body.chat_template_kwargs))
        elif body.prompt is not None:
            text = body.prompt
        else:
            raise ApiError(400, "give 'prompt' or 'messages'")
        ids = s.encode(text, add_bos=body.add_special_tokens)  # the ids a request of the same text is given, by default
        return {"count": len(ids), "max_model_len": s.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request, S.DetokenizeRequest)
        return {"prompt": s.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():  # vLLM's: what a client needs to tokenize as the server does (lm-evaluation-harness asks)
        tok = s.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer")
        eos = s.engine.model_config.eos_token_ids
        bos = getattr(tok, "bos_token_id", None)
        text = lambda t: None if t is None else tok.token_text(t)  # noqa: E731
        return {"tokenizer_class": type(tok).__name__, "eos_token": text(eos[0] if eos else None), "bos_token": text(bos),
                "add_bos_token": bool(tok.prompt_start()), "pad_token": None, "chat_template": s.template,
                "model_max_length": s.max_context}  # fmt: skip

    # OpenAI --------------------------------------------------------------------------------------
    async def openai(request: Request, body, prompts: list[list[int]], chat: bool, tools: Tools | None = None, opened: bool = False,
                     stop_ids: tuple[int, ...] = ()):  # fmt: skip
        """An OpenAI completion of each prompt (chat: one), `n` choices each: choice i·n + k is
        prompt i's k-th; `stop_ids`: tokens that end it besides the request's."""
        max_tokens = next(
            (v for v in (body.max_tokens, getattr(body, "max_completion_tokens", None)) if v is not None), 256 if chat else 16
        )
        n_logprobs = ((body.top_logprobs or 0) if body.logprobs else None) if chat else body.logprobs
        n = body.n or 1
        best_of = getattr(body, "best_of", None) or n
        if best_of < n or (best_of > n and body.stream):
            raise ApiError(400, "best_of must be at least n, and cannot be streamed when larger", param="best_of")
        echo = bool(getattr(body, "echo", False))
        scored = echo and n_logprobs is not None  # the prompt's own log-probabilities, before the completion's
        if scored and body.stream:
            raise ApiError(400, "echo with logprobs (the prompt's log-probabilities) is not streamed; ask without stream", param="stream")
        if max_tokens == 0 and chat:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        if max_tokens == 0 and (not echo or body.stream):
            raise ApiError(400, "max_tokens 0 (the prompt alone) needs echo, without stream; else ask for at least 1", param="max_tokens")
        # best_of ranks candidates by their log-probability: they are computed (and returned only if asked).
        # max_tokens 0: the engine samples one token, which is left out
        params = s.params(body.model_dump(include=SAMPLING_FIELDS), max(1, max_tokens), n_logprobs if best_of == n else (n_logprobs or 0))
        params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + stop_ids)
        grammar = await asyncio.to_thread(_grammar, s, body, tools)
        parse_tools = tools is not None and tools.parse
        stops = S.stops_of(body, "stop", limits)
        gens: list[Generation] = []
        try:
            for ids in prompts:
                for i in range(best_of):  # choice i is seeded seed + i; choices after the first reuse its prompt's KV pages
                    p = dataclasses.replace(
                        params, seed=(params.seed + i) % (1 << 32), prompt_logprobs=n_logprobs if scored and i == 0 else None
                    )
                    g = grammar if not gens or grammar is None else grammar.fork()
                    first = gens[len(gens) - i] if i else None  # this prompt's first choice
                    gens.append(Generation(app.state, request, ids, p, stops, g, keep_special=parse_tools or s.harmony, after=first))
        except ApiError:
            for g in gens:
                g.handle.cancel()
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created, obj = int(time.time()), "chat.completion" if chat else "text_completion"
        replies = [Reply(tools, s.reasoning_parser, opened, s.harmony) if chat else None for _ in gens]
        prefixes = [s.decode(ids) if echo else "" for ids in prompts]
        text_sent = [0] * len(gens)

        def usage():  # choices after a prompt's first read the pages it prefilled: its hits are the prompt's
            c = 0 if max_tokens == 0 else sum((g.out.usage or {}).get("completion_tokens", 0) for g in gens)
            p = sum(len(ids) for ids in prompts)
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                    "prompt_tokens_details": {"cached_tokens": sum(cached_tokens(gens[j]) for j in range(0, len(gens), best_of))}}  # fmt: skip

        def finish_of(i):
            f = "length" if max_tokens == 0 else gens[i].out.finish
            return "length" if f == "length" else "tool_calls" if replies[i] is not None and replies[i].calls else "stop"

        def logprobs(i, records):
            if n_logprobs is None:
                return None
            if chat:
                return chat_logprobs(s.tokenizer, records)
            out = completion_logprobs(s.tokenizer, records, text_sent[i])
            text_sent[i] += sum(len(t) for t in out["tokens"])
            return out

        def prompt_records(i) -> list[tuple]:  # the prompt's tokens as log-probability records (the first has none)
            first = i - i % best_of  # its prompt's first choice, which scored it
            return [(prompts[i // best_of][0], None, None)] + gens[first].handle.prompt_logprobs

        if not body.stream:
            outs = await texts(gens, limits.request_timeout_s)
            if max_tokens == 0:
                outs = [""] * len(gens)

            def best(j):  # prompt j's n choices: of its best_of candidates, those of highest log-probability
                group = range(j * best_of, (j + 1) * best_of)
                return sorted(group, key=lambda i: -sum(r[1] for r in gens[i].out.records))[:n] if best_of > n else group

            choices = []
            for k, i in enumerate(i for j in range(len(prompts)) for i in best(j)):
                records = (prompt_records(i) if scored else []) + ([] if max_tokens == 0 else gens[i].out.records)
                choice = {"index": k, "logprobs": logprobs(i, records)}
                if chat:
                    reply = replies[i]
                    reply.push(outs[i])
                    reply.finish()
                    msg = {"role": "assistant", "content": reply.content if reply.content or not reply.calls else None}
                    if s.reasoning_parser:
                        msg["reasoning_content"] = reply.reasoning or None
                    if reply.calls:
                        msg["tool_calls"] = [
                            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in reply.calls
                        ]
                    choice["message"] = msg
                else:
                    choice["text"] = prefixes[i // best_of] + outs[i]
                choice["finish_reason"] = finish_of(i)
                choices.append(choice)
            return {"id": rid, "object": obj, "created": created, "model": s.model_name, "choices": choices, "usage": usage()}

        def chunk(i, delta=None, finish=None, usage=None, records=()):
            lp = logprobs(i, list(records)) if records else None
            if chat:
                choice = {"index": i, "delta": delta if delta is not None else {}, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": i, "text": (delta or {}).get("content", ""), "finish_reason": finish, "logprobs": lp}
            c = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created, "model": s.model_name,
                 "choices": [] if usage else [choice]}  # fmt: skip
            if usage:
                c["usage"] = usage
            return sse(c)

        def delta_of(ev) -> dict:
            if ev[0] == "content":
                return {"content": ev[1]}
            if ev[0] == "reasoning":
                return {"reasoning_content": ev[1]}
            if ev[0] == "call":
                c = ev[2]
                return {"tool_calls": [{"index": ev[1], "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}]}
            return {"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            for i in range(len(gens)):
                if chat:
                    yield chunk(i, {"role": "assistant", "content": ""})
                elif prefixes[i // best_of]:
                    yield chunk(i, {"content": prefixes[i // best_of]})
            records = [[] for _ in gens]
            try:
                async for i, d in merged(gens):
                    records[i] += gens[i].new_records()
                    if d is None:  # choice i has ended
                        for ev in replies[i].finish() if chat else []:
                            yield chunk(i, delta_of(ev), records=records[i])
                            records[i] = []
                        yield chunk(i, {}, finish_of(i), records=records[i])
                        continue
                    for ev in replies[i].push(d) if chat else [("content", d)]:
                        yield chunk(i, delta_of(ev), records=records[i])
                        records[i] = []
            except ApiError as e:
                yield sse(error_body(request.url.path, e))
                yield sse("[DONE]")
                return
            if include_usage:
                yield chunk(0, usage=usage())
            yield sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request, S.CompletionRequest)
        prompts = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt
        if body.suffix:  # fill in the middle: each prompt is the text before the gap
            if s.fim is None:
                raise ApiError(
                    400, "suffix (fill in the middle) needs a model whose vocabulary has FIM tokens; this one has none", param="suffix"
                )
            if body.echo or not all(isinstance(p, str) for p in prompts):
                raise ApiError(400, "suffix needs the prompt as text, without echo", param="suffix")
            ids = [s.fim.ids(s.tokenizer, p, body.suffix) for p in prompts]
            return await openai(request, body, ids, chat=False, stop_ids=s.fim.stops(s.tokenizer))
        return await openai(request, body, [s.encode(p) if isinstance(p, str) else list(p) for p in prompts], chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request, S.ChatRequest)
        if len(body.messages) > limits.max_messages:
            raise ApiError(400, f"at most {limits.max_messages} messages", param="messages")
        ids, tools, opened = _chat_prompt(s, body)
        return await openai(request, body, [ids], chat=True, tools=tools, opened=opened)

    # Anthropic -----------------------------------------------------------------------------------
    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await body_of(request, S.CountTokensRequest)
        return {"input_tokens": len(_anthropic_prompt(s, body)[0])}

    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await body_of(request, S.MessagesRequest)
        ids, tools, opened = _anthropic_prompt(s, body)
        params = s.params(body.model_dump(include=SAMPLING_FIELDS), body.max_tokens)
        grammar = await asyncio.to_thread(_grammar, s, body, tools)
        gen = Generation(app.state, request, ids, params, S.stops_of(body, "stop_sequences", limits), grammar,
                         keep_special=(tools is not None and tools.parse) or s.harmony)  # fmt: skip
        reply = Reply(tools, s.reasoning_parser or thinks(body), opened, s.harmony)
        mid = "msg_" + secrets.token_hex(12)

        def reason(f):
            return "max_tokens" if f == "length" else "tool_use" if reply.calls else {"stop_string": "stop_sequence"}.get(f, "end_turn")

        def usage():  # Anthropic's input_tokens leave out those read from the cache
            hit = cached_tokens(gen)
            return {"input_tokens": len(ids) - hit, "cache_read_input_tokens": hit,
                    "output_tokens": (gen.out.usage or {}).get("completion_tokens", 0)}  # fmt: skip

        def tool_use(c):
            try:
                args = json.loads(c.arguments) if c.arguments else {}
            except ValueError:
                args = {"_raw": c.arguments}
            return {"type": "tool_use", "id": "toolu_" + c.id[5:], "name": c.name, "input": args}

        if not body.stream:
            text = await gen.text(limits.request_timeout_s)
            reply.push(text)
            reply.finish()
            content = [{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if reply.reasoning else []
            if reply.content or not reply.calls:
                content.append({"type": "text", "text": reply.content})
            content += [tool_use(c) for c in reply.calls]
            return {"id": mid, "type": "message", "role": "assistant", "model": s.model_name, "content": content,
                    "stop_reason": reason(gen.out.finish), "stop_sequence": gen.out.stop_string,
                    "usage": usage()}  # fmt: skip

        async def stream():
            msg = {"id": mid, "type": "message", "role": "assistant", "model": s.model_name, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": {"input_tokens": len(ids), "output_tokens": 0}}  # fmt: skip
            yield sse({"type": "message_start", "message": msg}, "message_start")  # the split by the cache comes with message_delta
            yield sse({"type": "ping"}, "ping")
            block = {"index": -1, "kind": None, "call": None}  # the open content block

            def events_of(ev):
                kind = {"reasoning": "thinking", "content": "text"}.get(ev[0], "tool_use")
                call = ev[1] if kind == "tool_use" else None
                out = []
                if block["kind"] != kind or block["call"] != call:
                    if block["kind"] is not None:
                        out.append(sse({"type": "content_block_stop", "index": block["index"]}, "content_block_stop"))
                    block.update(index=block["index"] + 1, kind=kind, call=call)
                    start = {"thinking": {"type": "thinking", "thinking": ""}, "text": {"type": "text", "text": ""}}.get(kind)
                    if start is None:
                        start = {**tool_use(ev[2]), "input": {}}
                    out.append(sse({"type": "content_block_start", "index": block["index"], "content_block": start}, "content_block_start"))
                if ev[0] in ("content", "reasoning") or ev[0] == "arguments":
                    delta = {"content": {"type": "text_delta", "text": ev[-1]}, "reasoning": {"type": "thinking_delta", "thinking": ev[-1]},
                             "arguments": {"type": "input_json_delta", "partial_json": ev[-1]}}[ev[0]]  # fmt: skip
                    out.append(sse({"type": "content_block_delta", "index": block["index"], "delta": delta}, "content_block_delta"))
                return out

            try:
                async for d in gen.deltas():
                    for ev in reply.push(d):
                        for e in events_of(ev):
                            yield e
            except ApiError as e:
                yield sse(error_body(request.url.path, e), "error")
                return
            last = reply.finish()
            for ev in last if block["kind"] or last else [("content", "")]:
                for e in events_of(ev):
                    yield e
            yield sse({"type": "content_block_stop", "index": block["index"]}, "content_block_stop")
            yield sse({"type": "message_delta", "delta": {"stop_reason": reason(gen.out.finish), "stop_sequence": gen.out.stop_string},
                       "usage": usage()}, "message_delta")  # fmt: skip
            yield sse({"type": "message_stop"}, "message_stop")

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    from freetoken_jax.server.responses import install  # imports this module

    install(app, body_of, limits)

    @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def unknown(request: Request, rest: str):
        raise ApiError(404, f"no route {request.method} {request.url.path}", "not_found_error")

    guarded = Guard(app, limits=limits, metrics=app.state.metrics, api_key=api_key, admin_key=admin_key, allowed_origins=allowed_origins)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        return CORSMiddleware(guarded, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])
    return guarded


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (`OSError` at once if the port is taken): `serve` binds before
    it loads and compiles, so that a taken port is said in the first second, not after warm-up."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


KEEP_ALIVE_S = 75.0
"""How long an idle kept-alive connection stays open. Longer than clients keep theirs (httpx,
under the openai and anthropic clients: 5 s), so a client never sends on a connection the server
is closing at that moment — equal timeouts lose a request now and then."""


class HttpServer:
    """uvicorn serving the app on a background thread; `server_address` is (host, bound port)."""

    def __init__(self, app, host: str, port: int, *, max_connections: int = 512, max_header_bytes: int = 16384, keep_alive_s: float = KEEP_ALIVE_S,
                 sock: socket.socket | None = None):  # fmt: skip
        sock = sock or bind(host, port)
        self.server_address = sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", backlog=2048, limit_concurrency=max_connections,
                                timeout_keep_alive=keep_alive_s, h11_max_incomplete_event_size=max_header_bytes)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="freetoken-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_http(service: Service, host: str = "127.0.0.1", port: int = 8000, **options) -> HttpServer:
    """Starts the HTTP server on a background thread and returns it (`.shutdown()` stops it).
    `options`: `create_app`'s (limits, keys, origins, log_prompts) and `HttpServer`'s."""
    server_opts = {k: options.pop(k) for k in ("max_connections", "max_header_bytes", "keep_alive_s", "sock") if k in options}
    return HttpServer(create_app(service, **options), host, port, **server_opts)
