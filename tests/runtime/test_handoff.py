"""The split FFI handoff (freetoken_moe_submit / freetoken_moe_wait) on the CPU backend: results
against a float64 reference over a sweep of shapes, several handoffs in one jitted program with
work between submit and wait, and clear errors for bad calls."""

import ctypes

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from freetoken_jax.runtime.handoff import LayerHandoff, resolve_mode


def reference(x, ids, w, valid, g, u, d, H, F):
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        if not valid[t]:
            continue
        for k in range(ids.shape[1]):
            if w[t, k] == 0:
                continue
            e = ids[t, k]
            a = g[e].astype(np.float64).reshape(F, H) @ x[t]
            b = u[e].astype(np.float64).reshape(F, H) @ x[t]
            out[t] += w[t, k] * (d[e].astype(np.float64).reshape(H, F) @ (a / (1 + np.exp(-a)) * b))
    return out


def banks(rng, E, F, H, dtype):
    mk = lambda *s: (rng.standard_normal(s, dtype=np.float32) * 0.2).astype(dtype)  # noqa: E731
    return mk(E, F * H), mk(E, F * H), mk(E, H * F)


def inputs(rng, T, H, K, E):
    x = rng.standard_normal((T, H), dtype=np.float32)
    ids = rng.integers(0, E, (T, K)).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    w[rng.random((T, K)) < 0.3] = 0  # entries left to the GPU
    valid = (rng.random(T) < 0.8).astype(np.int32)
    return x, ids, w, valid


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("E,F,H,T,K", [(4, 16, 32, 1, 1), (6, 40, 24, 5, 3), (3, 17, 33, 9, 2), (8, 64, 48, 64, 4)])
def test_ffi_matches_reference(E, F, H, T, K, dtype):
    rng = np.random.default_rng(E * 1000 + T)
    g, u, d = banks(rng, E, F, H, dtype)
    x, ids, w, valid = inputs(rng, T, H, K, E)
    h = LayerHandoff("ffi", g, u, d, H, F, "silu")
    out = np.asarray(jax.jit(lambda *a: h.collect(h.submit(*a), T))(x, ids, w, valid))
    want = reference(x, ids, w, valid, g, u, d, H, F)
    tol = 1e-4 if dtype == np.float32 else 3e-2
    np.testing.assert_allclose(out, want, atol=tol * max(1.0, np.abs(want).max()), rtol=0)
    assert not out[valid == 0].any()  # invalid rows are skipped, not computed


def test_chained_layers_with_work_between_submit_and_wait():
    """Two layers in one program, each with GPU-side work between its submit and its wait
    (`around`, as the hybrid step does); equals the callback path."""
    rng = np.random.default_rng(7)
    E, F, H, T, K = 5, 24, 16, 3, 2
    layers = [banks(rng, E, F, H, np.float32) for _ in range(2)]
    x, ids, w, valid = inputs(rng, T, H, K, E)
    A = jnp.asarray(rng.standard_normal((H, H), dtype=np.float32) * 0.1)

    def program(mode):
        hs = [LayerHandoff(mode, *b, H, F, "silu") for b in layers]

        def f(x):
            for h in hs:
                y, host = h.around(x, ids, w, valid, lambda y: jnp.tanh(y @ A), x)
                x = y + 0.1 * host
            return x

        return jax.jit(f)

    expected = np.asarray(program("callback")(x))
    for mode in ("ffi", "ffi_nograph"):
        np.testing.assert_allclose(np.asarray(program(mode)(x)), expected, atol=1e-5, rtol=0)
    # repeated runs reuse the staging jobs and give the same result
    f = program("ffi")
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(f(x)))


def test_bad_calls_raise():
    rng = np.random.default_rng(1)
    E, F, H = 4, 8, 16
    g, u, d = banks(rng, E, F, H, np.float32)
    h = LayerHandoff("ffi", g, u, d, H, F, "silu")
    x, ids, w, valid = inputs(rng, 2, H, 2, E)
    with pytest.raises(Exception, match="width"):  # x's width is not the banks' hidden size
        jax.jit(lambda *a: h.collect(h.submit(*a), 2))(x[:, :8], ids, w, valid).block_until_ready()
    bad = ids.copy()
    bad[0, 0] = E + 3
    w2 = w.copy()
    w2[0, 0], valid[0] = 1.0, 1
    with pytest.raises(Exception, match="out of range"):
        jax.jit(lambda *a: h.collect(h.submit(*a), 2))(x, bad, w2, valid).block_until_ready()
    # the failed job leaves its flags clear: the next call on the same staging job is right
    out = jax.jit(lambda *a: h.collect(h.submit(*a), 2))(x, ids, w2, valid)
    np.testing.assert_allclose(np.asarray(out), reference(x, ids, w2, valid, g, u, d, H, F), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="one expert per row"):
        LayerHandoff("ffi", g, u, d[:, :-1], H, F, "silu")
    with pytest.raises(ValueError, match="cpu_handoff"):
        resolve_mode("carrier-pigeon")
    from freetoken_jax import _cpu_ext

    with pytest.raises(RuntimeError, match="unknown handoff layer handle"):
        _cpu_ext.prepare_handoff_job(10**6, 2, 2, -1)
    assert resolve_mode("auto") == "callback"  # the CPU backend


def test_many_handoffs_in_a_row_follow_their_inputs():
    """One staging job reused by many calls, dispatched without waiting between them: each call's
    result follows its own inputs (each call's ready/done flags are set and cleared once)."""
    rng = np.random.default_rng(11)
    E, F, H, T, K = 4, 8, 16, 2, 2
    g, u, d = banks(rng, E, F, H, np.float32)
    h = LayerHandoff("ffi", g, u, d, H, F, "silu")
    f = jax.jit(lambda *a: h.collect(h.submit(*a), T))
    calls = [inputs(rng, T, H, K, E) for _ in range(40)]
    outs = [f(*c) for c in calls]  # asynchronous dispatch: several may be queued at once
    for c, out in zip(calls, outs):
        np.testing.assert_allclose(np.asarray(out), reference(*c, g, u, d, H, F), atol=1e-4, rtol=0)


def test_handoff_sync_mode():
    from freetoken_jax import _cpu_ext

    mode = _cpu_ext.handoff_sync()
    assert mode in ("stream_memops", "host_function", "kernel")
    assert _cpu_ext.handoff_sync("host_function") == "host_function"
    # Signalling kernels need a CUDA driver that loads modules and launches kernels; without one
    # the handoff keeps to host functions.
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        launches = all(hasattr(cuda, f) for f in ("cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel"))
    except OSError:
        launches = False
    assert _cpu_ext.handoff_sync("kernel") == ("kernel" if launches else "host_function")
    with pytest.raises(ValueError, match="stream_memops"):
        _cpu_ext.handoff_sync("carrier-pigeon")
    _cpu_ext.handoff_sync(mode)
    assert _cpu_ext.handoff_sync() == mode


def test_the_handoff_adds_no_jax_effect_and_stays_side_effecting_in_the_hlo():
    """A step with a JAX effect is dispatched through jit's Python path at every call; the pair
    adds none, while XLA still sees both custom calls as side-effecting (kept and never merged)."""
    rng = np.random.default_rng(5)
    E, F, H, T, K = 4, 8, 16, 2, 2
    g, u, d = banks(rng, E, F, H, np.float32)
    h = LayerHandoff("ffi", g, u, d, H, F, "silu")
    args = inputs(rng, T, H, K, E)

    def f(x, ids, w, valid):
        gpu, cpu = h.around(x, ids, w, valid, lambda t: t * 2.0, x)
        return gpu + cpu

    assert jax.make_jaxpr(f)(*args).effects == set()
    hlo = jax.jit(f).lower(*args).as_text()
    calls = [line for line in hlo.splitlines() if "freetoken_moe_" in line and "custom_call" in line]
    assert len(calls) == 2 and all("has_side_effect = true" in line for line in calls), calls
    np.testing.assert_allclose(np.asarray(jax.jit(f)(*args)), 2 * args[0] + reference(*args, g, u, d, H, F), atol=1e-4, rtol=0)
