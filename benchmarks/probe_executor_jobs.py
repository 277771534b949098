"""The CPU executor's rate on short jobs: one token's k experts per call (k = 1 … 8), as the
hybrid step's CPU share is (about 3 experts a layer at the -ncmoe 17 share), at several thread
counts. q4_0 experts of the Qwen3-30B-A3B shape in a bank far beyond the last-level cache (random
bytes with valid f16 scales), each call on the next k experts.

    python benchmarks/probe_executor_jobs.py [--experts 512] [--k 1 2 3 4 8] [--threads 8 12 16] [--calls 200]

Prints µs a call and GB/s of expert bytes read; a job's fixed cost is what the µs keep at k → 0
(k = 0: the Python call alone, which the hybrid step's handoff does not make).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from freetoken_jax.quant.formats import get_format
from freetoken_jax.runtime.cpu_executor import CpuExecutor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3, 4, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[8, 12, 16])
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    E, D, F = a.experts, a.hidden, a.ffn
    q, rng = get_format("q4_0"), np.random.default_rng(0)
    scale = np.float16(0.01).tobytes()

    def bank(rows: int, cols: int) -> np.ndarray:
        b = rng.integers(0, 256, (E, q.nbytes(rows, cols)), dtype=np.uint8)
        blocks = b.reshape(E, -1, 18)
        blocks[:, :, 0], blocks[:, :, 1] = scale[0], scale[1]
        return b

    gate, up, down = bank(F, D), bank(F, D), bank(D, F)
    per_expert = gate.shape[1] + up.shape[1] + down.shape[1]
    x = rng.standard_normal((1, D)).astype(np.float32)
    print(f"q4_0 experts [{F}, {D}], {per_expert / 1e6:.2f} MB each, bank of {E} ({3 * gate.nbytes / 1e9:.2f} GB)")
    print(f"{'threads':>7} {'k':>3} {'us/call':>9} {'GB/s':>7}")
    for threads in a.threads:
        ex = CpuExecutor(threads)
        for k in a.k:
            ids = [list((np.arange(k) + c * k) % E) for c in range(a.calls)]
            for c in range(min(20, a.calls)):  # warm the pool and the pages
                ex.run(x, [0] * k, ids[c], [1.0 / max(k, 1)] * k, gate, up, down, "silu", "q4_0")
            t = time.perf_counter()
            for c in range(a.calls):
                ex.run(x, [0] * k, ids[c], [1.0 / max(k, 1)] * k, gate, up, down, "silu", "q4_0")
            dt = (time.perf_counter() - t) / a.calls
            print(f"{threads:7d} {k:3d} {dt * 1e6:9.1f} {k * per_expert / dt / 1e9:7.1f}", flush=True)  # k = 0: 0 GB/s


if __name__ == "__main__":
    main()
