"""The ways of computing routed experts agree with a float64 numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from freetoken_jax.bench.expert_impls import named
from freetoken_jax.models.layers import ExpertLayout, routed_experts


def reference(x, ids, w, gate, up, down, bias=None):
    """float64; `bias`: per-expert (gate [E, F], up [E, F], down [E, D]) or None."""
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    bg, bu, bd = (np.zeros(a.shape[:2]) for a in (gate, up, down)) if bias is None else bias
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            g, u = gate[e] @ x[t] + bg[e], up[e] @ x[t] + bu[e]
            out[t] += w[t, k] * (down[e] @ ((g / (1 + np.exp(-g))) * u) + bd[e])
    return out


@pytest.mark.parametrize("impl", ["auto", "gather", "slices", "ragged", "dense", "grouped"])
@pytest.mark.parametrize("T,K,E,D,F", [(1, 2, 4, 16, 8), (3, 3, 8, 24, 40), (5, 1, 3, 8, 8), (2, 4, 4, 32, 16)])
def test_impls_match_reference(impl, T, K, E, D, F):
    rng = np.random.default_rng(T * 100 + K * 10 + E)
    x = rng.standard_normal((T, D)).astype(np.float32)
    gate, up = (rng.standard_normal((E, F, D)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((E, D, F)).astype(np.float32) * 0.3
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    compute = named(impl) or routed_experts
    got = compute(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), (jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down)), layout)
    ref = reference(x, ids, w, gate, up, down)
    assert np.linalg.norm(np.asarray(got) - ref) / np.linalg.norm(ref) < 1e-5


def test_dense_in_token_slices_matches_one_piece(monkeypatch):
    from freetoken_jax.models import layers

    rng = np.random.default_rng(7)
    T, K, E, D, F = 11, 2, 4, 16, 8
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((E, F, D)) * 0.3, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((E, D, F)) * 0.3, jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    whole = routed_experts(x, ids, w, (gate, up, down), layout, impl="dense")
    monkeypatch.setattr(layers, "DENSE_SLICE_BYTES", 2 * 4 * E * F * 3)  # 3 tokens per slice: 4 slices, the last short
    sliced = routed_experts(x, ids, w, (gate, up, down), layout, impl="dense")
    np.testing.assert_allclose(np.asarray(sliced), np.asarray(whole), rtol=1e-6, atol=1e-6)
    ref = reference(np.asarray(x), np.asarray(ids), np.asarray(w), np.asarray(gate), np.asarray(up), np.asarray(down))
    assert np.linalg.norm(np.asarray(sliced) - ref) / np.linalg.norm(ref) < 1e-5


def skewed_ids(rng, T, K, E, hot: int, share: float) -> np.ndarray:
    """Top-K of E for T tokens, expert `hot` chosen by about `share` of the tokens."""
    ids = []
    for _ in range(T):
        first = [hot] if rng.random() < share else []
        rest = rng.choice([e for e in range(E) if e not in first], K - len(first), replace=False)
        ids.append(first + list(rest))
    return np.asarray(ids, np.int32)


@pytest.mark.parametrize("share", [0.0, 0.4, 0.9])  # every group in C rows, in 2C, neither (the dense path)
def test_grouped_matches_reference_at_every_capacity(share, monkeypatch):
    """ "grouped" over T·K ≫ E pairs, uniform and skewed, with per-expert biases, unrouted pairs
    (weight 0), and experts in slices; the most-chosen expert's count picks the branch."""
    from freetoken_jax.models import layers

    rng = np.random.default_rng(int(share * 10))
    T, K, E, D, F = 96, 2, 12, 16, 8  # 2·T·K / E = 32: groups of C = 32 rows, then 64, then dense
    x = rng.standard_normal((T, D)).astype(np.float32)
    gate, up = (rng.standard_normal((E, F, D)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((E, D, F)).astype(np.float32) * 0.3
    bias = (rng.standard_normal((E, F)) * 0.1, rng.standard_normal((E, F)) * 0.1, rng.standard_normal((E, D)) * 0.1)
    ids = skewed_ids(rng, T, K, E, hot=3, share=share)
    most = np.bincount(ids.reshape(-1), minlength=E).max()
    assert (most <= 32, 32 < most <= 64, most > 64) == (share == 0.0, share == 0.4, share == 0.9)
    w = rng.random((T, K)).astype(np.float32)
    w[::7, 1] = 0.0  # pairs another strategy computes
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    monkeypatch.setattr(layers, "DENSE_SLICE_BYTES", 2 * 4 * 32 * F * 5)  # five experts per slice at C = 32: 3 slices
    args = (jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), (jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down)), layout)
    pair = layers.pair_biases(tuple(jnp.asarray(b, jnp.float32) for b in bias), jnp.asarray(ids))
    got = routed_experts(*args, impl="grouped", bias=pair)
    ref = reference(x, ids, w, gate, up, down, bias)
    assert np.linalg.norm(np.asarray(got) - ref) / np.linalg.norm(ref) < 1e-5
    dense = routed_experts(*args, impl="dense", bias=pair)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=1e-5, atol=1e-5)


def test_grouped_takes_the_branch_its_counts_allow(monkeypatch):
    """The capacities' branches run "grouped" (marked here by a poisoned stand-in) until an
    expert's count exceeds the larger one; then the layer runs "dense"."""
    from freetoken_jax.models import layers

    rng = np.random.default_rng(1)
    T, K, E, D, F = 96, 2, 12, 16, 8
    bank = (jnp.ones((E, F, D)), jnp.ones((E, F, D)), jnp.ones((E, D, F)))
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    used = []
    monkeypatch.setattr(layers, "_grouped", lambda x, *a: jnp.full(x.shape, float(a[-1]), x.dtype))  # a[-1]: the capacity
    for impl in ("grouped", "auto"):  # "auto" groups many pairs
        for share in (0.0, 0.4, 0.9):
            ids = jnp.asarray(skewed_ids(rng, T, K, E, hot=3, share=share))
            out = routed_experts(jnp.ones((T, D)), ids, jnp.ones((T, K)), bank, layout, impl=impl)
            used.append(float(out[0, 0]))
    assert used[:2] == used[3:5] == [32.0, 64.0] and used[2] not in (32.0, 64.0) and used[5] not in (32.0, 64.0)


def test_grouped_scatters_no_floats():
    """ "grouped" fills its rows and collects its results by gathers: the only scatters are of
    its int32 pair <-> row maps, so no result depends on the order of a GPU's atomic adds."""
    import re

    import jax

    from freetoken_jax.models import layers

    T, K, E, D, F = 64, 2, 8, 16, 8
    bank = (jnp.ones((E, F, D)), jnp.ones((E, F, D)), jnp.ones((E, D, F)))
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    counts = jnp.zeros((E,), jnp.int32)
    text = (
        jax.jit(lambda x, i, w: layers._grouped(x, i, w, bank, layout, None, counts, 32))
        .lower(jnp.ones((T, D)), jnp.zeros((T, K), jnp.int32), jnp.ones((T, K)))
        .as_text()
    )
    scatters = re.findall(r'"stablehlo.scatter".*?\}\) : \([^)]*\) -> tensor<([^>]*)>', text, re.S)  # the result types
    assert len(scatters) == 2 and all(s.endswith("xi32") for s in scatters), scatters
