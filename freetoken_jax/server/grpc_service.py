"""The gRPC service (`proto/freetoken.proto`) over the same `Service` as the HTTP shim.

`Generate` takes text, token ids or a chat (messages the model's template renders) and streams
one `Chunk` per token (its id, the text it completes — for a chat, its reasoning apart where the
server reads it so — and, if asked, its log-probabilities), ending with `Done` (finish reason
and usage); with `n` choices, each chunk and end carries its choice's index. A client that
cancels the call cancels the request, which frees its KV pages at the next step. Bad requests end with INVALID_ARGUMENT, an unknown model
with NOT_FOUND, a full queue with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import queue
import secrets
from concurrent import futures

import grpc

from freetoken_jax.server.chat import Reply, openai_messages, render_messages, template_kwargs, template_vars
from freetoken_jax.server.pb import freetoken_pb2 as pb
from freetoken_jax.server.pb import freetoken_pb2_grpc as pb_grpc
from freetoken_jax.server.schemas import ChatMessage, Limits
from freetoken_jax.server.service import ApiError, Service

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE}  # fmt: skip


def _token_logprob(record: tuple) -> pb.TokenLogprob:
    """A (token, log-probability, [(token, log-probability)]) record as its message."""
    token, lp, top = record
    return pb.TokenLogprob(token_id=token, logprob=lp, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def _split(reply: Reply | None, delta: str, last: bool = False) -> tuple[str, str]:
    """A text delta as (text, reasoning) through a chat input's `Reply` (as it is, without one)."""
    if reply is None:
        return delta, ""
    events = reply.push(delta) + (reply.finish() if last else [])
    return "".join(e[1] for e in events if e[0] == "content"), "".join(e[1] for e in events if e[0] == "reasoning")


class FreeTokenServicer(pb_grpc.FreeTokenServicer):
    def __init__(self, service: Service, limits: Limits):
        self.s, self.limits = service, limits

    def _abort(self, context, e: ApiError):
        context.abort(_CODES.get(e.status, grpc.StatusCode.INTERNAL), e.message)

    def _chat(self, chat) -> tuple[list[int], bool]:
        """A `Chat`'s prompt ids, rendered by the model's template, and whether the template opened
        a reasoning section (ended the prompt with <think>)."""
        msgs = [
            ChatMessage(role=m.role, content=m.content, **({"reasoning_content": m.reasoning} if m.reasoning else {}))
            for m in chat.messages
        ]
        if not msgs or any(m.role == "tool" for m in msgs):
            raise ApiError(400, "chat.messages: at least one message, none of role 'tool' (tool calls are the HTTP APIs')")
        where = "chat.template_kwargs_json"
        extra = template_vars(kwargs=template_kwargs(chat.template_kwargs_json, where), param=where)
        text = render_messages(self.s.template, openai_messages(msgs), None, **extra)
        return self.s.encode(text), text.rstrip().endswith("<think>")

    def _request(self, request) -> tuple[list[int], list, list, bool | None]:
        """(prompt ids, parameters per choice, grammar per choice, and for chat input whether its
        prompt opened a reasoning section) of a Generate request."""
        s, limits = self.s, self.limits
        s.check_model(request.model or None)
        which = request.WhichOneof("input")
        opened = None
        if which == "text":
            ids = s.encode(request.text)
        elif which == "tokens":
            ids = list(request.tokens.ids)
        elif which == "chat":
            ids, opened = self._chat(request.chat)
        else:
            raise ApiError(400, "give 'text', 'tokens' or 'chat'")
        if request.max_new_tokens <= 0:
            raise ApiError(400, "max_new_tokens must be at least 1")
        if request.n > 16:
            raise ApiError(400, f"n must be at most 16, got {request.n}")
        for field in ("logprobs", "prompt_logprobs"):
            if request.HasField(field) and getattr(request, field) > 20:
                raise ApiError(400, f"{field} must be at most 20, got {getattr(request, field)}")
        sp = request.sampling
        body = {"temperature": float(sp.temperature), "top_k": int(sp.top_k), "top_p": float(sp.top_p) or 1.0, "min_p": float(sp.min_p),
                "presence_penalty": float(sp.presence_penalty), "frequency_penalty": float(sp.frequency_penalty),
                "logit_bias": {str(k): float(v) for k, v in sp.logit_bias.items()}, "min_tokens": int(sp.min_tokens)}  # fmt: skip
        if sp.HasField("seed"):
            body["seed"] = int(sp.seed)
        if sp.HasField("repetition_penalty"):
            body["repetition_penalty"] = float(sp.repetition_penalty)
        params = s.params(body, int(request.max_new_tokens), int(request.logprobs) if request.HasField("logprobs") else None)
        params = dataclasses.replace(params, stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos)
        if len(request.stop) > limits.max_stops or any(len(x) > limits.max_stop_chars for x in request.stop):
            raise ApiError(400, f"at most {limits.max_stops} stop strings of at most {limits.max_stop_chars} characters each")
        n = max(1, request.n)
        kind = request.constraint.WhichOneof("kind") if request.HasField("constraint") else None
        grammar = None
        if kind == "json_schema":
            try:
                schema = json.loads(request.constraint.json_schema)
            except ValueError as e:
                raise ApiError(400, f"constraint.json_schema is not valid JSON: {e}") from e
            grammar = s.compile("constraint.json_schema", "json_schema", schema)
        elif kind == "choice":
            grammar = s.compile("constraint.choice", "choice", list(request.constraint.choice.values))
        elif kind is not None:
            grammar = s.compile(f"constraint.{kind}", kind, getattr(request.constraint, kind))
        scored = int(request.prompt_logprobs) if request.HasField("prompt_logprobs") else None  # computed by the first choice
        ps = [dataclasses.replace(params, seed=(params.seed + i) % (1 << 32), prompt_logprobs=None if i else scored) for i in range(n)]
        return ids, ps, [grammar if i == 0 or grammar is None else grammar.fork() for i in range(n)], opened

    def Generate(self, request, context):  # noqa: N802
        s = self.s
        handles = []
        try:
            ids, ps, grammars, opened = self._request(request)
            for p, g in zip(ps, grammars):  # choices after the first reuse its prompt's KV pages
                handles.append(s.submit(ids, p, g, handles[0] if handles else None))
        except ApiError as e:
            for h in handles:
                h.cancel()
            self._abort(context, e)
            return
        for h in handles:
            context.add_callback(h.cancel)
        chat = opened is not None  # its replies read by the HTTP chat path's `Reply` (reasoning apart; harmony's channels)
        outs = [s.output(h, list(request.stop), keep_special=chat and s.harmony) for h in handles]
        replies = [Reply(None, s.reasoning_parser, opened, s.harmony) if chat else None for _ in handles]
        ready: queue.Queue = queue.Queue()  # indices of choices with events queued
        for i, h in enumerate(handles):
            h.notify = functools.partial(ready.put, i)
            ready.put(i)
        left, prompt_sent = len(handles), False
        try:
            while left:
                i = ready.get(timeout=self.limits.request_timeout_s)
                h, out = handles[i], outs[i]
                while not out.done:
                    try:
                        ev = h.queue.get_nowait()
                    except queue.Empty:
                        break
                    stopped = out.finish == "stop_string"
                    text = out.feed(ev)  # an error event raises ApiError
                    if i == 0 and h.params.prompt_logprobs is not None and not prompt_sent:  # complete before its first event
                        prompt_sent = True
                        yield pb.GenerateResponse(chunk=pb.Chunk(index=0, prompt_logprobs=[_token_logprob(r) for r in h.prompt_logprobs]))
                    if ev.kind == "token" and not stopped:
                        lp = [] if ev.logprobs is None else [_token_logprob((ev.token, *ev.logprobs))]
                        text, reasoning = _split(replies[i], text)
                        yield pb.GenerateResponse(
                            chunk=pb.Chunk(index=i, token_ids=[ev.token], text=text, reasoning=reasoning, logprobs=lp)
                        )
                    elif ev.kind == "done":
                        text, reasoning = _split(replies[i], text, last=True)
                        if text or reasoning:
                            yield pb.GenerateResponse(chunk=pb.Chunk(index=i, text=text, reasoning=reasoning))
                        u = out.usage or {}
                        usage = pb.Usage(prompt_tokens=u.get("prompt_tokens", 0), completion_tokens=u.get("completion_tokens", 0),
                                         prefix_hit_tokens=u.get("prefix_hit_tokens", 0))  # fmt: skip
                        yield pb.GenerateResponse(done=pb.Done(index=i, finish_reason=out.finish, usage=usage))
                        left -= 1
        except ApiError as e:
            self._abort(context, e)
        except queue.Empty:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request did not finish within {self.limits.request_timeout_s:.0f} s")
        finally:
            for h in handles:
                if not h.finished:
                    h.cancel()

    def Tokenize(self, request, context):  # noqa: N802
        try:
            return pb.TokenizeResponse(ids=self.s.encode(request.text))
        except ApiError as e:
            self._abort(context, e)

    def Health(self, request, context):  # noqa: N802
        sched = self.s.scheduler
        problem = sched.failed or (None if sched.thread.is_alive() else "the scheduler thread has stopped")
        return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING if problem else pb.HealthResponse.SERVING, detail=problem or "ok")

    def RebuildCache(self, request, context):  # noqa: N802
        from freetoken_jax.config import ConfigError
        from freetoken_jax.runtime.runner import RebuildFailed
        from freetoken_jax.scheduler.batcher import Busy

        slots = request.expert_slots if request.HasField("expert_slots") else None
        pages = request.kv_pages if request.HasField("kv_pages") else None
        try:
            self.s.scheduler.rebuild_cache(slots, pages, drain=request.drain)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Busy as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except RebuildFailed as e:
            context.abort(grpc.StatusCode.INTERNAL, str(e))
        return pb.CacheStatus(json=json.dumps(self.s.scheduler.status()))

    def GetCacheStatus(self, request, context):  # noqa: N802
        return pb.CacheStatus(json=json.dumps(self.s.scheduler.status()))

    def GetMetrics(self, request, context):  # noqa: N802
        return pb.MetricsResponse(json=json.dumps({**self.s.engine.get_metrics(), **self.s.scheduler.get_metrics()}))

    def ListModels(self, request, context):  # noqa: N802
        return pb.ListModelsResponse(models=[pb.Model(id=self.s.model_name, strategy=self.s.engine.engine_config.moe_strategy.value)])


class _KeyCheck(grpc.ServerInterceptor):
    """Asks every call but Health for `authorization: Bearer KEY` (or `x-api-key`) metadata."""

    def __init__(self, key: str):
        self.key = key

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is needed (metadata authorization: Bearer KEY)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.endswith("/Health"):
            return continuation(details)
        md = dict(details.invocation_metadata)
        auth = md.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else md.get("x-api-key")
        if given and secrets.compare_digest(given, self.key):
            return continuation(details)
        return self._deny_stream if details.method.endswith("/Generate") else self._deny


def serve_grpc(service: Service, host: str = "127.0.0.1", port: int = 50051, workers: int = 32, *, api_key: str | None = None,
               limits: Limits | None = None) -> tuple[grpc.Server, int]:  # fmt: skip
    """Starts the gRPC server; returns it and the bound port (`port=0` picks a free one).
    `api_key`: asked of every call but Health; `limits`: the HTTP server's (message size, stops)."""
    limits = limits or Limits()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        interceptors=[_KeyCheck(api_key)] if api_key else [],
        options=[("grpc.max_receive_message_length", limits.max_body_bytes)],
        maximum_concurrent_rpcs=workers * 8,
    )
    pb_grpc.add_FreeTokenServicer_to_server(FreeTokenServicer(service, limits), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound
