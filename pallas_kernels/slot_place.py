"""A decode layer's fetched misses placed in victim slots, in one kernel.

`place(slot_for_id, id_of_slot, flat, slot, needed, miss, on_gpu, slot_W, fresh_W)` is the part
of `memory.slot_cache.place_misses` that follows `find_misses` and the choice of candidate slots
(the step's one sort, `StepVictims`, or the layer's own): for a layer's N entries (flat expert ids `flat`, their slot before the
layer `slot` or -1, `needed`: valid and resident, `miss`: fetched, `on_gpu`: computed from a slot)
and W candidate slots in LRU order (`slot_W`, `fresh_W`: no earlier layer of the step used them),

    free[w]   = fresh[w] and no needed entry sits in slot_W[w],
    victim[n] = the rank(n)-th free candidate for the rank(n)-th miss (S where n is no miss),
    slot_for_id: each victim's old id (`id_of_slot`) → -1, each missed id → its victim,
    slots[n]  = the entry's slot after the layer (0 where not on_gpu), used[n] the same or S,
    fresh[w]  = fresh[w] and no used entry sits in slot_W[w].

XLA runs this as about nine small kernels a layer (reductions over [N, W], a cumulative sum as a
reduce-window, the selects, a copy of `slot_for_id` and its scatter); here one program holds the
[N, W] comparisons in registers and scatters into `slot_for_id` in place (aliased). It fits where
N·W (both padded to powers of two) is at most `MAX_PAIRS`. `place_ref` is the jnp reference,
the computation XLA runs elsewhere.

`place_layer(slot_for_id, id_of_slot, ids, valid, slot_W, fresh_W, base=)` is a whole layer's
choice in the same one program: `find_misses`' part too (each id's first valid occurrence, its
slot before the layer read from `slot_for_id` itself, the misses; given `q`, strategy "hybrid",
which misses the CPU computes: `cpu_share`) and the fetch plan's destinations, from the router's
ids as they come (`base` + id is the flat id). `slot_for_id` then has no other reader in the
layer, so XLA keeps it in place instead of copying it before the kernel. `place_layer_ref` is its
jnp reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import call_params

MAX_PAIRS = 1 << 15  # N·W (padded) in one program's registers
NUM_WARPS = 4


def fits(N: int, W: int) -> bool:
    return pl.next_power_of_2(N) * pl.next_power_of_2(W) <= MAX_PAIRS


def _any(m, axis: int):
    """`jnp.any` as a maximum (Triton lowers no reduce_or)."""
    return jnp.max(m.astype(jnp.int32), axis=axis) > 0


def fetch_count(M, q, overhead: float = 0.0):
    """How many of M misses to fetch when a fraction q should go over PCIe: ⌊qM⌋ or ⌊qM⌋+1,
    whichever makes the later of the two sides (F·(1−q) on the GPU, (M−F)·q on the CPU, both in
    units of M/(Bp+Bh)) finish sooner. `overhead` is the CPU handoff's fixed cost per layer in
    units of one expert's PCIe fetch time; with it, all M are fetched when that is sooner than
    paying the handoff (where the handoff is dear, a lone miss is then fetched, and cached,
    rather than sent to the CPU at every step)."""
    M = jnp.asarray(M, jnp.int32)
    lo = jnp.floor(M * q).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, M)
    cost = lambda F: jnp.maximum(F * (1 - q), (M - F) * q + jnp.where(F < M, overhead * (1 - q), 0.0))  # noqa: E731
    best = jnp.where(cost(hi) < cost(lo), hi, lo)
    return jnp.where(cost(M) <= cost(best), M, best) if overhead else best


def cpu_share(flat, valid, miss, recent, q, overhead: float = 0.0):
    """Strategy "hybrid": of the misses, the `fetch_count(M, q)` most recently routed (`recent`:
    each miss's last routing clock; ties to the earlier entry) are fetched and the rest left in
    host RAM. (to_cpu: misses left there, on_cpu: every entry of their experts, the misses fetched)."""
    n = jnp.arange(flat.shape[0])
    recent = jnp.where(miss, recent, -2)
    ahead = miss[None, :] & ((recent[None, :] > recent[:, None]) | ((recent[None, :] == recent[:, None]) & (n[None, :] < n[:, None])))
    rank = jnp.sum(ahead.astype(jnp.int32), axis=1)  # among misses, most recently routed first
    to_cpu = miss & (rank >= fetch_count(jnp.sum(miss.astype(jnp.int32)), q, overhead))
    same = (flat[:, None] == flat[None, :]) & valid[None, :]
    on_cpu = valid & _any(same & to_cpu[None, :], 1)  # entries whose expert stays in host RAM
    return to_cpu, on_cpu, miss & ~to_cpu


def first_valid(flat, valid):
    """Each valid entry that is the first valid occurrence of its id."""
    n = jnp.arange(flat.shape[0])
    earlier = (flat[:, None] == flat[None, :]) & valid[None, :] & (n[None, :] < n[:, None])
    return valid & ~_any(earlier, 1)


def _victims(slot, needed, miss, slot_W, fresh_W, S: int):
    """Each miss's victim (S: none) among the free candidates; the kernel's and the reference's."""
    free = fresh_W & ~_any((slot[None, :] == slot_W[:, None]) & needed[None, :], 1)
    at = jnp.cumsum(free.astype(jnp.int32)) - 1  # the free candidates' ranks, in LRU order
    rank = jnp.cumsum(miss.astype(jnp.int32)) - 1  # each miss takes the rank-th victim
    take = free[None, :] & (at[None, :] == rank[:, None]) & miss[:, None]  # [N, W]
    return jnp.where(miss, jnp.sum(jnp.where(take, slot_W[None, :], 0), axis=1), S)


def _evicted(id_of_slot, victim, miss, S: int):
    """The id each victim held (-1: none), from an array or a kernel's ref. The evicted ids
    (resident elsewhere) and the missed ones (not resident) never coincide."""
    return jnp.where(miss, id_of_slot[jnp.clip(victim, 0, S - 1)], -1)


def _after(flat, slot, miss, on_gpu, victim, slot_W, fresh_W, S: int):
    """Each entry's slot after the layer (0 off the GPU), the slots used (S: none) and the
    candidates still fresh. An entry that repeats a missed expert takes that miss's victim."""
    same = (flat[:, None] == flat[None, :]) & miss[None, :]  # [N, N]
    filled = jnp.sum(jnp.where(same, victim[None, :], 0), axis=1)
    now = jnp.where(_any(same, 1), filled, slot)
    slots = jnp.where(on_gpu, now, 0)
    used = jnp.where(on_gpu, now, S)
    fresh = fresh_W & ~_any(slot_W[:, None] == used[None, :], 1)
    return slots, used, fresh


def _scatter(ref, idx, val, on):
    """ref[idx] = val at the lanes `on` (their idx distinct). The other lanes write the same
    element and value as one lane that is on, so that no lane writes an element's old value
    (interpret mode's masked store does, and lanes repeat an expert's id); where no lane is on
    none writes."""
    i0 = jnp.max(jnp.where(on, idx, -1))
    v0 = jnp.sum(jnp.where(on & (idx == i0), val, 0))
    plt.store(ref.at[jnp.where(on, idx, jnp.maximum(i0, 0))], jnp.where(on, val, v0), mask=jnp.broadcast_to(i0 >= 0, on.shape))


def _place_into(out_ref, ios_ref, flat, slot, needed, miss, on_gpu, slot_W, fresh_W, S: int):
    """The kernels' shared part: the victims, both scatters into `slot_for_id` (`out_ref`) and
    (victim, slots, used, fresh)."""
    victim = _victims(slot, needed, miss, slot_W, fresh_W, S)
    evicted = _evicted(ios_ref, victim, miss, S)
    _scatter(out_ref, evicted, jnp.full(evicted.shape, -1, jnp.int32), evicted >= 0)
    _scatter(out_ref, flat, victim, miss)
    return (victim, *_after(flat, slot, miss, on_gpu, victim, slot_W, fresh_W, S))


def _kernel(sfi_ref, ios_ref, flat_ref, slot_ref, needed_ref, miss_ref, gpu_ref, sw_ref, fw_ref,
            out_ref, victim_ref, slots_ref, used_ref, fresh_ref, *, S: int):  # fmt: skip
    del sfi_ref  # aliased with out_ref: written in place, never read
    flat, slot, slot_W = flat_ref[...], slot_ref[...], sw_ref[...]
    needed, miss, on_gpu, fresh_W = (r[...] != 0 for r in (needed_ref, miss_ref, gpu_ref, fw_ref))
    victim, slots, used, fresh = _place_into(out_ref, ios_ref, flat, slot, needed, miss, on_gpu, slot_W, fresh_W, S)
    victim_ref[...], slots_ref[...], used_ref[...] = victim, slots, used
    fresh_ref[...] = fresh.astype(jnp.int32)


def misses_of(slot, flat, valid):
    """A layer's entries against the slots they held before it (`slot`, -1: none): (each id's first
    valid occurrence, the misses among those, the valid entries already resident) — what
    `find_misses` and `place_layer` find before any CPU share."""
    first = first_valid(flat, valid)
    return first, first & (slot < 0), valid & (slot >= 0)


def _layer_kernel(*refs, S: int, base: int, hybrid: bool, overhead: float):
    sfi_ref, ios_ref, ids_ref, valid_ref, sw_ref, fw_ref, *refs = refs
    lr_ref, q_ref, *refs = refs if hybrid else (None, None, *refs)
    out_ref, victim_ref, dst_ref, miss_ref, slots_ref, used_ref, fresh_ref, cpu_ref, counts_ref = refs
    del sfi_ref  # aliased with out_ref: read and written through it
    flat, slot_W = ids_ref[...] + base, sw_ref[...]
    valid, fresh_W = valid_ref[...] != 0, fw_ref[...] != 0
    slot = out_ref[flat]  # every store below depends on every lane's slot (reductions), so follows these loads
    first, miss, needed = misses_of(slot, flat, valid)
    to_cpu = on_cpu = jnp.zeros_like(miss)
    if hybrid:
        to_cpu, on_cpu, miss = cpu_share(flat, valid, miss, lr_ref[flat], jnp.sum(q_ref[...]), overhead)
    victim, slots, used, fresh = _place_into(out_ref, ios_ref, flat, slot, needed, miss, valid & ~on_cpu, slot_W, fresh_W, S)
    victim_ref[...], dst_ref[...], miss_ref[...] = victim, jnp.where(miss, victim, 0), miss.astype(jnp.int32)
    slots_ref[...], used_ref[...], fresh_ref[...], cpu_ref[...] = slots, used, fresh.astype(jnp.int32), on_cpu.astype(jnp.int32)
    count = lambda m: jnp.sum(m.astype(jnp.int32))  # noqa: E731
    hits, fetched, left = count(first & (slot >= 0)), count(miss), count(to_cpu)
    i = jnp.arange(4)
    counts_ref[...] = jnp.where(i == 0, hits, jnp.where(i == 1, fetched, jnp.where(i == 2, left, 0)))


def place_layer(slot_for_id, id_of_slot, ids, valid, slot_W, fresh_W, last_routed=None, q=None, *, base: int, overhead: float = 0.0,
                interpret: bool = False, num_warps: int = NUM_WARPS):  # fmt: skip
    """(slot_for_id', victim, dst, miss, slots, used, on_cpu [N], fresh_W' [W], counts [4]) of a
    layer: `ids` [N] the router's expert ids (`base` + id the flat id), `valid` [N] its entries
    (nonzero: valid), `slot_W`/`fresh_W` the candidates (`StepVictims`); given `q` (a float,
    traced or not) with `last_routed` and `overhead`, strategy "hybrid"'s CPU share
    (`cpu_share`). `dst`: the fetch plan's destination (victim, 0 where no miss); `miss`,
    `on_cpu` (entries computed on the CPU) and `fresh_W'` 0/1; `counts`: the distinct experts
    found resident, fetched and left to the CPU, then 0. Entries and candidates are padded as
    `place` pads them."""
    N, W, S = ids.shape[0], slot_W.shape[0], id_of_slot.shape[0]
    if not fits(N, W):
        raise ValueError(f"{N} entries × {W} candidates exceed one program's {MAX_PAIRS} pairs")
    hybrid = q is not None
    Np, Wp = pl.next_power_of_2(N), pl.next_power_of_2(W)
    ins = (slot_for_id, id_of_slot, _pad(ids, Np, 0), _pad(valid, Np, 0), *pad_candidates(slot_W, fresh_W))
    if hybrid:
        ins += (last_routed, jnp.asarray(q, jnp.float32).reshape(1))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out, victim, dst, miss, slots, used, fresh, on_cpu, counts = pl.pallas_call(
        functools.partial(_layer_kernel, S=S, base=base, hybrid=hybrid, overhead=float(overhead)),
        in_specs=[any_spec] * len(ins),
        out_specs=[any_spec] * 9,
        out_shape=[jax.ShapeDtypeStruct(slot_for_id.shape, jnp.int32)]
        + [jax.ShapeDtypeStruct((Np,), jnp.int32)] * 5
        + [jax.ShapeDtypeStruct((Wp,), jnp.int32), jax.ShapeDtypeStruct((Np,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)],
        input_output_aliases={0: 0},
        name="slot_place_layer",
        **call_params(interpret, num_warps),
    )(*ins)
    return out, victim[:N], dst[:N], miss[:N], slots[:N], used[:N], on_cpu[:N], fresh[:W], counts


def place_layer_ref(slot_for_id, id_of_slot, ids, valid, slot_W, fresh_W, last_routed=None, q=None, *, base: int,
                    overhead: float = 0.0):  # fmt: skip
    """Reference: `place_layer` in jnp."""
    flat, valid, fresh_W = ids.astype(jnp.int32) + base, valid != 0, fresh_W != 0
    slot = slot_for_id[flat]
    first, miss, needed = misses_of(slot, flat, valid)
    to_cpu = on_cpu = jnp.zeros_like(miss)
    if q is not None:
        to_cpu, on_cpu, miss = cpu_share(flat, valid, miss, last_routed[flat], jnp.asarray(q, jnp.float32), overhead)
    out, victim, slots, used, fresh = place_ref(slot_for_id, id_of_slot, flat, slot, needed, miss, valid & ~on_cpu, slot_W, fresh_W)
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    counts = jnp.stack([jnp.sum(first & (slot >= 0)), jnp.sum(miss), jnp.sum(to_cpu), 0]).astype(jnp.int32)
    return out, victim, jnp.where(miss, victim, 0), i32(miss), slots, used, i32(on_cpu), fresh, counts


def _pad(a, n: int, value: int):
    """`a` as int32, padded to n with `value` (nothing to do where it has n already)."""
    a = a.astype(jnp.int32)
    return a if a.shape[0] == n else jnp.pad(a, (0, n - a.shape[0]), constant_values=value)


def pad_candidates(slot_W, fresh_W):
    """The candidates as the kernels take them: int32, W padded to a power of two with slots that
    match no entry (-2) and are never fresh."""
    Wp = pl.next_power_of_2(slot_W.shape[0])
    return _pad(slot_W, Wp, -2), _pad(fresh_W, Wp, 0)


def place(slot_for_id, id_of_slot, flat, slot, needed, miss, on_gpu, slot_W, fresh_W, *, interpret: bool = False,
          num_warps: int = NUM_WARPS):  # fmt: skip
    """(slot_for_id', victim [N], slots [N], used [N], fresh_W' [W], 0/1) — module docstring. Entries
    and candidates are padded to powers of two with ones that change nothing."""
    N, W, S = flat.shape[0], slot_W.shape[0], id_of_slot.shape[0]
    if not fits(N, W):
        raise ValueError(f"{N} entries × {W} candidates exceed one program's {MAX_PAIRS} pairs")
    Np, Wp = pl.next_power_of_2(N), pl.next_power_of_2(W)
    ins = (
        slot_for_id, id_of_slot, _pad(flat, Np, 0), _pad(slot, Np, -1), _pad(needed, Np, 0), _pad(miss, Np, 0), _pad(on_gpu, Np, 0),
        *pad_candidates(slot_W, fresh_W),
    )  # fmt: skip
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out, victim, slots, used, fresh = pl.pallas_call(
        functools.partial(_kernel, S=S),
        in_specs=[any_spec] * len(ins),
        out_specs=[any_spec] * 5,
        out_shape=[jax.ShapeDtypeStruct(slot_for_id.shape, jnp.int32)]
        + [jax.ShapeDtypeStruct((Np,), jnp.int32)] * 3
        + [jax.ShapeDtypeStruct((Wp,), jnp.int32)],
        input_output_aliases={0: 0},
        name="slot_place",
        **call_params(interpret, num_warps),
    )(*ins)
    return out, victim[:N], slots[:N], used[:N], fresh[:W]


def place_ref(slot_for_id, id_of_slot, flat, slot, needed, miss, on_gpu, slot_W, fresh_W):
    """Reference: the same computation in jnp, the scatter as one `.at[].set`."""
    S, fresh_W = id_of_slot.shape[0], fresh_W != 0
    victim = _victims(slot, needed, miss, slot_W, fresh_W, S)
    evicted = _evicted(id_of_slot, victim, miss, S)
    oob = slot_for_id.shape[0]
    out = slot_for_id.at[jnp.concatenate([jnp.where(evicted >= 0, evicted, oob), jnp.where(miss, flat, oob)])].set(
        jnp.concatenate([jnp.full(evicted.shape, -1, jnp.int32), victim.astype(jnp.int32)]), mode="drop"
    )
    slots, used, fresh = _after(flat, slot, miss, on_gpu, victim, slot_W, fresh_W, S)
    return out, victim, slots, used, fresh.astype(jnp.int32)
