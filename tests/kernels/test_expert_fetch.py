"""The Pallas fetch kernel (interpret mode) against its jnp reference, over shapes and dtypes."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.expert_fetch import block_size, fetch_rows, fetch_rows_many, fetch_rows_ref


@pytest.mark.parametrize("E,S,R,N", [(6, 4, 96, 3), (16, 8, 1536, 8), (3, 3, 7, 3), (10, 5, 64, 1), (8, 12, 4096, 6)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("block_elems", [8, 8192])
def test_fetch_matches_reference(E, S, R, N, dtype, block_elems):
    rng = np.random.default_rng(E * 1000 + R + N)
    bank = rng.standard_normal((E, R)).astype(dtype)
    slots = rng.standard_normal((S, R)).astype(dtype)
    src = rng.integers(0, E, N).astype(np.int32)
    dst = rng.permutation(S)[:N].astype(np.int32)
    valid = rng.random(N) < 0.7
    want = np.asarray(fetch_rows_ref(jnp.asarray(bank), jnp.asarray(slots), jnp.asarray(src), jnp.asarray(dst), jnp.asarray(valid)))
    got = np.asarray(
        fetch_rows(
            jnp.asarray(bank),
            jnp.asarray(slots),
            jnp.asarray(src),
            jnp.asarray(dst),
            jnp.asarray(valid),
            interpret=True,
            block_elems=block_elems,
        )
    )
    np.testing.assert_array_equal(got, want)
    # Rows not fetched keep their old contents; fetched ones equal the bank's rows exactly.
    for s in range(S):
        hit = np.flatnonzero((dst == s) & valid)
        np.testing.assert_array_equal(got[s], bank[src[hit[0]]] if hit.size else slots[s])


@pytest.mark.parametrize("rows", [(96, 96, 96), (1536, 768, 64), (7, 14), (4096,), (100, 52, 77), (8196, 8197)])
@pytest.mark.parametrize("block_elems", [8, 8192])
def test_fetch_many_matches_reference_per_bank(rows, block_elems):
    """Banks of one layer (row lengths may differ) move in one kernel; each must equal its own
    one-bank reference, and no bank's chunks may land in another's slots."""
    E, S, N = 9, 6, 5
    rng = np.random.default_rng(sum(rows) + block_elems)
    banks = [rng.standard_normal((E, R)).astype(ml_dtypes.bfloat16) for R in rows]
    slots = [rng.standard_normal((S, R)).astype(ml_dtypes.bfloat16) for R in rows]
    src = rng.integers(0, E, N).astype(np.int32)
    dst = rng.permutation(S)[:N].astype(np.int32)
    valid = np.array([1, 0, 1, 1, 0], bool)
    args = [jnp.asarray(a) for a in (src, dst, valid)]
    got = fetch_rows_many([jnp.asarray(b) for b in banks], [jnp.asarray(s) for s in slots], *args, interpret=True,
                          block_elems=block_elems)  # fmt: skip
    assert len(got) == len(rows)
    for b, s, g in zip(banks, slots, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(fetch_rows_ref(jnp.asarray(b), jnp.asarray(s), *args)))


def test_fetch_many_rejects_unpaired_banks():
    with pytest.raises(ValueError, match="banks for"):
        fetch_rows_many([jnp.zeros((4, 8))] * 2, [jnp.zeros((2, 8))], jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                        jnp.ones(1, bool), interpret=True)  # fmt: skip


def test_block_size_is_the_largest_power_of_two_that_fits():
    """Whatever a row's length (nvfp4's rows end in a 4-byte scale: 884 740 bytes at [768, 2048]),
    its chunks are full-size blocks, not the largest power of two dividing it."""
    for R, want in ((7, 4), (96, 64), (1536, 1024), (884_740, 8192), (1_573_248, 8192), (4096, 4096), (1, 1)):
        assert block_size(R, 8192) == want


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError):
        fetch_rows(
            jnp.zeros((4, 8)), jnp.zeros((2, 6)), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1, bool), interpret=True
        )


@pytest.mark.parametrize("block_elems", [8, 8192])
def test_narrower_banks_fill_the_start_of_wider_slot_rows(block_elems):
    """A layer whose format is smaller than the widest layer's: its rows land at the start of
    the slot rows and the rest of each slot row keeps what it held (a plain loop is the model)."""
    E, S = 7, 5
    rng = np.random.default_rng(block_elems)
    banks = [rng.integers(0, 255, (E, w), dtype=np.uint8) for w in (144, 210)]
    slots = [rng.integers(0, 255, (S, w), dtype=np.uint8) for w in (176, 210)]
    src, dst, valid = np.array([3, 6, 0], np.int32), np.array([4, 0, 2], np.int32), np.array([1, 1, 0], bool)
    got = fetch_rows_many([jnp.asarray(b) for b in banks], [jnp.asarray(s) for s in slots], jnp.asarray(src), jnp.asarray(dst),
                          jnp.asarray(valid), interpret=True, block_elems=block_elems)  # fmt: skip
    for b, s, g in zip(banks, slots, got):
        want = s.copy()
        for i in range(3):
            if valid[i]:
                want[dst[i], : b.shape[1]] = b[src[i]]
        np.testing.assert_array_equal(np.asarray(g), want)
        np.testing.assert_array_equal(np.asarray(fetch_rows_ref(jnp.asarray(b), jnp.asarray(s), jnp.asarray(src), jnp.asarray(dst),
                                                                jnp.asarray(valid))), want)  # fmt: skip
