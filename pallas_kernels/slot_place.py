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


def _kernel(sfi_ref, ios_ref, flat_ref, slot_ref, needed_ref, miss_ref, gpu_ref, sw_ref, fw_ref,
            out_ref, victim_ref, slots_ref, used_ref, fresh_ref, *, S: int):  # fmt: skip
    del sfi_ref  # aliased with out_ref: written in place, never read
    flat, slot, slot_W = flat_ref[...], slot_ref[...], sw_ref[...]
    needed, miss, on_gpu, fresh_W = (r[...] != 0 for r in (needed_ref, miss_ref, gpu_ref, fw_ref))
    victim = _victims(slot, needed, miss, slot_W, fresh_W, S)
    evicted = _evicted(ios_ref, victim, miss, S)
    _scatter(out_ref, evicted, jnp.full(evicted.shape, -1, jnp.int32), evicted >= 0)
    _scatter(out_ref, flat, victim, miss)
    slots, used, fresh = _after(flat, slot, miss, on_gpu, victim, slot_W, fresh_W, S)
    victim_ref[...], slots_ref[...], used_ref[...] = victim, slots, used
    fresh_ref[...] = fresh.astype(jnp.int32)


def place(slot_for_id, id_of_slot, flat, slot, needed, miss, on_gpu, slot_W, fresh_W, *, interpret: bool = False,
          num_warps: int = NUM_WARPS):  # fmt: skip
    """(slot_for_id', victim [N], slots [N], used [N], fresh_W' [W]) — module docstring. Entries
    and candidates are padded to powers of two with ones that change nothing."""
    N, W, S = flat.shape[0], slot_W.shape[0], id_of_slot.shape[0]
    if not fits(N, W):
        raise ValueError(f"{N} entries × {W} candidates exceed one program's {MAX_PAIRS} pairs")
    Np, Wp = pl.next_power_of_2(N), pl.next_power_of_2(W)
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    pad = lambda a, n, v: jnp.pad(i32(a), (0, n - a.shape[0]), constant_values=v)  # noqa: E731
    ins = (
        slot_for_id, id_of_slot, pad(flat, Np, 0), pad(slot, Np, -1), pad(needed, Np, 0), pad(miss, Np, 0), pad(on_gpu, Np, 0),
        pad(slot_W, Wp, -2), pad(fresh_W, Wp, 0),
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
    return out, victim[:N], slots[:N], used[:N], fresh[:W] != 0


def place_ref(slot_for_id, id_of_slot, flat, slot, needed, miss, on_gpu, slot_W, fresh_W):
    """Reference: the same computation in jnp, the scatter as one `.at[].set`."""
    S = id_of_slot.shape[0]
    victim = _victims(slot, needed, miss, slot_W, fresh_W, S)
    evicted = _evicted(id_of_slot, victim, miss, S)
    oob = slot_for_id.shape[0]
    out = slot_for_id.at[jnp.concatenate([jnp.where(evicted >= 0, evicted, oob), jnp.where(miss, flat, oob)])].set(
        jnp.concatenate([jnp.full(evicted.shape, -1, jnp.int32), victim.astype(jnp.int32)]), mode="drop"
    )
    slots, used, fresh = _after(flat, slot, miss, on_gpu, victim, slot_W, fresh_W, S)
    return out, victim, slots, used, fresh
