"""A sliding-window model (Qwen2-MoE, window 6 on layers 0 and 2) served with rings: the pages a
long sequence holds for its sliding layers stay bounded, and the prefix cache continues a
cached conversation only where the window's pages are still held, computing the rest again,
with the tokens of an engine without the cache (itself checked against transformers in
tests/models/test_models_hf.py)."""

import numpy as np
import pytest
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.memory.kv_cache import layer_pools, ring_layers

EC = EngineConfig(dtype="float32", max_context=128, max_batch=2, page_size=4, prefill_chunk=16)


@pytest.fixture(scope="module")
def path(ckpt_root):
    return make_checkpoint("qwen2_moe_swa", ckpt_root)


def _pools(eng):
    """Each layer's pools, out of the cache's groups."""
    return layer_pools(eng.runner.state.cache, ring_layers(eng.model_config, eng.engine_config))


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 96, n)]


def test_a_long_sequence_holds_a_bounded_ring(path):
    eng = FreeTokenEngine.from_pretrained(path, EC.replace(prefix_cache=False))
    cfg, runner = eng.model_config, eng.runner
    P, R = runner.tables
    assert [cfg.window_of(i) for i in range(cfg.num_layers)] == [6, 0, 6] and 0 < R < P
    pool = runner.ring_pool
    shared_free, ring_free = eng.pages.free_pages, pool.free_pages
    held = []
    for _ in eng.generate(_prompt(30, 0), max_new_tokens=90, ignore_eos=True):
        held.append(ring_free - pool.free_pages)
    assert len(held) == 90 and set(held[:-1]) == {R}  # 120 tokens span 30 pages; the ring stays R (the last token: released)
    assert pool.free_pages == ring_free and eng.pages.free_pages == shared_free  # all returned
    # the sliding layers' pool does not grow with the context
    longer = FreeTokenEngine.from_pretrained(path, EC.replace(max_context=1024, prefix_cache=False))
    assert longer.runner.ring_pool.num_pages == pool.num_pages
    assert [a.shape[0] for a, _ in _pools(longer)] == [pool.num_pages, longer.pages.num_pages, pool.num_pages]


def test_prefix_hits_need_the_window_and_recompute_only_past_it(path):
    eng = FreeTokenEngine.from_pretrained(path, EC)
    cold = FreeTokenEngine.from_pretrained(path, EC.replace(prefix_cache=False))
    radix, page = eng.batcher.radix, EC.page_size
    assert radix.lookback == 2  # window 6: the 5 positions before a token span 2 pages of 4

    def run(prompt):
        before = eng.get_metrics()["prefix_hit_tokens"]
        out = list(eng.generate(prompt, max_new_tokens=8, ignore_eos=True))
        assert out == list(cold.generate(prompt, max_new_tokens=8, ignore_eos=True))
        return out, eng.get_metrics()["prefix_hit_tokens"] - before

    first = _prompt(41, 1)
    out, hit = run(first)
    assert hit == 0
    # the next turn continues where the first one's KV ends (its prompt and 7 of its 8 tokens)
    turn = first + out + _prompt(9, 2)
    written = len(first) + len(out) - 1
    _, hit = run(turn)
    assert hit == written // page * page == 48
    # the window pages from page 10 on evicted: the hit falls back to the end of the first
    # prompt (pages 8 and 9 kept as it was prefilled), and only the rest is computed again
    path_nodes = radix.match(turn, whole=True)
    radix.unlock(path_nodes)
    assert [n.wpage is not None for n in path_nodes] == [False] * 8 + [True] * 6
    for n in path_nodes[10:]:
        eng.runner.ring_pool.release([n.wpage])
        n.wpage, radix.cached_wpages = None, radix.cached_wpages - 1
    _, hit = run(turn)
    assert hit == len(first) // page * page == 40
    # no window pages at all: nothing can be continued, everything is computed again
    eng.runner.ring_pool.release(radix.evict_wpages(radix.cached_wpages))
    assert radix.cached_wpages == 0
    _, hit = run(turn)
    assert hit == 0


def test_cached_windows_survive_a_growing_pool(path):
    """A resize that grows the shared pool keeps the cached prefixes and their window pages
    (the ring pool is not resized): the next turn still continues from them."""
    eng = FreeTokenEngine.from_pretrained(path, EC)
    cold = FreeTokenEngine.from_pretrained(path, EC.replace(prefix_cache=False))
    first = _prompt(41, 3)
    out = list(eng.generate(first, max_new_tokens=8, ignore_eos=True))
    ring = [a.shape[0] for a, _ in _pools(eng)]
    eng.rebuild_runtime_cache(kv_pages=eng.pages.num_pages * 2)
    assert [a.shape[0] for a, _ in _pools(eng)] == [ring[0], 2 * ring[1], ring[2]]
    turn = first + out + _prompt(5, 4)
    before = eng.get_metrics()["prefix_hit_tokens"]
    assert list(eng.generate(turn, max_new_tokens=8, ignore_eos=True)) == list(cold.generate(turn, max_new_tokens=8, ignore_eos=True))
    assert eng.get_metrics()["prefix_hit_tokens"] - before == 48
