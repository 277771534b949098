"""A thin OpenAI/Anthropic-compatible HTTP front end over the scheduler.

Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(OpenAI, with SSE streaming and usage), `POST /v1/messages` and `POST /v1/messages/count_tokens`
(Anthropic, streaming events as Anthropic's API sends them), `GET /v1/metrics`. Each request is
served on its own thread (stdlib `ThreadingHTTPServer`); generation goes through the
`Scheduler`, so concurrent requests are batched. Errors use each API's own error shape. A client
that disconnects mid-stream cancels its request, which frees its KV pages at the next step.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from freetoken_jax.server.service import ApiError, Service, _num, _stops
from freetoken_jax.server.text import message_text, render_chat


class Handler(BaseHTTPRequestHandler):
    service: Service
    protocol_version = "HTTP/1.1"
    server_version = "freetoken_jax"

    def log_message(self, fmt, *args):  # quiet by default
        pass

    # plumbing -------------------------------------------------------------------------------------
    def _anthropic(self) -> bool:
        return self.path.startswith("/v1/messages")

    def _send_json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ApiError) -> None:
        if self._anthropic():
            kind = {"overloaded_error": "overloaded_error", "not_found_error": "not_found_error", "api_error": "api_error"}.get(
                e.kind, "invalid_request_error"
            )
            self._send_json(
                529 if e.kind == "overloaded_error" else e.status, {"type": "error", "error": {"type": kind, "message": e.message}}
            )
        else:
            self._send_json(e.status, {"error": {"message": e.message, "type": e.kind, "param": None, "code": None}})

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def _sse_start(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _sse(self, obj, event: str | None = None) -> None:
        data = (f"event: {event}\n" if event else "") + f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
        self.wfile.write(data.encode())
        self.wfile.flush()

    # routes ---------------------------------------------------------------------------------------
    def do_GET(self):  # noqa: N802
        s = self.service
        if self.path == "/health":
            if s.scheduler.failed:
                return self._send_json(503, {"status": "failed", "model": s.model_name, "detail": s.scheduler.failed})
            return self._send_json(200, {"status": "ok", "model": s.model_name})
        if self.path == "/v1/cache/status":
            return self._send_json(200, s.scheduler.status())
        if self.path == "/v1/models":
            return self._send_json(
                200,
                {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": s.created, "owned_by": "freetoken_jax"}]},
            )
        if self.path == "/v1/metrics":
            return self._send_json(200, {**s.engine.get_metrics(), **s.scheduler.get_metrics()})
        self._error(ApiError(404, f"no route GET {self.path}", "not_found_error"))

    def do_POST(self):  # noqa: N802
        routes = {
            "/v1/completions": self._completions,
            "/v1/chat/completions": self._chat,
            "/v1/messages": self._messages,
            "/v1/messages/count_tokens": self._count_tokens,
            "/v1/cache/rebuild": self._rebuild,
        }
        fn = routes.get(self.path.split("?")[0])
        try:
            if fn is None:
                raise ApiError(404, f"no route POST {self.path}", "not_found_error")
            body = self._body()
            self.service.check_model(body)
            fn(body)
        except ApiError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; its request was cancelled where it streamed
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down
            self._error(ApiError(500, f"internal error: {type(e).__name__}: {e}", "api_error"))

    def _generate(self, ids, params, stops, on_delta):
        """Runs one request; calls on_delta(text) per delta; cancels it if the client goes away."""
        h = self.service.submit(ids, params)
        try:
            gen = self.service.run(h, stops)
            while True:
                try:
                    on_delta(next(gen))
                except StopIteration as stop:
                    return stop.value
        except BaseException:
            h.cancel()
            raise

    def _rebuild(self, body):
        from freetoken_jax.config import ConfigError
        from freetoken_jax.runtime.runner import RebuildFailed
        from freetoken_jax.scheduler.batcher import Busy

        unknown = set(body) - {"expert_slots", "kv_pages", "drain", "model"}
        if unknown:
            raise ApiError(400, f"unknown fields {sorted(unknown)}; give expert_slots and/or kv_pages (and drain)")
        try:
            st = self.service.scheduler.rebuild_cache(body.get("expert_slots"), body.get("kv_pages"), drain=bool(body.get("drain")))
        except ConfigError as e:
            raise ApiError(400, str(e)) from e
        except Busy as e:
            raise ApiError(409, str(e), "busy") from e
        except RebuildFailed as e:
            raise ApiError(500, str(e), "api_error") from e
        self._send_json(200, st)

    # OpenAI ---------------------------------------------------------------------------------------
    def _max_tokens(self, body: dict, keys=("max_tokens", "max_completion_tokens"), default=16) -> int:
        for k in keys:
            if body.get(k) is not None:
                return _num(body, k, int, default, 1)
        return default

    def _openai(self, body, ids, chat: bool):
        s = self.service
        n = _num(body, "n", int, 1, 1, 1)
        del n
        params = s.params(body, self._max_tokens(body, default=256 if chat else 16))
        stops = _stops(body.get("stop"))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        finish_of = lambda f: "length" if f == "length" else "stop"  # noqa: E731
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._sse_start()

            def chunk(delta=None, finish=None, usage=None):
                if chat:
                    choice = {"index": 0, "delta": delta if delta is not None else {}, "finish_reason": finish, "logprobs": None}
                else:
                    choice = {"index": 0, "text": (delta or {}).get("content", ""), "finish_reason": finish, "logprobs": None}
                c = {
                    "id": rid,
                    "object": obj + (".chunk" if chat else ""),
                    "created": created,
                    "model": s.model_name,
                    "choices": [] if usage else [choice],
                }
                if usage:
                    c["usage"] = usage
                self._sse(c)

            if chat:
                chunk({"role": "assistant", "content": ""})
            finish, _, usage = self._generate(ids, params, stops, lambda d: chunk({"content": d}))
            chunk({}, finish_of(finish))
            if include_usage:
                chunk(usage=self._usage(usage))
            self._sse("[DONE]")
            return
        parts: list[str] = []
        finish, _, usage = self._generate(ids, params, stops, parts.append)
        text = "".join(parts)
        choice = {"index": 0, "finish_reason": finish_of(finish), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self._send_json(
            200, {"id": rid, "object": obj, "created": created, "model": s.model_name, "choices": [choice], "usage": self._usage(usage)}
        )

    @staticmethod
    def _usage(u):
        u = u or {}
        p, c = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _completions(self, body):
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = self.service.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids")
        self._openai(body, ids, chat=False)

    def _chat_ids(self, messages, system=None) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list")
        msgs = [] if system is None else [{"role": "system", "content": system}]
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ApiError(400, "each message needs a 'role' string and 'content'")
            try:
                msgs.append({"role": m["role"], "content": message_text(m["content"])})
            except ValueError as e:
                raise ApiError(400, str(e)) from e
        try:
            text = render_chat(self.service.template, msgs)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise ApiError(400, f"the chat template rejected the messages: {e}") from e
        return self.service.encode(text)

    def _chat(self, body):
        self._openai(body, self._chat_ids(body.get("messages")), chat=True)

    # Anthropic ------------------------------------------------------------------------------------
    def _anthropic_ids(self, body) -> list[int]:
        system = body.get("system")
        if system is not None:
            try:
                system = message_text(system)
            except ValueError as e:
                raise ApiError(400, f"system: {e}") from e
        return self._chat_ids(body.get("messages"), system)

    def _count_tokens(self, body):
        self._send_json(200, {"input_tokens": len(self._anthropic_ids(body))})

    def _messages(self, body):
        s = self.service
        if body.get("max_tokens") is None:
            raise ApiError(400, "max_tokens: field required")
        ids = self._anthropic_ids(body)
        params = s.params(body, _num(body, "max_tokens", int, 1, 1))
        stops = _stops(body.get("stop_sequences"))
        mid = "msg_" + secrets.token_hex(12)

        def reason(f):
            return {"length": "max_tokens", "stop_string": "stop_sequence"}.get(f, "end_turn")

        if body.get("stream"):
            self._sse_start()
            msg = {"id": mid, "type": "message", "role": "assistant", "model": s.model_name, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": {"input_tokens": len(ids), "output_tokens": 0}}  # fmt: skip
            self._sse({"type": "message_start", "message": msg}, "message_start")
            self._sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}, "content_block_start")
            self._sse({"type": "ping"}, "ping")
            emit = lambda d: self._sse(
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d}}, "content_block_delta"
            )  # noqa: E731
            finish, stop, usage = self._generate(ids, params, stops, emit)
            self._sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            self._sse({"type": "message_delta", "delta": {"stop_reason": reason(finish), "stop_sequence": stop},
                       "usage": {"output_tokens": (usage or {}).get("completion_tokens", 0)}}, "message_delta")  # fmt: skip
            self._sse({"type": "message_stop"}, "message_stop")
            return
        parts: list[str] = []
        finish, stop, usage = self._generate(ids, params, stops, parts.append)
        self._send_json(200, {
            "id": mid, "type": "message", "role": "assistant", "model": s.model_name,
            "content": [{"type": "text", "text": "".join(parts)}], "stop_reason": reason(finish), "stop_sequence": stop,
            "usage": {"input_tokens": len(ids), "output_tokens": (usage or {}).get("completion_tokens", 0)},
        })  # fmt: skip


def serve_http(service: Service, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """Starts the HTTP server on a background thread and returns it (`.shutdown()` stops it)."""
    handler = type("BoundHandler", (Handler,), {"service": service})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="freetoken-http", daemon=True).start()
    return server
