"""A router's greedy top-k choice in one kernel.

`route(logits_TE, k, *, scoring, norm, scale, bias_E=None)` is, for each row t,

    s = softmax(logits[t]) or sigmoid(logits[t]) (`scoring`),
    ids[t] = the k largest of s (+ bias_E, where given), largest first, ties to the lower index,
    w[t] = s[ids[t]], divided by their sum (+ 1e-20 for sigmoid scores) where `norm`, times `scale`

— `models.layers.route` for `topk_method` "greedy". XLA computes this as four kernels a layer
(the softmax, a sort of the row, the gather of the k weights, their normalisation); here one
program per row holds the row in registers, takes the k largest one at a time (the maximum,
its lowest index, then that entry masked out) and writes ids and weights. Rows are padded to a
power of two (Triton's array sizes) with entries that are never chosen.

`route_ref` is the jnp reference (the softmax or sigmoid, `lax.top_k`, the gather).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import call_params

NUM_WARPS = 1


def _kernel(*refs, E, K, scoring, norm, scale, has_bias):
    logits_ref, *rest = refs
    bias_ref = rest.pop(0) if has_bias else None
    ids_ref, w_ref = rest
    t = pl.program_id(0)
    Ep, Kp = pl.next_power_of_2(E), ids_ref.shape[1]
    e = jnp.arange(Ep, dtype=jnp.int32)
    real = e < E
    col = jnp.minimum(e, E - 1)
    x = logits_ref[t, col].astype(jnp.float32)
    if scoring == "softmax":
        x = jnp.where(real, x, -jnp.inf)
        p = jnp.exp(x - jnp.max(x))
        s = p / jnp.sum(p)
    else:
        s = 1.0 / (1.0 + jnp.exp(-x))
    v = s + bias_ref[col] if has_bias else s
    v = jnp.where(real, v, -jnp.inf)
    slot = jnp.arange(Kp, dtype=jnp.int32)
    ids, w = jnp.zeros((Kp,), jnp.int32), jnp.zeros((Kp,), jnp.float32)
    for j in range(K):
        top = jnp.max(v)
        i = jnp.minimum(jnp.min(jnp.where(v == top, e, Ep)), E - 1)
        ids = jnp.where(slot == j, i, ids)
        w = jnp.where(slot == j, jnp.sum(jnp.where(e == i, s, 0.0)), w)
        v = jnp.where(e == i, -jnp.inf, v)
    if norm:
        w = w / (jnp.sum(w) + (1e-20 if scoring == "sigmoid" else 0.0))
    ids_ref[t, slot] = ids
    w_ref[t, slot] = w * scale


def route(logits_TE, k: int, *, scoring: str = "softmax", norm: bool = True, scale: float = 1.0, bias_E=None,
          interpret: bool = False, num_warps: int = NUM_WARPS):  # fmt: skip
    """(ids [T, k] int32, weights [T, k] float32) of a greedy router (module docstring)."""
    T, E = logits_TE.shape
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if not 0 < k <= E:
        raise ValueError(f"top-{k} of {E} experts")
    if bias_E is not None and bias_E.shape != (E,):
        raise ValueError(f"bias {bias_E.shape} is not [{E}]")
    Kp = pl.next_power_of_2(k)
    ins = [logits_TE] + ([bias_E.astype(jnp.float32)] if bias_E is not None else [])
    kernel = functools.partial(_kernel, E=E, K=k, scoring=scoring, norm=norm, scale=float(scale), has_bias=bias_E is not None)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    ids, w = pl.pallas_call(
        kernel,
        grid=(T,),
        in_specs=[any_spec] * len(ins),
        out_specs=[any_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((T, Kp), jnp.int32), jax.ShapeDtypeStruct((T, Kp), jnp.float32)],
        name="route_topk",
        **call_params(interpret, num_warps),
    )(*ins)
    return (ids, w) if Kp == k else (ids[:, :k], w[:, :k])


def route_ref(logits_TE, k: int, *, scoring: str = "softmax", norm: bool = True, scale: float = 1.0, bias_E=None):
    """Reference: the scores, `lax.top_k` of the choice, the weights gathered."""
    logits = logits_TE.astype(jnp.float32)
    s = jax.nn.sigmoid(logits) if scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    _, ids = jax.lax.top_k(s if bias_E is None else s + bias_E, k)
    w = jnp.take_along_axis(s, ids, axis=-1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return ids, w * scale
