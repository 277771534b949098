"""The offline API and the server are clients of one generation loop (`Batcher`): the same
prompts give the same tokens and finish reasons through `generate`, `generate_batch`, the
scheduler and the HTTP server; the offline API reuses cached prefixes as serving does."""

import json
import urllib.request

import pytest

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.engine import GenerationParams
from freetoken_jax.scheduler.scheduler import Scheduler
from freetoken_jax.server.http import Service, serve_http

EC = EngineConfig(dtype="float32", max_context=96, max_batch=4, page_size=8, prefill_chunk=16)
PROMPTS = [[256] + list(b"one loop for every caller %d" % i) for i in range(3)] + [[256, 7, 7, 7]]


def finish(tokens, params, eos):
    return "stop" if tokens and tokens[-1] in params.stop_set(eos) else "length"


@pytest.mark.parametrize("strategy", ["offload"])
def test_offline_and_server_agree(strategy):
    ecfg = EC.replace(moe_strategy=strategy, expert_slots=40 if strategy == "offload" else None)
    offline = FreeTokenEngine.from_pretrained("demo", ecfg)
    eos = offline.model_config.eos_token_ids
    plain = offline.generate_batch(PROMPTS, max_new_tokens=12, ignore_eos=True)
    # stop two of the requests on a token they generate mid-way; sample one
    params = [
        GenerationParams(max_new_tokens=12, seed=0, stop_token_ids=(plain[0][5],), ignore_eos=True),
        GenerationParams(max_new_tokens=12, seed=1, temperature=0.8, top_k=20),
        GenerationParams(max_new_tokens=9, seed=2, stop_token_ids=(plain[2][3],), ignore_eos=True),
        GenerationParams(max_new_tokens=12, seed=3, ignore_eos=True),
    ]
    one = [list(offline.generate(p, **vars(q))) for p, q in zip(PROMPTS, params)]
    assert one[0] == plain[0][: plain[0].index(plain[0][5]) + 1] and one[3] == plain[3]
    assert [finish(t, q, eos) for t, q in zip(one, params)] == ["stop", finish(one[1], params[1], eos), "stop", "length"]

    server_engine = FreeTokenEngine.from_pretrained("demo", ecfg)
    sched = Scheduler(server_engine)
    try:
        got = [sched.submit(p, q).result(120) for p, q in zip(PROMPTS, params)]
        assert [toks for toks, _ in got] == one
        assert [reason for _, reason in got] == [finish(t, q, eos) for t, q in zip(one, params)]
        httpd = serve_http(Service(sched, "demo", server_engine.model_path), "127.0.0.1", 0)
        try:
            url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/completions"
            greedy = GenerationParams(max_new_tokens=12)
            for prompt, want in zip(PROMPTS, offline.generate_batch(PROMPTS, max_new_tokens=12)):  # EOS ends these
                body = json.dumps(dict(model="demo", prompt=prompt, max_tokens=12, temperature=0)).encode()
                req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
                r = json.load(urllib.request.urlopen(req, timeout=120))
                assert r["usage"]["completion_tokens"] == len(want) and r["choices"][0]["finish_reason"] == finish(want, greedy, eos)
                if want[-1] not in eos:
                    assert r["choices"][0]["text"] == server_engine.tokenizer.decode(want)
        finally:
            httpd.shutdown()
    finally:
        sched.shutdown()
    # the offline batch matches the sequential calls, and the engine serves again after the scheduler let go
    assert offline.generate_batch(PROMPTS, max_new_tokens=12, ignore_eos=True) == plain
    assert server_engine.generate_batch(PROMPTS, max_new_tokens=12, ignore_eos=True) == plain


def test_offline_api_reuses_cached_prefixes():
    eng = FreeTokenEngine.from_pretrained("demo", EC)
    prompt = [256] + list(b"a long shared system prompt, then a question")
    m0 = dict(eng.get_metrics())
    first = list(eng.generate(prompt, max_new_tokens=6, ignore_eos=True))
    m1 = dict(eng.get_metrics())
    second = list(eng.generate(prompt, max_new_tokens=6, ignore_eos=True))
    m2 = dict(eng.get_metrics())
    assert second == first
    assert m1["prefix_hit_tokens"] == m0["prefix_hit_tokens"]
    hit = m2["prefix_hit_tokens"] - m1["prefix_hit_tokens"]
    assert hit == (len(prompt) - 1) // EC.page_size * EC.page_size > 0
    assert m2["prefilled_tokens"] - m1["prefilled_tokens"] == len(prompt) - hit < m1["prefilled_tokens"] - m0["prefilled_tokens"]
    # a different continuation of the same prefix reuses it too, and matches an engine without the cache
    other = prompt + list(b" and another")
    cold = FreeTokenEngine.from_pretrained("demo", EC.replace(prefix_cache=False))
    assert eng.generate_batch([other], max_new_tokens=6, ignore_eos=True) == cold.generate_batch([other], max_new_tokens=6, ignore_eos=True)
    assert eng.get_metrics()["prefix_hit_tokens"] > m2["prefix_hit_tokens"] and cold.get_metrics()["prefix_hit_tokens"] == 0


def test_closing_a_generation_releases_its_pages():
    eng = FreeTokenEngine.from_pretrained("demo", EC.replace(prefix_cache=False))
    free = eng.pages.free_pages
    it = eng.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True)
    next(it), next(it)
    assert eng.pages.free_pages < free
    it.close()
    assert eng.pages.free_pages == free and eng.batcher.idle()
    assert len(list(eng.generate(PROMPTS[1], max_new_tokens=3, ignore_eos=True))) == 3
