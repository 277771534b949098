"""The slot placement kernel (interpret mode on the CPU backend, Triton on a GPU) against its jnp
reference and a plain-Python model over layers drawn from random caches (entries and candidates
of sizes that are not powers of two, repeated experts, hybrid's entries left to the CPU, layers
without misses); the whole offload layer's kernel (`place_layer`) against its reference and
`find_misses` then `place`; their lowering to one Triton call; and how a layer chooses them (the
whole step through them: tests/runtime/test_offload.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_kernel_choice, random_slot_cache
from jax import export

from freetoken_jax.memory import slot_cache
from freetoken_jax.memory.slot_cache import find_misses
from pallas_kernels.slot_place import MAX_PAIRS, fits, place, place_layer, place_layer_ref, place_ref

INTERPRET = jax.default_backend() == "cpu"


def _layer(rng, L, E, S, T, K, W):
    """`place`'s arguments for a layer of a random consistent cache, the candidates W random
    distinct slots with random freshness."""
    c = random_slot_cache(rng, L, E, S, T * K)
    layer = int(rng.integers(0, L))
    valid = jnp.asarray(rng.integers(0, 2, T), jnp.int32).at[0].set(1)
    q = [None, 0.0, 0.5, 1.0][int(rng.integers(0, 4))]
    m = find_misses(c, layer, jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32), valid, E, q)
    slot_W = jnp.asarray(rng.permutation(S)[:W], jnp.int32)
    fresh_W = jnp.asarray(rng.random(W) < 0.8)
    return (c.slot_for_id, c.id_of_slot, m.flat, m.slot, m.valid & (m.slot >= 0), m.miss, m.valid & ~m.on_cpu, slot_W, fresh_W)


def _model(args):
    """Plain Python: victims in candidate order among the free ones, the maps, slots, freshness."""
    sfi, ios, flat, slot, needed, miss, on_gpu, slot_W, fresh_W = (np.asarray(a).tolist() for a in args)
    S = len(ios)
    in_use = {s for s, n in zip(slot, needed) if n}
    free = [w for w, f in zip(slot_W, fresh_W) if f and w not in in_use]
    victim, sfi, taken = [S] * len(flat), list(sfi), 0
    for n, is_miss in enumerate(miss):
        if is_miss:
            victim[n] = free[taken]
            taken += 1
            if ios[victim[n]] >= 0:
                sfi[ios[victim[n]]] = -1
            sfi[flat[n]] = victim[n]
    slots = [sfi[f] if g else 0 for f, g in zip(flat, on_gpu)]
    used = [sfi[f] if g else S for f, g in zip(flat, on_gpu)]
    fresh = [f and w not in used for w, f in zip(slot_W, fresh_W)]
    return sfi, victim, slots, used, fresh


@pytest.mark.parametrize("T,K,W", [(1, 8, 200), (3, 2, 13), (4, 8, 40), (1, 1, 5), (2, 6, 100)])
def test_kernel_equals_reference_and_model(T, K, W):
    rng = np.random.default_rng(T * 100 + K * 10 + W)
    L, E = 4, 64
    misses = 0
    for trial in range(4):
        S = int(rng.integers(max(W, T * K) + T * K, 3 * L * E))
        args = _layer(rng, L, E, S, T, K, W)
        got = jax.jit(lambda *a: place(*a, interpret=INTERPRET))(*args)
        ref = place_ref(*args)
        for g, r, w in zip(got, ref, _model(args)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=str(trial))
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(trial))
        misses += int(np.sum(args[5]))
    assert misses > 0


@pytest.mark.parametrize("T,K,W", [(1, 8, 200), (3, 2, 13), (2, 6, 100)])
def test_layer_kernel_equals_find_misses_then_place(T, K, W):
    """`place_layer` = `place_layer_ref` = `find_misses` then `place`, with the fetch plan's
    destinations, the entries left to the CPU and the layer's counts, over random caches,
    validity and repeated ids, without a CPU share and with one (q, the handoff's overhead)."""
    rng = np.random.default_rng(T * 100 + K * 10 + W + 1)
    L, E = 4, 64
    fetched = left = 0
    for trial in range(5):  # every (q, overhead) once
        q, overhead = [(None, 0.0), (0.0, 0.0), (0.5, 0.0), (0.37, 1.4), (1.0, 0.6)][trial % 5]
        S = int(rng.integers(max(W, T * K) + T * K, 3 * L * E))
        c = random_slot_cache(rng, L, E, S, T * K)
        layer = int(rng.integers(0, L))
        ids = jnp.asarray(rng.integers(0, E if trial % 2 else 6, (T, K)), jnp.int32)  # odd trials: few distinct ids
        valid_T = jnp.asarray(rng.integers(0, 2, T), jnp.int32).at[0].set(1)
        slot_W, fresh_W = jnp.asarray(rng.permutation(S)[:W], jnp.int32), jnp.asarray(rng.random(W) < 0.8, jnp.int32)
        valid = jnp.repeat(valid_T != 0, K)
        args = (c.slot_for_id, c.id_of_slot, ids.reshape(-1), valid, slot_W, fresh_W) + ((c.last_routed, q) if q is not None else ())
        kw = dict(base=layer * E, overhead=overhead)
        got = jax.jit(functools.partial(place_layer, **kw, interpret=INTERPRET))(*args)
        ref = place_layer_ref(*args, **kw)
        m = find_misses(c, layer, ids, valid_T, E, q, overhead)
        on_gpu = m.valid & ~m.on_cpu
        out, victim, slots, used, fresh = place(c.slot_for_id, c.id_of_slot, m.flat, m.slot, m.valid & (m.slot >= 0), m.miss, on_gpu,
                                                slot_W, fresh_W, interpret=INTERPRET)  # fmt: skip
        counts = [int(jnp.sum(m.first & (m.slot >= 0))), int(jnp.sum(m.miss)), int(jnp.sum(m.to_cpu)), 0]
        two = (out, victim, jnp.where(m.miss, victim, 0), m.miss, slots, used, m.on_cpu, fresh, counts)
        for g, r, w in zip(got, ref, two):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=str(trial))
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w).astype(np.int32), err_msg=str(trial))
        fetched, left = fetched + counts[1], left + counts[2]
    assert fetched > 0 and left > 0


def test_a_layer_without_misses_changes_no_map():
    rng = np.random.default_rng(3)
    args = list(_layer(rng, 2, 8, 40, 2, 2, 12))
    args[5] = jnp.zeros_like(args[5])  # no miss
    sfi, victim, *_ = place(*args, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(sfi), np.asarray(args[0]))
    assert (np.asarray(victim) == 40).all()


def test_lowers_to_one_triton_call():
    i = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    b = lambda *s: jax.ShapeDtypeStruct(s, jnp.bool_)  # noqa: E731
    exp = export.export(
        jax.jit(lambda *a: place(*a)), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    )(i(3072), i(847), i(8), i(8), b(8), b(8), b(8), i(200), b(200))
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "slot_place" in text and "stablehlo.scatter" not in text
    exp = export.export(
        jax.jit(lambda *a: place_layer(*a, base=128)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(i(3072), i(847), i(8), b(8), i(256), i(256))
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "slot_place_layer" in text
    assert "stablehlo.scatter" not in text and "stablehlo.gather" not in text and "stablehlo.pad" not in text
    exp = export.export(  # with hybrid's CPU share, q traced
        jax.jit(lambda *a: place_layer(*a, base=128, overhead=1.4)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(i(3072), i(847), i(8), b(8), i(256), i(256), i(3072), jax.ShapeDtypeStruct((), jnp.float32))
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.gather" not in text


def test_how_a_layer_places(monkeypatch):
    """FREETOKEN_SLOT_PLACE: "auto" takes the kernel on a GPU, "kernel" on any backend, where the
    entries and candidates fit one program; XLA's computation otherwise; bad names raise."""
    assert fits(8, 200) and not fits(64, 1600) and fits(1, MAX_PAIRS) and not fits(2, MAX_PAIRS)
    want = {
        ("auto", "gpu"): (True, False),
        ("auto", "cpu"): (False, False),
        ("xla", "gpu"): (False, False),
        ("kernel", "cpu"): (True, False),
    }
    choose = lambda: (slot_cache.place_kernel(8, 200), slot_cache.place_kernel(64, 1600))  # noqa: E731
    check_kernel_choice(monkeypatch, "FREETOKEN_SLOT_PLACE", want, choose, "scatter")
