"""OpenAI's Responses API through the official openai client: the same prompt and greedy text as
the chat API for the same conversation, streamed events that add up to the response, function
calls that validate against their tools' schemas, structured output, log-probabilities, stored
responses continued by `previous_response_id`, reasoning items (a harmony checkpoint), and 400s
for what is not supported; the input items' mapping to template messages and the output items
built from a reply's events checked against plain models of both."""

import json
import os

import anthropic
import jsonschema
import openai
import pytest
from helpers import chat_checkpoint, demo_server, model_server

from freetoken_jax import EngineConfig
from freetoken_jax.server.chat import Tools, anthropic_messages, content_text, openai_messages, render_messages
from freetoken_jax.server.responses import TEXT_PARTS, OutputItems, ResponseStore, chat_messages
from freetoken_jax.server.schemas import AnthropicMessage, ChatMessage, ChatRequest
from freetoken_jax.server.service import ApiError
from freetoken_jax.server.tools import FORMATS, ToolCall

EC = EngineConfig(dtype="float32", max_context=1024, max_batch=4, page_size=16, prefill_chunk=256)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]


def post(client, path: str, body: dict) -> tuple[int, dict]:
    """A POST to the server's route outside /v1 (vLLM's /tokenize): status and JSON body."""
    r = client._client.post(str(client.base_url).removesuffix("/v1/") + path, json=body)
    return r.status_code, r.json()


@pytest.fixture(scope="module")
def server():
    with demo_server(EC) as (url, service):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120), service


# Input items -> template messages ----------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Need it."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
]
CHAT_HISTORY = [
    {"role": "system", "content": "Answer in English."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Need it.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {"role": "developer", "content": "Be brief."},
]  # fmt: skip


def test_input_items_are_the_chat_messages_of_the_same_conversation():
    want = openai_messages(ChatRequest.model_validate({"messages": CHAT_HISTORY}).messages)
    assert chat_messages(HISTORY, "Answer in English.") == want
    # a call with no assistant text before it opens its own assistant message, reasoning included
    got = chat_messages([HISTORY[0], HISTORY[1], HISTORY[3]], None)
    assert got[1] == {"role": "assistant", "content": "", "reasoning_content": "Need it.", "thinking": "Need it.",
                      "tool_calls": [want[2]["tool_calls"][0]]}  # fmt: skip
    harmony = open(os.path.join(os.path.dirname(__file__), "..", "templates", "harmony.jinja")).read()
    text = render_messages(harmony, got, Tools.of(CHAT_TOOLS, None, None, FORMATS["harmony"]))
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
        in text
    )


@pytest.mark.parametrize(
    "item",
    [{"type": "item_reference", "id": "x"}, {"role": "tool", "content": "x"}, {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]},
     {"type": "function_call", "name": "f", "arguments": "{}"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"},
     {"type": "function_call_output", "output": "x"}, {"type": "function_call_output", "call_id": "c1", "output": None},
     {"role": "user", "content": 3}, {"role": "user", "content": None}, "text"],
)  # fmt: skip
def test_bad_input_items_name_their_place(item):
    with pytest.raises(ApiError) as e:
        chat_messages([{"role": "user", "content": "hi"}, item], None)
    assert e.value.status == 400 and e.value.param.startswith("input.1")


def test_each_api_reads_content_parts_with_one_reader_that_names_the_bad_part():
    parts = [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}, {"type": "output_text", "text": "c"}]
    assert content_text(parts, "x", TEXT_PARTS) == "abc"
    image = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]
    bad = [
        lambda: content_text(parts, "x"),  # chat and Anthropic take text parts only
        lambda: openai_messages([ChatMessage(role="user", content=image)]),
        lambda: anthropic_messages(
            [AnthropicMessage(role="user", content=[{"type": "tool_result", "tool_use_id": "t", "content": image}])], None
        ),
        lambda: chat_messages([{"role": "user", "content": [{"type": "input_text"}]}], None),
    ]
    params = []
    for f in bad:
        with pytest.raises(ApiError) as e:
            f()
        params.append(e.value.param)
    assert params == ["x.1", "messages.0.content.1", "messages.0.content.0.content.1", "input.0.content.0"]


# Reply events -> output items --------------------------------------------------------------------
def test_output_items_follow_the_reply_events():
    out = OutputItems()
    call = ToolCall("get_weather", '{"city": "Oslo"}', "call_1")
    events = [("reasoning", "Need "), ("reasoning", "it."), ("content", "Check"), ("content", "ing."), ("call", 0, call),
              ("arguments", 0, '{"city": '), ("arguments", 0, '"Oslo"}'), ("call", 1, ToolCall("get_time", "{}", "call_2")), ("content", "!")]  # fmt: skip
    sse = [e for ev in events for e in out.push(ev)] + out.close("incomplete")
    parsed = [json.loads(e.split("data: ", 1)[1]) for e in sse]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    assert all(e.startswith(f"event: {p['type']}\n") for e, p in zip(sse, parsed))
    items = out.items
    assert [(i["type"], i["status"]) for i in items] == [("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"),
                                                         ("function_call", "completed"), ("message", "incomplete")]  # fmt: skip
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Need it."}] and items[1]["content"][0]["text"] == "Checking."
    assert (items[2]["call_id"], items[2]["name"], items[2]["arguments"]) == ("call_1", "get_weather", '{"city": "Oslo"}')
    assert (items[3]["call_id"], items[3]["arguments"], items[4]["content"][0]["text"]) == ("call_2", "", "!")
    # each item: added, its deltas, its done events, in order and naming it
    for k, item in enumerate(items):
        mine = [p for p in parsed if p.get("output_index") == k]
        assert mine[0]["type"] == "response.output_item.added" and mine[0]["item"]["id"] == item["id"]
        assert mine[-1] == {
            "type": "response.output_item.done",
            "sequence_number": mine[-1]["sequence_number"],
            "output_index": k,
            "item": item,
        }
        deltas = "".join(p["delta"] for p in mine if p["type"].endswith(".delta"))
        assert deltas == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
        assert all(p.get("item_id", item["id"]) == item["id"] for p in mine)


def test_the_store_keeps_the_newest():
    store = ResponseStore(size=2)
    for k in range(3):
        store.put({"id": f"r{k}"}, [{"k": k}])
    assert store.get("r2")[1] == [{"k": 2}] and store.get("r1")[0] == {"id": "r1"}
    with pytest.raises(ApiError) as e:
        store.get("r0", "previous_response_id")
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    store.delete("r1")
    with pytest.raises(ApiError):
        store.get("r1")


# End to end on the demo model ---------------------------------------------------------------------
def test_text_equals_the_chat_apis_and_streams_into_the_same_response(server):
    client, _ = server
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The for statement"}]
    chat = client.chat.completions.create(model="demo", messages=msgs, max_tokens=24, temperature=0)
    r = client.responses.create(model="demo", instructions="Be brief.", input="The for statement", max_output_tokens=24, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"
    events = list(client.responses.create(model="demo", instructions="Be brief.", input="The for statement", max_output_tokens=24, temperature=0,
                                          stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.usage.output_tokens == 24
    # a reply that ends by itself is completed
    done = client.responses.create(model="demo", input="Hi", max_output_tokens=400, temperature=0, text={"format": {"type": "json_object"}})
    assert done.status == "completed" and isinstance(json.loads(done.output_text), dict)


def test_conversation_items_render_as_the_chat_messages_do(server):
    client, _ = server
    chat = client.chat.completions.create(model="demo", messages=CHAT_HISTORY, tools=CHAT_TOOLS, max_tokens=12, temperature=0)
    r = client.responses.create(
        model="demo", instructions="Answer in English.", input=HISTORY, tools=TOOLS, max_output_tokens=12, temperature=0
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.output_text == chat.choices[0].message.content


def test_previous_response_id_continues_the_stored_conversation(server):
    client, _ = server
    first = client.responses.create(model="demo", input="Weather?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=200, temperature=1.0, extra_body={"seed": 3})  # fmt: skip
    (call,) = [o for o in first.output if o.type == "function_call"]
    more = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    nxt = client.responses.create(model="demo", previous_response_id=first.id, input=more, tools=TOOLS, max_output_tokens=10, temperature=0)
    whole = [{"role": "user", "content": "Weather?"}] + [o.model_dump(exclude_none=True) for o in first.output] + more
    again = client.responses.create(model="demo", input=whole, tools=TOOLS, max_output_tokens=10, temperature=0)
    assert nxt.usage.input_tokens == again.usage.input_tokens > first.usage.input_tokens and nxt.output_text == again.output_text
    assert nxt.previous_response_id == first.id
    assert client.responses.retrieve(nxt.id).output_text == nxt.output_text
    client.responses.delete(nxt.id)
    for call in (
        lambda: client.responses.retrieve(nxt.id),
        lambda: client.responses.create(model="demo", previous_response_id=nxt.id, input="x"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model="demo", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_validate_against_their_schema(server, stream):
    client, _ = server
    for seed, choice in enumerate(["required", {"type": "function", "name": "get_weather"}]):
        kw = dict(
            model="demo",
            input="Weather?",
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_output_tokens=300,
            temperature=1.0,
            extra_body={"seed": seed},
        )
        if not stream:
            r = client.responses.create(**kw)
        else:
            events = list(client.responses.create(stream=True, **kw))
            r = events[-1].response
            for item in r.output:
                if item.type == "function_call":
                    k = r.output.index(item)
                    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == k)
                    (done,) = [e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == k]
                    assert deltas == done.arguments == item.arguments
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and calls
        for c in calls:
            assert c.name == "get_weather" and c.call_id
            jsonschema.validate(json.loads(c.arguments), WEATHER)


def test_json_schema_format_and_logprobs(server):
    client, service = server
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    for seed in range(3):
        r = client.responses.create(
            model="demo", input="Give", text={"format": fmt}, max_output_tokens=120, temperature=1.0, extra_body={"seed": seed}
        )
        jsonschema.validate(json.loads(r.output_text), WEATHER)
        assert r.text.format.type == "json_schema"
    kw = dict(model="demo", input="Name a color", max_output_tokens=8, temperature=0.8, extra_body={"seed": 5})
    r = client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=3)
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Name a color"}], max_tokens=8, temperature=0.8,
                                          seed=5, logprobs=True, top_logprobs=3)  # fmt: skip
    got, want = r.output[0].content[0].logprobs, chat.choices[0].logprobs.content
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in got] == [(e.token, [t.token for t in e.top_logprobs]) for e in want]
    # the same tokens' log-probabilities (another step of another batch: float32 rounding apart)
    flat = lambda es: [v for e in es for v in [e.logprob] + [t.logprob for t in e.top_logprobs]]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(flat(got), flat(want))) < 1e-4 and len(got) == 8
    streamed = list(client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=3, stream=True))
    deltas = [lp for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in streamed if e.type == "response.output_text.done"]
    dump = lambda es: [e.model_dump() for e in es]  # noqa: E731
    assert dump(deltas) == dump(done.logprobs) == dump(streamed[-1].response.output[0].content[0].logprobs)
    assert [e.token for e in deltas] == [e.token for e in got] and max(abs(a - b) for a, b in zip(flat(deltas), flat(got))) < 1e-4


def test_reasoning_effort_and_template_kwargs_reach_the_template(server):
    client, service = server
    kept = service.template
    service.template = "{{ reasoning_effort or '' }}{{ 'T' if enable_thinking is defined and enable_thinking else '' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"  # fmt: skip
    msgs = [{"role": "user", "content": "x"}]
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    try:
        plain = client.responses.create(model="demo", input="x", max_output_tokens=1)
        high = client.responses.create(model="demo", input="x", max_output_tokens=1, reasoning={"effort": "high", "summary": "auto"})
        chat = client.chat.completions.create(model="demo", messages=msgs, max_tokens=1, reasoning_effort="high")
        both = client.responses.create(model="demo", input="x", max_output_tokens=1, reasoning={"effort": "low"}, extra_body=on)
        chat_on = client.chat.completions.create(model="demo", messages=msgs, max_tokens=1, extra_body=on)
        status, tokenized = post(client, "/tokenize", {"messages": msgs, **on})
        _, bare = post(client, "/tokenize", {"prompt": "x", "add_special_tokens": False})
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="demo", messages=msgs, max_tokens=1, extra_body={"chat_template_kwargs": {"messages": []}})
    finally:
        service.template = kept
    assert plain.usage.input_tokens == len(service.encode("x"))
    assert high.usage.input_tokens == len(service.encode("highx")) == chat.usage.prompt_tokens
    assert both.usage.input_tokens == len(service.encode("lowTx")) and chat_on.usage.prompt_tokens == len(service.encode("Tx"))
    assert status == 200 and tokenized["tokens"] == service.encode("Tx") and bare["tokens"] == service.encode("x", add_bos=False)


@pytest.mark.parametrize(
    "kw",
    [dict(tools=[{"type": "web_search"}]), dict(background=True), dict(include=["file_search_call.results"]), dict(top_logprobs=2),
     dict(truncation="auto"), dict(text={"format": {"type": "json_schema", "name": "x"}}), dict(text={"verbosity": "low"}),
     dict(input=[{"type": "item_reference", "id": "x"}]), dict(tool_choice="required"), dict(max_tool_calls=3),
     dict(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), dict(reasoning={"effort": "max"})],
)  # fmt: skip
def test_unsupported_or_bad_fields_are_400(server, kw):
    client, _ = server
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="demo", **{"input": "x", "max_output_tokens": 2, **kw})


# Reasoning items on a harmony checkpoint ----------------------------------------------------------
def test_harmony_reasoning_comes_back_as_a_reasoning_item(tmp_path):
    template = open(os.path.join(os.path.dirname(__file__), "..", "templates", "harmony.jinja")).read()
    special = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
    path = chat_checkpoint(str(tmp_path), template, special, eos=["<|return|>", "<|call|>"])
    grammar = 'start: <|channel|> "analysis" <|message|> "pl" "a"* "n" <|end|> <|start|> "assistant" <|channel|> "final" <|message|> "yes" <|return|>'
    with model_server(path, "oss", EC) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(model="oss", input="x", max_output_tokens=60, temperature=1.0, extra_body={"seed": 1, "guided_grammar": grammar})
        r = client.responses.create(**kw)
        events = list(client.responses.create(stream=True, **kw))
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text.startswith("pla") and reasoning.content[0].text.endswith("n")
    assert message.type == "message" and r.output_text == "yes"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"] and events[-1].response.output_text == "yes"


def test_a_failure_mid_stream_ends_it_with_error_and_failed(server, monkeypatch):
    client, service = server
    tok = service.tokenizer
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bad")))
    events = list(client.responses.create(model="demo", input="x", max_output_tokens=4, stream=True))
    monkeypatch.setattr(tok, "decode", real)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert "RuntimeError" in events[2].message and events[3].response.status == "failed" and events[3].response.error.message
    assert client.responses.create(model="demo", input="x", max_output_tokens=2).status == "incomplete"  # the server goes on


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(server):
    client, service = server
    hits = lambda: service.scheduler.get_metrics()["prefix_hit_tokens"]  # noqa: E731
    prompt = "A prompt that is long enough to fill a few pages of the cache: " * 3
    seen = []
    for _ in range(2):
        before = hits()
        r = client.responses.create(model="demo", input=prompt, max_output_tokens=2)
        seen.append((r.usage.input_tokens_details.cached_tokens, hits() - before, r.usage.input_tokens))
    before = hits()
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}], max_tokens=2)
    seen.append((chat.usage.prompt_tokens_details.cached_tokens, hits() - before, chat.usage.prompt_tokens))
    before = hits()
    done = client.completions.create(model="demo", prompt=prompt, max_tokens=2)
    seen.append((done.usage.prompt_tokens_details.cached_tokens, hits() - before, done.usage.prompt_tokens))
    a = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="x", max_retries=0, timeout=120)
    kw = dict(model="demo", max_tokens=2, messages=[{"role": "user", "content": prompt}])
    total = a.messages.count_tokens(model="demo", messages=kw["messages"]).input_tokens
    for stream in (False, True):  # Anthropic's input_tokens leave out what was read from the cache
        before = hits()
        if stream:
            with a.messages.stream(**kw) as st:
                u = st.get_final_message().usage
        else:
            u = a.messages.create(**kw).usage
        seen.append((u.cache_read_input_tokens, hits() - before, total))
        assert u.input_tokens + u.cache_read_input_tokens == total
    assert seen[0][0] == 0 and all(c == h for c, h, _ in seen)  # a new prompt reads nothing; each says what the cache gave it
    assert seen[-1][0] == seen[-2][0] == seen[1][0]  # Anthropic's rendering of the same message is the chat's
    assert all(0 < c <= n and c % EC.page_size == 0 for c, _, n in seen[1:3]) and seen[1][0] == seen[2][0]  # the same rendered prompt
