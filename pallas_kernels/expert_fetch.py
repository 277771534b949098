"""Expert fetch: copy whole expert rows from host banks into device slots, in place.

`fetch_rows_many(banks, slots, src_N, dst_N, valid_N)` writes row `banks[k][src[i]]` into
`slots[k][dst[i]]` for every bank k and every i with `valid[i]`, in one kernel, and returns the
slot arrays (aliased to their inputs: under `jit` with the slots donated, nothing else is
copied). `fetch_rows` is the one-bank case. On the GPU the banks live in `pinned_host` memory
and the kernel's loads go over PCIe straight from them; on the CPU backend (interpret mode) the
banks are in the default memory kind. `fetch_rows_ref` is the jnp reference.

Grid: (expert i, chunk j of `block` contiguous elements of one bank's row; the banks' chunks
follow one another along j); each program moves one chunk, so a fetch of N experts runs
N × ΣR / block programs in parallel, and the kinds of weight of a layer (gate, up, down) move
in one launch instead of three. Blocks are powers of two (the GPU lowering needs them) no longer
than the shortest row; a row whose length the block does not divide (nvfp4's float32 trailer, fp8's
scale tiles) ends in one chunk placed at its last `block` elements, overlapping the one before
with the same values, so that every row moves in full-size chunks whatever its length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import call_params

BLOCK_ELEMS = 8192
NUM_WARPS = 4


def fetch_rows_ref(bank_ER, slots_SR, src_N, dst_N, valid_N):
    """Reference: the same copy with jnp (bank in the default memory kind). A bank's rows may be
    narrower than the slots' (a layer whose format is smaller): they fill each slot row's start."""
    S = slots_SR.shape[0]
    dst = jnp.where(valid_N, dst_N, S)  # out of range: dropped
    return slots_SR.at[dst, : bank_ER.shape[1]].set(bank_ER[src_N], mode="drop")


def block_size(R: int, target: int) -> int:
    """Largest power of two at most R and at most `target`."""
    b = 1
    while 2 * b <= min(R, target):
        b *= 2
    return b


def _kernel(src_ref, dst_ref, valid_ref, *refs, block: int, rows: tuple[int, ...]):
    K = len(rows)
    banks, outs = refs[:K], refs[2 * K :]  # refs[K:2K]: the slot inputs, aliased to outs
    i, j = pl.program_id(0), pl.program_id(1)
    valid = valid_ref[i] != 0
    start = 0
    for k, R in enumerate(rows):
        c = -(-R // block)  # chunks 0 .. c-2 at multiples of block, chunk c-1 at R - block

        @pl.when(valid & (j >= start) & (j < start + c - 1))
        def _(k=k, start=start):
            s, d, off = src_ref[i], dst_ref[i], (j - start) * block
            outs[k][d, pl.ds(off, block)] = banks[k][s, pl.ds(off, block)]

        @pl.when(valid & (j == start + c - 1))
        def _(k=k, R=R):
            s, d = src_ref[i], dst_ref[i]
            outs[k][d, pl.ds(R - block, block)] = banks[k][s, pl.ds(R - block, block)]

        start += c


@functools.partial(jax.jit, static_argnames=("interpret", "block_elems", "num_warps"), donate_argnums=(1,))
def fetch_rows(bank_ER, slots_SR, src_N, dst_N, valid_N, *, interpret: bool = False, block_elems: int = BLOCK_ELEMS,
               num_warps: int = NUM_WARPS):  # fmt: skip
    return fetch_rows_unjitted(bank_ER, slots_SR, src_N, dst_N, valid_N, interpret=interpret, block_elems=block_elems,
                               num_warps=num_warps)  # fmt: skip


def fetch_rows_unjitted(bank_ER, slots_SR, src_N, dst_N, valid_N, **kw):
    """`fetch_rows` for use inside an enclosing jit (which donates the slots)."""
    return fetch_rows_many((bank_ER,), (slots_SR,), src_N, dst_N, valid_N, **kw)[0]


def fetch_rows_many(banks, slots, src_N, dst_N, valid_N, *, interpret: bool = False, block_elems: int = BLOCK_ELEMS,
                    num_warps: int = NUM_WARPS) -> tuple:  # fmt: skip
    """Every bank's rows `src` into its slot array's rows `dst`, in one kernel, for use inside an
    enclosing jit (which donates the slots)."""
    banks, slots = tuple(banks), tuple(slots)
    if not banks or len(banks) != len(slots):
        raise ValueError(f"{len(banks)} banks for {len(slots)} slot arrays")
    for b, s in zip(banks, slots):
        if b.ndim != 2 or s.ndim != 2 or b.shape[1] > s.shape[1] or b.dtype != s.dtype:
            raise ValueError(f"bank {b.shape} {b.dtype} and slots {s.shape} {s.dtype} disagree")
    if not src_N.shape == dst_N.shape == valid_N.shape or src_N.ndim != 1:
        raise ValueError("src, dst and valid must be vectors of one length")
    K, N = len(banks), src_N.shape[0]
    # Blocks cover each bank row (a row narrower than its slot fills the slot row's start).
    rows = tuple(b.shape[1] for b in banks)
    block = block_size(min(rows), block_elems)
    chunks = sum(-(-R // block) for R in rows)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return tuple(
        pl.pallas_call(
            functools.partial(_kernel, block=block, rows=rows),
            grid=(N, chunks),
            in_specs=[any_spec] * (3 + 2 * K),
            out_specs=[any_spec] * K,
            out_shape=[jax.ShapeDtypeStruct(s.shape, s.dtype) for s in slots],
            input_output_aliases={3 + K + k: k for k in range(K)},
            name="expert_fetch",
            **call_params(interpret, num_warps),
        )(src_N.astype(jnp.int32), dst_N.astype(jnp.int32), valid_N.astype(jnp.int32), *banks, *slots)
    )
