"""Strategy "hybrid": of each layer's misses, fetch_count(M, q*) go to the GPU (most recently
routed first) and the rest are computed by the CPU executor; tokens equal fused for any q*, with
either CPU handoff (pure_callback or the split FFI submit/wait)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_slot_cache
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.memory.slot_cache import (
    borrow_for_prefill,
    find_misses,
    keep_buffer,
    place_misses,
    record_stats,
    step_victims,
)
from pallas_kernels.slot_place import fetch_count

# max_running: both rows decode together even with the fewest slots (one step's experts for max_batch rows)
BASE = dict(dtype="float32", max_context=48, max_batch=2, max_running=2, page_size=4, prefill_chunk=16, moe_strategy="hybrid",
            hybrid_overhead=0.0)  # fmt: skip
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [27, 18, 28]]


def test_fetch_count_balances_both_sides():
    for M in range(0, 40):
        for q in (0.0, 0.1, 0.3, 0.35, 0.5, 0.9, 1.0):
            F = int(fetch_count(jnp.int32(M), q))
            cost = lambda f, M=M, q=q: max(f * (1 - q), (M - f) * q)  # noqa: E731
            lo = int(np.floor(M * q))
            assert F in (lo, min(lo + 1, M)) and 0 <= F <= M
            assert cost(F) <= min(cost(lo), cost(min(lo + 1, M))) + 1e-9, (M, q, F)


def test_fetch_count_with_handoff_overhead():
    """With the handoff's fixed cost, the split is the best of ⌊qM⌋, ⌊qM⌋+1 and M under
    max(F·(1−q), (M−F)·q + o·(1−q)·[F<M]) (a plain-Python model); a lone miss is fetched."""
    for o in (0.5, 1.4, 4.0):
        for M in range(0, 40):
            for q in (0.0, 0.2, 0.37, 0.6, 1.0):
                cost = lambda f, M=M, q=q, o=o: max(f * (1 - q), (M - f) * q + (o * (1 - q) if f < M else 0.0))  # noqa: E731
                lo = int(np.floor(M * q))
                cands = [lo, min(lo + 1, M), M]
                F = int(fetch_count(jnp.int32(M), q, o))
                assert F in cands and cost(F) <= min(cost(c) for c in cands) + 1e-6, (M, q, o, F)
    assert int(fetch_count(jnp.int32(1), 0.37, 1.4)) == 1 and int(fetch_count(jnp.int32(1), 0.37, 0.0)) == 0
    assert int(fetch_count(jnp.int32(64), 0.37, 1.4)) < 64  # many misses still split


def test_misses_found_before_placing_agree_with_the_placed_maps():
    """A hybrid step starts the CPU job from `find_misses` alone and places the fetched misses
    while it runs: the entries it sends to the CPU must be exactly those whose expert is still
    not resident once `place_misses` has run, and the fetched ones must all have landed."""
    rng = np.random.default_rng(0)
    L, E, T, K = 3, 8, 3, 2
    for trial in range(60):
        S = int(rng.integers(T * K, 16))
        c = random_slot_cache(rng, L, E, S, T * K)
        layer = int(rng.integers(0, L))
        ids = jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32)  # repeats across tokens happen
        valid = jnp.asarray(rng.integers(0, 2, T), jnp.int32).at[0].set(1)
        q = float(rng.choice([0.0, 0.3, 0.5, 1.0]))
        m = find_misses(c, layer, ids, valid, E, q)
        new, slots_TK, plan, *_ = place_misses(c, layer, m, E, T, K)
        flat = layer * E + np.asarray(ids).reshape(-1)
        v = np.repeat(np.asarray(valid) != 0, K)
        after = np.asarray(new.slot_for_id)[flat]
        np.testing.assert_array_equal(np.asarray(m.on_cpu), v & (after < 0), err_msg=str(trial))
        missed = len({int(f) for f, ok, s in zip(flat, v, np.asarray(c.slot_for_id)[flat]) if ok and s < 0})
        assert int(np.sum(m.miss)) == int(fetch_count(jnp.int32(missed), q)), trial
        assert int(np.sum(m.miss)) + int(np.sum(m.to_cpu)) == missed, trial
        on_gpu = v & ~np.asarray(m.on_cpu)
        np.testing.assert_array_equal(np.asarray(slots_TK).reshape(-1)[on_gpu], after[on_gpu])
        np.testing.assert_array_equal(np.asarray(new.id_of_slot)[after[on_gpu]], flat[on_gpu])
        assert set(np.asarray(plan.dst_N)[np.asarray(plan.valid_N)]) <= set(after[on_gpu])


def test_victims_by_the_kernel_equal_xlas(monkeypatch):
    """FREETOKEN_VICTIM_TOPK=kernel chooses the same victims (the least recently used slots not in
    use, ties to the lower slot) as `lax.top_k`: every output of `place_misses` equal."""
    rng = np.random.default_rng(5)
    L, E, T, K = 3, 8, 3, 2
    for trial in range(8):
        c = random_slot_cache(rng, L, E, int(rng.integers(T * K, 16)), T * K)
        layer = int(rng.integers(0, L))
        ids = jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32)
        m = find_misses(c, layer, ids, jnp.ones(T, jnp.int32), E, float(rng.choice([0.0, 0.5, 1.0])))
        out = {}
        for how in ("xla", "kernel"):
            monkeypatch.setenv("FREETOKEN_VICTIM_TOPK", how)
            new, slots_TK, plan, *_ = place_misses(c, layer, m, E, T, K)
            out[how] = jax.tree.leaves((new, slots_TK, plan))
        for a, b in zip(out["xla"], out["kernel"]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(trial))
    monkeypatch.setenv("FREETOKEN_VICTIM_TOPK", "sort")
    with pytest.raises(ValueError, match="use xla or kernel"):
        place_misses(c, layer, m, E, T, K)


def test_a_steps_statistics_recorded_at_its_end_equal_each_layers_own():
    """`place_misses` leaves each layer's counters, routed ids and routing clock to
    `record_stats`, which writes them for all the step's layers at once: the same values a
    layer-by-layer update gives (a plain-Python model over the layers in step order)."""
    rng = np.random.default_rng(3)
    L, E, T, K = 4, 8, 3, 2
    for trial in range(30):
        c = random_slot_cache(rng, L, E, 10, T * K)
        hits, misses, cpu = (np.asarray(a).copy() for a in (c.hits_L, c.misses_L, c.cpu_L))
        routed, last_routed = np.asarray(c.routed_LN).copy(), np.asarray(c.last_routed).copy()
        stats = []
        for layer in range(L):
            ids = jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32)
            valid = jnp.asarray(rng.integers(0, 2, T), jnp.int32).at[0].set(1)
            m = find_misses(c, layer, ids, valid, E, float(rng.choice([0.0, 0.5, 1.0])))
            clock = int(c.clock)
            c, _, _, st, _ = place_misses(c, layer, m, E, T, K)
            stats.append(st)
            flat, v = layer * E + np.asarray(ids).reshape(-1), np.repeat(np.asarray(valid) != 0, K)
            hits[layer] += int(np.sum(np.asarray(m.first) & (np.asarray(m.slot) >= 0)))
            misses[layer] += int(np.sum(m.miss))
            cpu[layer] += int(np.sum(m.to_cpu))
            routed[layer] = np.where(v, flat, -1)
            last_routed[flat[v]] = clock
        out = record_stats(c, stats)
        for got, want in ((out.hits_L, hits), (out.misses_L, misses), (out.cpu_L, cpu), (out.routed_LN, routed),
                          (out.last_routed, last_routed)):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(trial))
    assert record_stats(c, []) is c


# Hybrid is family-independent past the router; two families here (shared experts and a dense
# layer; MLA with sigmoid grouped routing), every family in tests/quant/test_quantized_strategies.py.
@pytest.mark.parametrize("family", ["deepseek_v3"])  # the other families: tests/quant/test_quantized_strategies.py
def test_hybrid_matches_fused(family, ckpt_root):
    path = make_checkpoint(family, ckpt_root)
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**{**BASE, "moe_strategy": "fused"}))
    want = fused.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True)
    cfg = fused.model_config
    # (q = 1, every miss fetched: tests/bench/test_bench_compare.py)
    runs = ((0.35, 2 * cfg.top_k, "callback"), (0.0, 2 * cfg.top_k, "ffi"), (0.5, 1000, "callback"))
    for q, slots, handoff in runs:
        eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, expert_slots=slots, hybrid_q=q, cpu_handoff=handoff))
        assert eng.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True) == want, (family, q, slots, handoff)
        m = eng.get_metrics()
        if (q, handoff) == (0.35, "callback"):
            plain = eng
        if q == 0.0:
            assert m["experts_fetched"] == 0 and m["experts_on_cpu"] > 0
        if q == 0.35:
            assert 0 < m["experts_fetched"] < m["experts_fetched"] + m["experts_on_cpu"]
            # no slot ever holds an expert that was left to the CPU in the same step: the maps stay a bijection
            c = eng.runner.slots
            ids = np.asarray(c.id_of_slot)
            sfi = np.asarray(c.slot_for_id)
            assert all(sfi[i] == s for s, i in enumerate(ids) if i >= 0) and (sfi >= 0).sum() == (ids >= 0).sum()
    np.testing.assert_allclose(eng.logits(PROMPTS[0]), fused.logits(PROMPTS[0]), atol=1e-5, rtol=0)
    # with the handoff's fixed cost counted, lone misses are fetched instead: same tokens, more fetches
    cost = FreeTokenEngine.from_pretrained(
        path, EngineConfig(**{**BASE, "hybrid_overhead": 1.4}, expert_slots=2 * cfg.top_k, hybrid_q=0.35)
    )
    assert cost.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True) == want
    assert cost.get_metrics()["experts_on_cpu"] < plain.get_metrics()["experts_on_cpu"]


def test_one_kernel_a_layer_equals_xlas_choice(ckpt_root, monkeypatch):
    """A hybrid layer's misses, CPU share, victims and maps chosen by one kernel
    (FREETOKEN_SLOT_PLACE=kernel: `slot_place.place_layer`, interpret mode here; 18 slots hold the
    step's one sort, (3 layers + 1) × 4 entries, but not every expert) and by XLA's computation:
    the same tokens as fused, and the same fetches, CPU computations and slot maps."""
    path = make_checkpoint("qwen3_moe", ckpt_root)
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**{**BASE, "moe_strategy": "fused"}))
    want = fused.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True)
    runs = []
    for how in ("xla", "kernel"):
        monkeypatch.setenv("FREETOKEN_SLOT_PLACE", how)
        eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**{**BASE, "hybrid_overhead": 0.6}, expert_slots=18, hybrid_q=0.4))
        assert eng.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True) == want, how
        m, c = eng.get_metrics(), eng.runner.slots
        runs.append(
            (m["experts_fetched"], m["experts_on_cpu"], np.asarray(c.slot_for_id), np.asarray(c.id_of_slot), np.asarray(c.last_use))
        )
    assert runs[0][0] > 0 and runs[0][1] > 0
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("q", [None, 0.5])
def test_victims_from_one_sort_a_step_equal_one_sort_a_layer(q):
    """With (layers + 1)·N slots or more, a step takes its victims from one sort at its start
    (`StepVictims`) and writes `id_of_slot` and `last_use` at its end: every layer's slots, fetch
    plan and maps, and the cache after `record_stats`, equal those of one sort per layer. Caches
    from the random generator hold ties in `last_use`; every other one first goes through a
    prefill's `borrow_for_prefill` and `keep_buffer` (slots kept at the clock of the step that
    follows, unless keeping advances it) with few slots besides; steps follow one another on the same cache."""
    rng = np.random.default_rng(11)
    L, E, T, K = 3, 16, 2, 2
    N = T * K
    for trial in range(12):
        S = int(rng.integers(2 * E, L * E) if trial % 2 == 0 else rng.integers(2 * E, 2 * E + N))
        c = random_slot_cache(rng, L, E, S, N)
        if trial % 2:  # layers 0 and 1 kept: layer 2's victims reach the slots kept
            c, bufs = borrow_for_prefill(c, E)
            c = keep_buffer(keep_buffer(c, bufs[0], 0), bufs[1], 1)
        for step in range(3):
            sv, a, b, stats_a, stats_b = step_victims(c, L, N), c, c, [], []
            for layer in range(L):
                ids = jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32)
                valid = jnp.asarray(rng.integers(0, 2, T), jnp.int32).at[0].set(1)
                m = find_misses(a, layer, ids, valid, E, q)
                a, slots_a, plan_a, st_a, _ = place_misses(a, layer, m, E, T, K)
                b, slots_b, plan_b, st_b, sv = place_misses(b, layer, m, E, T, K, sv)
                stats_a.append(st_a)
                stats_b.append(st_b)
                for x, y in zip(jax.tree.leaves((slots_a, plan_a, a.slot_for_id)), jax.tree.leaves((slots_b, plan_b, b.slot_for_id))):
                    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{trial}/{step}/{layer}")
            a, b = record_stats(a, stats_a), record_stats(b, stats_b)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{trial}/{step}")
            c = a
    assert step_victims(random_slot_cache(rng, L, E, (L + 1) * N - 1, N), L, N) is None  # too few slots: a sort a layer
