"""Routed-expert implementations that benchmarks compare with the engine's (`--expert-impl`).

`named(impl)` is the `compute` a backend takes (`runtime/experts.py`): None for the engine's
choice ("auto"), `routed_experts` pinned to one of its implementations ("cuda", "kernel", "gather",
"dense", "grouped", "tiles", "ragged"), or "slices", kept out of the engine because it lost on
the H200 (benchmarks/RESULTS.md): one dynamic slice per (token, expert) pair, each feeding its
own matvec (no gathered copy; unrolled, so for a few pairs only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from freetoken_jax.models.routed import activation, routed_experts
from freetoken_jax.quant.layout import ExpertLayout

IMPLS = ("auto", "cuda", "kernel", "gather", "dense", "grouped", "tiles", "ragged", "slices")


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


@functools.cache
def named(impl: str):
    """The `compute` of an implementation name (one object per name: one executable per name)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown expert implementation {impl!r}; choose from {IMPLS}")
    if impl == "auto":
        return None
    if impl == "slices":
        return slices
    return functools.partial(routed_experts, impl=impl)
