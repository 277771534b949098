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
import numpy as np
from flax import nnx

from freetoken_jax.memory.kv_cache import KVCache, KVView
from freetoken_jax.memory.slot_cache import SlotCache
from freetoken_jax.models.stacked import stack_layers, take, unstack
from freetoken_jax.runtime.experts import FUSED, ExpertBackend
from freetoken_jax.runtime.sampling import Logprobs, Sampling, count_tokens, logprobs_of, sample, sample_full, sample_plain

# Positions whose logits a scored chunk computes at once (`chunk_logprobs`), at most 128 and at most
# 256 MB of float32 logits for all its rows: a 152k vocabulary's are 78 MB a row at 128 positions,
# where a whole 8192-token chunk's would be 5 GB.
SCORE_BLOCK, SCORE_BLOCK_BYTES = 128, 256 << 20


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """The model's parameters with its (static) NNX graph definition; make one with
    `Weights.of(params, graphdef)`. Under the host-bank strategies the routed experts' leaves are
    the host banks themselves (`runtime/offload.py`); how they are computed is the step's
    `experts` backend (`runtime/experts.py`).

    The parameters are kept as their flat list of arrays and the (static) tree structure of their
    `nnx.State`: jit flattens its arguments at every call, and an `nnx.State` flattens through a
    Python function per variable (about 0.3 ms a call for a 24-layer model, against microseconds
    for a tuple of arrays). With `stacked`, the layers' copies of each weight are one array
    (`models.stacked`: fewer arrays for a step to take), `plan` says where each leaf is."""

    leaves: tuple
    treedef: Any = dataclasses.field(metadata=dict(static=True))
    graphdef: Any = dataclasses.field(metadata=dict(static=True))
    plan: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def of(cls, params, graphdef, stacked: bool = False, experts: bool = False, consume: bool = False) -> Weights:
        """The weights of `params`; `stacked`: the layers' weights stacked (new arrays: `params`
        is left as it is unless `consume`, which deletes the arrays it stacks as it goes), the
        routed experts' banks too with `experts` (resident banks)."""
        if stacked:
            arrays, plan = stack_layers(params, experts, consume)
            return cls(arrays, jax.tree.structure(params), graphdef, plan)
        leaves, treedef = jax.tree.flatten(params)
        return cls(tuple(leaves), treedef, graphdef)

    def _tree(self, entry=take):
        """The parameters' tree, each stacked leaf `entry(stack, index)`."""
        return jax.tree.unflatten(self.treedef, self.leaves if self.plan is None else unstack(self.leaves, self.plan, entry))

    @property
    def params(self):
        """The parameters as an `nnx.State` (the tree `nnx.split` gives); stacked weights as slices
        of their stacks (outside a step, copies)."""
        return self._tree()

    @property
    def own_params(self):
        """The parameters' tree with the leaves kept as arrays of their own (host banks, weights
        that are not stacked) and None for each stacked leaf: no slice made (outside a step, a
        slice of a stack is a copy), for reading the former (the host banks' views)."""
        return self._tree(lambda stack, index: None)

    @property
    def host_params(self):
        """The parameters' tree in host memory (numpy), each stacked leaf copied out of its stack
        in turn: one slice of a stack on the device at a time, where `params` makes every slice
        at once (an export of a model whose weights fill the device)."""
        return jax.tree.map(np.asarray, self._tree(lambda stack, index: np.asarray(stack[index])))

    def model(self):
        return nnx.merge(self.graphdef, self.params)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What one decode step reads and replaces: the paged KV cache, each row's last token and
    its position, (offload, hybrid) the expert slot cache, and the token counts the full sampler's
    penalties read (`sample_step`; `sampling.process_logits` says what they hold; None where no
    step will sample with penalties)."""

    cache: KVCache
    tokens_B: jax.Array  # int32
    positions_B: jax.Array  # int32
    slots: SlotCache | None = None
    counts_BV: jax.Array | None = None  # int32

    @classmethod
    def start(cls, cache: KVCache, tokens_B, positions_B, slots: SlotCache | None = None, vocab_size: int | None = None) -> DecodeState:
        """A first state, every array committed to the device (see `on_device`); with
        `vocab_size`, with the token counts of the full sampler."""
        B = len(tokens_B)
        counts = None if vocab_size is None else jnp.zeros((B, vocab_size), jnp.int32)
        tokens, positions = jnp.asarray(tokens_B, jnp.int32), jnp.asarray(positions_B, jnp.int32)
        return cls(*on_device((cache, tokens, positions, slots, counts)))


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
    ring_BR: jax.Array | None = None  # int32 ring pages of each row for sliding layers (`kv_cache.ring_pages`)

    @classmethod
    def shapes(cls, B: int, P: int, R: int = 0) -> DecodeBatch:
        """The shapes of a batch of `B` rows, `P` pages and rings of `R` built from fresh arrays (`shapes`)."""
        return cls(
            jax.ShapeDtypeStruct((B, P), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.bool_), shapes(Sampling.greedy(B)), _ring_shape(B, R)
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    tokens_BT: jax.Array  # int32, padded
    positions_BT: jax.Array  # int32
    valid_BT: jax.Array  # bool
    page_table_BP: jax.Array  # int32
    sampling: Sampling
    ring_BR: jax.Array | None = None  # as `DecodeBatch.ring_BR`
    # int32: the token that follows each position (-1: none to score). Given, the prefill steps
    # also return each position's `Logprobs` of it (`chunk_logprobs`): a prompt's log-probabilities.
    targets_BT: jax.Array | None = None

    @classmethod
    def chunk(cls, segments, starts, table_BP, T: int, sampling: Sampling, ring_BR=None, targets=None) -> PrefillBatch:
        """A chunk of `T` positions per row: row b holds the tokens `segments[b]` from position
        `starts[b]` (the rest of its T padding); rows past `segments` are all padding. `targets`:
        per row, the tokens that follow its segment's positions (at most `len(segments[b])`; the
        rest, and rows given None, score nothing), or None for a chunk that scores nothing."""
        B = table_BP.shape[0]
        tok, valid, pos = np.zeros((B, T), np.int32), np.zeros((B, T), bool), np.zeros((B, T), np.int32)
        for b, (seg, start) in enumerate(zip(segments, starts)):
            tok[b, : len(seg)], valid[b, : len(seg)] = seg, True
            pos[b] = np.arange(start, start + T)
        ring = None if ring_BR is None else jnp.asarray(ring_BR, jnp.int32)
        tgt = None
        if targets is not None:
            tgt = np.full((B, T), -1, np.int32)
            for b, t in enumerate(targets):
                if t is not None:
                    tgt[b, : len(t)] = t
            tgt = jnp.asarray(tgt)
        return cls(jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(valid), jnp.asarray(table_BP, jnp.int32), sampling, ring, tgt)

    @classmethod
    def shapes(cls, B: int, T: int, P: int, R: int = 0, scored: bool = False) -> PrefillBatch:
        """The shapes of a chunk of `B` rows × `T` tokens, `P` pages and rings of `R` built from
        fresh arrays; `scored`: with targets."""
        i32 = jax.ShapeDtypeStruct((B, T), jnp.int32)
        table = jax.ShapeDtypeStruct((B, P), jnp.int32)
        return cls(i32, i32, jax.ShapeDtypeStruct((B, T), jnp.bool_), table, shapes(Sampling.greedy(B)), _ring_shape(B, R),
                   i32 if scored else None)  # fmt: skip


def _ring_shape(B: int, R: int):
    return jax.ShapeDtypeStruct((B, R), jnp.int32) if R else None


def _page_size(cache: KVCache) -> int:
    return cache[0][0].shape[2]


def forward(
    weights: Weights,
    experts: ExpertBackend,
    cache: KVCache,
    tokens_BT,
    positions_BT,
    valid_BT,
    page_table_BP,
    slots: SlotCache | None = None,
    buffered: bool = False,
    ring_BR=None,
):
    """Final hidden states [B, T, D] of this step's tokens, the extended KV cache and the expert
    slot cache (given for decode and slot-cache prefill under offload / hybrid, and for prefill
    through borrowed layer buffers with `buffered`). `ring_BR`: the rows' rings when the
    sliding layers keep their KV in rings (`kv_cache.ring_pages`). A step of many tokens holds
    each row's tokens at consecutive positions from its first, padding after them (as
    `PrefillBatch.chunk` builds them): its attention reads the chunk's own keys causally by
    index (`models.attention.attend_chunk`)."""
    model = weights.model()
    page = _page_size(cache)
    view = KVView.build(positions_BT, valid_BT, page_table_BP, page)
    if ring_BR is None and len({kv[0].shape[1] for kv in cache}) > 1:
        raise ValueError("this cache keeps sliding layers' KV in rings (kv_cache.ring_pages): give the batch its ring_BR")
    ring = None if ring_BR is None else KVView.ring(positions_BT, valid_BT, ring_BR, page)
    fns, slots_after = experts.expert_fns(model, valid_BT.reshape(-1), positions_BT.reshape(-1), slots, buffered)
    h, cache = model(tokens_BT, positions_BT, view, cache, fns, ring)
    return h, cache, slots_after()


def decode_forward(
    weights: Weights, state: DecodeState, batch: DecodeBatch, experts: ExpertBackend = FUSED
) -> tuple[jax.Array, DecodeState]:
    """The model half of a decode step: each row's logits [B, V] and the state with the step's
    KV (and slots) written; its tokens and positions are those of the step's input still
    (`sample_step` advances them)."""
    h, cache, slots = forward(
        weights, experts, state.cache, state.tokens_B[:, None], state.positions_B[:, None], batch.active_B[:, None], batch.page_table_BP,
        state.slots, ring_BR=batch.ring_BR,
    )  # fmt: skip
    return weights.model().logits(h[:, 0]), dataclasses.replace(state, cache=cache, slots=slots)


def sample_step(logits_BV, tokens_B, positions_B, counts_BV, batch: DecodeBatch, mask_BW=None, logprobs: bool = False):
    """The sampling half of a decode step with every control (`sampling.sample_full`): (next
    tokens, the same for the next state, which the next step donates, next positions, counts,
    `Logprobs` with `logprobs`, else None). Inactive rows keep their token and position.
    `mask_BW`: a grammar bitmask per row (`sampling.unpack_mask`)."""
    active = batch.active_B
    nxt, lp = sample_full(logits_BV, batch.sampling, counts_BV, positions_B, mask_BW, logprobs)
    counts_BV = count_tokens(counts_BV, nxt, active)
    nxt = jnp.where(active, nxt, tokens_B)
    return nxt, nxt, positions_B + active.astype(jnp.int32), counts_BV, lp


def decode_step(weights: Weights, state: DecodeState, batch: DecodeBatch, experts: ExpertBackend = FUSED) -> tuple[jax.Array, DecodeState]:
    """One token for every active row with temperature, top-k and top-p (`sampling.sample`):
    returns the sampled tokens [B] and the next state (its token counts untouched). Rows that
    ask for more go through `decode_forward` and `sample_step`."""
    s = batch.sampling
    return _decode(
        weights, state, batch, experts, lambda logits, pos: sample(logits, s.seeds_B, pos, s.temperature_B, s.top_k_B, s.top_p_B)
    )


def decode_step_plain(
    weights: Weights, state: DecodeState, batch: DecodeBatch, experts: ExpertBackend = FUSED
) -> tuple[jax.Array, DecodeState]:
    """`decode_step` for rows that are greedy or ask for a temperature alone (it ignores top-k
    and top-p): the same tokens without sorting the vocabulary (`sampling.sample_plain`). The
    engine's decode step while no active row asks for top-k or top-p (then `decode_step`)."""
    s = batch.sampling
    return _decode(weights, state, batch, experts, lambda logits, pos: sample_plain(logits, s.seeds_B, pos, s.temperature_B))


def _decode(weights, state, batch, experts, sampler):
    logits, st = decode_forward(weights, state, batch, experts)
    active = batch.active_B
    nxt = jnp.where(active, sampler(logits, st.positions_B + 1), st.tokens_B)
    return nxt, dataclasses.replace(st, tokens_B=nxt, positions_B=st.positions_B + active.astype(jnp.int32))


def prefill_step(weights: Weights, cache: KVCache, batch: PrefillBatch, experts: ExpertBackend = FUSED) -> tuple:
    """Writes a chunk of each row's prompt into the cache and samples the token that follows
    each row's last valid position in this chunk (meaningful for the chunk that ends a prompt):
    (tokens [B], KV cache), and the chunk's `chunk_logprobs` after them when the batch has
    `targets_BT`. Host-bank backends stream each layer's whole bank here (no slot cache)."""
    h, cache, _ = forward(
        weights, experts, cache, batch.tokens_BT, batch.positions_BT, batch.valid_BT, batch.page_table_BP, ring_BR=batch.ring_BR
    )
    return _sample_last(weights, h, batch), cache, *_scored(weights, h, batch)


def _sample_last(weights: Weights, h, batch: PrefillBatch) -> jax.Array:
    """The token after each row's last valid position of the chunk."""
    last = jnp.maximum(batch.valid_BT.sum(axis=1) - 1, 0)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    logits = weights.model().logits(h_last)
    pos = jnp.take_along_axis(batch.positions_BT, last[:, None], axis=1)[:, 0] + 1
    s = batch.sampling
    return sample(logits, s.seeds_B, pos, s.temperature_B, s.top_k_B, s.top_p_B)


def _scored(weights: Weights, h, batch: PrefillBatch) -> tuple:
    return () if batch.targets_BT is None else (chunk_logprobs(weights, h, batch.targets_BT),)


def chunk_logprobs(weights: Weights, h_BTD, targets_BT, block: int | None = None) -> Logprobs:
    """Each position's `Logprobs` under the model's distribution for what follows it: the
    log-probability of its target ([B, T]; a target < 0 reads token 0, to be ignored) and the
    `TOP_LOGPROBS` most likely tokens ([B, T, N]). The logits are computed `block` positions at a
    time (default: `SCORE_BLOCK`, fewer for many rows), so a long chunk never holds all of its
    float32 logits."""
    model = weights.model()
    B, T, D = h_BTD.shape
    if block is None:
        block = max(1, min(SCORE_BLOCK, SCORE_BLOCK_BYTES // (B * model.cfg.vocab_size * 4)))

    def one(h, t):
        return logprobs_of(model.logits(h), jnp.maximum(t, 0))

    if T <= block:
        return one(h_BTD, targets_BT)
    n = -(-T // block)
    pad = n * block - T
    hb = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, block, D).swapaxes(0, 1)
    tb = jnp.pad(targets_BT, ((0, 0), (0, pad)), constant_values=-1).reshape(B, n, block).swapaxes(0, 1)
    blocked = jax.lax.map(lambda a: one(*a), (hb, tb))  # each field [n, B, block(, N)]
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(B, n * block, *x.shape[3:])[:, :T], blocked)


def prefill_step_buffered(weights: Weights, cache: KVCache, batch: PrefillBatch, slots: SlotCache, experts: ExpertBackend):
    """`prefill_step` under "offload"/"hybrid" with at least 2 × num_experts slots: layers are
    loaded into two borrowed slot buffers, layer L+1 while layer L computes (`OffloadExecutor`).
    Returns (tokens, KV cache, slot cache) with the maps coherent again (and, with targets, the
    chunk's `chunk_logprobs`)."""
    b = batch
    h, cache, slots = forward(
        weights, experts, cache, b.tokens_BT, b.positions_BT, b.valid_BT, b.page_table_BP, slots, buffered=True, ring_BR=b.ring_BR
    )
    return _sample_last(weights, h, batch), cache, slots, *_scored(weights, h, batch)


def prefill_step_slots(weights: Weights, cache: KVCache, batch: PrefillBatch, slots: SlotCache, experts: ExpertBackend):
    """`prefill_step` through the slot cache as in decode: each token's routed experts looked up,
    the misses fetched (and, under "hybrid", shared with the CPU). For chunks too short to use
    most of a layer's experts (`offload.slot_prefill_pays`). Returns (tokens, KV cache, slot cache)
    (and, with targets, the chunk's `chunk_logprobs`)."""
    b = batch
    h, cache, slots = forward(weights, experts, cache, b.tokens_BT, b.positions_BT, b.valid_BT, b.page_table_BP, slots, ring_BR=b.ring_BR)
    return _sample_last(weights, h, batch), cache, slots, *_scored(weights, h, batch)


def score_step(weights: Weights, cache: KVCache, batch: PrefillBatch, experts: ExpertBackend = FUSED) -> tuple[jax.Array, KVCache]:
    """Like `prefill_step`, but returns the float32 logits at every position [B, T, V]."""
    h, cache, _ = forward(
        weights, experts, cache, batch.tokens_BT, batch.positions_BT, batch.valid_BT, batch.page_table_BP, ring_BR=batch.ring_BR
    )
    return weights.model().logits(h), cache
