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


def test_plain_sampler_draws_the_filtered_samplers_token_without_filters():
    """`sample_plain` (the engine's decode step: no sort) gives, row by row, the token `sample`
    draws with top-k, top-p and min-p off — greedy rows and sampling rows, bf16 and float32
    logits — so a row's tokens do not depend on whether its batch took the path with filters;
    and a row's draw is the same beside rows that filter."""
    from freetoken_jax.runtime.sampling import sample_plain

    rng = np.random.default_rng(0)
    B, V = 64, 1000
    seeds = jnp.asarray(rng.integers(0, 2**31, B), jnp.uint32)
    pos = jnp.asarray(rng.integers(0, 4096, B), jnp.int32)
    temp = jnp.asarray(np.where(np.arange(B) % 5 == 0, 0.0, rng.uniform(0.3, 2.0, B)), jnp.float32)
    off_k, off_p = jnp.zeros(B, jnp.int32), jnp.ones(B, jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        logits = jnp.asarray(rng.standard_normal((B, V)) * 3, dtype)
        plain = np.asarray(jax.jit(sample_plain)(logits, seeds, pos, temp))
        np.testing.assert_array_equal(plain, np.asarray(jax.jit(sample)(logits, seeds, pos, temp, off_k, off_p)))
        assert len(set(plain.tolist())) > B // 2  # sampled rows differ
        mixed_p = jnp.where(jnp.arange(B) % 2 == 1, 0.5, 1.0)  # odd rows filter; even rows must not change
        mixed = np.asarray(jax.jit(sample)(logits, seeds, pos, temp, off_k, mixed_p))
        np.testing.assert_array_equal(mixed[::2], plain[::2])


def test_plain_sampler_follows_softmax():
    from freetoken_jax.runtime.sampling import sample_plain

    n = 20000
    f = jax.jit(jax.vmap(lambda s: sample_plain(LOGITS, s[None], jnp.zeros(1, jnp.int32), jnp.ones(1))[0]))
    freq = np.bincount(np.asarray(f(jnp.arange(n, dtype=jnp.uint32))), minlength=6) / n
    p = np.asarray(jax.nn.softmax(LOGITS[0]))
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() * (1 - p.max()) / n)


def test_rows_with_filters_take_the_sorting_sampler():
    from freetoken_jax.runtime.sampling import GenerationParams

    assert not GenerationParams(temperature=0.7).filters and not GenerationParams(top_p=0.5).filters  # greedy: no filter applies
    assert GenerationParams(temperature=0.7, top_p=0.9).filters and GenerationParams(temperature=1.0, top_k=40).filters
    assert not GenerationParams(temperature=0.7, top_p=0.9).processed  # one step, not the two halves
