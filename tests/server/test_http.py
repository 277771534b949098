"""The HTTP shim driven by the official openai and anthropic clients over loopback."""

import json
import threading
import urllib.error
import urllib.request

import anthropic
import openai
import pytest
from helpers import demo_server, wait_idle

from freetoken_jax import EngineConfig, FreeTokenEngine

EC = EngineConfig(dtype="float32", max_context=128, max_batch=4, page_size=8, prefill_chunk=32)


@pytest.fixture(scope="module")
def server():
    with demo_server(EC) as (url, service):
        yield url, service


@pytest.fixture(scope="module")
def reference():
    return FreeTokenEngine.from_pretrained("demo", EC)


def oa(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def an(url):
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)


def test_models_and_health(server):
    url, _ = server
    assert [m.id for m in oa(url).models.list().data] == ["demo"]
    assert json.load(urllib.request.urlopen(url + "/health"))["status"] == "ok"


def test_completion_matches_engine(server, reference):
    url, service = server
    r = oa(url).completions.create(model="demo", prompt="Hello there", max_tokens=12, temperature=0)
    want = list(reference.generate(service.tokenizer.encode("Hello there"), max_new_tokens=12, seed=0))
    stop_at = len(want)
    assert r.choices[0].text == service.tokenizer.decode(want[:stop_at]) or r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(service.tokenizer.encode("Hello there"))
    assert r.usage.completion_tokens == len(want)


def test_chat_streaming_equals_non_streaming(server):
    url, _ = server
    c = oa(url)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say something"}]
    full = c.chat.completions.create(model="demo", messages=msgs, max_tokens=10, temperature=0, seed=1)
    chunks = list(
        c.chat.completions.create(
            model="demo", messages=msgs, max_tokens=10, temperature=0, seed=1, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.choices[0].finish_reason in ("stop", "length")


def test_stop_sequence_truncates(server):
    url, _ = server
    c = oa(url)
    # the first of these prompts whose continuation is long enough to hold a stop string
    for prompt in ("abc", "Hello", "The sea", "0123", "zz top", "story:"):
        base = c.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
        if len(base) >= 6:
            break
    assert len(base) >= 6, base
    stop = base[3:5]
    r = c.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == base[: base.find(stop)] and r.choices[0].finish_reason == "stop"


def test_anthropic_messages(server):
    url, _ = server
    c = an(url)
    msg = c.messages.create(model="demo", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0})
    assert msg.type == "message" and msg.usage.output_tokens == 8 and msg.stop_reason == "max_tokens"
    with c.messages.stream(model="demo", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == msg.content[0].text and final.stop_reason == "max_tokens"
    n = c.messages.count_tokens(model="demo", messages=[{"role": "user", "content": "Hi"}])
    assert n.input_tokens > 2


def test_errors_are_4xx_and_server_keeps_serving(server):
    url, _ = server
    c = oa(url)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="demo", prompt="x" * 200, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="demo", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="demo", prompt="x", max_tokens=2, temperature="hot")
    req = urllib.request.Request(url + "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and "not valid JSON" in json.load(e.value)["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        an(url).messages.create(model="demo", max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
    assert c.completions.create(model="demo", prompt="still alive", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_sixteen_concurrent_clients_equal_alone(server):
    url, _ = server
    c = oa(url)
    prompts = [f"client number {i} says" for i in range(16)]
    alone = [
        c.completions.create(model="demo", prompt=p, max_tokens=10, temperature=0.8, seed=i).choices[0].text for i, p in enumerate(prompts)
    ]
    got = {}

    def run(i):
        got[i] = c.completions.create(model="demo", prompt=prompts[i], max_tokens=10, temperature=0.8, seed=i).choices[0].text

    ts = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert [got[i] for i in range(16)] == alone


def test_disconnect_mid_stream_frees_pages(server):
    url, service = server
    sched = service.scheduler
    assert wait_idle(sched)
    free = sched.engine.pages.free_pages + sched.get_metrics()["prefix_cached_pages"]
    stream = oa(url).completions.create(model="demo", prompt="a long story", max_tokens=100, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    assert wait_idle(sched, 60)
    m = sched.get_metrics()
    assert sched.engine.pages.free_pages + m["prefix_cached_pages"] == free
    assert m["requests_cancelled"] >= 1


def test_same_long_prompt_twice_hits_the_prefix_cache(server):
    url, service = server
    prompt = "A long preamble that several requests share, long enough to fill pages. Now answer:"
    assert len(service.tokenizer.encode(prompt)) > 3 * EC.page_size
    sched = service.scheduler
    assert wait_idle(sched)
    texts, hits = [], []
    for _ in range(2):
        before = sched.get_metrics()["prefix_hit_tokens"]
        r = oa(url).completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0)
        texts.append(r.choices[0].text)
        hits.append(sched.get_metrics()["prefix_hit_tokens"] - before)
    assert texts[0] == texts[1]
    assert hits[1] >= 3 * EC.page_size and hits[1] > hits[0]
