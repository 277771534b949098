"""What overlaps inside one jitted prefill on this machine: loading layer L+1's experts while
layer L computes. Times, over every MoE layer of a preset (one prompt chunk of T tokens):

- loads (pallas): each layer's experts fetched from the host banks into a slot buffer by the
  Pallas kernel (the buffered prefill's load), nothing computed;
- loads (device_put): each layer's whole bank copied with an in-jit `device_put`;
- compute: each layer's routed experts computed from a buffer already on the device;
- both (pallas) / both (device_put): the load of layer L+1 issued before layer L computes.

overlap = (loads + compute − both) / min(loads, compute): 1 when the shorter side is hidden
completely, 0 when the two run one after the other.

    python benchmarks/probe_prefill_overlap.py --preset qwen3-30b-a3b --tokens 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from freetoken_jax.bench.compare import Bench  # noqa: E402
from freetoken_jax.bench.measure import median_time  # noqa: E402
from freetoken_jax.bench.presets import PRESETS  # noqa: E402
from freetoken_jax.memory.slot_cache import init_slot_cache  # noqa: E402
from freetoken_jax.models.routed import routed_experts  # noqa: E402
from freetoken_jax.runtime.offload import OffloadExecutor  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    bench = Bench(args.preset, dtype="bfloat16", max_batch=1, max_context=args.tokens + 16)
    cfg, w = bench.cfg, bench.engine.weights
    E, T, K, D = cfg.num_experts, args.tokens, cfg.top_k, cfg.hidden_dim
    dtype = jnp.dtype(bench.ecfg.dtype)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, D), dtype=np.float32) * 0.1, dtype)
    ids = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K], jnp.int32)
    wts = jnp.full((T, K), 1.0 / K, dtype)
    valid = jnp.ones((T,), bool)
    slots = jax.device_put(init_slot_cache(cfg, 2 * E, 1, dtype), jax.devices()[0])

    def run(weights, cache, load: str | None, compute: bool):  # the weights are an argument: banks never become constants
        ex = OffloadExecutor(cfg, weights.model(), cache, valid, prefill=True)
        n, acc = len(ex.banks), jnp.zeros((), jnp.float32)

        def load_layer(m):
            if load == "pallas":
                ex._fetch_layer(m)
                return ex.layer_slots.pop(m)
            banks = [ex._on_device(b) for b in ex.banks[m]]
            return banks

        def layer_rows(loaded, m):
            if load == "pallas" or load is None:
                c, s = ex.cache, loaded if load == "pallas" else ex.buffers[m % 2]
                return [a[s] for a in (c.gate_SR, c.up_SR, c.down_SR)]
            return loaded

        nxt = load_layer(0) if load else None
        for m in range(n):
            cur, nxt = nxt, (load_layer(m + 1) if load and m + 1 < n else None)
            rows = layer_rows(cur, m)
            if compute:
                out = routed_experts(x, ids, wts, tuple(rows), ex.layouts[m])
                acc = acc + out.astype(jnp.float32).sum()  # every output used: none of the compute can be pruned
            else:  # every loaded byte read once (an element alone would let XLA skip the copy)
                acc = acc + sum(r.astype(jnp.float32).sum() for r in rows)
        return acc

    variants = {
        "loads (pallas)": ("pallas", False), "loads (device_put)": ("device_put", False), "compute": (None, True),
        "both (pallas)": ("pallas", True), "both (device_put)": ("device_put", True),
    }  # fmt: skip
    out = dict(device=jax.devices()[0].device_kind, preset=args.preset, tokens=T, layers=cfg.num_moe_layers, ms={})
    for name, (load, compute) in variants.items():
        f = jax.jit(lambda w, c, load=load, compute=compute: run(w, c, load, compute))
        out["ms"][name] = median_time(lambda f=f: jax.block_until_ready(f(w, slots)), 3) * 1e3
        print(f"{name:>20}: {out['ms'][name]:9.2f} ms", flush=True)
    ms = out["ms"]
    for kind in ("pallas", "device_put"):
        lo, co, bo = ms[f"loads ({kind})"], ms["compute"], ms[f"both ({kind})"]
        out[f"overlap_{kind}"] = (lo + co - bo) / min(lo, co)
        print(f"overlap ({kind}): {out[f'overlap_{kind}']:.2f}", flush=True)
    bytes_all = cfg.num_moe_layers * E * bench.expert_bytes
    out["pallas_load_gb_s"] = bytes_all / ms["loads (pallas)"] * 1e-6
    out["device_put_load_gb_s"] = bytes_all / ms["loads (device_put)"] * 1e-6
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
