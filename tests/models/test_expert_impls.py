"""The ways of computing routed experts agree with a float64 numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from freetoken_jax.bench.expert_impls import named
from freetoken_jax.models.layers import ExpertLayout, routed_experts


def reference(x, ids, w, gate, up, down):
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            g, u = gate[e] @ x[t], up[e] @ x[t]
            out[t] += w[t, k] * down[e] @ ((g / (1 + np.exp(-g))) * u)
    return out


@pytest.mark.parametrize("impl", ["auto", "gather", "slices", "ragged", "dense"])
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
