"""Expert fetch: copy whole expert rows from a host bank into device slots, in place.

`fetch_rows(bank_ER, slots_SR, src_N, dst_N, valid_N)` writes row `bank[src[i]]` into
`slots[dst[i]]` for every i with `valid[i]`, and returns the slot array (aliased to its input:
under `jit` with the slots donated, nothing else is copied). On the GPU the bank lives in
`pinned_host` memory and the kernel's loads go over PCIe straight from it; on the CPU backend
(interpret mode) the bank is in the default memory kind. `fetch_rows_ref` is the jnp reference.

Grid: (expert i, chunk j of `block` contiguous elements of its row); each program moves one
chunk, so a fetch of N experts runs N × R / block programs in parallel. Blocks are powers of two
(the GPU lowering needs them) dividing the row length R.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def fetch_rows_ref(bank_ER, slots_SR, src_N, dst_N, valid_N):
    """Reference: the same copy with jnp (bank in the default memory kind)."""
    S = slots_SR.shape[0]
    dst = jnp.where(valid_N, dst_N, S)  # out of range: dropped
    return slots_SR.at[dst].set(bank_ER[src_N], mode="drop")


def block_size(R: int, target: int) -> int:
    """Largest power of two dividing R and at most `target`."""
    b = 1
    while R % (2 * b) == 0 and 2 * b <= target:
        b *= 2
    return b


def _kernel(src_ref, dst_ref, valid_ref, bank_ref, slots_in_ref, slots_ref, *, block: int):
    del slots_in_ref  # aliased to slots_ref
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(valid_ref[i] != 0)
    def _():
        s, d = src_ref[i], dst_ref[i]
        slots_ref[d, pl.ds(j * block, block)] = bank_ref[s, pl.ds(j * block, block)]


@functools.partial(jax.jit, static_argnames=("interpret", "block_elems"), donate_argnums=(1,))
def fetch_rows(bank_ER, slots_SR, src_N, dst_N, valid_N, *, interpret: bool = False, block_elems: int = 8192):
    return fetch_rows_unjitted(bank_ER, slots_SR, src_N, dst_N, valid_N, interpret=interpret, block_elems=block_elems)


def fetch_rows_unjitted(bank_ER, slots_SR, src_N, dst_N, valid_N, *, interpret: bool = False, block_elems: int = 8192):
    """`fetch_rows` for use inside an enclosing jit (which donates the slots)."""
    if bank_ER.ndim != 2 or bank_ER.shape[1:] != slots_SR.shape[1:] or bank_ER.dtype != slots_SR.dtype:
        raise ValueError(f"bank {bank_ER.shape} {bank_ER.dtype} and slots {slots_SR.shape} {slots_SR.dtype} disagree")
    if not src_N.shape == dst_N.shape == valid_N.shape or src_N.ndim != 1:
        raise ValueError("src, dst and valid must be vectors of one length")
    N, R = src_N.shape[0], slots_SR.shape[1]
    block = block_size(R, block_elems)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, block=block),
        grid=(N, R // block),
        in_specs=[any_spec] * 5,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct(slots_SR.shape, slots_SR.dtype),
        input_output_aliases={4: 0},
        interpret=interpret,
        name="expert_fetch",
    )(src_N.astype(jnp.int32), dst_N.astype(jnp.int32), valid_N.astype(jnp.int32), bank_ER, slots_SR)
