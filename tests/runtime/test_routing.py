"""Synthetic routing (benchmarks' --routing-skew): distinct ids per token, reproducible, varying
with position, Zipf-shaped popularity, and every strategy computes the same routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


def test_each_probe_draws_afresh_in_the_same_executable(ckpt_root):
    """`for_probe(i)` moves the positions the draw reads by i · PROBE_SHIFT: the same prompt
    decodes through other experts (other tokens), probe 0 through the same ones, and no step
    compiles again (the shift is traced); a router's own routing is the same for every probe."""
    path = make_checkpoint("qwen3_moe", ckpt_root)
    ecfg = EngineConfig(dtype="float32", max_context=48, max_batch=1, page_size=4, prefill_chunk=16, moe_strategy="offload")
    eng = FreeTokenEngine.from_pretrained(path, ecfg)
    assert eng.experts.for_probe(3) is eng.experts
    synth = SyntheticRouting(eng.experts, 1.0)
    prompt = [3, 14, 15, 92, 65, 35]

    def run(experts):
        eng.use(experts)
        return eng.generate_batch([prompt], max_new_tokens=12, ignore_eos=True)

    first = run(synth)
    traces = dict(eng.runner.steps.traces)
    assert run(synth.for_probe(0)) == first and run(synth.for_probe(1)) != first
    assert run(synth.for_probe(2)) not in (first, run(synth.for_probe(1)))
    assert dict(eng.runner.steps.traces) == traces


@pytest.mark.parametrize("how", ["kernel", "xla"])
def test_the_draw_waits_for_the_router(how, monkeypatch):
    """A layer's draw is made where its router chooses (in the router's kernel, or after XLA's
    routing) and reads the router's weights (a data dependence, which no compiler pass removes:
    an optimization barrier did not survive the CPU's), so that XLA cannot draw every layer's
    experts at the step's start and schedule what depends on them out of the layer, as no
    router's choice would allow. With working weights the draw equals `synthetic_ids`, the
    router's weights pass on unchanged, and a row whose weights are NaN draws experts 0..k-1."""
    from freetoken_jax.config import MoEModelConfig
    from freetoken_jax.models import layers
    from freetoken_jax.runtime.routing import Draw

    monkeypatch.setenv("FREETOKEN_ROUTER", how)
    cfg = MoEModelConfig(
        vocab_size=64, hidden_dim=64, intermediate_dim=128, num_layers=2, num_experts=60, top_k=6, num_heads=4, num_kv_heads=2
    )
    T, pos = 5, jnp.array([7, 0, 123, 4, 9], jnp.int32)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((T, 60)), jnp.float32)
    draw = Draw(pos, 3, 60, jnp.float32(1.0))
    step = jax.jit(lambda lg: layers.route(cfg, lg, None, draw))
    ids, w = step(logits)
    rids, rw = jax.jit(lambda lg: layers.route(cfg, lg))(logits)
    np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=1e-6)  # the router's weights (a GPU's fusions may round apart)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(synthetic_ids(rids, pos, 3, 60, 1.0)))
    assert not np.array_equal(np.asarray(ids), np.asarray(rids))
    ids2, _ = step(logits.at[2].set(jnp.nan))  # the draw of row 2 follows its router
    np.testing.assert_array_equal(np.delete(np.asarray(ids2), 2, 0), np.delete(np.asarray(ids), 2, 0))
    np.testing.assert_array_equal(np.asarray(ids2)[2], np.arange(6))


def test_the_draw_in_the_routers_kernel_lowers_to_one_triton_call():
    """The router and the draw together are the one Triton call of `route_topk` (the hash's
    uint32 arithmetic and the Gumbel noise lower to Triton)."""
    from jax import export

    from freetoken_jax.runtime.routing import Draw
    from pallas_kernels import route_topk

    def step(logits, pos, skew):
        return route_topk.route(logits, 8, draw=Draw(pos, 5, 128, skew).kernel())

    exp = export.export(
        jax.jit(step), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    )(jax.ShapeDtypeStruct((2, 128), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32))
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "route_topk" in text and "sort" not in text
