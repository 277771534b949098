"""Handing a layer's CPU share of routed experts from the jitted step to the C++ executor.

One interface, two paths: `submit(x, ids, w, valid)` starts the CPU job and returns a pending
value; `collect(pending)` returns the job's float32 [T, D] sums. Work traced between the two,
tied in order with `jax.lax.optimization_barrier` (`around` does all three), runs while the CPU
computes.

- "ffi": the XLA FFI targets `freetoken_moe_submit_graph` / `freetoken_moe_wait_graph` of the C++
  module. On a GPU, `submit` enqueues the device-to-host copy and the signal that the job's
  inputs are staged, and returns; `wait` holds XLA's stream until the job is done and copies the
  result back (by default one kernel a side that signals and, for a decode-sized job, moves its
  input and result too; FREETOKEN_HANDOFF_SYNC=stream_memops: stream memory operations beside
  copies; FREETOKEN_HANDOFF_SYNC=host_function: host functions; see cpu_ext/src/ffi_handoff.h).
  What they enqueue is the same at every call, so XLA records them into its CUDA graphs with the
  kernels around them.
  On the CPU backend the same targets run with plain copies.
- "ffi_nograph": the same pair not recorded into graphs (XLA launches the graph pieces between
  them one by one).
- "callback": `jax.pure_callback` at `collect` (nothing overlaps: the stream waits for the
  whole round trip). The default on the CPU backend.

Entries with weight 0 (experts the GPU computes) and rows with valid == 0 are skipped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.runtime.ffi import cuda_ordinal, primitive

MODES = ("auto", "ffi", "ffi_nograph", "callback")


def resolve_mode(mode: str) -> str:
    """ "auto" is "ffi" on a GPU and "callback" on the CPU backend."""
    if mode not in MODES:
        raise ValueError(f"cpu_handoff must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "ffi" if jax.default_backend() == "gpu" else "callback"
    return mode


@functools.cache
def _prepare_job(handle: int, tokens: int, top_k: int) -> None:
    """Creates the layer's staging job for this shape now, while tracing: a handler XLA records
    into a CUDA graph must not allocate."""
    from freetoken_jax import _cpu_ext

    _cpu_ext.prepare_handoff_job(handle, tokens, top_k, cuda_ordinal())


@dataclasses.dataclass(frozen=True)
class Pending:
    """A started CPU job: the FFI token (and top-k, which `wait` needs), or the callback's inputs."""

    token: jax.Array | None = None
    top_k: int = 0
    inputs: tuple = ()


class LayerHandoff:
    """The handoff of one MoE layer whose host banks (numpy views) are gate/up [E, F·D] and
    down [E, D·F] (bytes of format `fmt` when quantized), with per-expert float32 `bias`
    (gate, up, down) where the model has them."""

    def __init__(self, mode: str, gate, up, down, hidden: int, ffn: int, act: str, fmt: str = "bf16", threads: int | None = None,
                 bias=None):  # fmt: skip
        from freetoken_jax.runtime.cpu_executor import shared_executor

        self.mode = resolve_mode(mode)
        self.banks, self.hidden, self.ffn, self.act, self.fmt, self.threads = (gate, up, down), hidden, ffn, act, fmt, threads
        self.bias = bias
        self.handle = None
        if self.mode != "callback":
            self.handle = shared_executor(threads).register_layer(gate, up, down, hidden, ffn, act, fmt, bias)
        self.suffix = "_graph" if self.mode == "ffi" else ""

    def submit(self, x_TD, ids_TK, w_TK, valid_T) -> Pending:
        args = (x_TD.astype(jnp.float32), ids_TK.astype(jnp.int32), w_TK.astype(jnp.float32), valid_T.astype(jnp.int32))
        if self.mode == "callback":
            return Pending(inputs=args)
        x, ids, w, valid = args
        bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.float32).reshape(-1)  # noqa: E731
        packed = jnp.concatenate([x.reshape(-1), bits(ids), w.reshape(-1), bits(valid)])  # one copy to the host
        T, K = ids.shape
        _prepare_job(self.handle, T, K)
        token = primitive("freetoken_moe_submit" + self.suffix).bind(
            packed, result=jax.ShapeDtypeStruct((1,), jnp.int32), handle=np.int64(self.handle), tokens=np.int64(T), top_k=np.int64(K)
        )
        return Pending(token, K)

    def around(self, x_TD, ids_TK, w_TK, valid_T, between, tied):
        """The CPU job of these inputs overlapping the device work `between(tied)`: submits the
        job, ties `tied` (the work's inputs) behind the submit and the work's result before the
        wait with optimization barriers (without them XLA may schedule the work outside the
        pair, and nothing overlaps), and returns (`between`'s result, the job's float32 [T, D]
        sums)."""
        p = self.submit(x_TD, ids_TK, w_TK, valid_T)
        if p.token is not None:
            token, tied = jax.lax.optimization_barrier((p.token, tied))
            p = dataclasses.replace(p, token=token)
        out = between(tied)
        if p.token is not None:
            out, token = jax.lax.optimization_barrier((out, p.token))
            p = dataclasses.replace(p, token=token)
        return out, self.collect(p, x_TD.shape[0])

    def collect(self, p: Pending, T: int) -> jax.Array:
        out = jax.ShapeDtypeStruct((T, self.hidden), jnp.float32)
        if self.mode != "callback":
            wait = primitive("freetoken_moe_wait" + self.suffix)
            return wait.bind(p.token, result=out, handle=np.int64(self.handle), top_k=np.int64(p.top_k))
        return jax.pure_callback(self._on_host, out, *p.inputs)

    def _on_host(self, x, ids, w, valid):
        from freetoken_jax.runtime.cpu_executor import shared_executor

        x = np.asarray(x)
        K = ids.shape[1]
        keep = np.repeat(np.asarray(valid) != 0, K) & (np.asarray(w).reshape(-1) != 0)
        tokens = np.repeat(np.arange(x.shape[0], dtype=np.int32), K)[keep]
        ids, w = np.asarray(ids).reshape(-1)[keep], np.asarray(w).reshape(-1)[keep]
        return shared_executor(self.threads).run(x, tokens, ids, w, *self.banks, self.act, self.fmt, self.bias)
