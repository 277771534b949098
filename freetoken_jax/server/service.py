"""What every front end shares: the checks of sampling fields, the scheduler, the tokenizer and
chat template, and `Output`, which turns a request's token events into text deltas."""

from __future__ import annotations

import json
import math
import secrets
import time

from freetoken_jax.engine import GenerationParams, RequestError
from freetoken_jax.scheduler.grammar import Constraint, GrammarError
from freetoken_jax.scheduler.scheduler import Overloaded, Scheduler
from freetoken_jax.server.text import TextStream, chat_template


class ApiError(Exception):
    """A request's failure as the client sees it: an HTTP status, a message and the error kind
    (OpenAI's `type`; `http.py` maps it to Anthropic's). `retry_after`: seconds, for 429/503."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, retry_after: int | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.retry_after = status, message, kind, param, retry_after


def _num(body: dict, key: str, typ, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or isinstance(v, bool) or (typ is float and not math.isfinite(v)):
        raise ApiError(400, f"'{key}' must be {'an integer' if typ is int else 'a finite number'}", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"'{key}' must be in [{lo}, {hi}], got {v}", param=key)
    return v


# The fields that ask for a grammar (vLLM's guided_* and llama.cpp's GBNF `grammar`; vLLM's
# structured_outputs' own names), with the kind of grammar each gives: "choice" is one of its strings.
_GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "lark"),
           ("grammar", "gbnf"))  # fmt: skip
_STRUCTURED = (("json_", "json_schema"), ("regex", "regex"), ("choice", "choice"), ("grammar", "lark"), ("json_object", "json_object"))


class Service:
    """What the HTTP handlers and the gRPC service share: the scheduler, tokenizer, template."""

    def __init__(self, scheduler: Scheduler, model_name: str, model_path: str | None = None, template: str | None = None,
                 tool_parser: str | None = None, reasoning_parser: bool = False):  # fmt: skip
        """`tool_parser`: the format tool calls are read in (`tools.FORMATS`; None: the one the
        chat template shows); `reasoning_parser`: reasoning text (<think>…</think>) goes to its own
        field (`reasoning_content`, Anthropic `thinking` blocks) instead of the content."""
        from freetoken_jax.server import fim
        from freetoken_jax.server.tools import FORMATS, detect

        self.scheduler, self.model_name = scheduler, model_name
        self.engine = scheduler.engine
        self.tokenizer = self.engine.tokenizer
        self.template = template or getattr(self.tokenizer, "chat_template", None) or chat_template(model_path)
        if tool_parser is not None and tool_parser not in FORMATS:
            raise ValueError(f"unknown tool parser {tool_parser!r}; known: {', '.join(sorted(FORMATS))}")
        self.tool_format = FORMATS[tool_parser] if tool_parser else detect(self.template)
        # harmony (gpt-oss) always keeps its channels apart: analysis is reasoning, whatever the flag
        self.harmony = self.tool_format.name == "harmony"
        self.reasoning_parser = reasoning_parser or self.harmony
        self.fim = fim.detect(self.tokenizer)  # how a `suffix` is written, where the vocabulary has the tokens
        self.created = int(time.time())

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def max_context(self) -> int:
        return self.engine.engine_config.max_context

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "not_found_error", "model")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids")
        return self.tokenizer.encode(text, add_bos=add_bos)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"token ids out of range [0, {self.vocab_size}): {bad[:8]}", param="tokens")
        return self.tokenizer.decode(ids)

    def params(self, body: dict, max_tokens: int, logprobs: int | None = None) -> GenerationParams:
        """Sampling fields of a request body (numbers finite and in range; top_k at most the
        vocabulary; no seed: a random one); `logprobs`: how many of the most likely tokens to
        list per position (None: no log-probabilities)."""
        seed = _num(body, "seed", int, None, 0, (1 << 32) - 1)
        bias = []
        for k, v in (body.get("logit_bias") or {}).items():
            if not (k.isdigit() and int(k) < self.vocab_size):
                raise ApiError(400, f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {k!r}", param="logit_bias")
            if not -100 <= v <= 100:
                raise ApiError(400, f"logit_bias values must be in [-100, 100], got {v}", param="logit_bias")
            bias.append((int(k), float(v)))
        min_tokens = _num(body, "min_tokens", int, 0, 0, max_tokens)
        top_p = _num(body, "top_p", float, 1.0, 0.0, 1.0)
        if top_p <= 0:
            raise ApiError(400, "'top_p' must be greater than 0 (temperature 0 decodes greedily)", param="top_p")
        return GenerationParams(
            max_new_tokens=max_tokens,
            temperature=_num(body, "temperature", float, 1.0, 0.0, 2.0),
            top_k=_num(body, "top_k", int, 0, 0, self.vocab_size),
            top_p=top_p,
            seed=seed if seed is not None else secrets.randbelow(1 << 31),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            ignore_eos=bool(body.get("ignore_eos")),
            min_p=_num(body, "min_p", float, 0.0, 0.0, 1.0),
            presence_penalty=_num(body, "presence_penalty", float, 0.0, -2.0, 2.0),
            frequency_penalty=_num(body, "frequency_penalty", float, 0.0, -2.0, 2.0),
            repetition_penalty=_num(body, "repetition_penalty", float, 1.0, 1e-6, 10.0),
            logit_bias=tuple(bias),
            min_tokens=min_tokens,
            logprobs=logprobs,
        )

    def tool_grammar(self, tools) -> Constraint | None:
        """The grammar that forces a call to one of `tools.forced` (None when nothing is forced)."""
        if tools is None or tools.forced is None:
            return None
        g = self.engine.grammars
        try:
            return g.constraint(g.lark(tools.fmt.grammar(tools.forced, tools.many, self.tokenizer.token_id)))
        except GrammarError as e:
            raise ApiError(400, f"the tools' parameters cannot be used as a grammar: {e}", param="tools") from e

    def grammar(self, body) -> Constraint | None:
        """The grammar a request's output must follow (response_format, guided_json,
        guided_regex, guided_choice, guided_grammar (Lark), grammar (GBNF) or one of
        structured_outputs' json, regex, choice, grammar (Lark) and json_object: at most one),
        compiled; None without one."""
        given = []
        rf = getattr(body, "response_format", None)
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", "json_object", None))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
            given.append(("response_format", "json_schema", schema))
        so = getattr(body, "structured_outputs", None)
        fields = [(f, getattr(body, f, None), kind) for f, kind in _GUIDED]
        fields += [(f"structured_outputs.{f.rstrip('_')}", getattr(so, f), kind) for f, kind in _STRUCTURED] if so is not None else []
        for field, v, kind in fields:
            if v is None or v is False:  # json_object: false asks for nothing
                continue
            if kind == "json_schema" and isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError as e:
                    raise ApiError(400, f"{field} is not valid JSON: {e}", param=field) from e
            given.append((field, kind, v))
        if not given:
            return None
        if len(given) > 1:
            raise ApiError(400, f"give at most one of {', '.join(f for f, _, _ in given)}", param=given[1][0])
        return self.compile(*given[0])

    def compile(self, field: str, kind: str, spec) -> Constraint:
        """A fresh `Constraint` of `kind` ("json_object", "json_schema", "regex", "lark", "gbnf",
        "choice": one of the strings `spec`); errors are 400s naming `field`."""
        try:
            g = self.engine.grammars
            text = g.json_object() if kind == "json_object" else getattr(g, kind)(spec)
            return g.constraint(text)
        except (GrammarError, RequestError) as e:
            raise ApiError(400, f"{field}: {e}", param=field) from e

    def submit(self, ids: list[int], params: GenerationParams, grammar: Constraint | None = None, after=None):
        try:
            return self.scheduler.submit(ids, params, grammar, after)
        except RequestError as e:
            raise ApiError(400, str(e)) from e
        except Overloaded as e:
            resizing = not self.scheduler.batcher.admitting
            raise ApiError(503 if resizing else 429, str(e), "overloaded_error", retry_after=5 if resizing else 1) from e

    def output(self, handle, stops: list[str], keep_special: bool = False) -> Output:
        drop = handle.params.stop_set(self.engine.model_config.eos_token_ids) if keep_special else frozenset()
        return Output(handle, self.tokenizer, stops, keep_special, drop)


class Output:
    """One request's events in, text deltas out; holds back what may become a stop string and
    cancels the request when one appears. After its last event: `finish` ("stop", "length",
    "stop_string"), `stop_string`, `usage`. An error event raises `ApiError`."""

    def __init__(self, handle, tokenizer, stops: list[str], keep_special: bool = False, drop: frozenset = frozenset()):
        self.handle = handle
        self.text = TextStream(tokenizer, stops, keep_special, drop) if tokenizer is not None else None
        self.finish, self.usage, self.done = "length", None, False
        self.first_token_at: float | None = None
        self.records: list[tuple] = []  # (token, its log-probability, [(token, log-probability)]) when asked for

    @property
    def stop_string(self) -> str | None:
        return self.text.stop_string if self.text else None

    def feed(self, ev) -> str:
        if ev.kind == "token":
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            if self.text is None or self.finish == "stop_string":
                return ""
            if ev.logprobs is not None:
                self.records.append((ev.token, *ev.logprobs))
            delta, stopped = self.text.push(ev.token)
            if stopped:
                self.handle.cancel()
                self.finish = "stop_string"
            return delta
        self.done = True
        if ev.kind == "done":
            self.usage = ev.usage
            if self.finish != "stop_string":
                self.finish = "length" if ev.reason == "length" else "stop"
                return self.text.flush() if self.text is not None else ""
            return ""
        raise ApiError(500, ev.message or "generation failed", "api_error")
