import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.runtime.sampling import sample

LOGITS = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], jnp.float32)


def draw(n, temperature=1.0, top_k=0, top_p=1.0, logits=LOGITS):
    f = jax.jit(
        jax.vmap(
            lambda s: sample(
                logits, s[None], jnp.zeros(1, jnp.int32), jnp.full(1, temperature), jnp.full(1, top_k, jnp.int32), jnp.full(1, top_p)
            )[0]
        )
    )
    return np.asarray(f(jnp.arange(n, dtype=jnp.uint32)))


def test_greedy_is_argmax():
    assert set(draw(50, temperature=0.0)) == {0}


def test_temperature_one_follows_softmax():
    n = 20000
    freq = np.bincount(draw(n), minlength=6) / n
    p = np.asarray(jax.nn.softmax(LOGITS[0]))
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() * (1 - p.max()) / n)


def test_top_k_restricts_support():
    got = draw(3000, top_k=2)
    assert set(got) == {0, 1}
    p = np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum()
    assert abs((got == 0).mean() - p[0]) < 0.04


def test_top_p_keeps_the_smallest_nucleus():
    p = np.asarray(jax.nn.softmax(LOGITS[0]))  # ~[0.57, 0.21, 0.13, ...]
    assert set(draw(3000, top_p=float(p[0]) - 0.01)) == {0}
    assert set(draw(3000, top_p=float(p[0] + p[1]) - 0.01)) == {0, 1}


def test_seeds_reproduce_and_differ():
    a, b = draw(200), draw(200)
    np.testing.assert_array_equal(a, b)
    assert len(set(a)) > 2
