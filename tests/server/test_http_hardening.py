"""The HTTP server as a hostile client finds it: every bad input a clear 4xx before anything
streams, one request's failure its own, nothing lost under a burst, keys and origins enforced,
Prometheus metrics. Loopback only; bounded in count and time."""

import http.client
import json
import re
import socket
import threading
import time

import anthropic
import openai
import pytest
from helpers import wait_idle
from prometheus_client.parser import text_string_to_metric_families

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.scheduler.scheduler import Scheduler
from freetoken_jax.server.http import serve_http
from freetoken_jax.server.schemas import Limits
from freetoken_jax.server.service import Service

EC = EngineConfig(dtype="float32", max_context=128, max_batch=4, page_size=8, prefill_chunk=32)


@pytest.fixture(scope="module")
def engine():
    return FreeTokenEngine.from_pretrained("demo", EC)


@pytest.fixture(scope="module")
def server(engine):
    sched = Scheduler(engine, max_queue=8)
    service = Service(sched, "demo", engine.model_path)
    httpd = serve_http(service, "127.0.0.1", 0, limits=Limits(max_body_bytes=64 << 10, max_stops=4))
    yield f"http://127.0.0.1:{httpd.server_address[1]}", service, httpd.server_address[1]
    httpd.shutdown()
    sched.shutdown()


def oa(url, key="x"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def post(port, path, body, headers=None, raw: bytes | None = None):
    """(status, headers, parsed JSON or text) of one POST on a fresh connection."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    c.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    text = r.read().decode()
    try:
        out = json.loads(text)
    except ValueError:
        out = text
    c.close()
    return r.status, r.headers, out


def test_bad_bodies_are_400_not_500(server):
    _, _, port = server
    p = "/v1/completions"
    cases = {
        "lone surrogate": b'{"model": "demo", "prompt": "\\ud800", "max_tokens": 2}',
        "deep JSON": b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
        "5001 digits": b'{"prompt": "x", "max_tokens": ' + b"9" * 5001 + b"}",
        "NaN temperature": b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}',
        "string stream": b'{"prompt": "x", "max_tokens": 2, "stream": "false"}',
        "stream_options not an object": b'{"prompt": "x", "max_tokens": 2, "stream": true, "stream_options": 3}',
        "top_p 0": b'{"prompt": "x", "max_tokens": 2, "top_p": 0}',
        "top_k over the vocabulary": b'{"prompt": "x", "max_tokens": 2, "top_k": 2147483648}',
        "seed out of range": b'{"prompt": "x", "max_tokens": 2, "seed": -1}',
        "too many stops": b'{"prompt": "x", "max_tokens": 2, "stop": ["a", "b", "c", "d", "e"]}',
        "n > 16": b'{"prompt": "x", "max_tokens": 2, "n": 17}',
        "best_of < n": b'{"prompt": "x", "max_tokens": 2, "n": 3, "best_of": 2}',
        "not an object": b"[1, 2]",
    }
    for name, raw in cases.items():
        status, _, out = post(port, p, None, raw=raw)
        assert status == 400, (name, status, out)
        assert isinstance(out, dict) and out["error"]["type"] == "invalid_request_error", (name, out)
    status, _, out = post(port, "/v1/messages", None, raw=b'{"max_tokens": 4, "messages": [{"role": "user", "content": "\\udfff"}]}')
    assert status == 400 and out["type"] == "error" and out["error"]["type"] == "invalid_request_error"


def test_unsupported_parameters_are_refused_by_name(server):
    _, _, port = server
    asks = {"functions": [{"name": "f"}], "function_call": {"name": "f"}, "prediction": {"type": "content", "content": "x"},
            "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}, "web_search_options": {}, "verbosity": "low"}  # fmt: skip
    for name, value in asks.items():
        status, _, out = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, name: value})
        assert status == 400 and f"'{name}' is not supported" in out["error"]["message"], (name, out)
    # The values clients send by default ask for nothing: accepted.
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "n": 1, "tools": None, "tool_choice": "none",
               "functions": [], "function_call": "none", "modalities": ["text"], "verbosity": "medium"}  # fmt: skip
    status, _, out = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **neutral})
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    status, _, out = post(
        port, "/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}}
    )
    assert status == 400 and out["type"] == "error" and "thinking" in out["error"]["message"] and "budget_tokens" in out["error"]["message"]


def test_stop_token_ids_end_the_text(server):
    _, service, port = server
    ids = service.tokenizer.encode("Tokens that stop")
    toks, _ = service.submit(ids, service.params({"temperature": 0, "ignore_eos": True}, 12)).result(60)
    stop = toks[4]
    status, _, out = post(port, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop]})
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == toks.index(stop) + 1
    assert post(port, "/v1/completions", {"prompt": ids, "max_tokens": 2, "stop_token_ids": [10**9]})[0] == 400
    assert post(port, "/v1/completions", {"prompt": ids, "max_tokens": 2, "ignore_eos": "yes"})[0] == 400


def test_protocol_abuse(server):
    _, _, port = server
    # A body over the limit: 413 before it is read; a non-JSON POST: 415.
    assert post(port, "/v1/completions", {"prompt": "x" * (70 << 10)})[0] == 413
    assert post(port, "/v1/completions", None, {"Content-Type": "text/plain"}, raw=b'{"prompt": "x"}')[0] == 415
    # Duplicate Content-Length is refused by the HTTP layer; a chunked body is read as chunks.
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}"
    )
    assert s.recv(100).startswith(b"HTTP/1.1 400")
    s.close()
    body = json.dumps({"prompt": "chunked", "max_tokens": 2, "temperature": 0}).encode()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", iter([body[:10], body[10:]]), {"Content-Type": "application/json"}, encode_chunked=True)
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
    # A kept-alive connection survives a 404 POST whose body is itself a request.
    smuggled = b"GET /v1/cache/status HTTP/1.1\r\nHost: x\r\n\r\n"
    c.request("POST", "/no/such/route", smuggled, {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 404 and "no route" in json.loads(r.read())["error"]["message"]
    c.request("GET", "/health")
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    # A Content-Length that is not a number: 400 from the HTTP layer, not a 500.
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ten\r\n\r\n{}")
    assert s.recv(100).startswith(b"HTTP/1.1 400")
    s.close()
    # Half-sent requests hold a connection each, not a thread: with 64 of them open, a request
    # is still served.
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(64)]
    for k in idle:
        k.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    assert post(port, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    for k in idle:
        k.close()
    # An unsupported method gets a JSON error, not an HTML page.
    c.request("PUT", "/v1/completions", b"{}", {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status in (404, 405) and "error" in json.loads(r.read())
    c.close()


def test_a_connection_idle_as_long_as_clients_keep_theirs_is_still_served(server):
    # httpx (under the openai and anthropic clients) reuses a connection idle up to 5 s: the
    # server must not close it at the same moment, or the next request is lost in flight.
    _, _, port = server
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for pause in (5.5, 0):
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
        time.sleep(pause)
    c.close()


def test_streaming_errors_come_before_the_stream(server):
    url, service, port = server
    c = oa(url)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="demo", prompt="x" * 200, max_tokens=4, stream=True)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=500, stream=True)
    with pytest.raises(anthropic.BadRequestError):
        anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
            model="demo", max_tokens=500, messages=[{"role": "user", "content": "hi"}], stream=True
        )


def test_full_queue_and_resize_answer_with_retry_after(server):
    url, service, port = server
    sched = service.scheduler
    assert wait_idle(sched)
    sched.batcher.admitting = False  # as while a resize drains: 503
    try:
        status, headers, out = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True})
        assert status == 503 and int(headers["Retry-After"]) > 0 and "resized" in out["error"]["message"]
    finally:
        sched.batcher.admitting = True
    # Fill the queue behind a paused loop: the next streaming request gets 429 + Retry-After.
    gate = threading.Event()
    real_step = sched.batcher.step
    sched.batcher.step = lambda: gate.wait() and real_step()
    try:
        time.sleep(0.2)  # the loop is now parked in the patched step
        handles = [service.submit([1, 2, 3], service.params({"temperature": 0}, 2)) for _ in range(sched.max_queue)]
        status, headers, out = post(
            port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
        )
        assert status == 429 and int(headers["Retry-After"]) > 0 and out["error"]["type"] == "overloaded_error"
    finally:
        gate.set()
        sched.batcher.step = real_step
    for h in handles:
        assert len(h.result(60)[0]) == 2
    assert wait_idle(sched)


def test_one_requests_failure_is_its_own(server, monkeypatch):
    """An exception in one row's sampling parameters, in tokenizing one prompt and in
    detokenizing one stream fails that request only; the others, running beside it, finish."""
    url, service, port = server
    c = oa(url)
    results, errors = {}, {}

    def run(i, **kw):
        try:
            results[i] = c.completions.create(model="demo", prompt=f"request {i}", max_tokens=12, temperature=0, **kw).choices[0].text
        except Exception as e:  # noqa: BLE001
            errors[i] = e

    from freetoken_jax.runtime import sampling
    from freetoken_jax.scheduler import batcher

    real_row = sampling.sampling_row

    def row(p, *args):
        if p is not None and p.seed == 666:
            raise ValueError("injected")
        return real_row(p, *args)

    monkeypatch.setattr(batcher, "sampling_row", row)
    tok = service.tokenizer
    real_encode, real_decode = tok.encode, tok.decode
    poisoned = threading.Event()
    monkeypatch.setattr(
        tok, "encode", lambda t, *a, **k: (_ for _ in ()).throw(RuntimeError("bad")) if "explode" in t else real_encode(t, *a, **k)
    )
    monkeypatch.setattr(
        tok, "decode", lambda ids, *a, **k: (_ for _ in ()).throw(RuntimeError("bad")) if poisoned.is_set() else real_decode(ids, *a, **k)
    )
    baseline = {
        i: c.completions.create(model="demo", prompt=f"request {i}", max_tokens=12, temperature=0).choices[0].text for i in range(3)
    }
    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    ts.append(threading.Thread(target=run, args=(10,), kwargs={"seed": 666}))
    ts.append(
        threading.Thread(target=lambda: errors.__setitem__(11, post(port, "/v1/completions", {"prompt": "explode", "max_tokens": 2})))
    )
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert results == baseline
    assert isinstance(errors[10], openai.InternalServerError) and "injected" in str(errors[10])
    assert errors[11][0] == 500 and "RuntimeError" in errors[11][2]["error"]["message"]
    # Detokenization failing mid-stream: that stream ends with an error object and [DONE].
    poisoned.set()
    c2 = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c2.request(
        "POST", "/v1/completions", json.dumps({"prompt": "go", "max_tokens": 3, "stream": True}), {"Content-Type": "application/json"}
    )
    r = c2.getresponse()
    events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert r.status == 200 and events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    poisoned.clear()
    assert wait_idle(service.scheduler)
    assert c.completions.create(model="demo", prompt="request 0", max_tokens=12, temperature=0).choices[0].text == baseline[0]


def test_abandoned_requests_are_cancelled(server):
    url, service, port = server
    sched = service.scheduler
    assert wait_idle(sched)
    free = sched.engine.pages.free_pages + sched.get_metrics()["prefix_cached_pages"]
    cancelled = sched.get_metrics()["requests_cancelled"]
    for stream in (False, True):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        # ignore_eos: a greedy end-of-sequence as the first token finished one request before its
        # client went away (CI, now and then), and nothing was left to cancel
        body = json.dumps({"prompt": "story", "max_tokens": 110, "temperature": 0, "stream": stream, "ignore_eos": True}).encode()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        t = time.time() + 30
        while not sched.get_metrics()["running"] and time.time() < t:
            time.sleep(0.005)
        s.close()
    assert wait_idle(sched, 60)
    m = sched.get_metrics()
    assert m["requests_cancelled"] >= cancelled + 2
    assert sched.engine.pages.free_pages + m["prefix_cached_pages"] == free


def test_burst_of_64_clients_loses_nothing(server):
    url, service, port = server
    out = []

    def one(i):
        out.append(post(port, "/v1/completions", {"prompt": f"client {i}", "max_tokens": 3, "temperature": 0, "stream": i % 2 == 0}))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    assert len(out) == 64
    for status, headers, body in out:
        assert status == 200 or (status in (429, 503) and int(headers["Retry-After"]) > 0), (status, body)
    done = [b for s, _, b in out if s == 200]
    assert len(done) >= service.scheduler.max_queue
    for b in done:  # streamed or not, each finished request is whole
        assert (isinstance(b, dict) and b["usage"]["completion_tokens"] == 3) or (isinstance(b, str) and b.rstrip().endswith("[DONE]"))


def test_metrics_tokenize_and_models(server, caplog):
    url, service, port = server
    caplog.set_level("INFO", logger="freetoken_jax.http")
    before = service.scheduler.get_metrics()["requests"]
    oa(url).completions.create(model="demo", prompt="count me", max_tokens=2, temperature=0)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/v1/metrics")
    assert json.loads(c.getresponse().read())["requests"] == before + 1

    # The request's log line is written once the response is out (the client may be first), and
    # an earlier test's last line may come in late: this request's is the one with its 2 tokens.
    def mine(message):
        return "POST /v1/completions 200" in message and "completion_tokens=2" in message

    deadline = time.time() + 10
    while not any(mine(r.getMessage()) for r in caplog.records) and time.time() < deadline:
        time.sleep(0.01)
    line = next(r.getMessage() for r in caplog.records if mine(r.getMessage()))
    assert re.search(r" prompt_tokens=\d+ ", line) and "count me" not in line  # no prompt text by default
    c.request("GET", "/metrics")
    r = c.getresponse()
    fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    assert r.status == 200
    reqs = {tuple(sorted(s.labels.items())): s.value for s in fams["freetoken_http_requests"].samples if s.name.endswith("_total")}
    assert reqs[(("route", "/v1/completions"), ("status", "200"))] >= 1
    assert fams["freetoken_requests"].samples[0].value == before + 1
    assert fams["freetoken_time_to_first_token_seconds"].samples and "freetoken_waiting" in fams
    status, _, out = post(port, "/tokenize", {"prompt": "Hello there"})
    assert status == 200 and out["tokens"] == service.tokenizer.encode("Hello there") and out["count"] == len(out["tokens"])
    assert post(port, "/detokenize", {"tokens": out["tokens"]})[2]["prompt"] == service.tokenizer.decode(out["tokens"])
    assert post(port, "/detokenize", {"tokens": [10**9]})[0] == 400
    c.request("GET", "/tokenizer_info")  # vLLM's, as lm-evaluation-harness reads it before using /tokenize
    info = json.loads(c.getresponse().read())
    assert info["chat_template"] == service.template and info["model_max_length"] == service.max_context
    assert (
        info["eos_token"] is None and info["bos_token"] is None and info["add_bos_token"] is True
    )  # the demo's bytes have no text for them
    assert oa(url).models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        oa(url).models.retrieve("other")


def test_keys_origins_and_admin_routes():
    engine = FreeTokenEngine.from_pretrained("demo", EC)
    sched = Scheduler(engine)
    service = Service(sched, "demo", engine.model_path)
    httpd = serve_http(service, "127.0.0.1", 0, api_key="k1", admin_key="adm", allowed_origins=["https://app.example"])
    url, port = f"http://127.0.0.1:{httpd.server_address[1]}", httpd.server_address[1]
    try:
        with pytest.raises(openai.AuthenticationError):
            oa(url, "wrong").completions.create(model="demo", prompt="x", max_tokens=2)
        assert oa(url, "k1").completions.create(model="demo", prompt="x", max_tokens=2).usage.completion_tokens == 2
        a = anthropic.Anthropic(base_url=url, api_key="k1", max_retries=0)  # x-api-key
        assert a.messages.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": "x"}]).usage.output_tokens == 2
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/health")
        assert c.getresponse().read() and True
        rebuild = {"kv_pages": 40}
        assert post(port, "/v1/cache/rebuild", rebuild, {"Authorization": "Bearer k1"})[0] == 401  # the API key is not the admin key
        assert post(port, "/v1/cache/rebuild", rebuild, {"Authorization": "Bearer adm", "Content-Type": "text/plain"})[0] == 415
        assert post(port, "/v1/cache/rebuild", rebuild, {"Authorization": "Bearer adm", "Origin": "https://evil.example"})[0] == 403
        status, headers, _ = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 2},
                                  {"Authorization": "Bearer k1", "Origin": "https://app.example"})  # fmt: skip
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        c.request("OPTIONS", "/v1/completions", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        r = c.getresponse()
        r.read()
        assert r.status == 200 and r.getheader("access-control-allow-origin") == "https://app.example"
        assert post(port, "/v1/cache/rebuild", {"kv_pages": 10**6, "bogus": 1}, {"Authorization": "Bearer adm"})[0] == 400
    finally:
        httpd.shutdown()
        sched.shutdown()
