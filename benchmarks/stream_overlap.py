"""Can a layer's load from pinned host memory run beside the previous layer's compute inside one
jitted program? The pattern of a long prefill chunk: L layers, each a bank of E expert rows in
pinned host memory; layer m+1's rows are loaded while layer m computes on its own.

Variants (each one jitted program over the L layers, timed after a warm run):
  load      the loads only (the Pallas fetch kernel of `pallas_kernels/expert_fetch.py`, each
            layer's rows into a fresh device buffer);
  compute   the compute only (chained matmuls over a resident buffer, `--reps` per layer);
  serial    both, layer m+1's load issued before layer m's compute (one stream: XLA runs them in
            order);
  stream1   the same with each load under `compute_on("gpu_stream:1")` (XLA's stream annotation:
            the load runs on a second stream);
  copy      as serial, the load a `device_put` of the whole bank to device memory;
  copy1     copy under `compute_on("gpu_stream:1")`;
  inplace / inplace1  as serial / stream1, each layer fetched in place into one half of a
            [2E, row] buffer carried through the layers (the engine's borrowed layer buffers);
  ffi       as copy, the copy on the C++ module's copy stream (`runtime/bank_copy.py`), waited
            for after layer m's compute;
  ffi-pageable  the same from copies of the banks in pageable memory (numpy arrays);
  ffi-all   every layer's copy started on the copy stream before layer 0 computes, each waited
            for before its layer (no copy waits for a layer's compute to reach its start);
  copy-load / ffi-load  the whole-bank copies alone (`device_put`; the copy stream), nothing
            computed (FREETOKEN_BANK_COPY_STREAMS cuts each copy stream's bank into pieces).
`--profile N` prints each variant's kernel profile (torch's CUPTI profiler, as profile_step.py):
how long copies and compute ran beside each other, and N events of the last run in time order.
"dispatch ms" is how long the call took to return (before the result is ready): a variant whose
calls block the dispatching thread shows a dispatch time near its run time.
Overlap shows as a variant's time near max(load, compute) rather than their sum.

    python benchmarks/stream_overlap.py --layers 8 --reps 40
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from pallas_kernels.expert_fetch import fetch_rows_many

sys.path.insert(0, os.path.dirname(__file__))  # profile_step, for --profile


def on_stream(f, n: int):
    """`f` under XLA's stream annotation `gpu_stream:n` (jax 0.11's `compute_on(f, compute_type=...)`,
    jax 0.10's context manager)."""
    try:
        return compute_on(f, compute_type=f"gpu_stream:{n}", out_memory_spaces=jax.memory.Space.Device)
    except TypeError:

        def g(*args):
            with compute_on(f"gpu_stream:{n}"):
                return f(*args)

        return g


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rows", type=int, default=640, help="each expert: rows × 2048 bfloat16 weights")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=40, help="matmul pairs per layer (sets the compute time)")
    ap.add_argument("--variants", nargs="+", default=["load", "compute", "serial", "stream1", "copy", "copy1", "inplace", "inplace1"])
    ap.add_argument("--no-annotate", dest="annotate", action="store_false", help="compile without xla_gpu_experimental_stream_annotation")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after each variant's row, its kernel profile over two runs (profile_step's: copies beside compute, "
                         "idle gaps) and the last run's N events in time order")  # fmt: skip
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host" if gpu else None)
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    L, E, F, D, T = args.layers, args.experts, args.rows, 2048, args.tokens
    rng = np.random.default_rng(0)
    banks = [jax.device_put((rng.standard_normal((E, F * D), np.float32) * 0.02).astype(jnp.bfloat16), host) for _ in range(L)]
    x0 = jnp.asarray(rng.standard_normal((T, D), np.float32), jnp.bfloat16)
    idx, ones = jnp.arange(E, dtype=jnp.int32), jnp.ones((E,), bool)
    layer_gb = E * F * D * 2 / 1e9
    print(
        f"{jax.devices()[0].device_kind}: {L} layers of {E} experts, {layer_gb:.3f} GB a layer; {T} tokens, {args.reps} matmul pairs a layer"
    )

    def fetch(bank):
        return fetch_rows_many((bank,), (jnp.zeros((E, F * D), bank.dtype),), idx, idx, ones, interpret=not gpu)[0]

    def copy(bank):
        return jax.device_put(bank, on_dev) if gpu else bank

    def compute(x, w_ER):
        k = min(8, E)
        w = w_ER.reshape(E, F, D)[:k].reshape(k * F, D)  # [5120, 2048]: 8 of this layer's loaded experts
        for _ in range(args.reps):
            h = jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
            x = (jnp.dot(h, w, preferred_element_type=jnp.float32) * 0.05).astype(x.dtype)
        return x

    def pipeline(load):
        def run(x, banks):
            loaded = load(banks[0])
            for m in range(L):
                w = loaded
                if m + 1 < L:
                    x, w, nxt = jax.lax.optimization_barrier((x, w, banks[m + 1]))
                    loaded = load(nxt)
                x = compute(x, w)
            return x

        return run

    def fetch_into(bank, buf, dst):
        return fetch_rows_many((bank,), (buf,), idx, dst, ones, interpret=not gpu)[0]

    def pipeline_inplace(load):
        def run(x, banks):
            buf = load(banks[0], jnp.zeros((2 * E, F * D), banks[0].dtype), idx)
            for m in range(L):
                w = buf[E * (m % 2) : E * (m % 2 + 1)]
                if m + 1 < L:
                    x, w, buf, nxt = jax.lax.optimization_barrier((x, w, buf, banks[m + 1]))
                    buf = load(nxt, buf, idx + E * ((m + 1) % 2))
                x = compute(x, w)
            return x

        return run

    def pipeline_ffi(views):
        from freetoken_jax.runtime import bank_copy

        def run(x, banks):
            w = bank_copy.wait(bank_copy.start(views[0], x), x)
            for m in range(L):
                if m + 1 < L:
                    nxt = bank_copy.start(views[m + 1], x)
                    x, w, _ = jax.lax.optimization_barrier((x, w, nxt.token))
                x = compute(x, w)
                if m + 1 < L:
                    w = bank_copy.wait(nxt, x)
            return x

        return run

    def all_ahead_ffi(views):
        """Every layer's copy started before layer 0 computes (one after another on the copy
        stream), each waited for before its layer: no start waits for a layer's compute."""
        from freetoken_jax.runtime import bank_copy

        def run(x, banks):
            copies = [bank_copy.start(v, x) for v in views]
            x, _ = jax.lax.optimization_barrier((x, tuple(c.token for c in copies)))
            for m in range(L):
                x = compute(x, bank_copy.wait(copies[m], x))
            return x

        return run

    resident = copy(banks[0])

    def compute_only(x, _banks):
        for _ in range(L):
            x = compute(x, resident)
        return x

    variants = {
        "load": lambda x, b: sum(jnp.sum(fetch(bank)[:1, :8].astype(jnp.float32)) for bank in b) + x[0, 0],
        "copy-load": lambda x, b: sum(jnp.sum(copy(bank)[:1, :8].astype(jnp.float32)) for bank in b) + x[0, 0],
        "compute": compute_only,
        "serial": pipeline(jax.jit(fetch)),
        "stream1": pipeline(on_stream(jax.jit(fetch), 1)),
        "copy": pipeline(copy),
        "copy1": pipeline(on_stream(jax.jit(copy), 1)),
        "inplace": pipeline_inplace(jax.jit(fetch_into, donate_argnums=1)),
        "inplace1": pipeline_inplace(on_stream(jax.jit(fetch_into, donate_argnums=1), 1)),
    }
    if any(v.startswith("ffi") for v in args.variants):
        from freetoken_jax.runtime import bank_copy
        from freetoken_jax.runtime.cpu_executor import host_view

        views = [host_view(b) for b in banks]
        variants["ffi"] = pipeline_ffi(views)
        variants["ffi-all"] = all_ahead_ffi(views)
        variants["ffi-load"] = lambda x, b: (
            sum(jnp.sum(bank_copy.wait(bank_copy.start(v, x), x)[:1, :8].astype(jnp.float32)) for v in views) + x[0, 0]
        )
        if "ffi-pageable" in args.variants:
            variants["ffi-pageable"] = pipeline_ffi([np.array(host_view(b)) for b in banks])
    first = None
    print(f"\n{'variant':>12} {'ms':>8} {'dispatch ms':>12} {'GB/s of loads':>14} {'second stream':>14} {'same result':>12}", flush=True)
    for name in args.variants:
        try:
            lowered = jax.jit(variants[name]).lower(x0, banks)
            # XLA honours the stream annotation only with this option (jax's StreamAnnotationTest)
            f = lowered.compile({"xla_gpu_experimental_stream_annotation": True} if gpu and args.annotate else None)
            jax.block_until_ready(f(x0, banks))
            t = time.perf_counter()
            out = f(x0, banks)
            dispatch = (time.perf_counter() - t) * 1e3
            jax.block_until_ready(out)
            t = time.perf_counter()
            for _ in range(3):
                out = f(x0, banks)
            jax.block_until_ready(out)
            ms = (time.perf_counter() - t) / 3 * 1e3
            text = f.as_text()
            same = ""
            if not name.endswith("load") and name != "compute":  # the pipelines compute the same thing
                first = out if first is None else first
                same = str(bool(jnp.array_equal(out, first)))
            # each row as it is measured: a run cut short by a time limit keeps what it measured
            print(
                f"{name:>12} {ms:8.2f} {dispatch:12.2f} {L * layer_gb / ms * 1e3:14.1f} {str('call-start' in text):>14} {same:>12}",
                flush=True,
            )
            if args.profile and gpu:
                import profile_step

                profile_step.TIMELINE = args.profile
                profile_step.kernel_profile(lambda n, f=f: [jax.block_until_ready(f(x0, banks)) for _ in range(n)], n=2, top=6)
            if name.startswith("ffi") and gpu:  # the host time each copy's start took (enqueueing: microseconds)
                from freetoken_jax import _cpu_ext

                st = _cpu_ext.bank_copy_stats(True)
                print(f"{'':>12} {st['starts']} starts, {st['host_s'] / max(1, st['starts']) * 1e3:.3f} ms of host time each", flush=True)
        except Exception as e:  # a variant the backend refuses: say why and go on
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
