"""The ways of computing routed experts agree with a float64 numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from freetoken_jax.models.layers import routed_experts


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
    got = routed_experts(
        jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down), "silu", impl=impl
    )
    ref = reference(x, ids, w, gate, up, down)
    assert np.linalg.norm(np.asarray(got) - ref) / np.linalg.norm(ref) < 1e-5
