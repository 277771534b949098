"""Whole expert banks copied host->device on a stream of their own, for a prefill that loads
layers ahead of its compute (`runtime/offload.py`, prefill loads "copy" and "copy2").

An in-jit `device_put` of a host bank becomes an XLA copy-start / copy-done pair whose places
XLA's schedule chooses: it keeps few copies outstanding and waits for each soon after its start,
so the compute stream stalls on copies issued layers ahead (benchmarks/RESULTS.md, "Why the
copies still wait"). With the "stream" engine (FREETOKEN_PREFILL_COPY_ENGINE=stream) a bank's copy
is instead the FFI pair of the C++ module (cpu_ext/src/ffi_bank_copy.h): `start` enqueues the
copy on the module's copy stream and returns; `wait` holds XLA's stream until it has landed. Each
takes a value that must exist before it (`dep`), so the copy starts where the caller issues it
and the compute waits only where it needs the bank; every started copy runs after the ones
before it on the copy stream. On the CPU backend `start` copies with memcpy.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from freetoken_jax.config import env_choice
from freetoken_jax.runtime.ffi import primitive

ENGINES = ("xla", "stream")


def copy_engine() -> str:
    """How a prefill's whole-bank copies run (FREETOKEN_PREFILL_COPY_ENGINE): "xla" (the default)
    — an in-jit `device_put`, scheduled by XLA; "stream" — the C++ module's copy stream."""
    return env_choice("FREETOKEN_PREFILL_COPY_ENGINE", "xla", ENGINES)


def streams() -> bool:
    """Whether prefill's whole-bank copies go through the copy stream (`copy_engine` "stream"),
    which takes the host banks' views."""
    return copy_engine() == "stream"


def carried(views):
    """What an offload backend carries of the host bank views `views`: them where the copy stream
    will take them (FREETOKEN_PREFILL_COPY_ENGINE=stream, read when the backend is made), else
    None — views are static data compared by identity, and backends over the same banks must stay
    equal to share their executables."""
    return views if streams() else None


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A bank's device buffer while its copy may still be running (nothing but `wait` may take
    it), the bank's handle, and a token to tie what must follow the copy's start."""

    buf: jax.Array
    handle: int
    token: jax.Array


def register(view: np.ndarray) -> int:
    """The FFI handle of a host bank (a numpy view of its memory: `cpu_executor.host_view`)."""
    from freetoken_jax import _cpu_ext

    if not view.flags.c_contiguous:
        raise ValueError("a host bank copied by the copy stream must be contiguous")
    return int(_cpu_ext.register_host_bank(view.ctypes.data, view.nbytes))


def start(view: np.ndarray, dep: jax.Array) -> InFlight:
    """Starts the copy of host bank `view` into a new device buffer once `dep` exists."""
    handle = register(view)
    out = (jax.ShapeDtypeStruct(view.shape, view.dtype), jax.ShapeDtypeStruct((1,), np.int32))
    buf, token = primitive("freetoken_bank_copy_start", multiple=True).bind(dep, result=out, handle=np.int64(handle))
    return InFlight(buf, handle, token)


def wait(copy: InFlight, dep: jax.Array) -> jax.Array:
    """The copied bank, read only after its copy has landed and `dep` exists."""
    out = jax.ShapeDtypeStruct(copy.buf.shape, copy.buf.dtype)
    return primitive("freetoken_bank_copy_wait", ((0, 0),)).bind(copy.buf, dep, result=out, handle=np.int64(copy.handle))
