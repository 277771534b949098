"""The pure step functions: prefill a chunk, decode one token, score a prompt.

Each is a function of (weights, state, batch) with no hidden state, so it can be jitted with
the state donated, or called inside a user's own `jax.jit` / `lax.scan`. Shapes decide the
executable: batch size B, chunk length T and page-table width P. The engine buckets all three.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from freetoken_jax.memory.expert_cache import SlotCache
from freetoken_jax.runtime.kv_cache import KVCache, KVView
from freetoken_jax.runtime.sampling import sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """The model's parameters with its (static) NNX graph definition and how routed experts run:
    "fused" (every expert resident), "offload" (experts in host banks, a slot cache in the
    decode state), "hybrid" (offload, with a fraction 1 − `hybrid_q` of each layer's misses
    computed on the host instead of fetched) or "cpu" (every expert computed on the host by the
    C++ executor); `host_banks` holds numpy views of the banks per MoE layer and `handoff` says
    how CPU work leaves the jitted step ("ffi", "ffi_nograph" or "callback", see `runtime/handoff.py`)."""

    params: Any
    graphdef: Any = dataclasses.field(metadata=dict(static=True))
    strategy: str = dataclasses.field(default="fused", metadata=dict(static=True))
    host_banks: Any = dataclasses.field(default=None, metadata=dict(static=True))
    # Strategy "hybrid": the share of misses fetched, a traced float32 scalar (any q, one
    # executable; the engine's probe tries several). None for every other strategy.
    hybrid_q: Any = None
    handoff: str = dataclasses.field(default="callback", metadata=dict(static=True))  # see runtime/handoff.py
    hybrid_overhead: float = dataclasses.field(default=0.0, metadata=dict(static=True))  # see EngineConfig
    prefill_load: str = dataclasses.field(default="auto", metadata=dict(static=True))  # see EngineConfig
    # Benchmarks only: a Zipf exponent; routed experts are then drawn from that popularity
    # instead of taken from the router (`runtime/routing.py`). None: the model's own routing.
    # A traced value: every exponent runs in the same executable.
    routing_skew: Any = None

    def model(self):
        return nnx.merge(self.graphdef, self.params)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Per-row sampling parameters."""

    seeds_B: jax.Array  # uint32
    temperature_B: jax.Array  # float32, <= 0: greedy
    top_k_B: jax.Array  # int32, <= 0: off
    top_p_B: jax.Array  # float32, >= 1: off

    @classmethod
    def greedy(cls, batch: int) -> Sampling:
        return cls(jnp.zeros(batch, jnp.uint32), jnp.zeros(batch, jnp.float32), jnp.zeros(batch, jnp.int32), jnp.ones(batch, jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What one decode step reads and replaces: the paged KV cache, each row's last token and
    its position, and (strategy "offload") the expert slot cache."""

    cache: KVCache
    tokens_B: jax.Array  # int32
    positions_B: jax.Array  # int32
    experts: SlotCache | None = None

    @classmethod
    def start(cls, cache: KVCache, tokens_B, positions_B, experts: SlotCache | None = None) -> DecodeState:
        """A first state, every array committed to the device (see `on_device`)."""
        return cls(*on_device((cache, jnp.asarray(tokens_B, jnp.int32), jnp.asarray(positions_B, jnp.int32), experts)))


def on_device(tree):
    """`tree` committed to the engine's device. Every array a jitted step returns is committed;
    a fresh one (`jnp.zeros`, `jnp.asarray`) is not, and jit keys its executables on that too:
    a state built from fresh arrays would compile each step twice, once for the first call."""
    return jax.device_put(tree, jax.devices()[0])


def shapes(tree, committed: bool = False):
    """`tree` (arrays or shapes) as shapes to compile a step from ahead of its call
    (`jit(f).lower(...)`): committed to the device as `on_device` places arrays, or not, as a
    fresh array is. Placed as the call's arguments will be, the call finds the step compiled."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0]) if committed else None
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    page_table_BP: jax.Array  # int32
    active_B: jax.Array  # bool; inactive rows write nothing and keep their token
    sampling: Sampling

    @classmethod
    def shapes(cls, B: int, P: int) -> DecodeBatch:
        """The shapes of a batch of `B` rows and `P` pages built from fresh arrays (`shapes`)."""
        return cls(jax.ShapeDtypeStruct((B, P), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.bool_), shapes(Sampling.greedy(B)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    tokens_BT: jax.Array  # int32, padded
    positions_BT: jax.Array  # int32
    valid_BT: jax.Array  # bool
    page_table_BP: jax.Array  # int32
    sampling: Sampling

    @classmethod
    def shapes(cls, B: int, T: int, P: int) -> PrefillBatch:
        """The shapes of a chunk of `B` rows × `T` tokens and `P` pages built from fresh arrays."""
        i32 = jax.ShapeDtypeStruct((B, T), jnp.int32)
        return cls(i32, i32, jax.ShapeDtypeStruct((B, T), jnp.bool_), jax.ShapeDtypeStruct((B, P), jnp.int32), shapes(Sampling.greedy(B)))


def _page_size(cache: KVCache) -> int:
    return cache[0][0].shape[1]


def forward(
    weights: Weights, cache: KVCache, tokens_BT, positions_BT, valid_BT, page_table_BP, experts: SlotCache | None = None, prefill=False
):
    """Final hidden states [B, T, D] of this step's tokens, the extended KV cache and the expert
    slot cache (given for decode under "offload"/"hybrid", and for prefill through its borrowed
    layer buffers, `prefill=True`)."""
    model = weights.model()
    view = KVView.build(positions_BT, valid_BT, page_table_BP, _page_size(cache))
    fns, ex = None, None
    if weights.strategy == "fused":
        if weights.routing_skew is not None:
            fns = [layer.mlp.fused_expert_fn() if layer.is_moe else None for layer in model.layers]
    else:
        from freetoken_jax.runtime.offload import CpuExpertExecutor, OffloadExecutor

        if weights.strategy == "cpu":
            ex = CpuExpertExecutor(model.cfg, weights.host_banks, valid_BT.reshape(-1), weights.handoff)
        else:
            hybrid = weights.strategy == "hybrid" and experts is not None and not prefill  # prefill loads whole layers either way
            ex = OffloadExecutor(
                model.cfg,
                model,
                experts,
                valid_BT.reshape(-1),
                weights.hybrid_q if hybrid else None,
                weights.host_banks,
                weights.handoff,
                weights.hybrid_overhead,
                prefill,
                weights.prefill_load,
            )
        fns = ex.expert_fns(model)
    if weights.routing_skew is not None:
        from freetoken_jax.runtime.routing import with_synthetic_routing

        fns = with_synthetic_routing(fns, positions_BT.reshape(-1), model.cfg.num_experts, weights.routing_skew)
    h, cache = model(tokens_BT, positions_BT, view, cache, fns)
    return h, cache, getattr(ex, "cache", experts)  # the slot cache after this step (offload, hybrid)


def decode_step(weights: Weights, state: DecodeState, batch: DecodeBatch) -> tuple[jax.Array, DecodeState]:
    """One token for every active row: returns the sampled tokens [B] and the next state."""
    active = batch.active_B
    h, cache, experts = forward(
        weights, state.cache, state.tokens_B[:, None], state.positions_B[:, None], active[:, None], batch.page_table_BP, state.experts
    )
    logits = weights.model().logits(h[:, 0])
    s = batch.sampling
    nxt = sample(logits, s.seeds_B, state.positions_B + 1, s.temperature_B, s.top_k_B, s.top_p_B)
    nxt = jnp.where(active, nxt, state.tokens_B)
    return nxt, DecodeState(cache, nxt, state.positions_B + active.astype(jnp.int32), experts)


def prefill_step(weights: Weights, cache: KVCache, batch: PrefillBatch) -> tuple[jax.Array, KVCache]:
    """Writes a chunk of each row's prompt into the cache and samples the token that follows
    each row's last valid position in this chunk (meaningful for the chunk that ends a prompt)."""
    h, cache, _ = forward(weights, cache, batch.tokens_BT, batch.positions_BT, batch.valid_BT, batch.page_table_BP)
    return _sample_last(weights, h, batch), cache


def _sample_last(weights: Weights, h, batch: PrefillBatch) -> jax.Array:
    """The token after each row's last valid position of the chunk."""
    last = jnp.maximum(batch.valid_BT.sum(axis=1) - 1, 0)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    logits = weights.model().logits(h_last)
    pos = jnp.take_along_axis(batch.positions_BT, last[:, None], axis=1)[:, 0] + 1
    s = batch.sampling
    return sample(logits, s.seeds_B, pos, s.temperature_B, s.top_k_B, s.top_p_B)


def prefill_step_buffered(weights: Weights, cache: KVCache, batch: PrefillBatch, experts: SlotCache):
    """`prefill_step` under "offload"/"hybrid" with at least 2 × num_experts slots: layers are
    loaded into two borrowed slot buffers, layer L+1 while layer L computes (`OffloadExecutor`).
    Returns (tokens, KV cache, slot cache) with the maps coherent again."""
    h, cache, experts = forward(
        weights, cache, batch.tokens_BT, batch.positions_BT, batch.valid_BT, batch.page_table_BP, experts, prefill=True
    )
    return _sample_last(weights, h, batch), cache, experts


def prefill_step_slots(weights: Weights, cache: KVCache, batch: PrefillBatch, experts: SlotCache):
    """`prefill_step` through the slot cache as in decode: each token's routed experts looked up,
    the misses fetched (and, under "hybrid", shared with the CPU). For chunks too short to use
    most of a layer's experts (`offload.slot_prefill_pays`). Returns (tokens, KV cache, slot cache)."""
    h, cache, experts = forward(weights, cache, batch.tokens_BT, batch.positions_BT, batch.valid_BT, batch.page_table_BP, experts)
    return _sample_last(weights, h, batch), cache, experts


def score_step(weights: Weights, cache: KVCache, batch: PrefillBatch) -> tuple[jax.Array, KVCache]:
    """Like `prefill_step`, but returns the float32 logits at every position [B, T, V]."""
    h, cache, _ = forward(weights, cache, batch.tokens_BT, batch.positions_BT, batch.valid_BT, batch.page_table_BP)
    return weights.model().logits(h), cache
