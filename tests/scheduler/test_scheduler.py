"""Continuous batching: concurrent requests equal what each gets alone; prefix reuse; cancellation
frees pages; back-pressure; requests that can never fit fail fast."""

import threading

import pytest
from helpers import wait_idle

from freetoken_jax import EngineConfig, FreeTokenEngine, RequestError
from freetoken_jax.engine import GenerationParams
from freetoken_jax.scheduler.radix import RadixCache
from freetoken_jax.scheduler.scheduler import Overloaded

EC = EngineConfig(dtype="float32", max_context=96, max_batch=4, page_size=8, prefill_chunk=16)
PROMPTS = [[256] + list(b"the same long shared preamble, then request %d" % i) for i in range(9)]


@pytest.fixture(scope="module")
def reference():
    eng = FreeTokenEngine.from_pretrained("demo", EC)
    return {
        i: list(eng.generate(p, max_new_tokens=12, seed=i, temperature=0.0 if i % 2 else 0.9, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    }


@pytest.fixture
def sched(demo_scheduler):
    return demo_scheduler(EC)


def params(i, n=12):
    return GenerationParams(max_new_tokens=n, seed=i, temperature=0.0 if i % 2 else 0.9, ignore_eos=True)


def test_concurrent_equals_alone(sched, reference):
    results = {}

    def client(i):
        results[i] = sched.submit(PROMPTS[i], params(i)).result(120)[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == reference
    m = sched.get_metrics()
    assert m["requests_finished"] == len(PROMPTS) and m["prefix_hit_tokens"] > 0
    assert wait_idle(sched)
    # all pages back, except those the prefix tree keeps
    assert m["kv_pages_free"] + m["prefix_cached_pages"] == sched.engine.pages.num_pages - 1


def test_prefix_hit_gives_identical_output(sched, reference):
    a = sched.submit(PROMPTS[1], params(1))
    assert a.result(60)[0] == reference[1] and a.prefix_hit_tokens == 0
    b = sched.submit(PROMPTS[1], params(1))
    assert b.result(60)[0] == reference[1]
    assert b.prefix_hit_tokens == (len(PROMPTS[1]) - 1) // 8 * 8 > 0


def test_cancel_frees_pages(sched):
    free = sched.engine.pages.free_pages
    h = sched.submit(PROMPTS[0], GenerationParams(max_new_tokens=40, ignore_eos=True))
    for ev in h.events(60):
        if ev.kind == "token":
            h.cancel()
            break
    kinds = [ev.kind for ev in h.events(60)]
    assert kinds[-1] == "done"
    assert wait_idle(sched)
    m = sched.get_metrics()
    assert m["requests_cancelled"] == 1
    assert sched.engine.pages.free_pages + m["prefix_cached_pages"] == free


def test_back_pressure_and_impossible_requests(demo_scheduler):
    s = demo_scheduler(EC, max_queue=2)
    hs, rejected = [], 0
    for i in range(12):
        try:
            hs.append(s.submit(PROMPTS[i % 9], GenerationParams(max_new_tokens=40, ignore_eos=True)))
        except Overloaded:
            rejected += 1
    assert rejected > 0
    for h in hs:
        h.result(120)
    with pytest.raises(RequestError, match="exceeds the configured context"):
        s.submit([1] * 90, GenerationParams(max_new_tokens=20))


def test_radix_against_a_dict_model():
    r = RadixCache(page_size=2)
    assert r.insert([1, 2, 3, 4, 5], [10, 11, 12]) == ([12], [])  # the partial third page is not kept
    nodes = r.match([1, 2, 3, 4, 9, 9])
    assert [n.page for n in nodes] == [10, 11]
    assert r.insert([1, 2, 7, 7], [10, 20]) == ([], [])
    assert r.evict(5) == ([20], [])  # 11 is locked (matched above), 10 is its parent
    r.unlock(nodes)
    assert sorted(r.evict(5)[0]) == [10, 11] and r.cached_pages == 0


@pytest.mark.parametrize("given", [None, 1])
def test_running_limit_keeps_decoding_rows_within_the_slots(reference, given, demo_scheduler):
    """Under offload no more requests run than one step's routed experts fit the slots (or
    `max_running` when given); the others wait, and every output is what it is alone."""
    cfg = FreeTokenEngine.from_pretrained("demo", EC).model_config
    per_row = cfg.top_k * cfg.num_moe_layers
    ec = EC.replace(moe_strategy="offload", expert_slots=2 * per_row + per_row // 2, max_running=given)
    s = demo_scheduler(ec)
    seen, decode = [], s.batcher._decode

    def counting_decode():
        seen.append(sum(r is not None for r in s.batcher.rows))
        return decode()

    s.batcher._decode = counting_decode
    want = 2 if given is None else given
    assert s.running_limit() == want and s.get_metrics()["running_limit"] == want
    greedy = [i for i in range(len(PROMPTS)) if i % 2][:4]
    handles = {i: s.submit(PROMPTS[i], params(i)) for i in greedy}
    assert {i: h.result(120)[0] for i, h in handles.items()} == {i: reference[i] for i in greedy}
    assert max(seen) == want


def test_max_running_is_checked(demo_scheduler):
    from freetoken_jax.config import ConfigError

    with pytest.raises(ConfigError, match="max_running must be positive"):
        EC.replace(max_running=0)
    assert demo_scheduler(EC.replace(max_running=64)).running_limit() == EC.max_batch  # never more than the step's rows


def test_rows_that_stop_early_leave_the_others_and_the_cache_intact(sched, reference):
    """Each request stops on a token it generates (the device is then one step ahead of it);
    the others, and later requests continuing a stopped sequence from the prefix tree, still
    get what they get alone."""
    stop_at = {i: reference[i][2 + i % 4] for i in range(len(PROMPTS))}
    want = {i: reference[i][: reference[i].index(stop_at[i]) + 1] for i in range(len(PROMPTS))}
    results = {}

    def client(i):
        p = GenerationParams(max_new_tokens=12, seed=i, temperature=0.0 if i % 2 else 0.9, ignore_eos=True, stop_token_ids=[stop_at[i]])
        results[i] = sched.submit(PROMPTS[i], p).result(120)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: (want[i], "stop") for i in range(len(PROMPTS))}
    assert wait_idle(sched)
    alone = FreeTokenEngine.from_pretrained("demo", EC)
    for i in (1, 4):
        longer = PROMPTS[i] + want[i]
        h = sched.submit(longer, params(i, 8))
        assert h.result(60)[0] == list(alone.generate(longer, max_new_tokens=8, seed=i, temperature=0.0 if i % 2 else 0.9, ignore_eos=True))
        assert h.prefix_hit_tokens >= len(PROMPTS[i]) // 8 * 8
