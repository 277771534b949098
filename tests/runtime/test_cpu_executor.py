"""The C++ CPU expert executor on every ISA tier this machine has, against a float64 reference."""

import threading

import ml_dtypes
import numpy as np
import pytest
from helpers import executor_reference as reference

from freetoken_jax import _cpu_ext
from freetoken_jax.config import ACTIVATIONS
from freetoken_jax.runtime.cpu_executor import CpuExecutor, supported_tiers


@pytest.mark.parametrize("tier", supported_tiers())
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("T,H,F,E,N", [(1, 64, 32, 4, 2), (3, 37, 45, 5, 7), (64, 96, 40, 8, 100), (5, 130, 17, 3, 0), (2, 256, 128, 6, 8)])
def test_matches_float64(tier, dtype, T, H, F, E, N):
    rng = np.random.default_rng(T * 7 + H + F + N)
    x = rng.standard_normal((T, H)).astype(np.float32)
    gate, up = ((rng.standard_normal((E, F * H)).astype(np.float32) * 0.2).astype(dtype) for _ in range(2))
    down = (rng.standard_normal((E, H * F)).astype(np.float32) * 0.2).astype(dtype)
    tokens = rng.integers(0, T, N)
    experts = rng.integers(0, E, N)  # repeats included
    weights = rng.random(N).astype(np.float32)
    ex = CpuExecutor(threads=3, max_tier=tier)
    assert ex.tier == tier
    for act in ACTIVATIONS:
        got = ex.run(x, tokens, experts, weights, gate, up, down, act)
        ref = reference(x, tokens, experts, weights, gate, up, down, F, act)
        if N == 0:
            assert not got.any()
            continue
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        # bf16 dot products round the activations to bf16 too; every other tier is float32 math
        tol = 2e-2 if (tier == "avx512_bf16" and dtype == ml_dtypes.bfloat16) else 2e-5
        assert err < tol, (tier, act, err)


@pytest.mark.parametrize("tier", supported_tiers())
def test_expert_biases(tier):
    """Per-expert gate/up/down biases (gpt-oss) enter before the activation and after the down
    projection, for every item."""
    rng = np.random.default_rng(5)
    T, H, F, E, N = 3, 64, 32, 5, 9
    x = rng.standard_normal((T, H)).astype(np.float32)
    gate, up = (rng.standard_normal((E, F * H)).astype(np.float32) * 0.2 for _ in range(2))
    down = rng.standard_normal((E, H * F)).astype(np.float32) * 0.2
    bias = (rng.standard_normal((E, F)).astype(np.float32), rng.standard_normal((E, F)).astype(np.float32),
            rng.standard_normal((E, H)).astype(np.float32))  # fmt: skip
    tokens, experts, weights = rng.integers(0, T, N), rng.integers(0, E, N), rng.random(N).astype(np.float32)
    ex = CpuExecutor(threads=3, max_tier=tier)
    for act in ("silu", "swiglu_oai"):
        got = ex.run(x, tokens, experts, weights, gate, up, down, act, bias=bias)
        ref = reference(x, tokens, experts, weights, gate, up, down, F, act, bias=bias)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-5, (tier, act)
        plain = ex.run(x, tokens, experts, weights, gate, up, down, act)
        assert np.abs(plain - got).max() > 0.1  # the biases count
    with pytest.raises(ValueError, match="biases"):
        ex.run(x, tokens, experts, weights, gate, up, down, "silu", bias=(bias[0], bias[1], bias[1]))


def test_one_table_of_activations():
    """The executor computes exactly the activations the config accepts (same names)."""
    assert _cpu_ext.ACTIVATIONS == tuple(ACTIVATIONS)


def test_bad_input_raises():
    ex = CpuExecutor(threads=2)
    x = np.ones((2, 8), np.float32)
    g = np.ones((3, 4 * 8), np.float32)
    d = np.ones((3, 8 * 4), np.float32)
    ok = dict(tokens=[0], experts=[1], weights=[1.0])
    ex.run(x, gate=g, up=g, down=d, **ok)
    with pytest.raises(ValueError, match="expert id out of range"):
        ex.run(x, [0], [3], [1.0], g, g, d)
    with pytest.raises(ValueError, match="token index out of range"):
        ex.run(x, [2], [0], [1.0], g, g, d)
    with pytest.raises(ValueError, match="one length"):
        ex.run(x, [0, 1], [0], [1.0], g, g, d)
    with pytest.raises(ValueError, match="one expert per row"):
        ex.run(x, [0], [0], [1.0], g, g, np.ones((3, 30), np.float32))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ex.run(x, [0], [0], [1.0], g.astype(np.float64), g, d)
    with pytest.raises(ValueError, match="share one dtype"):
        ex.run(x, [0], [0], [1.0], g, g.astype(ml_dtypes.bfloat16), d)
    with pytest.raises(ValueError, match="activation 'relu'; use one of silu, gelu, gelu_tanh"):
        ex.run(x, [0], [0], [1.0], g, g, d, act="relu")
    with pytest.raises(ValueError):
        CpuExecutor(max_tier="sse9")


def test_oversubscribed_pool_gives_the_single_thread_result():
    """16 threads on this machine's few cores, jobs back to back: workers often wake after the job's
    tasks are gone. Every output row is computed by one task in a fixed order, so each job must
    equal the single-thread result bit for bit (a job returned before its tasks finished would not)."""
    rng = np.random.default_rng(3)
    T, H, F, E = 2, 200, 96, 6
    gate, up = ((rng.standard_normal((E, F * H)) * 0.2).astype(np.float32) for _ in range(2))
    down = (rng.standard_normal((E, H * F)) * 0.2).astype(np.float32)
    many, one = CpuExecutor(threads=16), CpuExecutor(threads=1)
    jobs = []
    for i in range(300):
        x = rng.standard_normal((T, H)).astype(np.float32)
        N = 1 + i % 5
        jobs.append((x, rng.integers(0, T, N), rng.integers(0, E, N), rng.random(N).astype(np.float32), gate, up, down))
    got = []

    def run_all():  # on a thread, so that a pool that hangs fails the test instead of the suite
        got.extend(many.run(*a) for a in jobs)

    t = threading.Thread(target=run_all, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and len(got) == len(jobs), "the pool hung"
    for i, (a, g) in enumerate(zip(jobs, got)):
        np.testing.assert_array_equal(g, one.run(*a), err_msg=f"job {i}")


def test_default_threads(monkeypatch):
    import os

    from freetoken_jax.runtime.cpu_executor import default_threads

    monkeypatch.delenv("FREETOKEN_CPU_THREADS", raising=False)
    n = len(os.sched_getaffinity(0))
    assert default_threads() == (n - 1 if n >= 8 else n)
    monkeypatch.setenv("FREETOKEN_CPU_THREADS", "3")
    assert default_threads() == 3 and CpuExecutor().threads == 3
    monkeypatch.setenv("FREETOKEN_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="positive integer"):
        default_threads()
