"""The gRPC service on a loopback port, driven by a generated client stub."""

import filecmp
import json
import os
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from helpers import wait_idle

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.scheduler.scheduler import Scheduler
from freetoken_jax.server.grpc_service import serve_grpc
from freetoken_jax.server.pb import freetoken_pb2 as pb
from freetoken_jax.server.pb import freetoken_pb2_grpc as pb_grpc
from freetoken_jax.server.service import Service
from freetoken_jax.server.text import render_chat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def stub():
    engine = FreeTokenEngine.from_pretrained(
        "demo", EngineConfig(dtype="float32", max_context=128, max_batch=4, page_size=8, prefill_chunk=32)
    )
    sched = Scheduler(engine)
    service = Service(sched, "demo", engine.model_path)
    server, port = serve_grpc(service, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.FreeTokenStub(channel), service
    channel.close()
    server.stop(None)
    sched.shutdown()


def generate(stub, **kw):
    chunks, done = [], None
    for r in stub.Generate(pb.GenerateRequest(**kw)):
        if r.WhichOneof("event") == "chunk":
            chunks.append(r.chunk)
        else:
            done = r.done
    return chunks, done


def test_generate_streams_tokens_and_usage(stub):
    s, service = stub
    chunks, done = generate(s, text="Hello", max_new_tokens=9, sampling=pb.SamplingParams(temperature=0.0), ignore_eos=True)
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 9 and done.finish_reason == "length" and done.usage.completion_tokens == 9
    want = list(
        FreeTokenEngine.from_pretrained("demo", EngineConfig(dtype="float32", max_context=128)).generate(
            service.tokenizer.encode("Hello"), max_new_tokens=9, ignore_eos=True
        )
    )
    assert ids == want
    assert "".join(c.text for c in chunks) == service.tokenizer.decode(ids)


def test_tokenize_health_metrics_models(stub):
    s, service = stub
    assert list(s.Tokenize(pb.TokenizeRequest(text="ab")).ids) == service.tokenizer.encode("ab")
    assert s.Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING
    assert "requests_finished" in json.loads(s.GetMetrics(pb.MetricsRequest()).json)
    assert [m.id for m in s.ListModels(pb.ListModelsRequest()).models] == ["demo"]


def test_errors(stub):
    s, _ = stub
    with pytest.raises(grpc.RpcError) as e:
        generate(s, model="other", text="x", max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        generate(s, tokens=pb.TokenIds(ids=[1, 99999]), max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        generate(s, text="x", max_new_tokens=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cancel_frees_pages(stub):
    s, service = stub
    sched = service.scheduler
    assert wait_idle(sched)
    free = sched.engine.pages.free_pages + sched.get_metrics()["prefix_cached_pages"]
    call = s.Generate(pb.GenerateRequest(text="go on", max_new_tokens=100, ignore_eos=True))
    next(call)
    call.cancel()
    assert wait_idle(sched, 60)
    assert sched.engine.pages.free_pages + sched.get_metrics()["prefix_cached_pages"] == free


def test_concurrent_streams_equal_alone(stub):
    s, _ = stub
    kw = lambda i: dict(text=f"stream {i}", max_new_tokens=8, sampling=pb.SamplingParams(temperature=0.7, seed=i), ignore_eos=True)  # noqa: E731
    alone = [[t for c in generate(s, **kw(i))[0] for t in c.token_ids] for i in range(8)]
    got = {}
    ts = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, [t for c in generate(s, **kw(i))[0] for t in c.token_ids])) for i in range(8)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert [got[i] for i in range(8)] == alone


def test_stubs_are_current(tmp_path):
    out = tmp_path / "gen"
    out.mkdir()
    # the same command as `make protos`, writing elsewhere
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Ifreetoken_jax/server/pb=proto", f"--python_out={out}",
                    f"--grpc_python_out={out}", "proto/freetoken.proto"], check=True, cwd=ROOT)  # fmt: skip
    for f in ("freetoken_pb2.py", "freetoken_pb2_grpc.py"):
        assert filecmp.cmp(out / "freetoken_jax/server/pb" / f, os.path.join(ROOT, "freetoken_jax/server/pb", f), shallow=False), (
            f"{f} is stale: run `make protos`"
        )


def test_generate_controls_choices_and_constraints(stub):
    """The sampling controls, log-probabilities, n choices and grammars of the HTTP API, on gRPC."""
    s, service = stub
    ref = FreeTokenEngine.from_pretrained("demo", EngineConfig(dtype="float32", max_context=128))
    prompt = service.tokenizer.encode("abcabc")
    sp = pb.SamplingParams(temperature=0.0, presence_penalty=1.5, repetition_penalty=1.3, logit_bias={120: 3.0}, min_tokens=4)
    chunks, done = generate(s, tokens=pb.TokenIds(ids=prompt), max_new_tokens=8, sampling=sp, logprobs=3)
    ids = [t for c in chunks for t in c.token_ids]
    want = list(ref.generate(prompt, max_new_tokens=8, presence_penalty=1.5, repetition_penalty=1.3, logit_bias={120: 3.0}, min_tokens=4))
    assert ids == want and done.usage.completion_tokens == len(want)
    lps = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in lps] == ids and all(len(lp.top) == 3 for lp in lps)
    logits = ref.logits(prompt + ids)[len(prompt) - 1 : -1]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    np.testing.assert_allclose([lp.logprob for lp in lps], logits[np.arange(len(ids)), ids] - lse, atol=1e-3)
    # n choices, seeded seed + i, each ending with its own Done
    rs = list(s.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=prompt), max_new_tokens=5, n=3, ignore_eos=True,
                                            sampling=pb.SamplingParams(temperature=1.0, seed=11))))  # fmt: skip
    got = {i: [t for r in rs if r.WhichOneof("event") == "chunk" and r.chunk.index == i for t in r.chunk.token_ids] for i in range(3)}
    assert sorted(r.done.index for r in rs if r.WhichOneof("event") == "done") == [0, 1, 2]
    for i in range(3):
        assert got[i] == list(ref.generate(prompt, max_new_tokens=5, temperature=1.0, seed=11 + i, ignore_eos=True))
    schema = {
        "type": "object",
        "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["k"],
        "additionalProperties": False,
    }
    chunks, done = generate(s, text="x", max_new_tokens=30, sampling=pb.SamplingParams(temperature=1.0, seed=2),
                            constraint=pb.Constraint(json_schema=json.dumps(schema)))  # fmt: skip
    assert set(json.loads("".join(c.text for c in chunks))) == {"k"} and done.finish_reason == "stop"
    with pytest.raises(grpc.RpcError) as e:
        generate(s, text="x", max_new_tokens=3, constraint=pb.Constraint(regex="([a"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    words = ["one (1)", 'two "2"', "drei ☃"]
    for seed in range(4):
        chunks, done = generate(s, text="x", max_new_tokens=20, sampling=pb.SamplingParams(temperature=1.5, seed=seed),
                                constraint=pb.Constraint(choice=pb.Choices(values=words)))  # fmt: skip
        assert "".join(c.text for c in chunks) in words and done.finish_reason == "stop"
    with pytest.raises(grpc.RpcError) as e:
        generate(s, text="x", max_new_tokens=3, constraint=pb.Constraint(choice=pb.Choices(values=["a", ""])))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint.choice" in e.value.details()


def test_chat_input_renders_through_the_template(stub):
    s, service = stub
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "More"}]  # fmt: skip
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in msgs])
    chunks, done = generate(s, chat=chat, max_new_tokens=6, sampling=pb.SamplingParams(temperature=0.0), ignore_eos=True)
    prompt = service.encode(render_chat(service.template, msgs))
    want = list(
        FreeTokenEngine.from_pretrained("demo", EngineConfig(dtype="float32", max_context=128)).generate(
            prompt, max_new_tokens=6, ignore_eos=True
        )
    )
    assert [t for c in chunks for t in c.token_ids] == want and done.usage.prompt_tokens == len(prompt)
    assert "".join(c.text for c in chunks) == service.tokenizer.decode(want) and not any(c.reasoning for c in chunks)
    kept = service.template
    service.template = "{{ flag | default('') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        _, plain = generate(s, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")]), max_new_tokens=1)
        _, flagged = generate(s, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")], template_kwargs_json='{"flag": "yes"}'),
                              max_new_tokens=1)  # fmt: skip
    finally:
        service.template = kept
    assert (plain.usage.prompt_tokens, flagged.usage.prompt_tokens) == (len(service.encode("x")), len(service.encode("yesx")))
    for bad in (pb.Chat(), pb.Chat(messages=[pb.ChatMessage(role="tool", content="x")]), pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")]),
                pb.Chat(messages=[pb.ChatMessage(role="user", content="x")], template_kwargs_json="{bad"),
                pb.Chat(messages=[pb.ChatMessage(role="user", content="x")], template_kwargs_json="[1]"),
                pb.Chat(messages=[pb.ChatMessage(role="user", content="x")], template_kwargs_json='{"messages": []}')):  # fmt: skip
        with pytest.raises(grpc.RpcError) as e:
            generate(s, chat=bad, max_new_tokens=1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_prompt_logprobs_come_first(stub):
    s, service = stub
    ref = FreeTokenEngine.from_pretrained("demo", EngineConfig(dtype="float32", max_context=128))
    prompt = service.tokenizer.encode("a prompt longer than one prefill chunk of thirty-two tokens")
    rs = list(s.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=prompt), max_new_tokens=3, n=2, prompt_logprobs=2,
                                            sampling=pb.SamplingParams(temperature=0.0))))  # fmt: skip
    first = rs[0].chunk
    assert first.index == 0 and not first.token_ids and [lp.token_id for lp in first.prompt_logprobs] == prompt[1:]
    logits = ref.logits(prompt)[:-1]
    lp = logits - (np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1))[:, None]
    np.testing.assert_allclose([p.logprob for p in first.prompt_logprobs], lp[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    assert [[t.token_id for t in p.top] for p in first.prompt_logprobs] == np.argsort(-lp, axis=-1)[:, :2].tolist()
    assert sum(len(r.chunk.prompt_logprobs) for r in rs if r.WhichOneof("event") == "chunk") == len(prompt) - 1  # once, not per choice
    with pytest.raises(grpc.RpcError) as e:
        generate(s, text="x", max_new_tokens=2, prompt_logprobs=21)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in e.value.details()
