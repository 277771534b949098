"""Routed-expert implementations that benchmarks compare with the engine's (`--expert-impl`).

`named(impl)` is the `compute` a backend takes (`runtime/experts.py`): None for the engine's
choice ("auto"), `routed_experts` pinned to "kernel", "gather", "dense" or "grouped", or one of the two below, kept
out of the engine because they lost on the H200 (benchmarks/RESULTS.md):

- "slices": one dynamic slice per (token, expert) pair, each feeding its own matvec (no gathered
  copy; unrolled, so for a few pairs only);
- "ragged": sort the pairs by expert and run grouped matmuls (`ragged_dot_general`), each expert
  read once (XLA's fallback expands them into zero-padded dense matmuls of T·k × E rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from freetoken_jax.models.routed import activation, routed_experts
from freetoken_jax.quant.layout import ExpertLayout

IMPLS = ("auto", "kernel", "gather", "dense", "grouped", "slices", "ragged")


def _no_bias(bias, name: str) -> None:
    if bias is not None:
        raise ValueError(f"the {name!r} expert implementation has no expert biases; use auto, gather or dense")


def slices(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, bias=None) -> jax.Array:
    _no_bias(bias, "slices")
    T, K = ids_TK.shape
    f, dt, mm = activation(layout.act), x_TD.dtype, dict(preferred_element_type=jnp.float32)
    rows = []
    for t in range(T):
        acc = jnp.zeros((x_TD.shape[1],), jnp.float32)
        for k in range(K):
            e = ids_TK[t, k]
            g, u, d = layout.matrices(tuple(jax.lax.dynamic_index_in_dim(b, e, 0, keepdims=False) for b in banks), dt)
            h = f(jnp.dot(g, x_TD[t], **mm), jnp.dot(u, x_TD[t], **mm)).astype(dt)
            acc = acc + w_TK[t, k] * jnp.dot(d, h, **mm)
        rows.append(acc)
    return jnp.stack(rows).astype(dt)


def ragged(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, bias=None) -> jax.Array:
    _no_bias(bias, "ragged")
    T, K = ids_TK.shape
    E = banks[0].shape[0]
    f, dt, mm = activation(layout.act), x_TD.dtype, dict(preferred_element_type=jnp.float32)
    gate_EFD, up_EFD, down_EDF = layout.matrices(banks, dt)
    flat = ids_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // K
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    # Grouped matmuls contracting the weights' minor (input) dimension: [E, out, in] as stored.
    dims = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    rdot = lambda a, w: jax.lax.ragged_dot_general(a, w, sizes, dims, **mm)
    xs = x_TD[tok]
    h = f(rdot(xs, gate_EFD), rdot(xs, up_EFD)).astype(dt)
    y = rdot(h, down_EDF) * w_TK.reshape(-1)[order][:, None]
    return jnp.zeros((T, x_TD.shape[1]), jnp.float32).at[tok].add(y).astype(dt)


@functools.cache
def named(impl: str):
    """The `compute` of an implementation name (one object per name: one executable per name)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown expert implementation {impl!r}; choose from {IMPLS}")
    if impl == "auto":
        return None
    if impl in ("kernel", "gather", "dense", "grouped"):
        return functools.partial(routed_experts, impl=impl)
    return {"slices": slices, "ragged": ragged}[impl]
