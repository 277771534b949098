"""The CPU executor on one prefill-sized job: T tokens, top-K of E experts, bf16 and q4_0 banks
(random weights), best of three; prints the milliseconds and a checksum of the output (equal
across executor versions that sum in the same order).

    python benchmarks/executor_prefill.py [threads]
"""

import sys
import time

import ml_dtypes
import numpy as np

from freetoken_jax.quant.banks import quantize_stack
from freetoken_jax.runtime.cpu_executor import CpuExecutor

H, F, E, T, K = 1024, 512, 32, 256, 8
rng = np.random.default_rng(0)
b = [(rng.standard_normal((E, F * H), dtype=np.float32) * 0.05).astype(ml_dtypes.bfloat16) for _ in range(3)]
x = rng.standard_normal((T, H), dtype=np.float32)
tokens = np.repeat(np.arange(T), K)
experts = np.concatenate([rng.choice(E, K, replace=False) for _ in range(T)])
w = rng.random(T * K).astype(np.float32)
ex = CpuExecutor(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
q = [np.asarray(quantize_stack("q4_0", a.reshape(E, *s))) for a, s in zip(b, ((F, H), (F, H), (H, F)))]
for name, banks, fmt in (("bf16", b, "bf16"), ("q4_0", q, "q4_0")):
    ex.run(x, tokens, experts, w, *banks, "silu", fmt)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        out = ex.run(x, tokens, experts, w, *banks, "silu", fmt)
        best = min(best, time.perf_counter() - t)
    print(name, f"{best * 1e3:.1f} ms for {T} tokens x top-{K}", float(np.abs(out).sum()))
