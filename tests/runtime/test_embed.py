"""The decode step is a pure function that users can put inside their own jit and lax.scan."""

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax import DecodeBatch, DecodeState, PrefillBatch, Sampling, decode_step, prefill_step
from freetoken_jax.memory.kv_cache import init_cache


def test_decode_step_in_user_scan(demo_engine):
    engine = demo_engine
    prompt = [256, 72, 101, 108, 108, 111]
    want = list(engine.generate(prompt, max_new_tokens=12, ignore_eos=True))

    cfg = engine.engine_config
    cache = init_cache(engine.model_config, cfg, jnp.float32)  # the user's own KV cache
    table = jnp.asarray([np.arange(1, cfg.pages_per_sequence + 1)], jnp.int32)
    T = 8
    batch = PrefillBatch(
        jnp.asarray([prompt + [0] * (T - len(prompt))], jnp.int32),
        jnp.arange(T, dtype=jnp.int32)[None],
        jnp.asarray([[True] * len(prompt) + [False] * (T - len(prompt))]),
        table,
        Sampling.greedy(1),
    )

    @jax.jit
    def user_program(weights, cache):
        first, cache = prefill_step(weights, cache, batch)
        state = DecodeState(cache, first, jnp.asarray([len(prompt)], jnp.int32))
        step_batch = DecodeBatch(table, jnp.asarray([True]), Sampling.greedy(1))

        def body(state, _):
            tok, state = decode_step(weights, state, step_batch)
            return state, tok[0]

        state, toks = jax.lax.scan(body, state, None, length=11)
        return jnp.concatenate([first, toks]), state.cache

    toks, cache = user_program(engine.weights, cache)
    assert np.asarray(toks).tolist() == want


def test_decode_step_has_no_conditional(demo_engine):
    """XLA's GPU runtime waits on the host for a conditional's predicate, which would keep a
    step's call from returning before the step is done (no next step queued meanwhile)."""
    engine = demo_engine
    table = jnp.zeros((2, engine.engine_config.pages_per_sequence), jnp.int32)
    cache = init_cache(engine.model_config, engine.engine_config, jnp.float32)
    state = DecodeState(cache, jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.int32))
    text = jax.jit(decode_step).lower(engine.weights, state, DecodeBatch(table, jnp.ones((2,), bool), Sampling.greedy(2))).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_weights_flatten_to_their_arrays(demo_engine):
    """jit flattens a step's arguments at every call: the weights must be one tuple of arrays
    (no per-variable nodes of an `nnx.State`), and `params` gives back the state they came from."""
    from flax import nnx

    from freetoken_jax import Weights

    w = demo_engine.weights
    leaves, treedef = jax.tree.flatten(w)
    assert treedef.num_nodes == len(leaves) + 2  # the Weights node, its tuple, the arrays
    assert all(isinstance(a, jax.Array) for a in leaves)
    again = Weights.of(w.params, w.graphdef)
    assert again.treedef == w.treedef and all(a is b for a, b in zip(again.leaves, w.leaves))
    params = nnx.state(w.model())
    assert jax.tree.structure(params) == w.treedef
    assert all(a is b for a, b in zip(jax.tree.leaves(params), w.leaves))
