"""The sampler's parts timed alone at a real vocabulary (151936 tokens), batch 1 and 8.

python benchmarks/probe_sampler.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.runtime.sampling import GenerationParams, process_logits, sample, sample_full, sample_plain, sampling_rows


def timed(f, x, n: int = 50) -> float:
    jax.block_until_ready(f(x))
    t0 = time.perf_counter()
    for _ in range(n):
        r = f(x)
    jax.block_until_ready(r)
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    V = 151936
    for B in (1, 8):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(B, V)).astype(np.float32))
        s = sampling_rows([GenerationParams(temperature=1.0)] * B)
        c, pos = jnp.zeros((B, V), jnp.int32), jnp.zeros(B, jnp.int32)
        fs = {
            "sample_plain (the decode step's)": lambda x, s=s, pos=pos: sample_plain(x, s.seeds_B, pos, s.temperature_B),
            "sample (top-k, top-p: one sort)": lambda x, s=s, pos=pos: sample(x, s.seeds_B, pos, s.temperature_B, s.top_k_B, s.top_p_B),
            "sample_full": lambda x, s=s, c=c, pos=pos: sample_full(x, s, c, pos),
            "sample_full, no logprobs": lambda x, s=s, c=c, pos=pos: sample_full(x, s, c, pos, logprobs=False),
            "process_logits": lambda x, s=s, c=c, pos=pos: process_logits(x, s, c, pos),
            "top_k 20": lambda x: jax.lax.top_k(x, 20),
            "argsort": lambda x: jnp.argsort(-x, axis=-1),
        }
        for name, f in fs.items():
            print(f"B={B} {name}: {timed(jax.jit(f), x):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
