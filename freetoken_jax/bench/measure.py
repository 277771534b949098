"""Bandwidth probes shared by the decode and prefill benchmarks (bytes per second)."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_time(fn, reps: int) -> float:
    """Seconds `fn()` takes: one warm-up call, then the median of `reps` calls."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def thread_times() -> tuple[int, int]:
    """(ns the calling thread has run on a core, ns it has waited runnable for one) so far, from
    Linux's schedstat; (0, 0) where there is none."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            ran, waited, _ = f.read().split()
        return int(ran), int(waited)
    except OSError:
        return 0, 0


def copy_bandwidth(gib: float = 4.0, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median)."""
    n = int(gib * (1 << 30)) // 2
    x = jax.jit(lambda: jax.lax.iota(jnp.float32, n).astype(jnp.bfloat16) * jnp.bfloat16(1e-3))()
    f = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
    return 2 * n * 2 / median_time(lambda: f(x).block_until_ready(), reps)


def h2d_bandwidth(host=None, gib: float = 1.0, reps: int = 5) -> float:
    """Host bank memory (pinned_host on a GPU) -> device `device_put` of `host` (an array or a
    list of them, copied together), or of a fresh `gib` GiB array (median)."""
    from freetoken_jax.runtime.offload import host_memory_kind

    dev = jax.devices()[0]
    if host is None:
        n = int(gib * (1 << 30)) // 2
        host = jax.device_put(
            np.arange(n, dtype=np.float32).astype(jnp.bfloat16), jax.sharding.SingleDeviceSharding(dev, memory_kind=host_memory_kind())
        )
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    nbytes = sum(a.nbytes for a in host) if isinstance(host, (list, tuple)) else host.nbytes
    return nbytes / median_time(lambda: jax.block_until_ready(jax.device_put(host, device)), reps)


def executor_pass(ex, layers, x, top_k: int, act: str = "silu", fmt: str | list[str] = "bf16"):
    """One batch-1 pass of the CPU executor over every expert of `layers` ([(gate, up, down[,
    biases])], host banks as `host_bank_views` gives them; `fmt` their executor format, or one
    per layer): one token's top-k experts per call, in turn. Returns (run, bytes of expert
    weights one run reads)."""
    fmts = [fmt] * len(layers) if isinstance(fmt, str) else fmt
    E = layers[0][0].shape[0]
    k = min(top_k, E)
    calls = E // k

    def run():
        for (gate, up, down, *bias), f in zip(layers, fmts):
            for c in range(calls):
                ex.run(x, [0] * k, [c * k + j for j in range(k)], [1.0 / k] * k, gate, up, down, act, f, tuple(bias) or None)

    return run, calls * k * sum(b.nbytes // b.shape[0] for banks in layers for b in banks[:3])


def executor_bandwidth(engine, views, reps: int = 3, threads: int | None = None) -> float:
    """The CPU executor at batch 1 over the engine's own host banks (`views`, from
    `host_bank_views`), every layer in turn: bytes of expert weights read per second."""
    from freetoken_jax.runtime.cpu_executor import shared_executor

    cfg = engine.model_config
    x = np.random.default_rng(0).standard_normal((1, cfg.hidden_dim), dtype=np.float32)
    from freetoken_jax.quant.layout import ExpertLayout

    fmts = [ExpertLayout.of(cfg, m).executor_format() for m in range(len(views))]
    run, nbytes = executor_pass(shared_executor(threads), views, x, cfg.top_k, cfg.hidden_act, fmts)
    return nbytes / median_time(run, reps)
