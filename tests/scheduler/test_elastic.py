"""Elastic memory on a live scheduler: grow and shrink expert slots and KV pages between requests
with identical outputs; invalid targets change nothing; injected failures roll back."""

import json
import urllib.error
import urllib.request

import pytest
from helpers import wait_idle

from freetoken_jax import ConfigError, EngineConfig, FreeTokenEngine
from freetoken_jax.engine import GenerationParams
from freetoken_jax.runtime import runner as runner_mod
from freetoken_jax.scheduler.batcher import Busy
from freetoken_jax.scheduler.scheduler import Overloaded
from freetoken_jax.server.http import serve_http
from freetoken_jax.server.service import Service

EC = EngineConfig(
    dtype="float32", max_context=64, max_batch=2, page_size=8, prefill_chunk=16, moe_strategy="offload", expert_slots=6, kv_pages=20
)
PROMPTS = [[256] + list(b"elastic memory request %d" % i) for i in range(3)]


def outputs(s):
    return [
        s.submit(p, GenerationParams(max_new_tokens=10, seed=i, temperature=0.7, ignore_eos=True)).result(120)[0]
        for i, p in enumerate(PROMPTS)
    ]


@pytest.fixture
def sched(demo_scheduler):
    return demo_scheduler(EC)


def test_grow_and_shrink_keep_outputs(sched):
    want = outputs(sched)
    # (slots alone: tests/runtime/test_compile.py resizes a warmed-up server's slots)
    for slots, pages in ((20, 40), (4, 12), (None, 9)):
        st = sched.rebuild_cache(slots, pages)
        if slots is not None:
            assert st["expert_slots"] == slots and sched.engine.runner.slots.num_slots == slots
        if pages is not None:
            assert st["kv_pages"] == pages and sched.engine.runner.state.cache[0][0].shape[1] == pages
        assert outputs(sched) == want, (slots, pages)
    assert sched.get_metrics()["prefix_hit_tokens"] > 0


def test_prefix_cache_survives_growth(sched):
    outputs(sched)
    cached = sched.radix.cached_pages
    assert cached > 0
    sched.rebuild_cache(kv_pages=40)
    assert sched.radix.cached_pages == cached
    h = sched.submit(PROMPTS[0], GenerationParams(max_new_tokens=10, seed=0, temperature=0.7, ignore_eos=True))
    h.result(60)
    assert h.prefix_hit_tokens > 0
    sched.rebuild_cache(kv_pages=12)
    assert sched.radix.cached_pages == 0 and sched.engine.pages.free_pages == 11


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(expert_slots=0), "positive"),
        (dict(expert_slots=-3), "positive"),
        (dict(expert_slots=3), "routes up to 4 experts"),
        (dict(kv_pages=1), "at least 2"),
        (dict(kv_pages=5), "one full-length sequence"),
        (dict(), "give expert_slots"),
        (dict(expert_slots=10**9), None),
    ],
)
def test_invalid_targets_change_nothing(sched, kw, match):
    before = sched.status()
    if match is None:  # more slots than experts (and prefill's two layer buffers) is clamped, not refused
        sched.rebuild_cache(**kw)
        cfg = sched.engine.model_config
        assert sched.status()["expert_slots"] == (cfg.num_moe_layers + 2) * cfg.num_experts
        return
    with pytest.raises(ConfigError, match=match):
        sched.rebuild_cache(**kw)
    assert sched.status() == before


def test_busy_then_drain(sched):
    h = sched.submit(PROMPTS[0], GenerationParams(max_new_tokens=36, ignore_eos=True))
    next(h.events(60))
    with pytest.raises(Busy):
        sched.rebuild_cache(kv_pages=30)
    st = sched.rebuild_cache(kv_pages=30, drain=True)
    assert st["kv_pages"] == 30
    toks, reason = h.result(60)
    assert reason == "length" and 1 + len(toks) == 36  # one token was read above


def test_drain_compiles_before_it_stops_admitting(sched, monkeypatch):
    """The new geometry is validated and compiled while requests are still admitted; admission
    stops only for the swap, and the answer says for how long."""
    runner = sched.engine.runner
    real = runner.prepare_resize
    seen = []

    def prepare(*a):
        seen.append((sched.batcher.admitting, sched.batcher.running()))
        return real(*a)

    monkeypatch.setattr(runner, "prepare_resize", prepare)
    h = sched.submit(PROMPTS[0], GenerationParams(max_new_tokens=30, ignore_eos=True))
    next(h.events(60))
    st = sched.rebuild_cache(kv_pages=30, drain=True)
    assert seen == [(True, 1)]  # compiled beside the running request, admission still open
    assert st["kv_pages"] == 30 and 0 <= st["refused_s"] < 60
    assert h.result(60)[1] == "length"
    with pytest.raises(ConfigError):
        sched.rebuild_cache(kv_pages=1, drain=True)  # refused while validating: nothing stopped
    assert sched.batcher.admitting


def test_pool_bounded_by_free_memory(sched, monkeypatch):
    monkeypatch.setattr(runner_mod, "host_memory_available", lambda: 1 << 20)  # 1 MiB free
    before = sched.status()
    with pytest.raises(ConfigError, match="more memory"):
        sched.rebuild_cache(kv_pages=100_000)
    assert sched.status() == before and sched.batcher.admitting


def test_compile_failure_changes_nothing(sched, monkeypatch):
    want = outputs(sched)
    before = sched.status()

    def boom(*a):
        raise ConfigError("compile check failed (injected)")

    monkeypatch.setattr(runner_mod.ModelRunner, "_compile_check", boom)
    with pytest.raises(ConfigError, match="injected"):
        sched.rebuild_cache(expert_slots=12)
    assert sched.status() == before and outputs(sched) == want


def test_allocation_failure_rolls_back(sched, monkeypatch):
    want = outputs(sched)
    real = runner_mod.init_slot_cache
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the 1st call only traces shapes for the compile check
            raise MemoryError("out of device memory (injected)")
        return real(*a, **k)

    monkeypatch.setattr(runner_mod, "init_slot_cache", flaky)
    with pytest.raises(runner_mod.RebuildFailed, match="previous geometry was restored"):
        sched.rebuild_cache(expert_slots=12, kv_pages=30)
    st = sched.status()
    assert st["expert_slots"] == 6 and st["kv_pages"] == 20 and not st["failed"]
    assert outputs(sched) == want


def test_double_failure_latches_failed_state(sched, monkeypatch):
    real = runner_mod.init_slot_cache
    calls = {"n": 0}

    def always(*a, **k):  # every allocation fails, the compile check's shape tracing does not
        calls["n"] += 1
        if calls["n"] == 1:
            return real(*a, **k)
        raise MemoryError("injected")

    monkeypatch.setattr(runner_mod, "init_slot_cache", always)
    with pytest.raises(runner_mod.RebuildFailed, match="restoring the previous geometry failed too"):
        sched.rebuild_cache(expert_slots=12)
    with pytest.raises(Overloaded, match="failed state"):
        sched.submit(PROMPTS[0], GenerationParams(max_new_tokens=2))


def test_http_endpoints(sched):
    httpd = serve_http(Service(sched, "demo", sched.engine.model_path), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:

        def post(body):
            req = urllib.request.Request(
                url + "/v1/cache/rebuild", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            return json.load(urllib.request.urlopen(req))

        assert post({"expert_slots": 10})["expert_slots"] == 10
        assert json.load(urllib.request.urlopen(url + "/v1/cache/status"))["expert_slots"] == 10
        with pytest.raises(urllib.error.HTTPError) as e:
            post({"expert_slots": -1})
        assert e.value.code == 400
        with pytest.raises(urllib.error.HTTPError) as e:
            post({"slots": 4})
        msg = json.load(e.value)["error"]["message"]
        assert e.value.code == 400 and "slots" in msg and "not permitted" in msg  # the unknown field, named
    finally:
        httpd.shutdown()
    assert wait_idle(sched)


def test_grpc_and_cli(sched, capsys):
    import grpc

    from freetoken_jax.cli import main
    from freetoken_jax.server.grpc_service import serve_grpc
    from freetoken_jax.server.pb import freetoken_pb2 as pb
    from freetoken_jax.server.pb import freetoken_pb2_grpc as pb_grpc

    service = Service(sched, "demo", sched.engine.model_path)
    server, port = serve_grpc(service, "127.0.0.1", 0)
    httpd = serve_http(service, "127.0.0.1", 0)
    try:
        stub = pb_grpc.FreeTokenStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        assert json.loads(stub.RebuildCache(pb.RebuildCacheRequest(expert_slots=9)).json)["expert_slots"] == 9
        with pytest.raises(grpc.RpcError) as e:
            stub.RebuildCache(pb.RebuildCacheRequest(kv_pages=1))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert main(["ctl", "cache", "--url", url, "--kv-pages", "25"]) == 0
        assert json.loads(capsys.readouterr().out)["kv_pages"] == 25
        assert main(["ctl", "cache", "--url", url, "--slots", "0"]) == 2
        assert "error 400: expert_slots" in capsys.readouterr().err
        assert json.loads(stub.GetCacheStatus(pb.CacheStatusRequest()).json)["kv_pages"] == 25
    finally:
        server.stop(None)
        httpd.shutdown()


def test_engine_resizes_between_generations(monkeypatch):
    """`FreeTokenEngine.rebuild_runtime_cache` without a scheduler: same outputs after growing and
    shrinking; refused while a generation is open; a failed rebuild rolls back, a double failure
    leaves the engine refusing work."""
    from freetoken_jax.engine import RequestError

    eng = FreeTokenEngine.from_pretrained("demo", EC)
    gen = lambda: eng.generate_batch(PROMPTS, max_new_tokens=8, ignore_eos=True)  # noqa: E731
    want = gen()
    for slots, pages in ((20, 40), (None, 12), (4, None)):
        st = eng.rebuild_runtime_cache(slots, pages)
        if slots is not None:
            assert st["expert_slots"] == slots == eng.runner.slots.num_slots
        if pages is not None:
            assert st["kv_pages"] == pages == eng.runner.state.cache[0][0].shape[1]
        assert gen() == want, (slots, pages)
    it = eng.generate(PROMPTS[0], max_new_tokens=4, ignore_eos=True)
    next(it)
    with pytest.raises(Busy, match="generation is running"):
        eng.rebuild_runtime_cache(expert_slots=6)
    it.close()
    with pytest.raises(ConfigError, match="positive integer"):
        eng.rebuild_runtime_cache(expert_slots=0)
    assert eng.runner.slots.num_slots == 4 and gen() == want
    real, calls = runner_mod.init_slot_cache, {"n": 0}

    def failing(calls_that_fail):  # call 1 only traces shapes for the compile check, 2 allocates, 3 restores
        def f(*a, **k):
            calls["n"] += 1
            if calls["n"] in calls_that_fail:
                raise MemoryError("injected")
            return real(*a, **k)

        return f

    monkeypatch.setattr(runner_mod, "init_slot_cache", failing({2}))
    with pytest.raises(runner_mod.RebuildFailed, match="previous geometry was restored"):
        eng.rebuild_runtime_cache(expert_slots=12)
    assert eng.runner.slots.num_slots == 4 and not eng.failed and gen() == want
    calls["n"] = 0
    monkeypatch.setattr(runner_mod, "init_slot_cache", failing({2, 3}))
    with pytest.raises(runner_mod.RebuildFailed, match="failed too"):
        eng.rebuild_runtime_cache(expert_slots=12)
    with pytest.raises(RequestError, match="failed state"):
        gen()
