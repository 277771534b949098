"""Bandwidth probes shared by the decode and prefill benchmarks (bytes per second)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def copy_bandwidth(gib: float = 4.0, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median)."""
    n = int(gib * (1 << 30)) // 2
    x = jax.jit(lambda: jax.lax.iota(jnp.float32, n).astype(jnp.bfloat16) * jnp.bfloat16(1e-3))()
    f = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
    f(x).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * n * 2 / float(np.median(ts))


def h2d_bandwidth(gib: float = 1.0) -> float:
    """Host bank memory (pinned_host on a GPU) -> device `device_put` (median of 5)."""
    from freetoken_jax.runtime.offload import host_memory_kind

    dev = jax.devices()[0]
    n = int(gib * (1 << 30)) // 2
    host = jax.device_put(
        np.arange(n, dtype=np.float32).astype(jnp.bfloat16), jax.sharding.SingleDeviceSharding(dev, memory_kind=host_memory_kind())
    )
    ts = []
    for _ in range(6):
        t = time.perf_counter()
        jax.device_put(host, jax.sharding.SingleDeviceSharding(dev, memory_kind="device")).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * n / float(np.median(ts[1:]))


def executor_bandwidth(engine, seconds: float = 3.0) -> float:
    """The CPU executor at batch 1 (one token's top-k experts per call) over the engine's own host
    banks, rotating through every layer: bytes of expert weights read per second."""
    from freetoken_jax.runtime.cpu_executor import shared_executor
    from freetoken_jax.runtime.offload import host_bank_views

    cfg = engine.model_config
    views = host_bank_views(engine.weights.params)
    ex = shared_executor()
    x = np.random.default_rng(0).standard_normal((1, cfg.hidden_dim), dtype=np.float32)
    k, E = cfg.top_k, cfg.num_experts
    n, t0, i = 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        ex.run(x, [0] * k, [(i * k + j) % E for j in range(k)], [1.0 / k] * k, *views[i % len(views)], cfg.hidden_act)
        n, i = n + k, i + 1
    itemsize = np.dtype(views[0][0].dtype).itemsize
    return n * cfg.expert_params * itemsize / (time.perf_counter() - t0)
