"""The unified expert slot cache: device state of the decode step.

S slots per weight kind are shared by all MoE layers. An expert is addressed by its flat id
`moe_layer * num_experts + expert` (moe_layer counts MoE layers only). `slot_for_id[id]` is its
slot or -1, `id_of_slot[s]` the id held by slot s or -1, `last_use[s]` the clock value of the
layer step that last used it; one global LRU over all layers (the clock advances once per MoE
layer per step). Every update has fixed shapes: a layer's needs are the B × k routed entries,
misses padded with a mask, so the step compiles once per batch bucket. What no later layer of
a step reads (the counters, `routed_LN`, `last_routed`) is written once for all the step's layers
at its end (`record_stats`): fewer, larger updates than one per layer. Where the cache has room
the victims of a whole step come from one sort at its start (`StepVictims`), and `id_of_slot`
and `last_use` are written at its end too.

Each slot array holds one expert per row, flattened: gate and up as [F·D] (rows of the [F, D]
matrix), down as [D·F], or for a quantized expert format the matrix's bytes (uint8,
`quant/layout.py`); the host banks use the same row layout, so a fetch copies rows verbatim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from freetoken_jax.config import MoEModelConfig, env_choice
from freetoken_jax.quant.layout import ExpertLayout, slot_row_sizes
from pallas_kernels import route_topk, slot_place

_NEVER = jnp.iinfo(jnp.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotCache:
    gate_SR: jax.Array  # [S, F*D] expert rows (bytes when quantized)
    up_SR: jax.Array
    down_SR: jax.Array  # [S, D*F]
    slot_for_id: jax.Array  # int32 [L_moe * E]
    id_of_slot: jax.Array  # int32 [S]
    last_use: jax.Array  # int32 [S]; -1: never used
    clock: jax.Array  # int32 []
    hits_L: jax.Array  # int32 [L_moe], cumulative distinct-expert hits per MoE layer
    misses_L: jax.Array  # int32 [L_moe], cumulative fetches per MoE layer
    routed_LN: jax.Array  # int32 [L_moe, max_batch * k]: flat ids each layer needed last step (-1 pad)
    last_routed: jax.Array  # int32 [L_moe * E]: clock when each expert was last routed to (-1: never)
    cpu_L: jax.Array  # int32 [L_moe], cumulative misses computed on the CPU (strategy "hybrid")

    @property
    def num_slots(self) -> int:
        return self.id_of_slot.shape[0]

    def with_(self, **kw) -> SlotCache:
        return dataclasses.replace(self, **kw)


def init_slot_cache(cfg: MoEModelConfig, slots: int, max_batch: int, dtype) -> SlotCache:
    L, E = cfg.num_moe_layers, cfg.num_experts
    dt = ExpertLayout.of(cfg).bank_dtype(dtype)
    gate, up, down = (jnp.zeros((slots, r), dt) for r in slot_row_sizes(cfg))  # as wide as the widest layer's rows
    return SlotCache(
        gate, up, down,
        jnp.full((L * E,), -1, jnp.int32), jnp.full((slots,), -1, jnp.int32), jnp.full((slots,), -1, jnp.int32),
        jnp.zeros((), jnp.int32), jnp.zeros((L,), jnp.int32), jnp.zeros((L,), jnp.int32),
        jnp.full((L, max_batch * cfg.top_k), -1, jnp.int32),
        jnp.full((L * E,), -1, jnp.int32), jnp.zeros((L,), jnp.int32),
    )  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FetchPlan:
    """What a layer must bring in: expert `src_N` of the layer into slot `dst_N` where `valid_N`."""

    src_N: jax.Array
    dst_N: jax.Array
    valid_N: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerMisses:
    """A layer's routed entries [N = T·k] against the cache as it was: which are the first valid
    occurrence of their expert, which miss and will be fetched (`miss`), which misses stay in
    host RAM (`to_cpu`) and which entries those experts' computation leaves on the CPU."""

    flat: jax.Array  # int32 [N] flat expert ids
    valid: jax.Array  # bool [N]
    first: jax.Array  # bool [N]
    slot: jax.Array  # int32 [N] slot before this layer (-1: not resident)
    miss: jax.Array  # bool [N]: fetched into a victim slot
    to_cpu: jax.Array  # bool [N]: misses left in host RAM (first occurrences)
    on_cpu: jax.Array  # bool [N]: every entry of an expert left in host RAM


def find_misses(
    c: SlotCache, moe_layer: int, ids_TK: jax.Array, valid_T: jax.Array, num_experts: int, q=None, overhead: float = 0.0
) -> LayerMisses:
    """What a layer's routing misses and (with `q`, strategy "hybrid") which misses the CPU
    computes: only `fetch_count(M, q)` of the M misses, the most recently routed ones, are
    fetched. Touches no state: a hybrid step starts the CPU job from this and places the fetched
    misses (`place_misses`) while the CPU computes. Requires S ≥ T·k."""
    T, K = ids_TK.shape
    N = T * K
    flat = moe_layer * num_experts + ids_TK.reshape(N).astype(jnp.int32)
    valid = jnp.repeat(valid_T != 0, K)
    slot = c.slot_for_id[flat]
    first, miss, _ = slot_place.misses_of(slot, flat, valid)
    to_cpu = on_cpu = jnp.zeros_like(miss)
    if q is not None:
        to_cpu, on_cpu, miss = slot_place.cpu_share(flat, valid, miss, c.last_routed[flat], q, overhead)
    return LayerMisses(flat, valid, first, slot, miss, to_cpu, on_cpu)


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """What a layer's `place_misses` leaves for `record_stats`: the state no later layer of the
    step reads (its counters, the ids it was routed, when), written for every layer at once at
    the step's end — one update per array a step instead of one per layer."""

    layer: int
    clock: jax.Array  # int32 []: the layer's clock value
    counts: jax.Array  # int32 [3]: distinct experts found resident, fetched, left to the CPU
    flat: jax.Array  # int32 [N]: its entries' flat ids
    valid: jax.Array  # bool [N]
    victim: jax.Array | None = None  # int32 [N]: with `StepVictims`, the slot each entry was fetched into (S: none)
    used: jax.Array | None = None  # int32 [N]: with `StepVictims`, the slot each entry was computed from (S: none)


def victim_kernel(n: int) -> bool:
    """Whether a layer chooses its n victims by `pallas_kernels/route_topk.top_k` (one kernel)
    rather than `lax.top_k`, which XLA compiles as a sort of every slot: FREETOKEN_VICTIM_TOPK=
    "kernel" (for n up to its `TOP_K_MAX`); "xla" (the default: on the H200 the kernel decoded
    level with it within the rows' spread, benchmarks/RESULTS.md 2026-12-04)."""
    return env_choice("FREETOKEN_VICTIM_TOPK", "xla", ("xla", "kernel")) == "kernel" and n <= route_topk.TOP_K_MAX


def _least_recent(last_use_S: jax.Array, n: int) -> jax.Array:
    """The slots of the n smallest `last_use_S`, smallest first (ties: the lower slot)."""
    if victim_kernel(n):
        return route_topk.top_k(-last_use_S[None], n, interpret=jax.default_backend() == "cpu")[1][0]
    return jax.lax.top_k(-last_use_S, n)[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepVictims:
    """A decode step's victims from one sort (`step_victims`) instead of one per layer. A slot a
    layer uses gets the clock of that layer, later than every slot no layer of the step has used
    yet (`keep_buffer` advances the clock too), so each layer's least recently used slots not in
    use are the first slots of the step-start LRU order that no earlier layer used and this one
    does not need. With W = (layers + 1)·N of them in that order, the layers never run out: the
    earlier layers used at most (layers − 1)·N, this one needs at most N, and N more remain. As
    the untouched slots keep their step-start ids and clocks, `id_of_slot` and `last_use` are
    written once, at the step's end (`record_stats`)."""

    slot_W: jax.Array  # int32 [W]: the W least recently used slots at the step's start, in order
    fresh_W: jax.Array  # int32 [W]: 1 where no earlier layer of the step used it


def step_victims(c: SlotCache, layers: int, N: int) -> StepVictims | None:
    """The step's victim candidates for `layers` MoE layers of N routed entries each, or None
    where the cache has fewer than (layers + 1)·N slots (each layer then sorts its own). For the
    placement kernel they are padded once here (`slot_place.pad_candidates`), rather than by every
    layer."""
    W = (layers + 1) * N
    if c.num_slots < W:
        return None
    slot_W, fresh_W = _least_recent(c.last_use, W), jnp.ones((W,), jnp.int32)
    if place_kernel(N, W):
        slot_W, fresh_W = slot_place.pad_candidates(slot_W, fresh_W)
    return StepVictims(slot_W, fresh_W)


def place_kernel(N: int, W: int) -> bool:
    """Whether a layer places its misses by `pallas_kernels/slot_place.place` (one kernel) rather
    than the same computation as XLA compiles it (about nine small kernels), for N entries and W
    candidate slots (FREETOKEN_SLOT_PLACE): "kernel" where it fits (`slot_place.fits`), "xla", or
    "auto" (unset) — the kernel on a GPU where it fits."""
    how = env_choice("FREETOKEN_SLOT_PLACE", "auto", ("auto", "xla", "kernel"))
    on = how == "kernel" or (how == "auto" and jax.default_backend() == "gpu")
    return on and slot_place.fits(N, W)


def place_misses(c: SlotCache, moe_layer: int, m: LayerMisses, num_experts: int, T: int, K: int, sv: StepVictims | None = None):
    """Chooses least-recently-used victims for the fetched misses among the slots this layer does
    not need and updates the maps and clocks. Returns the new cache, each entry's slot [T, k] (0
    for entries on the CPU), the fetch plan, the layer's `LayerStats` (for `record_stats`) and,
    given the step's `StepVictims`, those left for the next layer (then `id_of_slot` and
    `last_use` are left to `record_stats` as well). Without them the layer sorts every slot for
    its candidates: the N least recently used not in use (empty slots first; ties by index)."""
    # The per-slot updates are comparisons of every slot with the layer's N entries ([S, N]) and
    # selects, not scatters: elementwise work XLA fuses with its neighbours instead of one
    # scatter kernel each.
    N, S = T * K, c.num_slots
    flat, valid, slot, miss = m.flat, m.valid, m.slot, m.miss
    resident = slot >= 0
    needed = valid & resident
    s_S1 = jnp.arange(S, dtype=jnp.int32)[:, None]
    if sv is None:
        in_use = jnp.any((slot[None, :] == s_S1) & needed[None, :], axis=1)
        sv_layer = StepVictims(_least_recent(jnp.where(in_use, _NEVER, c.last_use), N), jnp.ones((N,), jnp.int32))
    else:
        sv_layer = sv
    args = (c.slot_for_id, c.id_of_slot, flat, slot, needed, miss, valid & ~m.on_cpu, sv_layer.slot_W, sv_layer.fresh_W)
    if place_kernel(N, sv_layer.slot_W.shape[0]):
        slot_for_id, victim, slots_N, used_N, fresh_W = slot_place.place(*args, interpret=jax.default_backend() == "cpu")
    else:
        slot_for_id, victim, slots_N, used_N, fresh_W = slot_place.place_ref(*args)
    slots_TK = slots_N.reshape(T, K)
    counts = jnp.stack([jnp.sum(m.first & resident), jnp.sum(miss), jnp.sum(m.to_cpu)]).astype(jnp.int32)
    stats = LayerStats(moe_layer, c.clock, counts, flat, valid)
    plan = FetchPlan(flat - moe_layer * num_experts, jnp.where(miss, victim, 0), miss)
    if sv is not None:
        stats = dataclasses.replace(stats, victim=victim, used=used_N)
        return c.with_(slot_for_id=slot_for_id, clock=c.clock + 1), slots_TK, plan, stats, StepVictims(sv.slot_W, fresh_W)
    filled = victim[None, :] == s_S1  # [S, N]: slot s takes entry n's expert (victims are distinct)
    id_of_slot = jnp.where(jnp.any(filled, axis=1), jnp.sum(jnp.where(filled, flat[None, :], 0), axis=1), c.id_of_slot)
    last_use = jnp.where(jnp.any(used_N[None, :] == s_S1, axis=1), c.clock, c.last_use)
    new = c.with_(slot_for_id=slot_for_id, id_of_slot=id_of_slot, last_use=last_use, clock=c.clock + 1)
    return new, slots_TK, plan, stats, None


def place_layer(c: SlotCache, moe_layer: int, ids_TK: jax.Array, valid_T: jax.Array, num_experts: int, sv: StepVictims, q=None,
                overhead: float = 0.0):  # fmt: skip
    """`find_misses` and `place_misses` with the step's `StepVictims` in one kernel
    (`slot_place.place_layer`; for the layers `place_kernel` gives it): the same results as
    theirs, and each entry's `on_cpu` [T, k] (given `q`: strategy "hybrid")."""
    T, K = ids_TK.shape
    N = T * K
    valid = jnp.repeat(valid_T != 0, K)
    ids = ids_TK.reshape(N)
    slot_for_id, victim, dst, miss, slots, used, on_cpu, fresh_W, counts = slot_place.place_layer(
        c.slot_for_id, c.id_of_slot, ids, valid, sv.slot_W, sv.fresh_W, c.last_routed, q, base=moe_layer * num_experts,
        overhead=overhead, interpret=jax.default_backend() == "cpu",
    )  # fmt: skip
    flat = moe_layer * num_experts + ids.astype(jnp.int32)
    stats = LayerStats(moe_layer, c.clock, counts[:3], flat, valid, victim, used)
    plan = FetchPlan(ids, dst, miss)
    new = c.with_(slot_for_id=slot_for_id, clock=c.clock + 1)
    return new, slots.reshape(T, K), plan, stats, StepVictims(sv.slot_W, fresh_W), on_cpu.reshape(T, K) != 0


def record_stats(c: SlotCache, stats: list[LayerStats]) -> SlotCache:
    """The layers' `LayerStats` written into the cache: cumulative counters, `routed_LN` and
    `last_routed`."""
    if not stats:
        return c
    layers = jnp.asarray([s.layer for s in stats], jnp.int32)
    counts = jnp.stack([s.counts for s in stats])
    W = c.routed_LN.shape[1]
    routed = jnp.stack([jnp.where(s.valid, s.flat, -1) for s in stats])[:, :W]  # the ids each layer was routed
    routed = jnp.pad(routed, ((0, 0), (0, W - routed.shape[1])), constant_values=-1)
    oob = c.last_routed.shape[0]
    ids = jnp.concatenate([jnp.where(s.valid, s.flat, oob) for s in stats])
    when = jnp.concatenate([jnp.broadcast_to(s.clock, s.flat.shape) for s in stats])
    c = _write_slots(c, [s for s in stats if s.victim is not None])
    return c.with_(
        hits_L=c.hits_L.at[layers].add(counts[:, 0]),
        misses_L=c.misses_L.at[layers].add(counts[:, 1]),
        cpu_L=c.cpu_L.at[layers].add(counts[:, 2]),
        routed_LN=c.routed_LN.at[layers].set(routed),
        last_routed=c.last_routed.at[ids].set(when, mode="drop"),
    )


def _write_slots(c: SlotCache, stats: list[LayerStats]) -> SlotCache:
    """`id_of_slot` and `last_use` after layers that chose victims from `StepVictims`: each slot
    is a victim at most once a step, and a slot used by several layers keeps the latest clock."""
    if not stats:
        return c
    victim = jnp.concatenate([s.victim for s in stats])
    used = jnp.concatenate([s.used for s in stats])
    when = jnp.concatenate([jnp.broadcast_to(s.clock, s.used.shape) for s in stats])
    flat = jnp.concatenate([s.flat for s in stats])
    return c.with_(
        id_of_slot=c.id_of_slot.at[victim].set(flat, mode="drop"),
        last_use=c.last_use.at[used].max(when, mode="drop"),
    )


def borrow_for_prefill(c: SlotCache, num_experts: int) -> tuple[SlotCache, jax.Array]:
    """Lends prefill two layer buffers of E slots each, [2, E]: the 2E least recently used slots
    (empty ones first), emptied — the experts they held leave the maps, so the maps stay a
    bijection whatever prefill writes there. Requires S ≥ 2E."""
    n = 2 * num_experts
    _, bufs = jax.lax.top_k(-c.last_use, n)
    held = c.id_of_slot[bufs]
    oob = c.slot_for_id.shape[0]
    c = c.with_(
        slot_for_id=c.slot_for_id.at[jnp.where(held >= 0, held, oob)].set(-1, mode="drop"),
        id_of_slot=c.id_of_slot.at[bufs].set(-1),
        last_use=c.last_use.at[bufs].set(-1),
    )
    return c, bufs.reshape(2, num_experts)


def keep_buffer(c: SlotCache, buf_E: jax.Array, moe_layer: int) -> SlotCache:
    """After prefill: buffer `buf_E` holds every expert of `moe_layer`; each one not resident
    elsewhere becomes resident there (used now), the others leave their buffer slot empty."""
    E, S = buf_E.shape[0], c.num_slots
    ids = moe_layer * E + jnp.arange(E, dtype=jnp.int32)
    free = c.slot_for_id[ids] < 0
    oob = c.slot_for_id.shape[0]
    return c.with_(
        slot_for_id=c.slot_for_id.at[jnp.where(free, ids, oob)].set(buf_E, mode="drop"),
        id_of_slot=c.id_of_slot.at[jnp.where(free, buf_E, S)].set(ids, mode="drop"),
        last_use=c.last_use.at[jnp.where(free, buf_E, S)].set(c.clock, mode="drop"),
        clock=c.clock + 1,  # later than the slots kept, as `StepVictims` needs
    )
