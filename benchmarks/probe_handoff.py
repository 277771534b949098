"""What the split CPU handoff costs inside a jitted step, apart from the model around it.

A synthetic step of `--layers` layers, each: `--small` small matmuls (standing in for the
launch-bound attention and router), then the Pallas fetch of `--fetch` experts from a pinned
host bank into slots and their expert compute on the GPU, then the sum. Variants:

- none: no handoff (the offload step's shape);
- ffi: the split FFI pair (submit before the fetch, wait after the GPU experts, tied with
  barriers as in `OffloadExecutor`), signalled by stream memory operations and recorded into
  XLA's CUDA graphs; nograph: the same kept out of the graphs (handoff "ffi_nograph"); hostfn:
  that, signalled by host functions. The CPU computes `--cpu` experts per layer (0: empty jobs,
  so the difference to `none` is the handoff's own cost);
- callback: `jax.pure_callback` at the wait.

Prints, per variant, ms per step, the cost per layer against `none`, the time the Python call
took to return (dispatch) and the CPU side of the handoff as the C++ dispatcher timed it.

    python benchmarks/probe_handoff.py --layers 48 --fetch 2 --cpu 0 --variants none ffi nograph hostfn
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.runtime.cpu_executor import host_view
from freetoken_jax.runtime.handoff import LayerHandoff
from freetoken_jax.runtime.offload import host_memory_kind
from pallas_kernels.expert_fetch import fetch_rows_many


def build(args, variant: str, views):
    L, H, F, E, n = args.layers, args.hidden, args.ffn, args.experts, args.fetch
    interpret = jax.default_backend() == "cpu"
    handoffs = None
    if variant != "none":
        mode = {"callback": "callback", "ffi": "ffi"}.get(variant, "ffi_nograph")
        handoffs = [LayerHandoff(mode, *views, H, F, "silu") for _ in range(L)]

    def step(x_TD, small, slots, ids_TK, w_TK, banks):  # banks are arguments: never constants on the device
        T = x_TD.shape[0]
        valid_T = jnp.ones((T,), jnp.int32)
        slots = list(slots)
        dst, ok = jnp.arange(n, dtype=jnp.int32), jnp.ones((n,), jnp.int32)
        for m in range(L):
            h = x_TD
            for k in range(args.small):
                h = jnp.tanh(h @ small[m, k]).astype(x_TD.dtype)
            src = (jnp.arange(n, dtype=jnp.int32) + m * n) % E

            def gpu_side(slots, h=h, src=src):  # the fetch and the GPU experts, as OffloadExecutor's
                slots = list(fetch_rows_many(banks, slots, src, dst, ok, interpret=interpret))
                g, u, d = (s[:n] for s in slots)
                a = jnp.einsum("td,nfd->tnf", h, g.reshape(n, F, H), preferred_element_type=jnp.float32)
                b = jnp.einsum("td,nfd->tnf", h, u.reshape(n, F, H), preferred_element_type=jnp.float32)
                y = jnp.einsum("tnf,ndf->td", (jax.nn.silu(a) * b).astype(h.dtype), d.reshape(n, H, F), preferred_element_type=jnp.float32)
                return y, slots

            if handoffs is None:
                y, slots = gpu_side(slots)
            else:  # other experts each layer
                (y, slots), host = handoffs[m].around(h, (ids_TK + m * ids_TK.shape[1]) % E, w_TK, valid_T, gpu_side, slots)
                y = y + host
            x_TD = (x_TD.astype(jnp.float32) + 1e-3 * y).astype(x_TD.dtype)
        return x_TD, tuple(slots)

    return jax.jit(step, donate_argnums=(2,))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--experts", type=int, default=16, help="experts in the host bank")
    ap.add_argument("--fetch", type=int, default=2, help="experts fetched over PCIe per layer")
    ap.add_argument("--cpu", type=int, default=0, help="experts the CPU computes per layer (0: empty jobs)")
    ap.add_argument("--small", type=int, default=8, help="small matmuls per layer before the handoff")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--variants", nargs="+", default=["none", "ffi", "nograph"], choices=["none", "ffi", "nograph", "hostfn", "callback"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.cpu > args.experts:
        ap.error("--cpu must not exceed --experts")
    from freetoken_jax import _cpu_ext

    H, F, E, T, K = args.hidden, args.ffn, args.experts, args.batch, max(args.cpu, 1)
    dt = jnp.bfloat16
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    kind = host_memory_kind()
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind) if kind else jax.sharding.SingleDeviceSharding(dev)
    banks = [jax.device_put(jnp.asarray(rng.standard_normal((E, F * H), np.float32) * 0.02, dt), host) for _ in range(3)]
    views = [host_view(b) for b in banks]
    small = jnp.asarray(rng.standard_normal((args.layers, args.small, H, H), np.float32) * 0.02, dt)
    x = jnp.asarray(rng.standard_normal((T, H), np.float32), dt)
    ids = jnp.asarray(np.tile(np.arange(K, dtype=np.int32), (T, 1)))
    w = jnp.full((T, K), 1.0 / K if args.cpu else 0.0, jnp.float32)

    rows, base = [], None
    for v in args.variants:
        _cpu_ext.handoff_sync("host_function" if v == "hostfn" else "stream_memops")
        f = build(args, v, views)
        slots = tuple(jnp.zeros((max(args.fetch, 1) * 2, F * H), dt) for _ in range(3))
        t = time.perf_counter()
        compiled = f.lower(x, small, slots, ids, w, banks).compile()
        compile_s = time.perf_counter() - t
        y = x
        for _ in range(3):
            y, slots = compiled(y, small, slots, ids, w, banks)
        jax.block_until_ready(y)
        _cpu_ext.handoff_stats(True)
        dispatch = 0.0
        t = time.perf_counter()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            y, slots = compiled(y, small, slots, ids, w, banks)
            dispatch += time.perf_counter() - t0
        jax.block_until_ready(y)
        ms = (time.perf_counter() - t) / args.steps * 1e3
        st = _cpu_ext.handoff_stats(True)
        n = max(st["count"], 1)
        base = ms if v == "none" else base
        row = dict(variant=v, ms_per_step=ms, dispatch_ms=dispatch / args.steps * 1e3, compile_s=compile_s,
                   per_layer_us=None if base is None else (ms - base) / args.layers * 1e3,
                   cpu_side_us=st["cpu_s"] / n * 1e6, window_us=st["window_s"] / n * 1e6)  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""), args=vars(args), rows=rows
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    print(f"\nXLA_FLAGS={out['xla_flags']!r}")
    print(f"{'variant':>9} {'ms/step':>8} {'us/layer':>9} {'dispatch':>9} {'cpu us':>7} {'window':>7}")
    for r in rows:
        pl = "" if r["per_layer_us"] is None else f"{r['per_layer_us']:9.1f}"
        print(f"{r['variant']:>9} {r['ms_per_step']:8.3f} {pl:>9} {r['dispatch_ms']:9.3f} {r['cpu_side_us']:7.1f} {r['window_us']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
