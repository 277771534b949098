"""Strategy "hybrid": of each layer's misses, fetch_count(M, q*) go to the GPU (most recently
routed first) and the rest are computed by the CPU executor; tokens equal fused for any q*, with
either CPU handoff (pure_callback or the split FFI submit/wait)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.memory.expert_cache import fetch_count

BASE = dict(dtype="float32", max_context=48, max_batch=2, page_size=4, prefill_chunk=16, moe_strategy="hybrid", hybrid_overhead=0.0)
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


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_hybrid_matches_fused(family, ckpt_root):
    path = make_checkpoint(family, ckpt_root)
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**{**BASE, "moe_strategy": "fused"}))
    want = fused.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True)
    cfg = fused.model_config
    runs = ((0.35, 2 * cfg.top_k, "callback"), (0.0, 2 * cfg.top_k, "ffi"), (1.0, 2 * cfg.top_k, "callback"), (0.5, 1000, "callback"))
    for q, slots, handoff in runs:
        eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, expert_slots=slots, hybrid_q=q, cpu_handoff=handoff))
        assert eng.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True) == want, (family, q, slots, handoff)
        m = eng.get_metrics()
        if (q, handoff) == (0.35, "callback"):
            plain = eng
        if q == 0.0:
            assert m["experts_fetched"] == 0 and m["experts_on_cpu"] > 0
        if q == 1.0:
            assert m["experts_on_cpu"] == 0
        if q == 0.35:
            assert 0 < m["experts_fetched"] < m["experts_fetched"] + m["experts_on_cpu"]
            # no slot ever holds an expert that was left to the CPU in the same step: the maps stay a bijection
            c = eng.slots
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
