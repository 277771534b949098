import time, jax, jax.numpy as jnp, numpy as np
from freetoken_jax.runtime.sampling import sample, sample_full, process_logits, sampling_rows, GenerationParams
def t(f, *a, n=50):
    jax.block_until_ready(f(*a)); t0=time.perf_counter()
    for _ in range(n): r = f(*a)
    jax.block_until_ready(r); return (time.perf_counter()-t0)/n*1e3
for B in (1, 8):
    V=151936
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B,V)).astype(np.float32))
    s = sampling_rows([GenerationParams(temperature=1.0)]*B)
    c = jnp.zeros((B,V), jnp.int32); pos = jnp.zeros(B, jnp.int32)
    fs = {"sample": jax.jit(lambda x: sample(x, s.seeds_B, pos, s.temperature_B, s.top_k_B, s.top_p_B)),
          "sample_full": jax.jit(lambda x: sample_full(x, s, c, pos)),
          "process": jax.jit(lambda x: process_logits(x, s, c, pos)),
          "top_k20": jax.jit(lambda x: jax.lax.top_k(x, 20)),
          "log_softmax": jax.jit(lambda x: jax.nn.log_softmax(x)),
          "argsort": jax.jit(lambda x: jnp.argsort(-x, axis=-1))}
    for k, f in fs.items():
        print(B, k, f"{t(f, x):.3f} ms", flush=True)
