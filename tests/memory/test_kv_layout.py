"""The cache's layers stacked into groups (`kv_cache.kv_groups`): the groups against the rules
that define them, a cache of either layout read back per layer, resizes and page copies that keep
every layer's pages, engines in both layouts giving the same tokens and the same pages (a
sliding-window model with rings, MLA, the fused decode kernel), and a compiled decode step that
updates the stacked arrays in place."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.config import MoEModelConfig
from freetoken_jax.memory import kv_cache
from freetoken_jax.memory.kv_cache import (
    copy_pages,
    grown_cache,
    init_cache,
    kv_groups,
    layer_groups,
    layer_pools,
    ring_groups,
    ring_layers,
)


@pytest.mark.parametrize("seed", range(40))
def test_groups_follow_their_rules(seed):
    """Under "stacked", each group holds layers of one kind (ring or not), at most as many as the
    element cap allows, each kind's layers in order in as few groups as the cap allows; groups are
    ordered by their first layer, and a cache of those group sizes is read back as those groups.
    Under "layers", one group a layer."""
    rng = np.random.default_rng(seed)
    rings = tuple(bool(r) for r in rng.random(int(rng.integers(1, 10))) < rng.random())
    elements = int(rng.integers(1, 5))
    cap = int(rng.integers(1, 6))
    max_elements = cap * elements + int(rng.integers(0, elements))  # room for `cap` layers, not cap + 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_cache, "MAX_STACK_ELEMENTS", max_elements)
        groups = kv_groups(rings, "stacked", elements)
        assert sorted(i for g in groups for i in g) == list(range(len(rings)))
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
        for kind in (False, True):
            mine = [g for g in groups if rings[g[0]] == kind]
            assert all(rings[i] == kind for g in mine for i in g)
            layers = [i for i, r in enumerate(rings) if r == kind]
            assert [i for g in mine for i in g] == layers
            assert all(len(g) <= cap for g in mine) and len(mine) == math.ceil(len(layers) / cap)
        for layout in ("stacked", "layers"):
            want = kv_groups(rings, layout, elements)
            cache = tuple((jax.ShapeDtypeStruct((len(g), elements), jnp.float32),) for g in want)
            assert layer_groups(rings, cache) == want
    assert kv_groups(rings, "layers") == tuple((i,) for i in range(len(rings)))


def test_a_cache_that_fits_no_layout_is_refused():
    cache = ((jax.ShapeDtypeStruct((2, 8), jnp.float32),), (jax.ShapeDtypeStruct((2, 8), jnp.float32),))
    with pytest.raises(ValueError, match="groups of \\[2, 2\\] layers"):
        layer_groups((False, False, False), cache)


CFG = MoEModelConfig(vocab_size=64, hidden_dim=32, intermediate_dim=32, num_layers=5, num_experts=4, top_k=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, sliding_window=6, sliding_layers=(True, False, True, True, False))  # fmt: skip
ECFG = EngineConfig(dtype="float32", max_context=128, max_batch=2, page_size=4, prefill_chunk=8)


def _filled(layout, seed=0):
    cache = init_cache(CFG, ECFG, jnp.float32, layout)
    rng = np.random.default_rng(seed)
    return tuple(tuple(jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in g) for g in cache)


@pytest.mark.parametrize("layout", ["stacked", "layers"])
def test_layouts_hold_the_same_pools(layout):
    """Both layouts hold, per layer, the pools of `pool_pages` (rings for the sliding layers) of
    the model's entry shapes, in as many arrays as their groups."""
    rings = ring_layers(CFG, ECFG)
    assert rings == (True, False, True, True, False)
    cache = init_cache(CFG, ECFG, jnp.float32, layout)
    assert len(cache) == (2 if layout == "stacked" else 5)
    pools = layer_pools(cache, rings)
    pages = kv_cache.pool_pages(CFG, ECFG)
    for i, p in enumerate(pools):
        assert [a.shape for a in p] == [(pages[i], ECFG.page_size, *s) for s in CFG.kv_entry_shapes()]
    assert sum(a.nbytes for g in cache for a in g) == kv_cache.cache_bytes(CFG, ECFG, 4)


@pytest.mark.parametrize("layout", ["stacked", "layers"])
@pytest.mark.parametrize("capped", [False, True])
def test_a_grown_cache_keeps_every_layers_pages(layout, capped, monkeypatch):
    """Growing the shared pool keeps every layer's pages where they were (new pages empty, rings
    as they were), also where the bigger pools no longer stack as before (`capped`: the element
    cap fits two of the old shared pools, one of the grown ones, so the grown cache regroups)."""
    rings = ring_layers(CFG, ECFG)
    if capped:
        pool = ECFG.total_kv_pages * ECFG.page_size * max(math.prod(s) for s in CFG.kv_entry_shapes())
        monkeypatch.setattr(kv_cache, "MAX_STACK_ELEMENTS", 5 * pool // 2)
    old = _filled(layout, seed=1)
    new = ECFG.replace(kv_pages=ECFG.total_kv_pages * 2)
    grown = grown_cache(old, CFG, new)
    want = kv_groups(rings, layout, max(math.prod(a.shape[1:]) for g in grown for a in g))
    assert layer_groups(rings, grown) == want
    if capped and layout == "stacked":
        assert layer_groups(rings, old) == ((0, 2), (1, 4), (3,)) and want == ((0,), (1,), (2,), (3,), (4,))  # regrouped
    for i, (before, after) in enumerate(zip(layer_pools(old, rings), layer_pools(grown, rings))):
        for a, b in zip(before, after):
            n = a.shape[0]
            assert b.shape[0] == (n if rings[i] else new.total_kv_pages)
            np.testing.assert_array_equal(np.asarray(b[:n]), np.asarray(a))
            assert not np.asarray(b[n:]).any()


@pytest.mark.parametrize("layout", ["stacked", "layers"])
def test_ring_page_copies_touch_only_the_rings(layout):
    """`copy_pages` over the ring groups: every ring layer's pages src land at dst; every other
    page, and every shared-pool layer, as it was."""
    rings = ring_layers(CFG, ECFG)
    cache = _filled(layout, seed=3)
    src, dst = jnp.asarray([1, 2, 3], jnp.int32), jnp.asarray([5, 6, 7], jnp.int32)
    after = jax.jit(copy_pages, static_argnums=(1,))(cache, ring_groups(CFG, ECFG, cache), src, dst)
    for ring, a_pools, b_pools in zip(rings, layer_pools(cache, rings), layer_pools(after, rings)):
        for a, b in zip(a_pools, b_pools):
            a, b = np.asarray(a), np.asarray(b)
            want = a.copy()
            if ring:
                want[[5, 6, 7]] = a[[1, 2, 3]]
            np.testing.assert_array_equal(b, want)


@pytest.mark.parametrize(
    "name,attention",
    [("qwen2_moe_swa", "auto"), ("qwen3_moe_k", "fused"), ("deepseek_v2_rope16", "kernel")],
)
def test_layouts_give_the_same_tokens_and_pages(name, attention, ckpt_root, monkeypatch):
    """An engine with its layers stacked and one with a group a layer generate the same tokens
    for a batch of prompts and leave the same pages in every layer's pools, bit for bit: rings
    beside a shared pool, MLA's latent pools, the fused decode kernel writing the stacked pools in
    place, the MLA kernel reading them."""
    monkeypatch.setenv("FREETOKEN_DECODE_ATTENTION", attention)
    path = make_checkpoint(name, ckpt_root)
    ec = EngineConfig(dtype="float32", max_context=64, max_batch=2, page_size=4, prefill_chunk=8, prefix_cache=False)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, 90, n)] for s, n in ((0, 11), (1, 6))]
    got = {}
    for layout in ("stacked", "layers"):
        monkeypatch.setenv("FREETOKEN_KV_LAYOUT", layout)
        eng = FreeTokenEngine.from_pretrained(path, ec)
        cfg = eng.model_config
        rings = ring_layers(cfg, eng.engine_config)
        groups = layer_groups(rings, eng.runner.state.cache)
        assert len(groups) == (len(set(rings)) if layout == "stacked" else cfg.num_layers)
        outs = [list(eng.generate(p, max_new_tokens=7, ignore_eos=True)) for p in prompts]
        got[layout] = outs, [[np.asarray(a) for a in p] for p in layer_pools(eng.runner.state.cache, rings)]
    (toks_s, pools_s), (toks_l, pools_l) = got["stacked"], got["layers"]
    assert toks_s == toks_l
    for a_pools, b_pools in zip(pools_s, pools_l):
        for a, b in zip(a_pools, b_pools):
            np.testing.assert_array_equal(a, b)
    assert any(np.asarray(a).any() for p in pools_s for a in p)  # pages were written


def test_a_decode_step_updates_the_stacked_pools_in_place(monkeypatch):
    """The compiled decode step of a stacked cache takes one array per stored tensor of each
    group (5 state arrays where a group a layer takes 11), writes every output over a donated
    input, and holds no copy of a stacked pool: its temporary memory exceeds that of the step
    over one group a layer by less than one layer's pool."""
    from freetoken_jax.runtime.steps import DecodeBatch, Sampling

    ec = EngineConfig(dtype="float32", max_context=512, max_batch=2, page_size=16, prefill_chunk=16)
    temp, leaves = {}, {}
    for layout in ("stacked", "layers"):
        monkeypatch.setenv("FREETOKEN_KV_LAYOUT", layout)
        runner = FreeTokenEngine.from_pretrained("demo", ec).runner
        batch = DecodeBatch(jnp.zeros((2, ec.pages_per_sequence), jnp.int32), jnp.asarray([True, True]), Sampling.greedy(2))
        compiled = runner.steps.decode.lower(runner.weights, runner.state, batch, runner.experts).compile()
        header = compiled.as_text().split("\n", 1)[0]
        leaves[layout] = len(jax.tree.leaves(runner.state))
        assert len(re.findall(r"\{[\d,]*\}: \(\d+", header)) == leaves[layout]
        temp[layout] = compiled.memory_analysis().temp_size_in_bytes
        pool = runner.state.cache[-1][0].nbytes // runner.state.cache[-1][0].shape[0]
    assert leaves == {"stacked": 5, "layers": 11}  # the demo's 4 layers: K and V, tokens, positions, counts
    assert temp["stacked"] - temp["layers"] < pool, (temp, pool)
