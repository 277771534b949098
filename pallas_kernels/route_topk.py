"""Top-k choices in one kernel: a router's greedy choice, and the k largest of a short row.

`route(logits_TE, k, *, scoring, norm, scale, bias_E=None)` is, for each row t,

    s = softmax(logits[t]) or sigmoid(logits[t]) (`scoring`),
    ids[t] = the k largest of s (+ bias_E, where given), largest first, ties to the lower index,
    w[t] = s[ids[t]], divided by their sum (+ 1e-20 for sigmoid scores) where `norm`, times `scale`

— `models.layers.route` for `topk_method` "greedy". XLA computes this as four kernels a layer
(the softmax, a sort of the row, the gather of the k weights, their normalisation); here one
program per row holds the row in registers, takes the k largest one at a time (the maximum,
its lowest index, then that entry masked out) and writes ids and weights. Rows are padded to a
power of two (Triton's array sizes) with entries that are never chosen.

`route(..., draw=(scores, arrays))` writes other ids beside the router's weights: the k largest
of `scores(t, e, *refs)` (float32 [E'] for row t, `e` the padded expert indices, `refs` the
kernel's references to `arrays`), −inf for a row whose first weight is NaN — the benchmarks'
synthetic routing (`runtime/routing.py`) drawn in the router's kernel, where it took two kernels
of its own after it.

`top_k(x_TN, k)` is `lax.top_k` (the k largest of each row, largest first, ties to the lower
index) by the same loop, for small k: XLA sorts the whole row instead (the slot cache's victims:
the k least recently used of every slot). `route_ref` and `top_k_ref` are the jnp references.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import call_params

NUM_WARPS = 1


def _largest(v, alive, K: int, Kp: int, gather=None):
    """The K largest entries of the vector v among `alive` ones, largest first, ties to the lower
    index, taken one at a time (the maximum, its lowest index, then that entry out): their indices
    and values [Kp] (zeros past K), and `gather` at those indices where given."""
    n = v.shape[0]
    e = jnp.arange(n, dtype=jnp.int32)
    slot = jnp.arange(Kp, dtype=jnp.int32)
    low = -float("inf") if jnp.issubdtype(v.dtype, jnp.floating) else int(jnp.iinfo(v.dtype).min)
    ids, vals = jnp.zeros((Kp,), jnp.int32), jnp.zeros((Kp,), v.dtype)
    got = None if gather is None else jnp.zeros((Kp,), gather.dtype)
    for j in range(K):
        top = jnp.max(jnp.where(alive, v, low))
        i = jnp.min(jnp.where(alive & (v == top), e, n - 1))
        ids, vals = jnp.where(slot == j, i, ids), jnp.where(slot == j, top, vals)
        if gather is not None:
            got = jnp.where(slot == j, jnp.sum(jnp.where(e == i, gather, 0)), got)
        alive = alive & (e != i)
    return ids, vals, got


def _route_kernel(*refs, E, K, scoring, norm, scale, has_bias, draw):
    logits_ref, *rest = refs
    bias_ref = rest.pop(0) if has_bias else None
    draw_refs = [rest.pop(0) for _ in range(draw[1])] if draw else []
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
    ids, _, w = _largest(v, real, K, Kp, gather=jnp.where(real, s, 0.0))
    if norm:
        w = w / (jnp.sum(w) + (1e-20 if scoring == "sigmoid" else 0.0))
    slot = jnp.arange(Kp, dtype=jnp.int32)
    w = w * scale
    if draw:
        first = jnp.sum(jnp.where(slot == 0, w, 0.0))
        scores = jnp.where(jnp.isnan(first), -jnp.inf, draw[0](t, e, *draw_refs))
        ids, _, _ = _largest(scores, real, K, Kp)
    ids_ref[t, slot] = jnp.minimum(ids, E - 1)  # (a NaN row matches nothing)
    w_ref[t, slot] = w


def _top_k_kernel(x_ref, vals_ref, ids_ref, *, N, K):
    t = pl.program_id(0)
    Np, Kp = pl.next_power_of_2(N), ids_ref.shape[1]
    e = jnp.arange(Np, dtype=jnp.int32)
    ids, vals, _ = _largest(x_ref[t, jnp.minimum(e, N - 1)], e < N, K, Kp)
    slot = jnp.arange(Kp, dtype=jnp.int32)
    ids_ref[t, slot] = jnp.minimum(ids, N - 1)
    vals_ref[t, slot] = vals


def route(logits_TE, k: int, *, scoring: str = "softmax", norm: bool = True, scale: float = 1.0, bias_E=None,
          draw=None, interpret: bool = False, num_warps: int = NUM_WARPS):  # fmt: skip
    """(ids [T, k] int32, weights [T, k] float32) of a greedy router; `draw`: (scores, arrays),
    the ids drawn in place of the router's (module docstring)."""
    T, E = logits_TE.shape
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if not 0 < k <= E:
        raise ValueError(f"top-{k} of {E} experts")
    if bias_E is not None and bias_E.shape != (E,):
        raise ValueError(f"bias {bias_E.shape} is not [{E}]")
    Kp = pl.next_power_of_2(k)
    ins = [logits_TE] + ([bias_E.astype(jnp.float32)] if bias_E is not None else [])
    if draw is not None:
        ins += list(draw[1])
    kernel = functools.partial(_route_kernel, E=E, K=k, scoring=scoring, norm=norm, scale=float(scale), has_bias=bias_E is not None,
                               draw=None if draw is None else (draw[0], len(draw[1])))  # fmt: skip
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


TOP_K_MAX = 16  # `top_k`'s k at most: its loop takes one entry at a time


def top_k(x_TN, k: int, *, interpret: bool = False, num_warps: int = 4):
    """`lax.top_k(x_TN, k)` for k ≤ `TOP_K_MAX` (module docstring): values [T, k] and indices
    [T, k] int32."""
    T, N = x_TN.shape
    if not 0 < k <= min(N, TOP_K_MAX):
        raise ValueError(f"top-{k} of {N} (at most {TOP_K_MAX})")
    Kp = pl.next_power_of_2(k)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    vals, ids = pl.pallas_call(
        functools.partial(_top_k_kernel, N=N, K=k),
        grid=(T,),
        in_specs=[any_spec],
        out_specs=[any_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((T, Kp), x_TN.dtype), jax.ShapeDtypeStruct((T, Kp), jnp.int32)],
        name="top_k",
        **call_params(interpret, num_warps),
    )(x_TN)
    return (vals, ids) if Kp == k else (vals[:, :k], ids[:, :k])


def top_k_ref(x_TN, k: int):
    """Reference: `lax.top_k`."""
    return jax.lax.top_k(x_TN, k)
