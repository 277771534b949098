"""Synthetic routing for benchmarks: replaces each token's routed experts by a seeded draw from a
Zipf popularity over the layer's experts, so that decode can be measured under a chosen routing
distribution instead of what the (random) router of a benchmark model gives.

Expert popularity in a layer is p_e ∝ 1 / rank_e^s, the ranks a fixed random permutation per
layer (the hot experts differ between layers); s = 0 is uniform, trained routers look like s ≈ 1.
Each token draws its top-k without replacement (Gumbel top-k) with noise hashed from the layer,
its position and its row in the step (a decode step's batch row, a prefill chunk's token index),
so a step's routing is reproducible but changes from step to step. A layer's draw is made in
its router's kernel where the step takes that kernel (`pallas_kernels/route_topk.py`; else the
hashed noise and a top-k after XLA's routing), where jax.random's threefry and a sort took five
kernels: the draw is the benchmark's, not the engine's, and costs the step as little as it can. A prompt's
last token drawn in a prefill chunk and the same token sent through the decode step get
different experts. The router's weights are kept (only the ids change).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.runtime.experts import ExpertBackend
from pallas_kernels import route_topk


def log_ranks(num_experts: int, layer: int) -> np.ndarray:
    """log(rank) of each expert of a layer (ranks from 1, a fixed permutation per layer)."""
    return np.log(np.random.default_rng(10_007 + layer).permutation(num_experts) + 1.0)


def log_popularity(num_experts: int, skew: float, layer: int) -> np.ndarray:
    logp = -skew * log_ranks(num_experts, layer)
    return (logp - np.logaddexp.reduce(logp)).astype(np.float32)


def _mix(h):
    """A 32-bit integer hash (uint32 in and out; lowbias32): every input bit reaches every output bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def _uniform(*keys):
    """A uniform float32 in (0, 1) for each element of the broadcast integer `keys`, hashed
    (elementwise ops that XLA fuses into one kernel with their consumers, where jax.random's
    threefry takes several kernels for each draw)."""
    h = jnp.uint32(0x9E3779B9)
    for k in keys:
        h = _mix(h ^ jnp.asarray(k).astype(jnp.uint32))
    return ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def _scores(logr, skew, pos, row, e, layer: int, seed: int):
    """The draw's scores, elementwise over broadcast arguments: −skew · log(rank) plus Gumbel
    noise hashed from the seed, the layer, the position, the row and the expert."""
    u = _uniform(seed, layer, pos, row, e)
    return -skew * logr - jnp.log(-jnp.log(u))


def synthetic_scores(T: int, positions_T: jax.Array, layer: int, num_experts: int, skew, seed: int = 0) -> jax.Array:
    """[T, E] float32: the layer's log-popularity plus Gumbel noise hashed from the seed, the
    layer, each token's position and its row in the step; its top-K is the draw. `skew` may be
    traced: one executable serves every exponent (the draw needs the log-popularity only up to a
    constant, so it is not normalized here)."""
    logr = jnp.asarray(log_ranks(num_experts, layer), jnp.float32)[None, :]
    rows, e = jnp.arange(T, dtype=jnp.int32)[:, None], jnp.arange(num_experts, dtype=jnp.int32)[None, :]
    return _scores(logr, jnp.asarray(skew, jnp.float32), positions_T.astype(jnp.int32)[:, None], rows, e, layer, seed)


def _top(scores_TE: jax.Array, K: int) -> jax.Array:
    """The K largest of each row, by the kernel of `pallas_kernels/route_topk.py` on a GPU."""
    if jax.default_backend() == "gpu" and K <= route_topk.TOP_K_MAX:
        return route_topk.top_k(scores_TE, K)[1]
    return jax.lax.top_k(scores_TE, K)[1]


def synthetic_ids(ids_TK: jax.Array, positions_T: jax.Array, layer: int, num_experts: int, skew, seed: int = 0,
                  w_TK: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """The layer's draw in place of the router's `ids_TK` (same shape and dtype): each token's K
    experts, the top-K of `synthetic_scores`. With the router's weights `w_TK`, a row's scores
    go to −inf where its first weight is NaN (which a working router never gives): the draw then
    depends on the router (`Draw` says why)."""
    T, K = ids_TK.shape
    scores = synthetic_scores(T, positions_T, layer, num_experts, skew, seed)
    if w_TK is not None:
        scores = jnp.where(jnp.isnan(w_TK[:, :1]), -jnp.inf, scores)
    return _top(scores, K).astype(ids_TK.dtype)


def _kernel_scores(t, e, pos_ref, skew_ref, logr_ref, *, E: int, layer: int, seed: int):
    """Row t's scores inside the router's kernel (`route_topk.route(..., draw=)`)."""
    return _scores(logr_ref[jnp.minimum(e, E - 1)], skew_ref[0], pos_ref[t], t, e, layer, seed)


@dataclasses.dataclass(frozen=True)
class Draw:
    """One layer's synthetic draw, made where its router chooses (`models.layers.route(...,
    draw=)`): in the router's kernel where the step takes it, else `synthetic_ids` after XLA's
    routing. The draw reads its router's weights (a row whose first weight is NaN draws from −inf
    scores), so that it comes when a router's choice would: drawn from positions alone, every
    layer's draw could be made at the step's start, and XLA would schedule the work that depends
    only on the experts chosen out of its layer (an optimization barrier does not hold that on
    every backend: the CPU's drops it first)."""

    positions_T: jax.Array
    layer: int
    num_experts: int
    skew: Any
    seed: int = 0

    def ids(self, ids_TK: jax.Array, w_TK: jax.Array) -> jax.Array:
        return synthetic_ids(ids_TK, self.positions_T, self.layer, self.num_experts, self.skew, self.seed, w_TK=w_TK)

    def kernel(self) -> tuple:
        """`route_topk.route`'s `draw`: the scores function and the arrays it reads."""
        E = self.num_experts
        fn = functools.partial(_kernel_scores, E=E, layer=self.layer, seed=self.seed)
        arrays = (
            self.positions_T.astype(jnp.int32),
            jnp.asarray(self.skew, jnp.float32).reshape(1),
            jnp.asarray(log_ranks(E, self.layer), jnp.float32),
        )
        return fn, arrays


class _Drawn:
    """A layer's expert function whose routing is `draw` (read by `models.layers.MoEBlock`)."""

    def __init__(self, fn, draw: Draw):
        self.fn, self.draw = fn, draw

    def __call__(self, x, ids, w, bias=None):
        return self.fn(x, ids, w, bias)


def with_synthetic_routing(fns: list, positions_T: jax.Array, num_experts: int, skew) -> list:
    """Each layer's expert function with the synthetic routing's draw for its router to make."""
    out, m = [], 0
    for fn in fns:
        out.append(None if fn is None else _Drawn(fn, Draw(positions_T, m, num_experts, skew)))
        m += fn is not None
    return out


PROBE_SHIFT = 1 << 20  # positions between two probes' draws (past any context)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SyntheticRouting(ExpertBackend):
    """A benchmark backend: `inner` computes the experts that a seeded Zipf(`skew`) draw picks
    instead of the router's (the router's weights are kept). `skew` is traced: every exponent
    runs in one executable; so is `shift`, added to the positions the draw reads (the `auto`
    probe's measurements each draw afresh: `for_probe`)."""

    inner: ExpertBackend
    skew: Any  # float32 scalar
    shift: Any = 0  # int32 scalar

    def for_probe(self, i: int) -> SyntheticRouting:
        return dataclasses.replace(self, inner=self.inner.for_probe(i), shift=int(i) * PROBE_SHIFT)

    @property
    def strategy(self):
        return self.inner.strategy

    @property
    def uses_slots(self) -> bool:
        return self.inner.uses_slots

    @property
    def q(self):
        return self.inner.q

    def prefill_path(self, cfg, tokens, num_slots):
        return self.inner.prefill_path(cfg, tokens, num_slots)

    def for_prefill(self, cfg, tokens):
        return dataclasses.replace(self, inner=self.inner.for_prefill(cfg, tokens))

    @property
    def on_device(self) -> bool:
        """Whether a `Cpu` backend inside computes its prefill chunks on the device."""
        return getattr(self.inner, "on_device", False)

    # hybrid's variants (the `auto` probe's candidates), routed the same way
    def with_q(self, q: float) -> SyntheticRouting:
        return dataclasses.replace(self, inner=self.inner.with_q(q))

    def as_offload(self) -> SyntheticRouting:
        return dataclasses.replace(self, inner=self.inner.as_offload())

    def as_cpu(self) -> SyntheticRouting:
        return dataclasses.replace(self, inner=self.inner.as_cpu())

    def expert_fns(self, model, valid_T, positions_T, slots, buffered=False):
        fns, after = self.inner.expert_fns(model, valid_T, positions_T, slots, buffered)
        if fns is None:
            fns = [layer.mlp.expert_fn() if layer.is_moe else None for layer in model.layers]
        return with_synthetic_routing(fns, positions_T + self.shift, model.cfg.num_experts, self.skew), after
