"""`python -m freetoken_jax.bench bw`: measure the machine with the engine's own kernels and decide.

Figures (GB/s): STREAM-like host read (C++, every core); the CPU expert executor at batch 1 over
bf16 experts rotating through a working set far beyond the last-level cache, and over the same
experts in each quantized format asked for (`--formats`; with its ratio to the host read); and, on a GPU,
pinned host → device `device_put`, the Pallas fetch kernel moving experts from a pinned bank
into slots (calls dispatched ahead, so that the device never waits for the host between them),
and the executor and the fetch again running at the same time (contended). The
recommendation is `hybrid` only when the CPU executor moves more than `threshold` × what PCIe
moves (contended figures when there are some), else `offload`; q* = Bp / (Bp + Bh).

The result is written atomically to `<cache dir>/benchbw.json` (schema version, time, device,
CPU model and ISA tier, dtype, figures, recommendation). `load_profile` ignores — with a message,
never an exception — a missing, corrupt, old-schema or foreign (other GPU or CPU) profile.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time

import numpy as np

from freetoken_jax.bench.measure import executor_pass, h2d_bandwidth, median_time
from freetoken_jax.runtime.choice import SCHEMA, THRESHOLD, cpu_model, device_name, profile_path, recommend

log = logging.getLogger("freetoken_jax")


def _host_read(gb: float, threads: int, reps: int) -> float:
    from freetoken_jax import _cpu_ext

    buf = np.ones(int(gb * 1e9) // 8 * 8, np.uint8)
    return buf.nbytes / median_time(lambda: _cpu_ext.stream_read(buf, threads), reps) / 1e9


def measure(
    *,
    hidden: int = 2048,
    ffn: int = 768,
    top_k: int = 8,
    working_set_gb: float = 1.0,
    host_read_gb: float = 1.0,
    threads: int = 0,
    reps: int = 3,
    formats: tuple[str, ...] = (),
) -> dict:
    """Runs the probes; sizes default to Qwen3-30B-A3B experts (bf16, top-8). `formats`: also
    the executor on these quantized expert formats (the same experts, quantized)."""
    import jax
    import ml_dtypes

    from freetoken_jax.runtime.cpu_executor import shared_executor

    def phase(what: str) -> None:  # the probes take seconds each: say which one runs
        print(f"bench bw: {what}", file=sys.stderr, flush=True)

    threads = threads or os.cpu_count() or 1
    fig: dict = {}
    phase(f"host memory read ({host_read_gb:g} GB, {threads} threads)")
    fig["host_read_gb_s"] = _host_read(host_read_gb, threads, reps)
    expert_bytes = 3 * hidden * ffn * 2
    E = max(2, int(working_set_gb * 1e9 // expert_bytes))
    rng = np.random.default_rng(0)
    banks = [(rng.standard_normal((E, ffn * hidden), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16) for _ in range(2)]
    banks.append((rng.standard_normal((E, hidden * ffn), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16))
    ex = shared_executor(threads)  # the engine's executor of this thread count, at its tier (FREETOKEN_CPU_TIER caps it)
    x = rng.standard_normal((1, hidden), dtype=np.float32)
    phase(f"CPU executor on {E} bf16 experts ({ex.tier})")
    cpu_pass, cpu_bytes = executor_pass(ex, [banks], x, top_k)  # the whole working set, batch 1
    fig["cpu_moe_gb_s"] = cpu_bytes / median_time(cpu_pass, reps) / 1e9
    fig["cpu_tier"] = ex.tier
    for fmt in formats:  # the same experts quantized, repeated to the same working set in bytes of the format
        from freetoken_jax.quant.banks import quantize_stack

        phase(f"CPU executor on {fmt} experts")
        shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
        q = [np.asarray(quantize_stack(fmt, b.reshape(E, *s))) for b, s in zip(banks, shapes)]
        copies = max(1, round(expert_bytes / sum(a.shape[1] for a in q)))
        q = [np.tile(a, (copies, 1)) for a in q]
        run, nbytes = executor_pass(ex, [q], x, top_k, fmt=fmt)
        fig[f"cpu_moe_{fmt}_gb_s"] = nbytes / median_time(run, reps) / 1e9
        fig[f"cpu_moe_{fmt}_of_read"] = fig[f"cpu_moe_{fmt}_gb_s"] / fig["host_read_gb_s"]
    phase("the CPU handoff's fixed cost")
    fig.update(handoff_cost(reps=reps))
    if jax.default_backend() == "gpu":
        phase("PCIe fetch, device copy and the contended host bandwidth")
        fig.update(_gpu_probes(banks, E, cpu_bytes, cpu_pass, reps))
    return fig


def handoff_cost(layers: int = 48, reps: int = 3) -> dict:
    """Microseconds one CPU handoff adds to a jitted step when the CPU has nothing to do: a chain
    of `layers` small device ops with a submit/wait pair (FFI) or a pure_callback each (every
    routing weight 0, so the job is empty), against the same chain without."""
    import jax
    import jax.numpy as jnp

    from freetoken_jax.runtime.handoff import LayerHandoff

    H, F = 64, 16
    rng = np.random.default_rng(1)
    banks = [rng.standard_normal((2, F * H), dtype=np.float32) for _ in range(3)]
    ids, w, valid = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.float32), jnp.ones((1,), jnp.int32)

    def chain(h):
        def f(x):
            for _ in range(layers):
                x = jnp.tanh(x * 0.5 + 0.1)
                if h is not None:
                    x = x + h.collect(h.submit(x, ids, w, valid), 1)
            return x

        return jax.jit(f)

    x = jnp.ones((1, H), jnp.float32)
    out = {}
    base = chain(None)
    t0 = median_time(lambda: base(x).block_until_ready(), max(reps, 5))
    for mode in ("ffi", "callback"):
        f = chain(LayerHandoff(mode, *banks, H, F, "silu"))
        out[f"handoff_{mode}_us"] = (median_time(lambda f=f: f(x).block_until_ready(), max(reps, 5)) - t0) / layers * 1e6
    return out


def _gpu_probes(banks, E, cpu_bytes, cpu_pass, reps) -> dict:
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.expert_fetch import fetch_rows_unjitted

    dev = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    out = {}
    bank = jax.device_put(np.asarray(banks[0]), pinned)
    out["h2d_gb_s"] = h2d_bandwidth(bank, reps=reps) / 1e9
    n = min(E, 64)
    box = [jnp.zeros((n, bank.shape[1]), bank.dtype)]

    @functools.partial(jax.jit, donate_argnums=(1,))
    def fetch_marked(bank, slots, src, dst, valid):
        slots = fetch_rows_unjitted(bank, slots, src, dst, valid)
        return slots, slots[dst[0], :1]  # a small output of its own: ready when the fetch is, never donated

    def fetcher(k: int):
        src, dst, valid = jnp.arange(k, dtype=jnp.int32), jnp.arange(k, dtype=jnp.int32), jnp.ones((k,), bool)

        def fetch():
            box[0], mark = fetch_marked(bank, box[0], src, dst, valid)
            return mark

        return fetch

    row_bytes = bank.shape[1] * bank.dtype.itemsize
    fetch_all = fetcher(n)
    jax.block_until_ready(fetch_all())  # compiled before timing
    run_pipelined(fetch_all, lasting(0.2, reps))  # the link and the GPU out of their idle states
    count, sec = run_pipelined(fetch_all, lasting(0.5, 4 * reps))
    out["fetch_gb_s"] = count * n * row_bytes / sec / 1e9
    k = min(n, 8)  # small fetches, so that the last one barely outlasts the CPU pass
    fetch_small = fetcher(k)
    jax.block_until_ready(fetch_small())
    fetch_rate, cpu_rate = run_together(fetch_small, k * row_bytes, cpu_pass, cpu_bytes)
    out["contended_fetch_gb_s"], out["contended_cpu_moe_gb_s"] = fetch_rate / 1e9, cpu_rate / 1e9
    return out


def lasting(seconds: float, calls: int):
    """A `run_pipelined` stop condition: at least `calls` calls and `seconds` from now."""
    t = time.perf_counter()
    return lambda c: c >= calls and time.perf_counter() - t >= seconds


def run_pipelined(fetch, stop, depth: int = 3) -> tuple[int, float]:
    """Calls `fetch()` until `stop(calls so far)`, with at most `depth` calls in flight: each call
    returns a value that is ready when its work is (or None), and the oldest is waited for once
    more are pending, so the device never idles between calls while the host waits.
    Returns (calls, seconds until the last is done)."""
    import collections

    import jax

    pending: collections.deque = collections.deque()
    count, t = 0, time.perf_counter()
    while not stop(count):
        pending.append(fetch())
        count += 1
        if len(pending) > depth:
            jax.block_until_ready(pending.popleft())
    for mark in pending:
        jax.block_until_ready(mark)
    return count, time.perf_counter() - t


def run_together(fetch, fetch_bytes: int, cpu_pass, cpu_bytes: int) -> tuple[float, float]:
    """Contended rates (bytes/s): `cpu_pass` runs once on a thread while `fetch` repeats on this
    one (pipelined, `run_pipelined`) for as long as the pass runs, so both rates cover the same
    window (the last fetches may end a little after the pass)."""
    started, done, t_cpu = threading.Event(), threading.Event(), {}

    def cpu_job():
        started.set()
        t = time.perf_counter()
        try:
            cpu_pass()
        finally:
            t_cpu["s"] = time.perf_counter() - t
            done.set()

    th = threading.Thread(target=cpu_job, daemon=True)
    th.start()
    started.wait()
    count, t_fetch = run_pipelined(fetch, lambda c: done.is_set() and c > 0)
    th.join()
    return count * fetch_bytes / t_fetch, cpu_bytes / t_cpu["s"]


def run_bw(
    *, path: str | None = None, json_path: str | None = None, threshold: float = THRESHOLD, dtype: str = "bfloat16", **sizes
) -> dict:
    fig = measure(**sizes)
    prof = dict(schema=SCHEMA, time=time.time(), device=device_name(), cpu_model=cpu_model(), dtype=dtype, figures=fig,
                threshold=threshold, recommendation=recommend(fig, threshold))  # fmt: skip
    for p in filter(None, (profile_path(path), json_path)):
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(p)), prefix=".benchbw-")
        with os.fdopen(fd, "w") as f:
            json.dump(prof, f, indent=1)
        os.replace(tmp, p)
    return prof
