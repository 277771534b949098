"""`python -m freetoken_jax.bench decode|prefill` on the demo model: the JSON it writes, the
figures' consistency across strategies, and the plot option."""

import json

import numpy as np
import pytest

from freetoken_jax.bench.__main__ import main
from freetoken_jax.bench.compare import plot

ROW_KEYS = {"strategy", "batch", "slots_gb", "slots", "routing_skew", "ms_per_token", "tokens_per_s", "ttft_ms", "hit_rate",
            "gb_fetched_per_token", "experts_on_cpu_per_step", "q", "bound_ms", "ratio_to_bound"}  # fmt: skip


def test_decode_side_by_side(tmp_path, capsys):
    out = tmp_path / "decode.json"
    argv = ["decode", "--preset", "demo", "--strategy", "offload", "hybrid", "naive", "cpu", "--slots-gb", "0.0005", "0.002",
            "--gen-len", "8", "--routing-skew", "0", "--q", "0.1", "1", "--dtype", "float32", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    d = json.loads(out.read_text())
    assert d["kind"] == "decode" and d["h2d_gb_s"] > 0 and d["executor_gb_s"] > 0
    # the bounds' link rate: a fresh buffer's on the CPU backend (a layer's banks are measured on a GPU)
    assert d["h2d_gb_s"] == d["h2d_buffer_gb_s"] and d["h2d_banks_gb_s"] is None
    assert d["q"] == pytest.approx(d["h2d_gb_s"] / (d["h2d_gb_s"] + d["hybrid_executor_gb_s"]))  # q*, measured on hybrid's threads
    # one hybrid row per --q value, all in one executable (q is traced): at q = 1 every miss is fetched
    full = {r["slots_gb"]: r for r in d["rows"] if r["strategy"] == "hybrid" and r["q"] == pytest.approx(1)}
    assert set(full) == {0.0005, 0.002} and all(r["experts_on_cpu_per_step"] == 0 for r in full.values())
    rows = {(r["strategy"], r["slots_gb"]): r for r in d["rows"] if r["q"] != pytest.approx(1)}
    assert set(rows) == {("offload", 0.0005), ("offload", 0.002), ("hybrid", 0.0005), ("hybrid", 0.002), ("naive", None), ("cpu", None)}
    for r in d["rows"]:
        assert ROW_KEYS <= set(r) and r["tokens_per_s"] > 0 and 0 <= r["hit_rate"] <= 1 and r["bound_ms"] > 0 and r["routing_skew"] == 0
        # the driving thread ran within the step (schedstat's run time of a running thread lags by up
        # to a scheduler tick at each reading: a few ms over the few steps timed here)
        assert 0 < r["host_thread_ms_per_step"] <= r["ms_per_token"] * 1.05 + 1.0
    assert rows[("naive", None)]["hit_rate"] == 0 and rows[("naive", None)]["gb_fetched_per_token"] > 0
    # more slots, no fewer hits (same seeded routing); the hybrid sends work to the CPU
    assert rows[("offload", 0.002)]["hit_rate"] >= rows[("offload", 0.0005)]["hit_rate"]
    assert rows[("offload", 0.002)]["slots"] > rows[("offload", 0.0005)]["slots"]
    assert rows[("hybrid", 0.0005)]["experts_on_cpu_per_step"] > 0 and rows[("hybrid", 0.0005)]["q"] == pytest.approx(0.1)
    assert "of bound" in capsys.readouterr().out
    # every row against the naive row of its batch and skew
    naive = rows[("naive", None)]["tokens_per_s"]
    for r in d["rows"]:
        assert r["x_naive"] == pytest.approx(r["tokens_per_s"] / naive)


def test_prompt_fed_through_decode_times_the_same_positions(tmp_path):
    """--prompt-by-decode replaces the prefill by decode steps over the prompt: the timed steps sit
    at the same positions, so synthetic routing (seeded by position) fetches the same experts."""
    rows = []
    for extra in ([], ["--prompt-by-decode"]):
        out = tmp_path / f"d{len(extra)}.json"
        argv = ["decode", "--preset", "demo", "--strategy", "naive", "--routing-skew", "0", "--batch", "4", "--gen-len", "8", "--prompt-len", "12",
                "--dtype", "float32", "--json", str(out), *extra]  # fmt: skip
        assert main(argv) == 0
        rows += json.loads(out.read_text())["rows"]
    prefilled, fed = rows
    assert prefilled["ttft_ms"] > 0 and fed["ttft_ms"] is None
    assert fed["gb_fetched_per_token"] == prefilled["gb_fetched_per_token"] > 0


def test_decode_steps_compiled_ahead_on_threads(tmp_path, capsys):
    from freetoken_jax.bench.compare import Bench

    bench = Bench("demo", dtype="float32", max_batch=2, max_context=64)
    rows = [
        dict(variant=v, B=B, slots_gb=0.001, prompt_len=8, steps=6, q=0.2, skew=k)
        for v, B in (("offload", 2), ("naive", 1))
        for k in (0.0, 1.0)
    ]
    bench.precompile(rows, 2)
    assert bench.steps.compilations()["decode"] == 2 and "failed" not in capsys.readouterr().err  # one executable serves both skews
    for r in rows:  # every row runs the executable compiled for it on the threads
        got = bench.decode(**r, prompt_by_decode=True)
        assert got["tokens_per_s"] > 0 and got["batch"] == r["B"] and got["routing_skew"] == r["skew"]
    assert bench.steps.compilations()["decode"] == 2
    # and the command line does the same
    out = tmp_path / "d.json"
    argv = ["decode", "--preset", "demo", "--strategy", "offload", "--slots-gb", "0.0005", "0.002", "--gen-len", "6",
            "--routing-skew", "0", "--dtype", "float32", "--compile-workers", "2", "--prompt-by-decode", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().err.count("compiled ahead") == 2
    got = json.loads(out.read_text())["rows"]
    assert [(r["strategy"], r["slots_gb"]) for r in got] == [("offload", 0.0005), ("offload", 0.002)]
    assert not any("x_naive" in r for r in got)  # no naive row, nothing to compare with


def test_speedups_pair_rows_by_batch_and_skew():
    from freetoken_jax.bench.compare import add_speedups

    rows = [dict(strategy=s, batch=b, routing_skew=k, tokens_per_s=t)
            for s, b, k, t in (("naive", 1, 0, 10.0), ("naive", 1, 1, 20.0), ("hybrid", 1, 0, 25.0), ("hybrid", 1, 1, 50.0),
                               ("hybrid", 4, 0, 80.0))]  # fmt: skip
    assert add_speedups(rows)
    assert [r.get("x_naive") for r in rows] == [1.0, 1.0, 2.5, 2.5, None]  # batch 4 has no naive row


def test_prefill(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_PREFILL_ATTENTION", "flash")  # recorded with the rows
    monkeypatch.setenv("JAX_EXEC_TIME_OPTIMIZATION_EFFORT", "0.0")  # jax's, read at its import: recorded, no effect here
    out = tmp_path / "prefill.json"
    # (offload loads a demo layer's bank by copy on the CPU backend, as offload-copy does)
    argv = ["prefill", "--preset", "demo", "--strategy", "offload", "offload-fetch", "offload-copy2", "stream", "fused", "--slots-gb", "0.01",
            "--prompt-len", "40", "--chunk", "16",
            "--dtype", "float32", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["switches"].get("FREETOKEN_PREFILL_ATTENTION") == "flash"
    assert record["switches"].get("JAX_EXEC_TIME_OPTIMIZATION_EFFORT") == "0.0"
    assert record["prefill_load"] == "auto"  # the engine's choice: the CPU backend leaves it to the executor
    rows = record["rows"]
    assert [(r["strategy"], r["prompt_len"], r["chunks"], r["buffered"]) for r in rows] == [
        ("offload", 40, 3, True),  # 0.01 GB holds more than 2 x 16 demo experts: two layer buffers
        ("offload-fetch", 40, 3, True),
        ("offload-copy2", 40, 3, True),
        ("stream", 40, 3, False),
        ("fused", 40, 3, False),
    ]
    assert rows[0]["pcie_bound_ms"] > 0 and rows[4]["pcie_bound_ms"] is None and all(r["tokens_per_s"] > 0 for r in rows)
    assert len({r["first_token"] for r in rows}) == 1  # every load path prefills the same prompt to the same token
    # ... with the same lead over the runner-up (greedy: the first token is the most likely one)
    margins = [r["first_margin"] for r in rows]
    assert margins[0] > 0 and max(margins) - min(margins) < 1e-4, margins


def test_prefill_under_synthetic_routing(tmp_path, monkeypatch):
    from freetoken_jax.bench import compare
    from freetoken_jax.runtime.routing import SyntheticRouting

    drawn = []  # the skew of every routing the bench computes with (that it changes the output: tests/runtime/test_routing.py)
    monkeypatch.setattr(compare, "SyntheticRouting", lambda experts, skew: drawn.append(skew) or SyntheticRouting(experts, skew))
    out = tmp_path / "prefill.json"
    argv = ["prefill", "--preset", "demo", "--strategy", "offload", "fused", "--slots-gb", "0.01", "--prompt-len", "40",
            "--chunk", "16", "--routing-skew", "0", "3", "--expert-impl", "grouped", "--dtype", "float32", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["strategy"], r["routing_skew"]) for r in rows] == [("offload", 0), ("fused", 0), ("offload", 3), ("fused", 3)]
    # the strategies agree under each routing, and each row computed the routing drawn at its skew
    assert rows[0]["first_token"] == rows[1]["first_token"] and rows[2]["first_token"] == rows[3]["first_token"]
    assert sorted(set(drawn)) == [0.0, 3.0] and len(drawn) >= 4


def test_plot_draws_or_says_what_is_missing(tmp_path):
    rows = [dict(strategy="offload", batch=1, routing_skew=0, slots_gb=v, tokens_per_s=t) for v, t in ((8, 10.0), (16, 20.0))]
    rows.append(dict(strategy="naive", batch=1, routing_skew=0, slots_gb=None, tokens_per_s=5.0))
    path = tmp_path / "p.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="matplotlib"):
            plot(rows, str(path))
    else:
        plot(rows, str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transformers_baseline_beside_the_engine(tmp_path, ckpt_root, capsys):
    from hf_models import make_checkpoint

    path = make_checkpoint("qwen3_moe", ckpt_root)
    out = tmp_path / "t.json"
    argv = ["decode", "--model", path, "--strategy", "offload", "transformers", "--slots-gb", "0.001", "--gen-len", "6",
            "--prompt-len", "8", "--dtype", "float32", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"offload", "transformers"}
    assert rows["transformers"]["tokens_per_s"] > 0 and rows["transformers"]["placement"] == "cpu"  # no GPU here
    # a preset has no Hugging Face checkpoint: the baseline is skipped with a message, the rest runs
    assert main(["decode", "--preset", "demo", "--strategy", "transformers", "naive", "--gen-len", "6", "--dtype", "float32"]) == 0
    assert "needs --model with a Hugging Face checkpoint" in capsys.readouterr().err


def test_plot_command_draws_several_runs_together(tmp_path):
    runs = []
    for skew in (0, 1):
        rows = [dict(strategy="offload", batch=1, routing_skew=skew, slots_gb=v, tokens_per_s=10.0 + v + skew) for v in (8, 16)]
        runs.append(tmp_path / f"s{skew}.json")
        runs[-1].write_text(json.dumps(dict(kind="decode", rows=rows)))
    other = tmp_path / "prefill.json"
    other.write_text(json.dumps(dict(kind="prefill", rows=[])))
    with pytest.raises(SystemExit, match="not the JSON of a `bench decode` run"):
        main(["plot", str(runs[0]), str(other), "--out", str(tmp_path / "x.png")])
    path = tmp_path / "both.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="matplotlib"):
            main(["plot", *map(str, runs), "--out", str(path)])
    else:
        assert main(["plot", *map(str, runs), "--out", str(path)]) == 0
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_expert_impl_is_recorded_and_gives_the_same_tokens(tmp_path):
    firsts = {}
    for impl in ("ragged", "dense"):
        out = tmp_path / f"{impl}.json"
        argv = ["prefill", "--preset", "demo", "--strategy", "offload", "--slots-gb", "0.01", "--prompt-len", "40", "--chunk", "16",
                "--dtype", "float32", "--expert-impl", impl, "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        d = json.loads(out.read_text())
        assert d["expert_impl"] == impl
        firsts[impl] = d["rows"][0]["first_token"]
    assert firsts["ragged"] == firsts["dense"]


def test_user_errors_are_one_line_and_come_first(tmp_path, capsys, monkeypatch):
    """A bad setting is one line on stderr (no traceback); a --plot that cannot be drawn is said
    before the run, not after it."""
    from freetoken_jax.bench import compare

    assert main(["decode", "--model", str(tmp_path / "nope"), "--gen-len", "4"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint directory" in err and "Traceback" not in err
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setattr(compare, "run", lambda args: (_ for _ in ()).throw(AssertionError("ran before checking --plot")))
    assert main(["decode", "--gen-len", "4", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_decode_rows_split_the_step_at_the_handoff_windows(tmp_path, monkeypatch):
    """With the FFI handoff (the GPU's; its CPU handlers here), a cpu row reports the handoff's
    window and the step's time outside the windows per layer, which together make up the step."""
    from freetoken_jax.bench import compare

    monkeypatch.setattr(compare, "resolve_mode", lambda mode: "ffi")
    out = tmp_path / "d.json"
    argv = ["decode", "--preset", "demo", "--strategy", "cpu", "--prompt-len", "8", "--gen-len", "12", "--routing-skew", "0",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    (r,) = json.loads(out.read_text())["rows"]
    layers = r["handoffs_per_step"]
    assert layers > 0 and r["handoff_window_us"] > 0 and r["outside_windows_us_per_layer"] > 0
    whole = layers * (r["handoff_window_us"] + r["outside_windows_us_per_layer"]) / 1e3
    assert whole == pytest.approx(r["ms_per_token"], rel=1e-6)


def test_first_layer_banks_are_the_executors_first_banks():
    """The banks whose copy times the link for the bounds are the first MoE layer's, the same
    memory the CPU executor reads (`host_bank_views`); copied together, their rate is a rate."""
    from freetoken_jax.bench.compare import Bench, first_layer_banks
    from freetoken_jax.bench.measure import h2d_bandwidth

    bench = Bench("demo", dtype="float32", max_batch=1, max_context=64, quiet=True)
    banks = first_layer_banks(bench.engine.weights.params)
    assert len(banks) == 3
    for bank, view in zip(banks, bench.views[0][:3]):
        np.testing.assert_array_equal(np.asarray(bank), view)
    assert h2d_bandwidth(banks, reps=2) > 0
