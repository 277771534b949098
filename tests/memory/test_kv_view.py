"""`KVView.block_mask` and `entries_read` (what a many-token step's blocked attention reads
block by block) against slices of the whole mask, for tables in position order and for rings,
with windows, a limit below each row's chunk and padding tokens."""

import jax.numpy as jnp
import numpy as np
import pytest

from freetoken_jax.memory.kv_cache import KVView


@pytest.mark.parametrize("kind", ["table", "ring"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("below", [False, True])
def test_block_masks_are_slices_of_the_mask(kind, window, below):
    rng = np.random.default_rng(len(kind) + window + below)
    B, T, page, P = 3, 6, 4, 9
    starts = np.array([0, 11, 27])
    positions = jnp.asarray(np.stack([np.arange(s, s + T) for s in starts]), jnp.int32)
    valid = jnp.asarray(np.arange(T)[None] < np.array([[6], [2], [0]]))  # a full chunk, a short one, a row of padding
    table = jnp.asarray(rng.permutation(np.arange(1, 1 + B * P)).reshape(B, P), jnp.int32)
    view = KVView.build(positions, valid, table, page) if kind == "table" else KVView.ring(positions, valid, table, page)
    lim = positions[:, 0] if below else None
    whole = np.array(view.mask(window))
    if below:
        whole &= np.asarray(view.cached_pos_BS)[:, None, :] < starts[:, None, None]
    S, W = whole.shape[2], 8
    padded = np.concatenate([whole, np.zeros((B, T, W), bool)], axis=2)
    for lo in range(0, S + 1, 4):  # every block start, one past the table
        got = np.asarray(view.block_mask(jnp.int32(lo), W, window, lim))
        np.testing.assert_array_equal(got, padded[:, :, lo : lo + W], err_msg=f"lo={lo}")
    read = np.flatnonzero(whole.any(axis=(0, 1)))
    last = int(read.max()) + 1 if read.size else 0
    got = int(view.entries_read(lim))
    assert got >= last and (window or got == last)  # exact without a window; never short of the last entry read
