"""Decode's 4-bit expert kernels (interpret mode) against float64 and their jnp reference, over
shapes; their lowering to Triton for the GPU (checked here, without one); and the engine's
"kernel" expert implementation against "gather"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from freetoken_jax.config import ACTIVATIONS
from freetoken_jax.models.routed import kernel_fits, routed_experts
from freetoken_jax.quant.formats import get_format
from freetoken_jax.quant.layout import ExpertLayout
from pallas_kernels import Stacked
from pallas_kernels.gathered_experts import ACTS, FORMATS, _pieces, experts, experts_ref


def _slots(rng, S, F, D, extra=0, fmt="q4_0"):
    """gate, up, down slots of S experts in `fmt` (rows `extra` bytes wider than the matrices)
    and their dequantized float64 matrices."""
    Q = get_format(fmt)
    out, mats = [], []
    for o, i in ((F, D), (F, D), (D, F)):  # the numpy references: nothing to compile per shape
        b = np.stack([Q.quantize_ref(w) for w in rng.standard_normal((S, o, i)).astype(np.float32) * 0.3])
        mats.append(np.stack([Q.dequantize_ref(r, o, i) for r in b]).astype(np.float64))
        out.append(np.concatenate([b, rng.integers(0, 256, (S, extra), dtype=np.uint8)], axis=1))
    return out, mats


def _float64(x, ids, w, mats, act):
    g, u, d = (m[ids] for m in mats)
    x = np.asarray(x, np.float64)
    gx, ux = np.einsum("tkfd,td->tkf", g, x), np.einsum("tkfd,td->tkf", u, x)
    h = np.asarray(act(jnp.asarray(gx, jnp.float32), jnp.asarray(ux, jnp.float32)), np.float64)
    return np.einsum("tkdf,tkf,tk->td", d, h, np.asarray(w, np.float64))


SHAPES = [(5, 64, 96, 1, 3), (7, 96, 64, 2, 2), (9, 128, 768, 1, 4)]  # S, F, D, T, K (F = 32: test_rows_per_program_...)
# every format on every shape with silu; the other activations with q4_0 on the first shape
CASES = [(f, s, "silu") for f in FORMATS for s in SHAPES] + [("q4_0", SHAPES[0], a) for a in ACTS if a != "silu"]


@pytest.mark.parametrize("fmt,shape,act", CASES)
def test_kernels_match_float64_and_reference(fmt, shape, act):
    S, F, D, T, K = shape
    rng = np.random.default_rng(S * F + D + T * K)
    (g, u, d), mats = _slots(rng, S, F, D, extra=5, fmt=fmt)
    x = rng.standard_normal((T, D)).astype(np.float32)
    ids = rng.integers(0, S, (T, K)).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    f = ACTIVATIONS[act]
    # 16 rows a program (interpret mode runs programs one by one); other counts: test_rows_per_program_...
    got = np.asarray(experts(fmt, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), g, u, d, F=F, D=D, act=f, interpret=True,
                             block_rows=16))  # fmt: skip
    want = _float64(x, ids, w, mats, f)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    ref = np.asarray(experts_ref(fmt, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), g, u, d, F=F, D=D, act=f))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("shape", SHAPES)
def test_q4_0_words_kernels_match_float64_and_the_bytes_kernels(shape):
    """q4_0 slots given as their 16-bit words (`Format.words`) go through `_words_dot`, whose
    row runs (216 words: 128, 64, 16, 8) straddle blocks: the result is float64's and the bytes
    kernels' within float32 sums."""
    S, F, D, T, K = shape
    rng = np.random.default_rng(S + F * D + K)
    slots, mats = _slots(rng, S, F, D, extra=6)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, S, (T, K)), jnp.int32)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    f, words = ACTIVATIONS["silu"], [get_format("q4_0").words(jnp.asarray(a)) for a in slots]
    got = np.asarray(experts("q4_0", x, ids, w, *words, F=F, D=D, act=f, interpret=True, block_rows=16))
    want = _float64(x, ids, w, mats, f)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    as_bytes = np.asarray(experts("q4_0", x, ids, w, *slots, F=F, D=D, act=f, interpret=True, block_rows=16))
    np.testing.assert_allclose(got, as_bytes, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    ref = np.asarray(experts_ref("q4_0", x, ids, w, *words, F=F, D=D, act=f))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_bf16_hidden_rounded_as_the_reference_and_weight_zero_pairs_add_nothing():
    """h is rounded to x's dtype (bf16) as the XLA path rounds it; a pair of weight 0 whose slot
    holds bytes that decode to non-finite values (0xFF: NaN scales) adds nothing: the output is
    finite and equals the reference without those pairs (to bf16's rounding of the sum)."""
    rng = np.random.default_rng(3)
    S, F, D, T = 6, 64, 128, 2
    (g, u, d), _ = _slots(rng, S, F, D)
    for a in (g, u, d):
        a[5] = 0xFF
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    ids = jnp.asarray([[0, 5, 2], [5, 1, 3]], jnp.int32)
    w = jnp.asarray([[0.5, 0.0, 0.25], [0.0, 0.7, 0.3]], jnp.float32)
    f = ACTIVATIONS["silu"]
    got = experts("q4_0", x, ids, w, g, u, d, F=F, D=D, act=f, interpret=True)
    assert got.dtype == jnp.bfloat16 and np.isfinite(np.asarray(got, np.float32)).all()
    keep = jnp.asarray([[0, 2], [1, 3]], jnp.int32), jnp.asarray([[0.5, 0.25], [0.7, 0.3]], jnp.float32)
    want = experts_ref("q4_0", x, *keep, g, u, d, F=F, D=D, act=f)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt,act,words", [("q4_0", a, False) for a in ACTS] + [("mxfp4", "silu", False), ("q4_0", "silu", True)])
def test_kernels_lower_to_triton_for_the_gpu(fmt, act, words):
    """The Pallas → Triton lowering runs here without a GPU (the GPU compiles the Triton IR)."""
    sds = jax.ShapeDtypeStruct
    slot = sds((100, 884736 // 2), jnp.uint16) if words else sds((100, 884736), jnp.uint8)
    args = (sds((1, 2048), jnp.bfloat16), sds((1, 8), jnp.int32), sds((1, 8), jnp.float32)) + (slot,) * 3
    exp = export.export(jax.jit(lambda *a: experts(fmt, *a, F=768, D=2048, act=ACTIVATIONS[act])), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)  # fmt: skip
    text, tag = exp.mlir_module(), fmt + ("_words" if words else "")
    assert text.count("__gpu$xla.gpu.triton") == 2 and f"{tag}_gate_up" in text and f"{tag}_down" in text


def test_bad_shapes_raise():
    z = jnp.zeros((4, 2000), jnp.uint8)
    f = ACTIVATIONS["silu"]
    with pytest.raises(ValueError, match="no expert kernels for format 'q8_0'"):
        experts("q8_0", jnp.zeros((1, 64)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), z, z, z, F=64, D=64, act=f, interpret=True)
    with pytest.raises(ValueError, match="whole blocks"):
        experts("q4_0", jnp.zeros((1, 48)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), z, z, z, F=64, D=48, act=f, interpret=True)
    with pytest.raises(ValueError, match="cannot hold"):
        experts("q4_0", jnp.zeros((1, 128)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), z, z, z, F=64, D=128, act=f, interpret=True)


def test_engine_kernel_impl_equals_gather_and_refuses_what_it_cannot_compute():
    rng = np.random.default_rng(11)
    S, F, D = 12, 64, 96
    (g, u, d), _ = _slots(rng, S, F, D)
    layout = ExpertLayout(("q4_0",) * 3, F, D, "silu")
    x = jnp.asarray(rng.standard_normal((2, D)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, S, (2, 4)), jnp.int32)
    w = jnp.asarray(rng.random((2, 4)), jnp.float32)
    banks = tuple(jnp.asarray(a) for a in (g, u, d))
    got = routed_experts(x, ids, w, banks, layout, impl="kernel")
    want = routed_experts(x, ids, w, banks, layout, impl="gather")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))
    # entry 1 of layers' stacked banks (entry 0 another layer's), read in place
    stacks = tuple(Stacked(jnp.stack([jnp.flip(b, 0), b]), 1) for b in banks)
    got = routed_experts(x, ids, w, stacks, layout, impl="kernel")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))
    assert not kernel_fits(ExpertLayout(("q8_0",) * 3, F, D, "silu"))
    assert not kernel_fits(ExpertLayout(("q4_0",) * 3, F, D, "gelu"))
    assert not kernel_fits(layout, bias=(0.0, 0.0, 0.0))
    assert kernel_fits(ExpertLayout(("mxfp4",) * 3, F, D, "silu"))
    with pytest.raises(ValueError, match="experts without biases"):
        routed_experts(x, ids, w, banks, ExpertLayout(("q4_0",) * 3, F, D, "gelu"), impl="kernel")


@pytest.mark.parametrize("block_rows,num_warps", [(1, 2), (16, 8)])
def test_rows_per_program_do_not_change_the_result(block_rows, num_warps):
    rng = np.random.default_rng(block_rows)
    (g, u, d), mats = _slots(rng, 5, 32, 64)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    ids, w = np.array([[4, 1, 4]], np.int32), np.array([[0.2, 0.5, 0.3]], np.float32)
    f = ACTIVATIONS["silu"]
    got = np.asarray(experts("q4_0", jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), g, u, d, F=32, D=64, act=f, interpret=True,
                                  block_rows=block_rows, num_warps=num_warps))  # fmt: skip
    want = _float64(x, ids, w, mats, f)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_pieces_cover_the_blocks_in_powers_of_two():
    for nb in (1, 3, 24, 48, 64, 96, 100):
        got = _pieces(nb)
        assert sum(n for _, n in got) == nb and all(n & (n - 1) == 0 for _, n in got)
        assert [b for b, _ in got] == [sum(n for _, n in got[:i]) for i in range(len(got))]
