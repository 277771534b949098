"""Sliding-window layers' rings (`kv_cache.ring_pages`) and the prefix cache's window pages,
against plain-Python models: what a ring view lets each token read, and which cached prefixes
`RadixCache` lets a request continue once window pages are evicted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from freetoken_jax.memory.kv_cache import KVView, gather_pages, write_pages
from freetoken_jax.scheduler.radix import RadixCache


@pytest.mark.parametrize("window,page,chunk", [(5, 4, 8), (6, 4, 1), (16, 4, 4), (7, 2, 16)])
def test_ring_view_reads_exactly_the_window(window, page, chunk):
    """Two sequences written step by step (chunks of random length up to `chunk`, then single
    tokens, as prefill and decode write them) into rings of R pages: every token sees exactly
    the positions of its window, each holding what was written there, wherever the ring wrapped."""
    rng = np.random.default_rng(window * 100 + chunk)
    R = -(-(window - 1 + chunk + 4) // page) + 1
    pool = jnp.full((1 + 2 * R, page), -1, jnp.int32)
    ring = jnp.asarray([np.arange(1, R + 1), np.arange(R + 1, 2 * R + 1)[::-1]], jnp.int32)  # two rows, any page order

    @jax.jit
    def step(pool, positions, valid):  # every step `chunk` wide: the tokens past a row's count are padding
        view = KVView.ring(positions, valid, ring, page)
        pool = write_pages(pool, view, positions)  # each entry holds its own position
        return pool, gather_pages(pool, view), view.mask(window), jnp.broadcast_to(view.cached_pos_BS, (2, view.cached_pos_BS.shape[1]))

    pos = np.zeros(2, int)
    for s in range(40):
        T = int(rng.integers(1, chunk + 1)) if s < 20 else 1  # prefill chunks, then decode steps
        n = [T, int(rng.integers(0, T + 1))]  # row 1 writes fewer tokens
        positions = jnp.asarray([np.arange(p, p + chunk) for p in pos], jnp.int32)
        valid = jnp.asarray([np.arange(chunk) < k for k in n])
        pool, seen, mask, cached = step(pool, positions, valid)
        seen, mask, cached = np.asarray(seen), np.asarray(mask), np.asarray(cached)
        for b in range(2):
            for t in range(n[b]):
                p = pos[b] + t
                assert sorted(cached[b][mask[b, t]]) == list(range(max(0, p - window + 1), p + 1)), (b, p)
                assert (seen[b][mask[b, t]] == cached[b][mask[b, t]]).all(), (b, p)
            assert not mask[b, n[b] :].any()
        pos += n


def test_radix_window_pages_against_a_dict_model():
    """With a lookback of 2 pages, a prefix is continued only where its last 2 pages keep their
    window page; evicting window pages leaves tombstones that shorten later matches."""
    r = RadixCache(page_size=2, lookback=2)
    toks = list(range(1, 13))  # 6 pages
    assert r.insert(toks, [10, 11, 12, 13, 14, 15], [None, None, 31, 32, None, None]) == ([], [])
    path = r.match(toks)
    assert [n.page for n in path] == [10, 11, 12, 13]  # continuable at 4 pages, not at 5 or 6
    r.unlock(path)
    assert r.cached_wpages == 2
    # a second sequence gives window pages at its end; one of the same page is handed back
    assert r.insert(toks, [10, 11, 12, 13, 14, 15], [None, None, 33, None, 34, 35]) == ([], [33])
    nodes = r.match(toks)
    assert [n.page for n in nodes] == [10, 11, 12, 13, 14, 15] and r.cached_wpages == 4
    assert r.evict_wpages(10) == []  # every window page is on the locked path
    r.unlock(nodes)
    for evicted in range(1, 5):
        assert len(r.evict_wpages(1)) == 1 and r.cached_wpages == 4 - evicted
        path = r.match(toks, whole=True)
        r.unlock(path)
        left = [n.wpage for n in path]
        model = max(j for j in range(7) if all(w is not None for w in left[max(0, j - 2) : j]))
        got = r.match(toks)
        r.unlock(got)
        assert len(got) == model and left.count(None) == 2 + evicted
    assert len(r.match(toks)) == 0  # every window page gone: nothing can be continued
    # evicting a leaf frees its window page with it
    r2 = RadixCache(page_size=2, lookback=1)
    r2.insert([1, 2, 3, 4], [5, 6], [7, 8])
    assert r2.evict(1) == ([6], [8]) and r2.cached_wpages == 1
