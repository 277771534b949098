"""gpt-oss's harmony format: replies read into reasoning, content and tool calls whole and as
they stream (`harmony.HarmonyStream`), and the chat API end to end on a tiny checkpoint whose
tokenizer has harmony's special tokens and whose template renders harmony
(tests/templates/harmony.jinja): grammar-shaped replies come back split by channel, and forced
calls parse against their schema, streamed or not."""

import json
import os

import jsonschema
import openai
import pytest
from helpers import chat_checkpoint, model_server

from freetoken_jax import EngineConfig
from freetoken_jax.server.chat import Reply, Tools, openai_messages, render_messages
from freetoken_jax.server.harmony import HarmonyStream
from freetoken_jax.server.schemas import ChatRequest
from freetoken_jax.server.tools import FORMATS, detect

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
TEMPLATE = open(os.path.join(os.path.dirname(__file__), "..", "templates", "harmony.jinja")).read()
SPECIAL = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

# (generated text as decoded with special tokens, stop token dropped; reasoning, content, calls)
SAMPLES = [
    ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.',
     'User asks: "What is 2 + 2?" Simple.', "2 + 2 = 4.", []),
    ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking Oslo.<|end|>'
     '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "days": 2}',
     "Need the weather.", "Checking Oslo.", [("get_weather", {"city": "Oslo", "days": 2})]),
    # the recipient in the role part of the header; a built-in tool's call is reasoning
    ('<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=browser.search<|channel|>analysis<|message|>{"query": "x"}<|end|>'
     '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome", "days": 1}<|call|>',
     'Look it up.{"query": "x"}', "", [("get_weather", {"city": "Rome", "days": 1})]),
    ("plain text from a model that does not write harmony", "", "plain text from a model that does not write harmony", []),
]  # fmt: skip


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_harmony_stream_splits_channels_as_they_come(sample, step):
    text, reasoning, content, calls = SAMPLES[sample]
    reply = Reply(Tools.of(TOOLS, None, None, FORMATS["harmony"]), True, harmony=True)
    events = [e for k in range(0, len(text), step) for e in reply.push(text[k : k + step])] + reply.finish()
    assert (reply.reasoning, reply.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == calls
    for i, c in enumerate(reply.calls):  # argument deltas add up, after the call's start
        assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == i) == c.arguments
        start = next(k for k, e in enumerate(events) if e[0] == "call" and e[1] == i)
        assert all(k > start for k, e in enumerate(events) if e[0] == "arguments" and e[1] == i)
    # without tools the call's text is content; harmony markers never reach the user
    plain = HarmonyStream(calls=False)
    ev = plain.push(text) + plain.finish()
    assert not plain.calls and all("<|" not in e[1] for e in ev if text.startswith("<|"))


def test_harmony_is_detected_and_renders_tool_history():
    assert detect(TEMPLATE).name == "harmony" and FORMATS["harmony"].parse(SAMPLES[1][0])[0].name == "get_weather"
    body = ChatRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need it.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}], "tools": TOOLS})  # fmt: skip
    text = render_messages(TEMPLATE, openai_messages(body.messages), Tools.of(TOOLS, None, None, FORMATS["harmony"]))
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text and "type get_weather = (_: " in text
    assert ('<|start|>assistant<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
            '<|constrain|>json<|message|>{"city": "Oslo", "days": 1}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
            "<|message|>sunny<|end|><|start|>assistant") in text  # fmt: skip


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    path = chat_checkpoint(str(tmp_path_factory.mktemp("harmony")), TEMPLATE, SPECIAL, eos=["<|return|>", "<|call|>"])
    ecfg = EngineConfig(dtype="float32", max_context=1024, max_batch=2, page_size=16, prefill_chunk=256)
    with model_server(path, "oss", ecfg) as (url, service):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120), service


def test_harmony_chat_end_to_end(harmony):
    client, service = harmony
    assert service.tool_format.name == "harmony" and service.reasoning_parser  # channels are always kept apart
    grammar = 'start: <|channel|> "analysis" <|message|> "pl" "a"* "n" <|end|> <|start|> "assistant" <|channel|> "final" <|message|> "yes" <|return|>'
    kw = dict(
        model="oss",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=60,
        temperature=1.0,
        seed=1,
        extra_body={"guided_grammar": grammar},
    )
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.content == "yes" and msg.model_extra["reasoning_content"].startswith("pl")
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(d.content or "" for d in deltas) == "yes"
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == msg.model_extra["reasoning_content"]
    # a forced call: harmony's grammar, read back as a tool call, streamed or not
    for seed in range(2):
        kw = dict(model="oss", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required", max_tokens=120,
                  temperature=1.0, seed=seed)  # fmt: skip
        r = client.chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather" and not r.choices[0].message.content
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        args = "".join(d.function.arguments or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices
                       for d in c.choices[0].delta.tool_calls or [])  # fmt: skip
        assert args == call.function.arguments


def test_cli_chat_shows_reasoning_apart(capsys):
    """`chat` on a harmony model: the answer on stdout (and into the conversation), the reasoning
    on stderr, no markers in either."""
    import types

    from freetoken_jax.cli import _stream

    text = SAMPLES[0][0]

    class Engine:
        def stream_text(self, ids, special=False, **kw):
            assert special  # harmony needs its markers decoded
            yield from (text[k : k + 3] for k in range(0, len(text), 3))

    args = types.SimpleNamespace(max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    reply, _ = _stream(Engine(), [1], args, harmony=True)
    out, err = capsys.readouterr()
    assert reply == "2 + 2 = 4." and out == reply + "\n" and err == SAMPLES[0][1]


def test_harmony_chat_over_grpc_splits_reasoning(harmony):
    import grpc

    from freetoken_jax.server.grpc_service import serve_grpc
    from freetoken_jax.server.pb import freetoken_pb2 as pb
    from freetoken_jax.server.pb import freetoken_pb2_grpc as pb_grpc

    _, service = harmony
    server, port = serve_grpc(service, "127.0.0.1", 0)
    grammar = 'start: <|channel|> "analysis" <|message|> "pl" "a"* "n" <|end|> <|start|> "assistant" <|channel|> "final" <|message|> "yes" <|return|>'
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")]), max_new_tokens=60,
                                     sampling=pb.SamplingParams(temperature=1.0, seed=1), constraint=pb.Constraint(lark=grammar))  # fmt: skip
            chunks = [r.chunk for r in pb_grpc.FreeTokenStub(channel).Generate(req) if r.WhichOneof("event") == "chunk"]
    finally:
        server.stop(None)
    reasoning, text = "".join(c.reasoning for c in chunks), "".join(c.text for c in chunks)
    assert text == "yes" and reasoning.startswith("pla") and reasoning.endswith("n") and set(reasoning[2:-1]) <= {"a"}
