"""Expert formats: numpy references round-trip within each format's error, the jnp quantizer and
dequantizer equal the references, q8_0 / q4_0 / mxfp4 bytes equal the `gguf` package's."""

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import random_blocks

from freetoken_jax.config import ConfigError, MoEModelConfig
from freetoken_jax.quant.formats import E2M1, FORMATS, _e2m1, get_format, small_ints

NAMES = sorted(FORMATS)


def weights(O, I, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((O, I)).astype(np.float32) * np.exp(rng.standard_normal((O, 1))).astype(np.float32)
    w[0, : min(I, 40)] = 0.0  # an all-zero block (scale 0)
    return w


def shapes(name):
    f = FORMATS[name]
    base = [(3, f.block), (5, 4 * f.block), (130, 2 * f.block)]
    return base + ([(7, 200), (129, 300)] if f.pads else [])  # fp8: inputs not a multiple of its block


@pytest.mark.parametrize("name", NAMES)
def test_reference_round_trip_error_is_within_the_format(name):
    f = get_format(name)
    for O, I in shapes(name):
        w = weights(O, I)
        b = f.quantize_ref(w)
        assert b.dtype == np.uint8 and b.shape == (f.nbytes(O, I),)
        back = f.dequantize_ref(b, O, I)
        assert back.shape == (O, I) and back.dtype == np.float64
        assert np.all(back[0, : min(I, 40) // f.block * f.block] == 0)
        # Per-row error bound: half a quantization step of the block scale (relative to the row's max).
        rel = np.abs(back - w).max(axis=1) / np.maximum(np.abs(w).max(axis=1), 1e-30)
        bound = {"q8_0": 0.5 / 127 + 1e-3, "q4_0": 1 / 8 + 1e-3, "mxfp4": 0.25, "nvfp4": 0.25, "fp8": 1 / 16, "q4_k": 0.1, "q5_k": 0.05,
                 "q6_k": 0.035}[name]  # fmt: skip
        assert rel.max() <= bound, (O, I, rel.max())


@pytest.mark.parametrize("name", NAMES)
def test_jnp_quantizer_and_dequantizer_equal_the_references(name):
    f = get_format(name)
    for O, I in shapes(name)[: 2 if f.block == 256 else None]:  # the K-quants' 256-wide blocks: two shapes
        w = np.stack([weights(O, I, s) for s in range(2)])  # a leading expert axis
        got = np.asarray(jax.jit(f.quantize)(jnp.asarray(w)))  # jitted as the engine calls them (one compile a shape)
        ref = np.stack([f.quantize_ref(x) for x in w])
        np.testing.assert_array_equal(got, ref)
        deq = np.asarray(jax.jit(f.dequantize, static_argnums=(1, 2))(jnp.asarray(ref), O, I))
        assert deq.shape == (2, O, I)
        np.testing.assert_array_equal(deq, np.stack([f.dequantize_ref(x, O, I) for x in ref]).astype(np.float32))


@pytest.mark.parametrize("name", NAMES)
def test_matvec_equals_float64_on_the_dequantized_weights(name):
    """`Format.matvec` (what a decode step's gathered experts compute) against float64: the
    reference dequantization times x, over a leading [tokens, experts] shape and the format's
    shapes (inputs that are not a multiple of the block where the format pads)."""
    f = get_format(name)
    rng = np.random.default_rng(1)
    for O, I in shapes(name)[: 2 if f.block == 256 else None]:
        b = np.stack([f.quantize_ref(weights(O, I, s)) for s in range(6)]).reshape(2, 3, -1)
        x = rng.standard_normal((2, 3, I)).astype(np.float32)
        got = np.asarray(jax.jit(f.matvec, static_argnums=(2, 3))(jnp.asarray(b), jnp.asarray(x), O, I))
        want = np.einsum(
            "tkoi,tki->tko", np.stack([f.dequantize_ref(r, O, I) for r in b.reshape(6, -1)]).reshape(2, 3, O, I), x.astype(np.float64)
        )
        scale = np.abs(np.stack([f.dequantize_ref(r, O, I) for r in b.reshape(6, -1)])).reshape(2, 3, O, I) @ np.abs(x)[..., None]
        assert got.shape == (2, 3, O)
        np.testing.assert_array_less(np.abs(got - want), 1e-5 * scale[..., 0] + 1e-30)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.int32, jnp.uint32])
def test_codes_made_floats_by_their_bits_are_exact(dtype):
    top = min(int(jnp.iinfo(dtype).max), (1 << 23) - 1)
    c = np.unique(np.concatenate([np.arange(min(top + 1, 4096)), np.linspace(0, top, 513).astype(np.int64)]))
    for minus in (0.0, 8.0, 128.0):
        got = np.asarray(small_ints(jnp.asarray(c, dtype), minus))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, c.astype(np.float64) - minus)


def test_e2m1_codes_made_floats_by_their_bits_equal_the_table():
    got = np.asarray(_e2m1(jnp.arange(16, dtype=jnp.uint8)))
    np.testing.assert_array_equal(got, np.asarray(E2M1, np.float32))
    np.testing.assert_array_equal(np.signbit(got), np.arange(16) >= 8)  # code 8 is -0


def test_q4_0_matvec_over_words_equals_float64():
    """q4_0 rows as 16-bit words (`Format.words`, how a GPU's decode reads them) give the float64
    product as the bytes do, over every shape of the sweep; only q4_0 rows of an even length
    have words."""
    f = get_format("q4_0")
    rng = np.random.default_rng(4)
    for O, I in shapes("q4_0"):
        b = np.stack([f.quantize_ref(weights(O, I, s)) for s in range(6)]).reshape(2, 3, -1)
        x = rng.standard_normal((2, 3, I)).astype(np.float32)
        words = f.words(jnp.asarray(b))
        assert words.dtype == jnp.uint16 and words.shape == (2, 3, b.shape[-1] // 2)
        got = np.asarray(jax.jit(f.matvec, static_argnums=(2, 3))(words, jnp.asarray(x), O, I))
        deq = np.stack([f.dequantize_ref(r, O, I) for r in b.reshape(6, -1)]).reshape(2, 3, O, I)
        want = np.einsum("tkoi,tki->tko", deq, x.astype(np.float64))
        np.testing.assert_array_less(np.abs(got - want), 1e-5 * (np.abs(deq) @ np.abs(x)[..., None])[..., 0] + 1e-30)
    assert f.words(jnp.zeros((2, 17), jnp.uint8)) is None
    assert all(get_format(n).words(jnp.zeros((2, 36), jnp.uint8)) is None for n in NAMES if n != "q4_0")


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_matvec_on_random_bytes(name):
    """Every bit of the K-quants' packed 6-bit scales and mins set at random (as in GGUF files
    that ggml quantized), not only the values our quantizer writes."""
    f = get_format(name)
    rng = np.random.default_rng(2)
    O, I = 5, 512
    b = np.stack([random_blocks(name, O, I, rng) for _ in range(4)]).reshape(4, -1)
    x = rng.standard_normal((4, I)).astype(np.float32)
    w = np.stack([f.dequantize_ref(r, O, I) for r in b])
    got = np.asarray(f.matvec(jnp.asarray(b), jnp.asarray(x), O, I))
    np.testing.assert_array_less(np.abs(got - np.einsum("koi,ki->ko", w, x)), 1e-5 * (np.abs(w) @ np.abs(x)[..., None])[..., 0] + 1e-30)


@pytest.mark.parametrize("name", ["q4_0", "mxfp4", "nvfp4", "q4_k"])
def test_nibble_matvec_reads_the_bytes_in_place(name):
    """q4_0, mxfp4, nvfp4 and q4_k rows meet x without a dequantized matrix: no concatenation of the low and
    high codes, and every bitcast keeps its element width (one that folds an axis of bytes into
    a wider value needs those bytes contiguous, and XLA copied them out of each gathered expert
    in a kernel of their own)."""
    f = get_format(name)
    O, I = 8, 4 * f.block
    jaxpr = jax.make_jaxpr(lambda b, x: f.matvec(b, x, O, I))(jnp.zeros((3, f.nbytes(O, I)), jnp.uint8), jnp.zeros((3, I)))
    prims = [e for e in jaxpr.jaxpr.eqns]
    assert not [e for e in prims if e.primitive.name == "concatenate"]
    for e in prims:
        if e.primitive.name == "bitcast_convert_type":
            assert e.invars[0].aval.shape == e.outvars[0].aval.shape, e
    assert any(e.primitive.name == "reduce_sum" for e in prims)


GGUF = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0, "mxfp4": gguf.GGMLQuantizationType.MXFP4}


@pytest.mark.parametrize("name", sorted(GGUF))
def test_bytes_equal_gguf(name):
    f = get_format(name)
    w = weights(64, 512, 3)
    mine = f.quantize_ref(w)
    theirs = gguf.quants.quantize(w, GGUF[name])
    np.testing.assert_array_equal(mine, theirs.reshape(-1))
    np.testing.assert_array_equal(f.dequantize_ref(mine, 64, 512), gguf.quants.dequantize(theirs, GGUF[name]).astype(np.float64))


K_QUANTS = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q5_k": gguf.GGMLQuantizationType.Q5_K, "q6_k": gguf.GGMLQuantizationType.Q6_K}


@pytest.mark.parametrize("name", sorted(K_QUANTS))
def test_k_quants_dequantize_as_gguf(name):
    """Every code, 6-bit scale / min and f16 scale random (as ggml's quantizer leaves them): the
    float64 reference and the jnp dequantizer equal the `gguf` package's dequantization."""
    f = get_format(name)
    b = random_blocks(name, 5, 768, np.random.default_rng(7), scale=1.0)
    theirs = gguf.quants.dequantize(b, K_QUANTS[name]).astype(np.float64)
    np.testing.assert_array_equal(f.dequantize_ref(b, 5, 768), theirs)
    np.testing.assert_array_equal(np.asarray(f.dequantize(jnp.asarray(b.reshape(-1)), 5, 768)), theirs.astype(np.float32))


def test_nvfp4_rows_are_gguf_nvfp4_times_the_tensor_scale():
    f = get_format("nvfp4")
    w = weights(8, 256, 4)
    b = f.quantize_ref(w)
    g = b[-4:].copy().view(np.float32)[0]
    theirs = gguf.quants.dequantize(b[:-4].reshape(8, -1), gguf.GGMLQuantizationType.NVFP4)
    np.testing.assert_array_equal(f.dequantize_ref(b, 8, 256), theirs.astype(np.float64) * np.float64(g))


def test_layouts_byte_by_byte():
    # q4_0: one block of 32 = 0..31 → d = -31/-8... (max magnitude 31 is positive: d = 31 / -8)
    x = np.arange(32, dtype=np.float32).reshape(1, 32)
    b = get_format("q4_0").quantize_ref(x)
    d = np.float16(31 / -8)
    assert b[:2].tobytes() == d.tobytes() and b.shape == (18,)
    q = np.clip(np.trunc(x[0] / np.float32(d.astype(np.float32)) * 0 + x[0] * np.float32(1 / np.float32(31 / -8)) + 8.5), 0, 15)
    assert list(b[2:]) == [int(q[j]) | int(q[j + 16]) << 4 for j in range(16)]
    # fp8: a row's block is its f32 scale then its e4m3 codes; the tile scale is max|w| / 448
    w = np.full((2, 128), 2.0, np.float32)
    b = get_format("fp8").quantize_ref(w)
    assert b.shape == (2 * 132,)
    assert b[:4].view(np.float32)[0] == np.float32(2.0 / 448)
    assert np.all(b[4:132].view(ml_dtypes.float8_e4m3fn).astype(np.float32) == 448)
    # mxfp4: e8m0 exponent byte, then codes; 6 × 2^0 encodes as code 7 with e = 127
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 16] = 6.0, -0.5
    b = get_format("mxfp4").quantize_ref(w)
    assert b[0] == 127 and b[1] == 7 | (9 << 4) and E2M1[9] == -0.5


def test_bad_shapes_and_names_are_config_errors():
    with pytest.raises(ConfigError, match="unknown expert format"):
        get_format("q3_k")
    with pytest.raises(ConfigError, match="blocks of 32"):
        get_format("q4_0").check(4, 48)
    with pytest.raises(ConfigError, match="unknown expert format"):
        MoEModelConfig(vocab_size=64, hidden_dim=64, intermediate_dim=64, num_layers=1, num_experts=2, top_k=1, expert_format="int3")
    with pytest.raises(ConfigError, match="multiples"):
        MoEModelConfig(vocab_size=64, hidden_dim=96, intermediate_dim=64, num_layers=1, num_experts=2, top_k=1, expert_format="nvfp4")
