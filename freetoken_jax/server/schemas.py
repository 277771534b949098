"""The HTTP request bodies as typed models: what `http.py` accepts, checked before anything runs.

Numbers are finite and in range, flags are JSON booleans (not "false"), strings are valid
Unicode, and lists are bounded (`Limits`). Fields the APIs define that the engine does not act
on yet are refused (a 400 naming the field) unless they carry the value that asks for nothing;
other unknown fields pass.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StringConstraints, field_validator, model_validator

from freetoken_jax.server.service import ApiError

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (`serve` flags set them)."""

    max_body_bytes: int = 8 << 20
    max_stops: int = 16
    max_stop_chars: int = 256
    max_messages: int = 4096
    request_timeout_s: float = 600.0  # a request's whole life, generation included
    body_timeout_s: float = 30.0  # to receive the body once the headers are in


# Fields of the APIs the engine does not act on yet, with the values that ask nothing of it
# (clients send those by default). Any other value is refused with a 400 naming the field:
# nothing a client asks for is silently ignored.
_NOT_YET = {
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "prediction": (None,), "tool_use": (None,), "guided_decoding_backend": (None,),
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,), "verbosity": (None, "medium"),
}  # fmt: skip


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    not_yet: ClassVar[dict] = _NOT_YET

    @model_validator(mode="after")
    def _nothing_ignored(self):
        for name, value in (self.model_extra or {}).items():
            if name in self.not_yet and not any(value == ok and type(value) is type(ok) or value is ok for ok in self.not_yet[name]):
                raise ValueError(f"'{name}' is not supported by this server yet; leave it out")
        return self

    model: str | None = None
    temperature: FiniteFloat | None = Field(None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    seed: StrictInt | None = Field(None, ge=0, lt=1 << 32)
    stream: StrictBool = False
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=64)] | None = None  # vLLM's: more tokens that end the text
    ignore_eos: StrictBool = False  # vLLM's: generate past the end-of-sequence token


Stop = str | list[str] | None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object ({'name': ..., 'schema': {...}})")
        return self


Choices = Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1, max_length=4096)]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its newer spelling of the guided_* fields): one of them."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None  # Lark, as guided_grammar
    json_object: StrictBool | None = None


class _Guided(_Body):
    """vLLM's structured-output fields and llama.cpp's GBNF `grammar`."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None  # the output is one of these strings
    guided_grammar: str | None = None  # Lark
    grammar: str | None = None  # GBNF
    structured_outputs: StructuredOutputs | None = None


GUIDED = tuple(k for k in _Guided.model_fields if k not in _Body.model_fields)


class _OpenAI(_Guided):
    n: StrictInt | None = Field(None, ge=1, le=16)  # choices, sharing the prompt's KV pages
    stop: Stop = None
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0: the prompt alone (completions with echo)
    presence_penalty: FiniteFloat | None = Field(None, ge=-2, le=2)
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2, le=2)
    repetition_penalty: FiniteFloat | None = Field(None, gt=0, le=10)  # vLLM's
    min_p: FiniteFloat | None = Field(None, ge=0, le=1)  # vLLM's
    min_tokens: StrictInt | None = Field(None, ge=0)  # vLLM's
    logit_bias: dict[str, FiniteFloat] | None = None
    response_format: ResponseFormat | None = None  # structured output, besides `_Guided`'s


MAX_PROMPTS = 1024  # prompts of one completions request (each its own request to the engine)


def _one_prompt(p) -> bool:
    return isinstance(p, str) and p != "" or isinstance(p, list) and p != [] and all(type(t) is int for t in p)


class CompletionRequest(_OpenAI):
    # one prompt (text or token ids), or a batch of them: choice i * n + k is prompt i's k-th
    prompt: str | list
    logprobs: StrictInt | None = Field(None, ge=0, le=20)  # the most likely tokens to list per position
    echo: StrictBool = False
    suffix: str | None = None  # the text after the gap: fill in the middle (`fim.py`)
    best_of: StrictInt | None = Field(None, ge=1, le=16)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v):
        if _one_prompt(v) or isinstance(v, list) and 0 < len(v) <= MAX_PROMPTS and all(_one_prompt(p) for p in v):
            return v
        raise ValueError(f"give a non-empty string or list of token ids, or a list of 1 to {MAX_PROMPTS} of them")


ToolName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionSpec(BaseModel):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: ToolName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


ReasoningEffort = Literal["minimal", "low", "medium", "high"]
TemplateKwargs = Annotated[dict[str, Any], Field(max_length=32)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None


class ChatRequest(_OpenAI):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: Annotated[list[ToolSpec], Field(max_length=256)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: ReasoningEffort | None = None  # the chat template's `reasoning_effort` (gpt-oss's reads it)
    chat_template_kwargs: TemplateKwargs | None = None  # vLLM's: more variables for the template (Qwen3's `enable_thinking`)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return self


# OpenAI's Responses API ---------------------------------------------------------------------------
class ResponsesTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]  # built-in tools (web search, files, ...) are OpenAI's own services
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ResponsesToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: ToolName


class TextFormat(JsonSchemaFormat):
    """`text.format`: chat's `response_format` with the schema's fields beside its type."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type 'json_schema' needs 'schema'")
        return self


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # reasoning comes back whole, not summarised


RESPONSES_INCLUDE = ("message.output_text.logprobs", "reasoning.encrypted_content")


class ResponsesRequest(_Guided):
    not_yet: ClassVar[dict] = {**_NOT_YET, "background": (None, False), "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,),
                               "truncation": (None, "disabled"), "service_tier": (None, "auto", "default")}  # fmt: skip

    input: Annotated[str, StringConstraints(min_length=1)] | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    tools: Annotated[list[ResponsesTool], Field(max_length=256)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    include: list[Literal[RESPONSES_INCLUDE]] | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    chat_template_kwargs: TemplateKwargs | None = None  # as chat's (vLLM's extension)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicThinking(BaseModel):
    """Anthropic's extended thinking: the template's `enable_thinking` (Qwen3's reads it) and the
    reply's reasoning in `thinking` blocks; `budget_tokens` is checked as Anthropic checks it but
    bounds nothing beyond `max_tokens`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "disabled"]
    budget_tokens: StrictInt | None = Field(None, ge=1024)

    @model_validator(mode="after")
    def _budget_given(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("type 'enabled' needs 'budget_tokens' (at least 1024)")
        return self


class MessagesRequest(_Guided):
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    max_tokens: StrictInt = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=256)] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: AnthropicThinking | None = None

    @model_validator(mode="after")
    def _budget_under_max(self):
        if self.thinking is not None and self.thinking.type == "enabled" and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=256)] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: AnthropicThinking | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True  # the tokenizer's BOS, where it has one
    chat_template_kwargs: TemplateKwargs | None = None

    @field_validator("messages")
    @classmethod
    def _one_input(cls, v, info):
        if v is not None and info.data.get("prompt") is not None:
            raise ValueError("give 'prompt' or 'messages', not both")
        return v


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]


class RebuildRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    expert_slots: StrictInt | None = Field(None, ge=1)
    kv_pages: StrictInt | None = Field(None, ge=2)
    drain: StrictBool = False


def stops_of(body: BaseModel, field: str, limits: Limits) -> list[str]:
    """A body's stop strings as a list, within `limits` (else `ApiError`)."""
    v = getattr(body, field)
    stops = [] if v is None else [v] if isinstance(v, str) else list(v)
    if len(stops) > limits.max_stops or any(len(s) > limits.max_stop_chars for s in stops):
        raise ApiError(400, f"at most {limits.max_stops} stop strings of at most {limits.max_stop_chars} characters each", param=field)
    return stops
