"""Tool calling and reasoning: each family's call format read back whole and as it streams,
the grammars that force calls, the templates that render tool history, and the APIs end to end
(the openai and anthropic clients) on the demo model and on a tiny Qwen3-MoE checkpoint with
Qwen3's chat template and a tokenizer with its added tokens."""

import json
import os
import random

import anthropic
import jsonschema
import openai
import pytest
from helpers import chat_checkpoint, demo_server, model_server

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.server.chat import Tools, openai_messages, render_messages
from freetoken_jax.server.schemas import ChatRequest
from freetoken_jax.server.tools import FORMATS, ThinkStream, ToolCall, ToolStream, _object_end, detect

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TEMPLATE = open(os.path.join(os.path.dirname(__file__), "..", "templates", "qwen3.jinja")).read()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[TOOL_CALLS]", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
           "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"]  # fmt: skip
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]


# Formats ------------------------------------------------------------------------------------------
SAMPLES = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": {"n": 2}}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": {"n": 2}}}, {"name": "get_time", "arguments": {}}]',
    "deepseek_v3": "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Oslo", "days": {"n": 2}}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```'
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "glm45": "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n"
             '<arg_value>{"n": 2}</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>',
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_tool_stream_reads_calls_as_they_come(fmt, step):
    text = SAMPLES[fmt]
    ts = ToolStream(FORMATS[fmt])
    events = []
    for k in range(0, len(text), step):
        events += ts.push(text[k : k + step])
    last, content, calls = ts.finish()
    events += last
    assert content == "Let me check.\n" if fmt == "hermes" else content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "days": {"n": 2}}), ("get_time", {})]
    assert "".join(e[1] for e in events if e[0] == "content") == content
    for i, c in enumerate(calls):  # the argument deltas add up to the arguments, after the call's start
        assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == i) == c.arguments
        starts = [k for k, e in enumerate(events) if e[0] == "call" and e[1] == i]
        assert len(starts) == 1 and all(k > starts[0] for k, e in enumerate(events) if e[0] == "arguments" and e[1] == i)


def writing(fmt: str, calls: list[dict]) -> str:
    """A reply making `calls` ({"name", "arguments"}) in `fmt`'s form, after a line of text."""
    return "Writing it." + FORMATS[fmt].write([ToolCall(c["name"], json.dumps(c["arguments"])) for c in calls])


def stream_counting_reads(f, text: str, step: int):
    """`text` streamed through a `ToolStream` of format `f` in deltas of `step` characters: (events,
    content, calls, the length of each section `f.partial` read)."""
    read = []
    real = f.partial
    f.partial = lambda section, memo=None: read.append(len(section)) or real(section, memo)
    try:
        ts = ToolStream(f)
        events = [e for k in range(0, len(text), step) for e in ts.push(text[k : k + step])]
    finally:
        del f.partial
    last, content, calls = ts.finish()
    return events + last, content, calls, read


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_a_long_call_streams_without_reading_its_section_at_every_delta(fmt):
    content = "def f(x):\n    return {'a': [x]}  # code, with the braces and brackets JSON closes with\n" * 300
    text = writing(fmt, [{"name": "write_file", "arguments": {"path": "a.py", "content": content}}])
    f = FORMATS[fmt]
    events, content_text, calls, read = stream_counting_reads(f, text, 4)
    assert content_text.startswith("Writing it.") and [c.name for c in calls] == ["write_file"]
    assert json.loads("".join(e[2] for e in events if e[0] == "arguments")) == {"path": "a.py", "content": content}
    if not f.streams_arguments:  # read again only where one of the format's `closes` arrived
        closers = sum(text.count(c) for c in f.closes)
        assert len(read) <= closers + 1 and sum(read) <= (closers + 1) * len(text), (len(read), closers)


def test_the_incremental_object_scan_ends_where_json_does():
    # _object_end, fed a growing text, against json's own reading of each prefix.
    rng = random.Random(0)
    pieces = ['"a\\"}"', '"\\\\"', "{", "}", "[", "]", '"<tool_call>"', '"x{[y"', "1", ", ", ": "]
    for _ in range(300):
        obj = {
            "k": [rng.choice([{"s": "".join(rng.choice('ab{}[]"\\<>') for _ in range(rng.randint(0, 6)))}, [1, {}], "q\\"])],
            "n": rng.random(),
        }
        text = "  " + json.dumps(obj) + rng.choice(["", " </tool_call>", "}"]) + "".join(rng.choice(pieces) for _ in range(2))
        memo, j = {}, 2
        for n in range(j, len(text) + 1):
            got = _object_end(text[:n], j, memo)
            try:
                want = json.JSONDecoder().raw_decode(text[:n], j)[1]
            except ValueError:
                want = None
            assert got == want, (text[:n], got, want)
            if got is not None:
                break


def test_many_calls_stream_without_reading_the_complete_ones_again():
    # Forty calls at once (an agent writing forty files): a Hermes stream, which reads the open
    # call's arguments at every delta, reads from the call being written, not from the first.
    calls = [
        {"name": "write_file", "arguments": {"path": f"f{i}.txt", "content": "{x: [1]}\n" * (i % 3) + "x" * (40 + i)}} for i in range(40)
    ]
    one = [writing("hermes", [c]).removeprefix("Writing it.") for c in calls]
    text = "Writing it." + "".join(one)
    events, content, got, read = stream_counting_reads(FORMATS["hermes"], text, 3)
    assert content == "Writing it." and [(c.name, json.loads(c.arguments)) for c in got] == [(c["name"], c["arguments"]) for c in calls]
    for i, c in enumerate(got):
        assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == i) == c.arguments
    assert [e[1] for e in events if e[0] == "call"] == list(range(40))
    assert max(read) <= 3 * max(map(len, one)), max(read)


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
@pytest.mark.parametrize("inner", ["<tool_call>", "</tool_call>\n<tool_call>", "[TOOL_CALLS]", "]}]", "<arg_key>k</arg_key>", "```\n"])
def test_a_marker_inside_an_argument_is_text(fmt, inner):
    # An agent writing a file about tool calls: the markers in its content are not calls.
    calls = [
        {"name": "write_file", "arguments": {"path": "a.md", "content": f"see {inner} here"}},
        {"name": "get_time", "arguments": {"zone": "UTC"}},
    ]
    text = writing(fmt, calls)
    f = FORMATS[fmt]
    assert [(c.name, json.loads(c.arguments)) for c in f.parse(text[len("Writing it.") :])] == [(c["name"], c["arguments"]) for c in calls]
    for step in (1, 5, 1000):
        events, content, got, _ = stream_counting_reads(f, text, step)
        assert content.rstrip() == "Writing it." and [(c.name, json.loads(c.arguments)) for c in got] == [
            (c["name"], c["arguments"]) for c in calls
        ]
        assert [e[1] for e in events if e[0] == "call"] == [0, 1]
        for i, c in enumerate(got):
            assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == i) == c.arguments
    if f.streams_arguments:  # the first call streams whole while the second is written, the marker no pause
        ts = ToolStream(f)
        cut = text.index(calls[1]["name"])
        pushed = [e for k in range(0, cut, 3) for e in ts.push(text[k : min(k + 3, cut)])]
        assert "".join(e[2] for e in pushed if e[0] == "arguments" and e[1] == 0) == json.dumps(calls[0]["arguments"])


@pytest.mark.parametrize(
    "fmt, bad",
    [("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> and prose'), ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}'),
     ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'), ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "<tool_call>"}\n</tool_call>'),
     ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</tool_call>"), ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>"),
     ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}'), ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ')],
)  # fmt: skip
def test_an_unfinished_or_malformed_section_does_not_parse(fmt, bad):
    with pytest.raises((ValueError, KeyError)):
        FORMATS[fmt].parse(bad)


def test_glm45_is_told_from_hermes_and_its_grammar_forces_calls_that_parse():
    assert detect("{{ '<tool_call>' }}{{ '<arg_key>' }}").name == "glm45" and detect("{{ '<tool_call>' }}").name == "hermes"
    fmt = FORMATS["glm45"]
    assert fmt.parse("<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>12ab</arg_value>\n</tool_call>")[0].arguments == '{"s": "12ab"}'
    engine = FreeTokenEngine.from_pretrained("demo", EngineConfig(dtype="float32", max_context=512, max_batch=1))
    grammar = fmt.grammar(TOOLS, many=False)
    for seed in range(3):
        text = engine.tokenizer.decode(list(engine.generate("call:", max_new_tokens=400, temperature=1.0, seed=seed, lark=grammar)))
        (call,) = fmt.parse(text)
        assert call.name in SCHEMAS and set(json.loads(call.arguments)) <= set(SCHEMAS[call.name]["properties"]), text


def test_a_section_that_does_not_parse_is_content():
    ts = ToolStream(FORMATS["hermes"])
    ev = ts.push("a <tool_call> not json") + ts.finish()[0]
    assert "".join(e[1] for e in ev if e[0] == "content") == "a <tool_call> not json"
    assert ts.finish()[2] == []
    assert detect(TEMPLATE).name == "hermes" and detect("{{ '[TOOL_CALLS]' }}").name == "mistral" and detect(None).name == "hermes"


@pytest.mark.parametrize(
    "text, inside, want",
    [("<think>\nplan it</think>\n\nThe answer", False, ("\nplan it", "The answer")), ("No reasoning here", False, ("", "No reasoning here")),
     ("plan</think>answer", True, ("plan", "answer")), ("  <thi", False, ("", "<thi")), ("still thinking", True, ("still thinking", ""))],
)  # fmt: skip
def test_think_stream(text, inside, want):
    for step in (1, 2, 100):
        t = ThinkStream(inside)
        parts = [t.push(text[k : k + step]) for k in range(0, len(text), step)] + [t.flush()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want


def test_tool_history_renders_through_the_template():
    body = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": TOOLS})  # fmt: skip
    tools = Tools.of(TOOLS, None, None, FORMATS["hermes"])
    text = render_messages(TEMPLATE, openai_messages(body.messages), tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert json.dumps(TOOLS[0]) in text  # the template's own tool list
    plain = render_messages(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", openai_messages(body.messages), tools
    )
    assert plain.startswith("system: # Tools") and '"get_time"' in plain  # a template without tools is given them in a system message


# The APIs on the demo model -------------------------------------------------------------------------
EC = EngineConfig(dtype="float32", max_context=1536, max_batch=4, page_size=16, prefill_chunk=256)


@pytest.fixture(scope="module")
def demo():
    with demo_server(EC) as (url, _):
        yield url


def check_calls(calls, names):
    assert calls and all(c.function.name in names for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_hold_on_random_weights(demo, stream):
    client = openai.OpenAI(base_url=demo + "/v1", api_key="x", max_retries=0, timeout=120)
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}] * 2):
        kw = dict(
            model="demo",
            messages=[{"role": "user", "content": "help"}],
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            parallel_tool_calls=False,
        )  # one call: random weights would go on calling till the length runs out
        names = ["get_time"] if isinstance(choice, dict) else list(SCHEMAS)
        if not stream:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
            check_calls(r.choices[0].message.tool_calls, names)
            continue
        calls, finish = {}, None
        for c in client.chat.completions.create(stream=True, **kw):
            if not c.choices:
                continue
            for d in c.choices[0].delta.tool_calls or []:
                if d.id:
                    calls[d.index] = openai.types.chat.ChatCompletionMessageToolCall(
                        id=d.id, type="function", function={"name": d.function.name, "arguments": ""}
                    )
                calls[d.index].function.arguments += d.function.arguments or ""
            finish = c.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        check_calls(list(calls.values()), names)


def test_anthropic_tool_use(demo):
    client = anthropic.Anthropic(base_url=demo, api_key="x", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": "d", "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kw = dict(model="demo", max_tokens=120, extra_body={"temperature": 1.0}, tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "help"}])  # fmt: skip
    r = client.messages.create(**kw)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses
    for b in uses:
        jsonschema.validate(b.input, SCHEMAS[b.name])
    with client.messages.stream(**{**kw, "tool_choice": {"type": "tool", "name": "get_weather"}}) as s:
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [b.name for b in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER)
    # the result goes back as a tool_result block and renders
    follow = client.messages.create(model="demo", max_tokens=4, tools=tools, messages=[
        {"role": "user", "content": "help"}, {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]}])  # fmt: skip
    assert follow.usage.output_tokens >= 1


def test_tool_requests_that_cannot_be_served_are_400(demo):
    client = openai.OpenAI(base_url=demo + "/v1", api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "x"}]
    for kw in (dict(tool_choice="required"), dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
               dict(tools=TOOLS + TOOLS[:1]), dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
               dict(messages=[{"role": "tool", "content": "x"}]), dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}])):  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="demo", max_tokens=2, **{"messages": msgs, **kw})


# A Qwen3-MoE checkpoint with Qwen3's template ---------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = chat_checkpoint(str(tmp_path_factory.mktemp("qwen3_tools")), TEMPLATE, SPECIAL, ADDED)
    with model_server(path, "qwen", EC) as (url, service):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120), service


def test_qwen_template_forced_calls_and_reasoning(qwen):
    client, service = qwen
    assert service.tool_format.name == "hermes"
    for seed in range(3):
        r = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required",
                                           max_tokens=160, temperature=1.0, seed=seed, parallel_tool_calls=False)  # fmt: skip
        check_calls(r.choices[0].message.tool_calls, list(SCHEMAS))
    # reasoning in its own field when the parser is on; in the content when off (vLLM's default)
    kw = dict(
        model="qwen",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=40,
        temperature=1.0,
        seed=1,
        extra_body={"guided_grammar": 'start: <think> "\\nab" "b"* </think> "\\n\\nyes"'},
    )  # <think>: the added token
    off = client.chat.completions.create(**kw).choices[0].message
    assert off.content.startswith("<think>\nab") and off.content.endswith("</think>\n\nyes")
    service.reasoning_parser = True
    try:
        on = client.chat.completions.create(**kw).choices[0].message
        streamed = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    finally:
        service.reasoning_parser = False
    assert on.content == "yes" and on.model_extra["reasoning_content"].startswith("\nab")
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in streamed) == on.model_extra["reasoning_content"]
    assert "".join(d.content or "" for d in streamed) == "yes"


def test_qwen_thinking_switches(qwen):
    client, service = qwen
    msgs = [{"role": "user", "content": "x"}]
    # vLLM's chat_template_kwargs: Qwen3's template closes an empty think section when thinking is off
    text = render_messages(TEMPLATE, openai_messages(ChatRequest.model_validate({"messages": msgs}).messages), None, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    empty = len(service.encode("<think>\n\n</think>\n\n", add_bos=False))
    off = client.chat.completions.create(
        model="qwen", messages=msgs, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    plain = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=1)
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens + empty
    # Anthropic's thinking: the template's enable_thinking, and the reasoning in thinking blocks (no --reasoning-parser here)
    a = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="x", max_retries=0, timeout=120)
    grammar = 'start: <think> "\\nab" "b"* </think> "\\n\\nyes"'
    kw = dict(model="qwen", max_tokens=1100, messages=msgs, extra_body={"guided_grammar": grammar, "seed": 1, "temperature": 1.0})
    on = a.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert (
        [b.type for b in on.content] == ["thinking", "text"] and on.content[0].thinking.startswith("\nab") and on.content[1].text == "yes"
    )
    with a.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **kw) as s:
        assert [(b.type, getattr(b, "thinking", None)) for b in s.get_final_message().content] == [
            (b.type, getattr(b, "thinking", None)) for b in on.content
        ]
    written = a.messages.create(**kw)  # without thinking the reply is the text as the model wrote it
    assert [b.type for b in written.content] == ["text"] and written.content[0].text.startswith("<think>\nab")
    count = lambda **k: a.messages.count_tokens(model="qwen", messages=msgs, **k).input_tokens  # noqa: E731
    assert count(thinking={"type": "disabled"}) == count() + empty == count(thinking={"type": "enabled", "budget_tokens": 1024}) + empty
    for bad in ({"type": "enabled", "budget_tokens": 1100}, {"type": "enabled"}, {"type": "enabled", "budget_tokens": 100}):
        with pytest.raises(anthropic.BadRequestError):
            a.messages.create(thinking=bad, **kw)
