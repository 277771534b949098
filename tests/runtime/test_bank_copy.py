"""The copy stream's FFI pair (`runtime/bank_copy.py`, cpu_ext/src/ffi_bank_copy.cc) on the CPU
backend: a started bank arrives whole, in its dtype and shape, wherever the wait is placed; a
bank is registered once; a buffer of the wrong size is refused."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from freetoken_jax.runtime import bank_copy


@pytest.mark.parametrize(
    "shape, dtype",
    [((1, 1), np.uint8), ((3, 37), np.uint8), ((8, 1024), np.uint16), ((5, 96), ml_dtypes.bfloat16), ((2, 3, 7), np.float32)],
)
def test_started_banks_arrive_whole(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    banks = [rng.integers(0, 200, shape).astype(dtype) for _ in range(3)]

    @jax.jit
    def step(x):
        copies = [bank_copy.start(b, x) for b in banks]  # all in flight at once
        x, _ = jax.lax.optimization_barrier((x, tuple(c.token for c in copies)))
        y = x * 2
        return [bank_copy.wait(c, y) for c in copies], y

    got, y = step(jnp.arange(4.0))
    for g, b in zip(got, banks):
        assert g.dtype == b.dtype and g.shape == b.shape
        np.testing.assert_array_equal(np.asarray(g), b)
    np.testing.assert_array_equal(np.asarray(y), np.arange(4.0) * 2)


def test_a_bank_has_one_handle_and_the_copy_checks_its_size(monkeypatch):
    a, b = np.zeros((4, 8), np.uint8), np.ones((4, 8), np.uint8)
    assert bank_copy.register(a) == bank_copy.register(a) != bank_copy.register(b)
    with pytest.raises(ValueError, match="contiguous"):
        bank_copy.register(np.zeros((4, 8), np.uint8)[:, ::2])
    copy = bank_copy.InFlight(jnp.zeros((4, 4), np.uint8), bank_copy.register(a), jnp.zeros((1,), jnp.int32))
    with pytest.raises(Exception, match="has 32 bytes; the device buffer 16"):
        jax.block_until_ready(jax.jit(lambda buf: bank_copy.wait(bank_copy.InFlight(buf, copy.handle, copy.token), buf))(copy.buf))
    assert bank_copy.copy_engine() == "xla"  # the default
    monkeypatch.setenv("FREETOKEN_PREFILL_COPY_ENGINE", "dma")
    with pytest.raises(ValueError, match="FREETOKEN_PREFILL_COPY_ENGINE"):
        bank_copy.copy_engine()
