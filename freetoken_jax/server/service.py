"""What every front end shares: validation of request fields, the scheduler, the tokenizer and
chat template, and the loop that turns a request's token events into text deltas."""

from __future__ import annotations

import secrets
import time

from freetoken_jax.engine import GenerationParams, RequestError
from freetoken_jax.scheduler.scheduler import Overloaded, Scheduler
from freetoken_jax.server.text import TextStream, chat_template


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _num(body: dict, key: str, typ, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be {'an integer' if typ is int else 'a number'}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"'{key}' must be in [{lo}, {hi}], got {v}")
    return v


def _stops(v) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise ApiError(400, "'stop' must be a string or a list of strings")


class Service:
    """What the HTTP handlers (and the gRPC service) share: the scheduler, tokenizer, template."""

    def __init__(self, scheduler: Scheduler, model_name: str, model_path: str | None = None):
        self.scheduler, self.model_name = scheduler, model_name
        self.engine = scheduler.engine
        self.tokenizer = self.engine.tokenizer
        self.template = chat_template(model_path)
        self.created = int(time.time())

    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is not None and m != self.model_name:
            raise ApiError(404, f"model {m!r} does not exist; this server serves {self.model_name!r}", "not_found_error")

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids")
        return self.tokenizer.encode(text)

    def params(self, body: dict, max_tokens: int, seed_key: str = "seed") -> GenerationParams:
        temperature = _num(body, "temperature", float, 1.0, 0.0, 2.0)
        seed = _num(body, seed_key, int, None)
        return GenerationParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_k=_num(body, "top_k", int, 0, 0),
            top_p=_num(body, "top_p", float, 1.0, 0.0, 1.0) or 1.0,
            seed=(seed if seed is not None else secrets.randbelow(1 << 31)) & 0xFFFFFFFF,
        )

    def submit(self, ids: list[int], params: GenerationParams):
        try:
            return self.scheduler.submit(ids, params)
        except RequestError as e:
            raise ApiError(400, str(e)) from e
        except Overloaded as e:
            raise ApiError(429, str(e), "overloaded_error") from e

    def run(self, handle, stops: list[str]):
        """Yields text deltas; returns (finish, stop string, usage) through StopIteration."""
        ts = TextStream(self.tokenizer, stops) if self.tokenizer is not None else None
        finish, usage = "length", None
        for ev in handle.events(timeout=600):
            if ev.kind == "token":
                if ts is None:
                    continue
                delta, stopped = ts.push(ev.token)
                if delta:
                    yield delta
                if stopped:
                    handle.cancel()
                    finish = "stop_string"
            elif ev.kind == "done":
                usage = ev.usage
                if finish != "stop_string":
                    finish = "length" if ev.reason == "length" else "stop"
                    if ts is not None and (tail := ts.flush()):
                        yield tail
            else:
                raise ApiError(500, ev.message or "generation failed", "api_error")
        return finish, (ts.stop_string if ts else None), usage
