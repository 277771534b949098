"""Quantizing expert stacks into banks, a layer at a time, as weights are loaded or made.

`quantize_stack(fmt, stack)` turns one layer's [E, out, in] stack of one projection into its
bank [E, nbytes] (uint8, `quant/formats.py`) on the default device, a few experts at a time so
that the quantizer's float32 intermediates stay under `CHUNK_BYTES`; `quantizing(place, fmt)`
wraps a loader's `place(path, array)` so that every expert stack is quantized before it is placed
(the unquantized stack is dropped as soon as its bank exists: never two full copies).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.quant.formats import get_format

CHUNK_BYTES = 1 << 30


@functools.partial(jax.jit, static_argnames=("fmt",))
def _quantize(fmt: str, x):
    return get_format(fmt).quantize(x)


def quantize_stack(fmt: str, stack) -> np.ndarray | jax.Array:
    """[E, out, in] → uint8 [E, nbytes] (a device array)."""
    E, O, I = stack.shape
    per_expert = O * I * 4 * (17 if fmt in ("mxfp4", "nvfp4") else 3)  # the e2m1 search compares 16 codes
    step = max(1, min(E, CHUNK_BYTES // per_expert))
    parts = [_quantize(fmt, jnp.asarray(stack[e : e + step])) for e in range(0, E, step)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def quantizing(place, fmt):
    """`place(path, array)` that quantizes expert stacks first (`place` None: to the device):
    to `fmt`, a format name, or a model config's format of each layer and projection."""
    from freetoken_jax.models import is_expert_path

    def put(path, a):
        if is_expert_path(path):
            a = quantize_stack(fmt if isinstance(fmt, str) else format_at(fmt, path), a)
        return place(path, a) if place is not None else jnp.asarray(a)

    return put


def format_at(cfg, path: tuple) -> str:
    """The format of the expert bank at `path` (`layers/i/mlp/experts/gate|up|down`) under `cfg`."""
    from freetoken_jax.quant.layout import PROJECTIONS

    m = sum(cfg.moe_layers[: path[1]])
    return cfg.formats_of(m)[PROJECTIONS.index(path[-1])]


def quantize_params(params, fmt: str):
    """A parameter state with every expert stack quantized to `fmt` (one layer at a time)."""
    from flax import nnx

    put = quantizing(None, fmt)
    return nnx.State.from_flat_path([(p, v.replace(put(p, v.get_value()))) for p, v in params.flat_state()])
