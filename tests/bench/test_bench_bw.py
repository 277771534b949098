"""`bench bw`: the recommendation rule, the profile file, and strategy "auto"."""

import json
import logging
import re
import time

import pytest

from freetoken_jax import EngineConfig, FreeTokenEngine, MoEModelConfig
from freetoken_jax.bench import bw
from freetoken_jax.runtime import choice
from freetoken_jax.runtime.routing import PROBE_SHIFT, SyntheticRouting


@pytest.mark.parametrize(
    "fig, strategy",
    [
        (dict(cpu_moe_gb_s=100.0, fetch_gb_s=49.0), "hybrid"),
        (dict(cpu_moe_gb_s=98.0, fetch_gb_s=49.0), "offload"),  # exactly 2x: not more than the threshold
        (dict(cpu_moe_gb_s=98.1, fetch_gb_s=49.0), "hybrid"),
        (dict(cpu_moe_gb_s=200.0, fetch_gb_s=49.0, contended_cpu_moe_gb_s=80.0, contended_fetch_gb_s=45.0), "offload"),  # contended decides
        (dict(cpu_moe_gb_s=30.0), "fused"),  # no accelerator link
    ],
)
def test_recommendation(fig, strategy):
    r = bw.recommend(fig)
    assert r["strategy"] == strategy
    if strategy != "fused":
        cpu = fig.get("contended_cpu_moe_gb_s", fig["cpu_moe_gb_s"])
        pcie = fig.get("contended_fetch_gb_s", fig["fetch_gb_s"])
        assert r["q"] == pytest.approx(pcie / (pcie + cpu))
    assert bw.recommend(dict(cpu_moe_gb_s=100.0, fetch_gb_s=49.0), threshold=2.5)["strategy"] == "offload"


def test_contended_rates_cover_the_same_window():
    """The fetch repeats for as long as the CPU pass runs, and each rate is bytes over its own
    time: a 0.2 s pass with 5 ms fetches gives about 40 fetches."""

    calls = []

    def fetch():
        calls.append(time.perf_counter())
        time.sleep(0.005)

    def cpu_pass():
        time.sleep(0.2)

    fetch_rate, cpu_rate = bw.run_together(fetch, 1000, cpu_pass, 10_000)
    assert 25 <= len(calls) <= 42
    assert cpu_rate == pytest.approx(10_000 / 0.2, rel=0.2)
    assert fetch_rate == pytest.approx(1000 / 0.005, rel=0.3)
    assert calls[-1] - calls[0] >= 0.15  # fetches spread over the pass, not bunched at its start


class _Device:
    """A stand-in device: items run one after another; a mark is ready when its item is. Records
    how many items were still running when each new one was enqueued."""

    def __init__(self):
        self.free_at, self.ends, self.busy_at_enqueue = time.perf_counter(), [], []

    def enqueue(self, seconds: float):
        now = time.perf_counter()
        self.busy_at_enqueue.append(sum(t > now for t in self.ends))
        self.free_at = max(now, self.free_at) + seconds
        self.ends.append(self.free_at)
        return _Mark(self.free_at)


class _Mark:
    def __init__(self, t: float):
        self.t, self.waited = t, False

    def block_until_ready(self):
        time.sleep(max(0.0, self.t - time.perf_counter()))
        self.waited = True
        return self


@pytest.mark.parametrize("depth", [0, 3])
def test_pipelined_fetches_keep_the_device_busy(depth):
    """Calls dispatched ahead (1 ms of host work, 10 ms of device work each) find the device
    still busy with earlier ones, so it never waits for the host; waiting on each call
    (depth 0) leaves it idle at every call. Never more than depth + 1 in flight, and every call
    is waited for before the figure is taken."""
    dev, marks = _Device(), []

    def fetch():
        time.sleep(0.001)  # dispatch
        marks.append(dev.enqueue(0.010))
        return marks[-1]

    count, sec = bw.run_pipelined(fetch, lambda c: c >= 12, depth=depth)
    assert count == 12 and all(m.waited for m in marks)
    assert sec >= dev.ends[-1] - dev.ends[0]
    busy = dev.busy_at_enqueue[1:]
    assert max(busy) <= depth
    assert (min(busy) >= 1) if depth else (max(busy) == 0)


def test_lasting_needs_both_the_calls_and_the_time():
    stop = bw.lasting(0.05, 3)
    assert not stop(100)  # enough calls, too soon
    time.sleep(0.06)
    assert not stop(2) and stop(3)


def test_run_writes_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CPU_TIER", "scalar")  # measured at the tier the engine's executors would use
    prof = bw.run_bw(
        path=str(tmp_path / "p.json"), json_path=str(tmp_path / "copy.json"), working_set_gb=0.02, host_read_gb=0.05, hidden=128, ffn=64
    )
    for f in ("p.json", "copy.json"):
        d = json.loads((tmp_path / f).read_text())
        assert d["schema"] == bw.SCHEMA and d["device"] == bw.device_name() and d["cpu_model"] == bw.cpu_model()
        assert d["figures"]["host_read_gb_s"] > 0 and d["figures"]["cpu_moe_gb_s"] > 0 and d["figures"]["cpu_tier"] == "scalar"
        assert {"handoff_ffi_us", "handoff_callback_us"} <= set(d["figures"])
        assert d["recommendation"]["strategy"] in ("fused", "offload", "hybrid")
    assert choice.load_profile(str(tmp_path / "p.json"))["recommendation"] == prof["recommendation"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".benchbw-")]  # no temporary left


def test_bad_profiles_are_ignored_with_a_message(tmp_path, caplog):
    p = tmp_path / "benchbw.json"
    good = dict(
        schema=bw.SCHEMA, device=bw.device_name(), cpu_model=bw.cpu_model(), figures={}, recommendation=dict(strategy="hybrid", q=0.3)
    )
    cases = {
        "unreadable": "{corrupt",
        "schema": json.dumps({**good, "schema": 0}),
        "measured on": json.dumps({**good, "device": "gpu:Some Other GPU"}),
        "no recommendation": json.dumps({**good, "recommendation": None}),
    }
    for word, text in cases.items():
        p.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="freetoken_jax"):
            assert choice.load_profile(str(p)) is None
        assert word in caplog.text
    p.write_text(json.dumps(good))
    assert choice.load_profile(str(p))["recommendation"]["strategy"] == "hybrid"


def test_auto_strategy(tmp_path, monkeypatch):
    cfg = MoEModelConfig(
        vocab_size=64, hidden_dim=32, intermediate_dim=48, num_layers=3, num_experts=8, top_k=2, num_heads=4, num_kv_heads=2
    )
    base = EngineConfig(dtype="float32", max_context=40, max_batch=2, moe_strategy="auto")
    assert FreeTokenEngine(cfg, base.replace(total_vram_gb=1.0)).engine_config.moe_strategy == "fused"
    small = base.replace(total_vram_gb=0.0004)  # the dense weights and KV fit, all experts do not
    monkeypatch.setattr(choice, "profile_path", lambda path=None: str(tmp_path / "benchbw.json"))
    e = FreeTokenEngine(cfg, small)
    assert e.engine_config.moe_strategy == "offload" and "no benchbw.json" in e.get_metrics()["strategy_reason"]
    prof = dict(
        schema=bw.SCHEMA,
        device=bw.device_name(),
        cpu_model=bw.cpu_model(),
        figures=dict(handoff_ffi_us=50.0, fetch_gb_s=10.0),
        recommendation=dict(strategy="hybrid", q=0.3, reason="made up"),
    )
    (tmp_path / "benchbw.json").write_text(json.dumps(prof))
    e = FreeTokenEngine(cfg, small.replace(auto_probe_steps=0))  # the recommendation as is
    assert e.engine_config.moe_strategy == "hybrid" and e.engine_config.hybrid_q == 0.3
    # the measured handoff cost becomes hybrid_overhead, in expert fetch times: 50 us / (3 x 32 x 48 x 4 B / 10 GB/s)
    assert e.engine_config.hybrid_overhead == pytest.approx(50e-6 / (3 * 32 * 48 * 4 / 10e9))
    assert (
        e.generate_batch([[1, 2, 3]], max_new_tokens=3, ignore_eos=True)[0]
        == FreeTokenEngine(cfg, base.replace(moe_strategy="fused")).generate_batch([[1, 2, 3]], max_new_tokens=3, ignore_eos=True)[0]
    )


def test_auto_hybrid_is_checked_by_a_decode_probe(tmp_path, monkeypatch, caplog):
    """With a profile, hybrid runs only if a decode probe finds it at least as fast as offload,
    whatever the profile's bandwidth rule recommends; the outcome is kept in the profile."""
    cfg = MoEModelConfig(
        vocab_size=64, hidden_dim=32, intermediate_dim=48, num_layers=3, num_experts=8, top_k=2, num_heads=4, num_kv_heads=2
    )
    ecfg = EngineConfig(dtype="float32", max_context=40, max_batch=2, moe_strategy="auto", total_vram_gb=0.0004, auto_probe_steps=4)
    monkeypatch.setattr(choice, "profile_path", lambda path=None: str(tmp_path / "benchbw.json"))
    profile = tmp_path / "benchbw.json"

    def write(strategy, figures=None):  # a fresh profile: no kept probe outcome
        profile.write_text(json.dumps(dict(schema=bw.SCHEMA, device=bw.device_name(), cpu_model=bw.cpu_model(), figures=figures or {},
                                           recommendation=dict(strategy=strategy, q=0.3, reason="made up"))))  # fmt: skip

    fused = FreeTokenEngine(cfg, ecfg.replace(moe_strategy="fused", total_vram_gb=None))
    want = fused.generate_batch([[1, 2, 3]], max_new_tokens=4, ignore_eos=True)
    offload_wins, hybrid_wins, cpu_wins = ({"hybrid": 5.0, "offload": 10.0, "cpu": 1.0}, "offload"), \
        ({"hybrid": 12.0, "offload": 10.0, "cpu": 1.0}, "hybrid"), ({"hybrid": 5.0, "offload": 4.0, "cpu": 9.0}, "cpu")  # fmt: skip
    # the recommendation only starts the probe: each outcome from "hybrid", and hybrid's from "offload"
    for rec, (rates, kept) in [("hybrid", offload_wins), ("hybrid", hybrid_wins), ("hybrid", cpu_wins), ("offload", hybrid_wins)]:
        write(rec)
        monkeypatch.setattr(FreeTokenEngine, "_decode_rate", lambda self, steps, probe, r=rates: r[self.experts.strategy])
        e = FreeTokenEngine(cfg, ecfg)
        assert e.engine_config.moe_strategy == e.experts.strategy == kept, (rec, rates)
        assert "decode probe" in e.strategy_reason and f"hybrid {rates['hybrid']:.1f} tok/s" in e.strategy_reason
        if rec == "hybrid" or kept == "cpu":
            assert e.generate_batch([[1, 2, 3]], max_new_tokens=4, ignore_eos=True) == want
        if kept == "cpu":  # the slot cache is freed for good
            assert e.runner.state.slots is None and e.plan.slots == 0 and e.get_metrics()["moe_strategy"] == "cpu"
        if kept == "hybrid":  # every q measured the same: the recommendation stays
            assert e.engine_config.hybrid_q == 0.3 and float(e.experts.q) == pytest.approx(0.3)
        # the next start of the same model and settings takes the kept outcome without probing
        monkeypatch.setattr(FreeTokenEngine, "_decode_rate", lambda self, steps, probe: pytest.fail("probed again"))
        again = FreeTokenEngine(cfg, ecfg)
        assert again.engine_config.moe_strategy == kept and "a decode probe of this model here chose" in again.strategy_reason
        other = FreeTokenEngine(cfg, ecfg.replace(max_batch=1, auto_probe_steps=0))  # other settings, no probe: the recommendation
        assert other.engine_config.moe_strategy == rec
    # a benchmark's synthetic routing stays on every candidate (hybrid at each q, offload) and on
    # the winner, cpu here (its slots freed); each measurement draws afresh, the winner as before
    write("offload")
    rates = {"hybrid": 5.0, "offload": 4.0, "cpu": 9.0}
    seen = []
    monkeypatch.setattr(
        FreeTokenEngine, "_decode_rate",
        lambda self, steps, probe: seen.append((type(self.experts), self.experts.shift, probe)) or rates[self.experts.strategy],
    )  # fmt: skip
    e = FreeTokenEngine(cfg, ecfg, routing_skew=0.0)
    assert seen == [(SyntheticRouting, i * PROBE_SHIFT, i) for i in range(6)]
    assert isinstance(e.experts, SyntheticRouting) and e.experts.shift == 0 and e.engine_config.moe_strategy == "cpu"
    assert len(e.generate_batch([[1, 2, 3]], max_new_tokens=4, ignore_eos=True)[0]) == 4
    write("hybrid")
    # the q probe keeps the fastest q of 0.3 + (0, -0.05, -0.1, 0.05)
    seen = []

    def rate(self, steps, probe):
        if self.experts.strategy in ("offload", "cpu"):
            return 1.0
        seen.append(round(float(self.experts.q), 4))
        return {0.2: 9.0, 0.25: 7.0}.get(seen[-1], 5.0)

    monkeypatch.setattr(FreeTokenEngine, "_decode_rate", rate)
    caplog.clear()  # (the engines above log their probes too where the logger is already at INFO)
    with caplog.at_level(logging.INFO, logger="freetoken_jax"):
        e = FreeTokenEngine(cfg, ecfg)
    assert sorted(seen) == [0.2, 0.25, 0.3, 0.35]
    said = [r.getMessage() for r in caplog.records if "probe " in r.getMessage() and " of 6: " in r.getMessage()]
    hybrid_rates = [(0.3, 5.0), (0.25, 7.0), (0.2, 9.0), (0.35, 5.0)]  # in the probe's order: the recommendation, its offsets
    want_said = [f"probe {i + 1} of 6: hybrid at q {q:g} {r:.1f} tok/s" for i, (q, r) in enumerate(hybrid_rates)]
    want_said += ["probe 5 of 6: offload 1.0 tok/s", "probe 6 of 6: cpu 1.0 tok/s"]
    assert [m.split("auto: ")[1] for m in said] == want_said  # each measurement said as it ends
    assert e.engine_config.hybrid_q == pytest.approx(0.2) and float(e.experts.q) == pytest.approx(0.2)
    assert "q = 0.2" in e.strategy_reason and e.get_metrics()["hybrid_q"] == pytest.approx(0.2)
    assert e.generate_batch([[1, 2, 3]], max_new_tokens=4, ignore_eos=True) == want
    # with the figures measured apart in the profile, their q* (60 / (60 + 40)) is measured too
    write("hybrid", dict(h2d_gb_s=60.0, cpu_moe_gb_s=40.0, contended_fetch_gb_s=10.0, contended_cpu_moe_gb_s=35.0))
    seen = []

    def rate_apart(self, steps, probe):  # q 0.6 the fastest
        r = rate(self, steps, probe)
        return 10.0 if self.experts.strategy == "hybrid" and seen[-1] == 0.6 else r

    monkeypatch.setattr(FreeTokenEngine, "_decode_rate", rate_apart)
    e = FreeTokenEngine(cfg, ecfg)
    assert sorted(seen) == [0.2, 0.25, 0.3, 0.35, 0.6] and e.engine_config.hybrid_q == pytest.approx(0.6)
    monkeypatch.undo()
    monkeypatch.setattr(choice, "profile_path", lambda path=None: str(tmp_path / "benchbw.json"))
    write("hybrid")
    e = FreeTokenEngine(cfg, ecfg)  # measured for real: the choice follows the two figures it reports
    got = dict(re.findall(r"(hybrid|offload|cpu) ([0-9.]+) tok/s", e.strategy_reason.split("decode probe:")[1]))
    best = max(got, key=lambda k: (float(got[k]), k == "hybrid", k == "offload"))
    assert e.engine_config.moe_strategy == best
    # four values of q and offload: two executables; cpu over the slots a third (and a fourth without them)
    assert e.runner.steps.traces.get("decode_step_plain") == (4 if best == "cpu" else 3)
    m = e.get_metrics()
    assert m["requests"] == 0 and m["generated_tokens"] == 0  # the probe's tokens are not the user's


def test_each_decode_probe_decodes_its_own_prompt(monkeypatch):
    """The probe's measurements sample from prompts of their own (a router's choice follows the
    tokens: a repeated prompt would find the experts of the measurement before in the slots),
    each the same from one start to the next."""
    cfg = MoEModelConfig(
        vocab_size=64, hidden_dim=32, intermediate_dim=48, num_layers=2, num_experts=8, top_k=2, num_heads=4, num_kv_heads=2
    )
    e = FreeTokenEngine(cfg, EngineConfig(dtype="float32", max_context=40, max_batch=1, moe_strategy="fused"))
    asked = []
    monkeypatch.setattr(e, "generate", lambda prompt, **kw: asked.append((tuple(prompt), kw["seed"])) or iter(range(kw["max_new_tokens"])))
    for probe in (0, 1, 2, 1):
        assert e._decode_rate(4, probe) > 0
    assert len(set(asked[:3])) == 3 and len({p for p, _ in asked[:3]}) == 3 and asked[3] == asked[1]


def test_apart_q_takes_the_figures_measured_apart():
    """q* from the profile's link and executor measured alone (the contended pair left out), the
    executor's figure for the experts' format where it has one; None without both figures."""
    both = dict(fetch_gb_s=50.0, h2d_gb_s=40.0, cpu_moe_gb_s=75.0, cpu_moe_q4_0_gb_s=50.0, contended_fetch_gb_s=10.0,
                contended_cpu_moe_gb_s=60.0)  # fmt: skip
    assert choice.apart_q(both) == pytest.approx(50 / 125) and choice.apart_q(both, "q4_0") == pytest.approx(0.5)
    assert choice.apart_q(dict(h2d_gb_s=30.0, cpu_moe_gb_s=70.0)) == pytest.approx(0.3)
    assert choice.apart_q(dict(h2d_gb_s=30.0)) is None and choice.apart_q(dict(cpu_moe_gb_s=30.0, contended_fetch_gb_s=9.0)) is None
    assert choice.apart_q({}) is None
