"""The gRPC service (`proto/freetoken.proto`) over the same `Service` as the HTTP shim.

`Generate` streams one `Chunk` per token (its id and the text it completes) and ends with
`Done` (finish reason and usage); a client that cancels the call cancels the request, which
frees its KV pages at the next step. Bad requests end with INVALID_ARGUMENT, an unknown model
with NOT_FOUND, a full queue with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from concurrent import futures

import grpc

from freetoken_jax.server.pb import freetoken_pb2 as pb
from freetoken_jax.server.pb import freetoken_pb2_grpc as pb_grpc
from freetoken_jax.server.schemas import Limits
from freetoken_jax.server.service import ApiError, Service

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE}  # fmt: skip


class FreeTokenServicer(pb_grpc.FreeTokenServicer):
    def __init__(self, service: Service, limits: Limits):
        self.s, self.limits = service, limits

    def _abort(self, context, e: ApiError):
        context.abort(_CODES.get(e.status, grpc.StatusCode.INTERNAL), e.message)

    def Generate(self, request, context):  # noqa: N802
        s, limits = self.s, self.limits
        try:
            s.check_model(request.model or None)
            which = request.WhichOneof("input")
            if which == "text":
                ids = s.encode(request.text)
            elif which == "tokens":
                ids = list(request.tokens.ids)
            else:
                raise ApiError(400, "give 'text' or 'tokens'")
            if request.max_new_tokens <= 0:
                raise ApiError(400, "max_new_tokens must be at least 1")
            sp = request.sampling
            body = {"temperature": float(sp.temperature), "top_k": int(sp.top_k), "top_p": float(sp.top_p) or 1.0}
            if sp.HasField("seed"):
                body["seed"] = int(sp.seed)
            params = s.params(body, int(request.max_new_tokens))
            params = dataclasses.replace(params, stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos)
            if len(request.stop) > limits.max_stops or any(len(x) > limits.max_stop_chars for x in request.stop):
                raise ApiError(400, f"at most {limits.max_stops} stop strings of at most {limits.max_stop_chars} characters each")
            handle = s.submit(ids, params)
        except ApiError as e:
            self._abort(context, e)
            return
        context.add_callback(handle.cancel)
        gen = s.run(handle, list(request.stop))
        sent = 0
        try:
            while True:
                try:
                    text = next(gen)
                except StopIteration as stop:
                    finish, usage = stop.value.finish, stop.value.usage
                    break
                new = handle.generated[sent:]
                sent = len(handle.generated)
                yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=new, text=text))
        except ApiError as e:
            self._abort(context, e)
            return
        if sent < len(handle.generated):
            yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=handle.generated[sent:], text=""))
        u = usage or {}
        yield pb.GenerateResponse(done=pb.Done(finish_reason=finish, usage=pb.Usage(prompt_tokens=u.get("prompt_tokens", 0),
                                  completion_tokens=u.get("completion_tokens", 0), prefix_hit_tokens=u.get("prefix_hit_tokens", 0))))  # fmt: skip

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
