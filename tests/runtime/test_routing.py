"""Synthetic routing (benchmarks' --routing-skew): distinct ids per token, reproducible, varying
with position, Zipf-shaped popularity, and every strategy computes the same routing."""

import jax
import jax.numpy as jnp
import numpy as np
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.runtime.routing import SyntheticRouting, log_popularity, synthetic_ids


def test_draws_are_distinct_reproducible_and_zipf_shaped():
    E, K, T = 32, 4, 4000
    ids0 = jnp.zeros((T, K), jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)
    a = np.asarray(synthetic_ids(ids0, pos, layer=3, num_experts=E, skew=1.0))
    assert all(len(set(r)) == K for r in a) and a.min() >= 0 and a.max() < E
    np.testing.assert_array_equal(a, np.asarray(synthetic_ids(ids0, pos, 3, E, 1.0)))
    assert (a[:-1] != a[1:]).any(axis=1).mean() > 0.9  # routing changes from position to position
    counts = np.bincount(a.reshape(-1), minlength=E)
    p = np.exp(log_popularity(E, 1.0, 3))
    hot, cold = np.argsort(-p)[:4], np.argsort(p)[:4]
    assert counts[hot].sum() > 3 * counts[cold].sum()  # popular experts drawn far more often
    u = np.bincount(np.asarray(synthetic_ids(ids0, pos, 3, E, 0.0)).reshape(-1), minlength=E)
    assert u.max() < 1.3 * u.mean()  # skew 0: uniform
    assert not np.array_equal(a, np.asarray(synthetic_ids(ids0, pos, 4, E, 1.0)))  # layers differ
    traced = jax.jit(lambda s: synthetic_ids(ids0, pos, 3, E, s))  # one executable for every exponent
    np.testing.assert_array_equal(np.asarray(traced(1.0)), a)
    np.testing.assert_array_equal(np.asarray(traced(0.0)), np.asarray(synthetic_ids(ids0, pos, 3, E, 0.0)))
    assert traced._cache_size() == 1


def test_every_strategy_computes_the_same_synthetic_routing(ckpt_root):
    path = make_checkpoint("qwen3_moe", ckpt_root)
    # The draw depends on a token's row: both prompts run side by side under every strategy.
    base = dict(dtype="float32", max_context=48, max_batch=2, max_running=2, page_size=4, prefill_chunk=16)
    prompts = [[3, 14, 15, 92, 65, 35], [27, 18, 28]]
    out = {}
    for strategy in ("fused", "offload", "cpu"):
        eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**base, moe_strategy=strategy, hybrid_overhead=0.0))
        plain = eng.generate_batch(prompts, max_new_tokens=8, ignore_eos=True) if strategy == "fused" else None
        eng.use(SyntheticRouting(eng.experts, jnp.float32(1.0)))
        out[strategy] = eng.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
        if plain is not None:
            assert out[strategy] != plain  # the override changes what is computed
    assert out["offload"] == out["fused"] and out["cpu"] == out["fused"]


def test_the_draw_waits_for_the_router():
    """A layer's draw reads its router's weights (a data dependence, which no compiler pass
    removes: an optimization barrier did not survive the CPU's), so that XLA cannot draw every
    layer's experts at the step's start and schedule what depends on them out of the layer, as no
    router's choice would allow; with working weights the draw equals `synthetic_ids`."""
    from freetoken_jax.runtime.routing import with_synthetic_routing

    seen = {}
    (wrapped,) = with_synthetic_routing([lambda x, ids, w, bias=None: seen.update(ids=ids, w=w) or x], jnp.arange(2), 32, 0.0)
    ids = jnp.zeros((2, 4), jnp.int32)
    step = jax.jit(lambda w: (wrapped(jnp.zeros((2, 8)), ids, w), seen["ids"], seen["w"])[1:])
    got, w_out = step(jnp.full((2, 4), 0.25))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(synthetic_ids(ids, jnp.arange(2), 0, 32, 0.0)))
    np.testing.assert_array_equal(np.asarray(w_out), 0.25)  # the weights pass on as they are
    broken = jnp.full((2, 4), 0.25).at[1, 0].set(jnp.nan)  # the draw of row 1 follows its weights
    got2, _ = step(broken)
    np.testing.assert_array_equal(np.asarray(got2)[0], np.asarray(got)[0])
    np.testing.assert_array_equal(np.asarray(got2)[1], np.arange(4))
