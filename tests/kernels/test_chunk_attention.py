"""A prefill chunk's causal attention to its own keys, and its attention to a cached prefix of
each row's length, with each query's log-sum-exp: the jnp reference (and, on a GPU, cuDNN's
flash attention) against float64 over shapes, GQA groups, windows, value widths narrower than
the keys' (MLA), prefix lengths (none, part, all of the table) and dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.chunk_attention import attention, cudnn_fits

IMPLS = ("ref", "cudnn") if jax.default_backend() == "gpu" else ("ref",)


def _float64(q, k, v, scale, window):
    B, T, H, _ = q.shape
    G = H // k.shape[2]
    s = np.einsum("bthd,bshd->bhts", q, np.repeat(k, G, axis=2)) * scale
    t = np.arange(T)
    read = (t[None] <= t[:, None]) & ((t[None] > t[:, None] - window) if window else True)
    s = np.where(read, s, -np.inf)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    o = np.einsum("bhts,bshe->bthe", np.exp(s - lse[..., None]), np.repeat(v, G, axis=2))
    return o, np.moveaxis(lse, 1, 2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "B, T, K, G, d, e, window, dtype",
    [
        (1, 16, 2, 4, 64, 64, 0, jnp.bfloat16),  # GQA
        (2, 33, 4, 1, 128, 128, 0, jnp.bfloat16),  # MHA, T not a power of two
        (1, 40, 1, 8, 192, 128, 0, jnp.bfloat16),  # MLA: values narrower than keys
        (2, 24, 2, 2, 64, 64, 7, jnp.float16),  # a sliding window
        (1, 12, 2, 2, 16, 8, 0, jnp.float32),  # float32 (the reference only on every backend)
    ],
)
def test_matches_float64(impl, B, T, K, G, d, e, window, dtype):
    if impl == "cudnn" and not cudnn_fits(dtype, d, e):
        with pytest.raises(ValueError, match="cuDNN"):
            attention(jnp.zeros((B, T, K * G, d), dtype), jnp.zeros((B, T, K, d), dtype), jnp.zeros((B, T, K, e), dtype),
                      scale=0.1, implementation=impl)  # fmt: skip
        return
    rng = np.random.default_rng(B * T + d + window)
    q, k = rng.standard_normal((B, T, K * G, d)), rng.standard_normal((B, T, K, d))
    v = rng.standard_normal((B, T, K, e))
    q, k, v = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64) for a in (q, k, v))  # rounded as the kernel sees them
    scale = 1 / np.sqrt(d)
    with jax.default_matmul_precision("highest"):  # float32 products in float32 on a GPU too (not TF32)
        o, lse = jax.jit(lambda q, k, v: attention(q, k, v, scale=scale, window=window, implementation=impl))(
            *(jnp.asarray(a, dtype) for a in (q, k, v))
        )
    assert o.shape == (B, T, K * G, e) and lse.shape == (B, T, K * G) and o.dtype == lse.dtype == jnp.float32
    want_o, want_lse = _float64(q, k, v, scale, window)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # probabilities rounded to the values' dtype before their matmul
    np.testing.assert_allclose(np.asarray(o), want_o, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5 if dtype == jnp.float32 else 1e-3, rtol=1e-5)


def test_unknown_implementation_raises():
    x = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation"):
        attention(x, x, x, scale=1.0, implementation="flash")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "T, S, K, G, d, lengths, dtype",
    [
        (8, 24, 2, 4, 64, (0, 13, 24), jnp.bfloat16),  # a row with nothing before its chunk, one reading the whole table
        (5, 40, 1, 2, 128, (1, 39), jnp.float16),
        (6, 12, 2, 1, 16, (7,), jnp.float32),
    ],
)
def test_prefix_lengths_match_float64(impl, T, S, K, G, d, lengths, dtype):
    """With `lengths_B` every query reads the first lengths[b] keys, none causal; a row of none
    gives o = 0 and lse = -1e30."""
    if impl == "cudnn" and not cudnn_fits(dtype, d, d):
        return
    B = len(lengths)
    rng = np.random.default_rng(S + d)
    q, k, v = (rng.standard_normal(s) for s in ((B, T, K * G, d), (B, S, K, d), (B, S, K, d)))
    q, k, v = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64) for a in (q, k, v))
    with jax.default_matmul_precision("highest"):
        o, lse = jax.jit(lambda q, k, v, n: attention(q, k, v, scale=0.2, lengths_B=n, implementation=impl))(
            *(jnp.asarray(a, dtype) for a in (q, k, v)), jnp.asarray(lengths, jnp.int32)
        )
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for b, n in enumerate(lengths):
        if n == 0:
            assert (np.asarray(o[b]) == 0).all() and (np.asarray(lse[b]) == -1e30).all()
            continue
        s = np.einsum("thd,shd->hts", q[b], np.repeat(k[b, :n], G, axis=1)) * 0.2
        m = s.max(-1, keepdims=True)
        want_lse = np.log(np.exp(s - m).sum(-1)) + m[..., 0]
        want_o = np.einsum("hts,she->the", np.exp(s - want_lse[..., None]), np.repeat(v[b, :n], G, axis=1))
        np.testing.assert_allclose(np.asarray(o[b]), want_o, atol=tol, rtol=tol)
        np.testing.assert_allclose(np.asarray(lse[b]), want_lse.T, atol=1e-5 if dtype == jnp.float32 else 1e-3, rtol=1e-5)


def test_prefix_takes_no_window():
    x = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="window"):
        attention(x, x, x, scale=1.0, window=3, lengths_B=jnp.ones((1,), jnp.int32))
