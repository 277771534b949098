"""The top-k kernels (interpret mode on the CPU backend, Triton on a GPU): the router's against its
jnp reference and float64 over shapes, scorings and options, `top_k` against `lax.top_k` over
shapes, dtypes and ties; their lowering to one Triton call each; and how the models choose the
router's (the slot cache's victims by `top_k`: tests/runtime/test_hybrid.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_kernel_choice
from jax import export

from pallas_kernels.route_topk import route, route_ref, top_k, top_k_ref

INTERPRET = jax.default_backend() == "cpu"


def _float64(logits, ids, scoring, norm, scale):
    """The weights of the chosen ids in float64."""
    x = logits.astype(np.float64)
    if scoring == "softmax":
        s = np.exp(x - x.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
    else:
        s = 1 / (1 + np.exp(-x))
    w = np.take_along_axis(s, ids, axis=-1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return w * scale, s


@pytest.mark.parametrize(
    "T,E,k,scoring,norm,bias,scale",
    [
        (1, 128, 8, "softmax", True, False, 1.0),  # Qwen3-30B-A3B's router, one decode row
        (5, 60, 4, "softmax", False, False, 1.0),  # Qwen2-MoE: 60 experts (padded to 64), weights not renormalised
        (3, 8, 2, "softmax", True, False, 1.0),  # Mixtral
        (4, 64, 6, "sigmoid", True, True, 2.5),  # a sigmoid router with a correction bias and a scale; k = 6 (padded to 8)
        (2, 32, 1, "sigmoid", False, False, 1.0),
        (17, 256, 8, "softmax", True, True, 1.0),
    ],
)
def test_matches_reference_and_float64(T, E, k, scoring, norm, bias, scale):
    rng = np.random.default_rng(T * E + k)
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    b = (rng.standard_normal(E) * 0.5).astype(np.float32) if bias else None
    kw = dict(scoring=scoring, norm=norm, scale=scale, bias_E=None if b is None else jnp.asarray(b))
    ids, w = route(jnp.asarray(logits), k, interpret=INTERPRET, **kw)
    rids, rw = route_ref(jnp.asarray(logits), k, **kw)
    assert ids.shape == (T, k) and w.shape == (T, k) and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=2e-6, atol=1e-7)
    want, s = _float64(logits, np.asarray(ids), scoring, norm, scale)
    np.testing.assert_allclose(np.asarray(w), want, rtol=2e-6, atol=1e-7)
    choice = s + (0 if b is None else b)  # the chosen ids are the k largest, largest first
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-choice, axis=-1, kind="stable")[:, :k])


@pytest.mark.parametrize("T,E,k,scoring", [(1, 128, 8, "softmax"), (5, 60, 4, "softmax"), (3, 8, 2, "sigmoid"), (17, 256, 8, "softmax")])
def test_a_draw_replaces_the_ids_and_keeps_the_weights(T, E, k, scoring):
    """`draw=(scores, arrays)`: ids the k largest of the scores the function reads from its
    arrays (here a [T, E] table, ties from a short range going to the lower index), weights the
    router's; a row whose first weight is NaN (its logits NaN) takes ids 0..k-1."""
    rng = np.random.default_rng(E + k)
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    logits[T // 2] = np.nan
    table = np.round(rng.standard_normal((T, E)), 1).astype(np.float32)
    scores = lambda t, e, tab: tab[t, jnp.minimum(e, E - 1)]  # noqa: E731
    ids, w = route(jnp.asarray(logits), k, scoring=scoring, draw=(scores, (jnp.asarray(table),)), interpret=INTERPRET)
    rids, rw = route_ref(jnp.asarray(logits), k, scoring=scoring)
    np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=2e-6, atol=1e-7)
    want = np.array(jax.lax.top_k(jnp.asarray(table), k)[1])
    want[T // 2] = np.arange(k)
    np.testing.assert_array_equal(np.asarray(ids), want)


def test_ties_go_to_the_lower_index():
    """Equal scores: the lower index first, as `lax.top_k` orders them; a row of equal logits
    chooses experts 0..k-1 with equal weights."""
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0, 2.0, 0.0], [0.0] * 8], np.float32)
    ids, w = route(jnp.asarray(logits), 4, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 2, 4, 5], [0, 1, 2, 3]])
    np.testing.assert_allclose(np.asarray(w)[1], 0.25, rtol=1e-6)


@pytest.mark.parametrize(
    "T,N,k,dtype", [(1, 847, 8, "int32"), (3, 8, 8, "int32"), (2, 1000, 16, "float32"), (1, 33, 5, "int32"), (4, 2048, 1, "float32")]
)
def test_top_k_matches_lax(T, N, k, dtype):
    """Values and indices equal `lax.top_k`'s, ties (many: values from a short range) to the lower
    index; the extremes of int32 (the slot cache's "never" and "in use") included."""
    rng = np.random.default_rng(N + k)
    if dtype == "int32":
        x = rng.integers(-6, 6, (T, N)).astype(np.int32)
        x[:, rng.integers(0, N, 3)] = np.iinfo(np.int32).max
        x[:, rng.integers(0, N, 3)] = -np.iinfo(np.int32).max
    else:
        x = np.round(rng.standard_normal((T, N)), 1).astype(np.float32)
    vals, ids = top_k(jnp.asarray(x), k, interpret=INTERPRET)
    rvals, rids = top_k_ref(jnp.asarray(x), k)
    assert vals.dtype == x.dtype and ids.dtype == jnp.int32 and ids.shape == (T, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(rvals))


def test_bad_arguments_raise():
    x = jnp.zeros((2, 8), jnp.float32)
    for kw, msg in [(dict(k=9), "top-9"), (dict(k=2, scoring="relu"), "scoring"), (dict(k=2, bias_E=jnp.zeros(7)), "bias")]:
        with pytest.raises(ValueError, match=msg):
            route(x, interpret=True, **kw)
    with pytest.raises(ValueError, match="at most 16"):
        top_k(jnp.zeros((1, 64)), 17, interpret=True)


def test_lowers_to_one_triton_call():
    exp = export.export(
        jax.jit(lambda x: route(x, 6, scoring="sigmoid", bias_E=jnp.zeros(128))),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(jax.ShapeDtypeStruct((4, 128), jnp.float32))
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "route_topk" in text
    exp = export.export(
        jax.jit(lambda x: top_k(x, 8)), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    )(jax.ShapeDtypeStruct((1, 847), jnp.int32))
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "top_k" in text and "sort" not in text


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_models_through_the_kernel_match_transformers(name, ckpt_root, monkeypatch):
    """A prompt's logits with every router step through the kernel (FREETOKEN_ROUTER=kernel):
    Mixtral's 6 experts (padded to 8) and renormalised weights, Qwen2-MoE's unnormalised ones
    beside a shared expert."""
    from hf_models import check_prompt_logits

    from pallas_kernels import route_topk

    monkeypatch.setenv("FREETOKEN_ROUTER", "kernel")
    calls = []
    monkeypatch.setattr(route_topk, "route", lambda *a, f=route_topk.route, **kw: calls.append(a[1]) or f(*a, **kw))
    check_prompt_logits(name, ckpt_root, 22, 20, max_context=64, prefill_chunk=8)
    assert calls  # traced through the kernel


def test_how_a_step_routes(monkeypatch):
    """FREETOKEN_ROUTER: "auto" takes the kernel on a GPU for decode-sized steps of a greedy
    router, XLA's otherwise; grouped routers (DeepSeek's) always XLA's; bad names raise."""
    from freetoken_jax.config import MoEModelConfig
    from freetoken_jax.models import layers

    base = dict(vocab_size=64, hidden_dim=64, intermediate_dim=128, num_layers=2, num_experts=8, top_k=2, num_heads=4, num_kv_heads=2)
    greedy, grouped = MoEModelConfig(**base), MoEModelConfig(**base, topk_method="noaux_tc", n_group=2, topk_group=1)
    big = layers.ROUTER_KERNEL_ROWS + 1
    want = {  # (setting, backend): greedy at 1 row, at `big` rows, grouped at 1 row
        ("auto", "gpu"): ("kernel", "xla", "xla"),
        ("auto", "cpu"): ("xla", "xla", "xla"),
        ("xla", "gpu"): ("xla", "xla", "xla"),
        ("kernel", "cpu"): ("kernel", "kernel", "xla"),
    }
    choose = lambda: (layers.router_kernel(greedy, 1), layers.router_kernel(greedy, big), layers.router_kernel(grouped, 1))  # noqa: E731
    check_kernel_choice(monkeypatch, "FREETOKEN_ROUTER", want, choose, "fast")
