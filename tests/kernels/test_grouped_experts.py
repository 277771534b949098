"""The grouped expert kernels of a prefill chunk: the tile layout against a plain-Python model of
it; the Triton kernels (interpret mode here, compiled where the suite runs on a GPU) against
float64 and their jnp references over shapes, blocks, biases and unrouted rows; their lowering
to Triton for the GPU (checked here, without one); the ragged dot against float64 (and jax's
Mosaic GPU kernel on a GPU, its lowering here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from freetoken_jax.config import ACTIVATIONS
from pallas_kernels import grouped_experts as ge

GPU = jax.default_backend() == "gpu"
silu = ACTIVATIONS["silu"]

pytestmark = pytest.mark.usefixtures("full_float32_products")  # (conftest: references compared to 1e-5)


def _ids(rng, T, K, E, skew=0.0):
    """Top-K of E a token; with `skew`, expert 0 first for that share of tokens, expert E-1 never."""
    out = []
    for _ in range(T):
        first = [0] if rng.random() < skew else []
        rest = rng.choice([e for e in range(1, E - 1)], K - len(first), replace=False)
        out.append(first + list(rest))
    return np.asarray(out, np.int32)


@pytest.mark.parametrize("T,K,E,bm", [(40, 3, 5, 16), (97, 2, 9, 16), (64, 4, 6, 32), (7, 2, 16, 16)])
def test_tile_layout_matches_a_plain_model(T, K, E, bm):
    """Each expert's pairs, in token-then-k order, from a multiple of bm on, groups in expert order
    with no tile between them; each tile's expert; E past the last group; P within its bound."""
    ids = _ids(np.random.default_rng(T + E), T, K, E, skew=0.5)
    pair_of_row, row_of_pair, tile_E = (np.asarray(a) for a in ge.tile_layout(jnp.asarray(ids), E, bm))
    P = ge.padded_rows(T * K, E, bm)
    assert pair_of_row.shape == (P,) and P % bm == 0 and P < T * K + E * bm + bm
    want_rows, want_tiles, row = np.full(P, T * K), [], 0
    for e in range(E):
        pairs = [p for p in range(T * K) if ids.reshape(-1)[p] == e]
        want_rows[row : row + len(pairs)] = pairs
        n = -(-len(pairs) // bm)
        want_tiles += [e] * n
        row += n * bm
    want_tiles += [E] * (P // bm - len(want_tiles))
    np.testing.assert_array_equal(pair_of_row, want_rows)
    np.testing.assert_array_equal(tile_E, want_tiles)
    np.testing.assert_array_equal(pair_of_row[row_of_pair], np.arange(T * K))


def _case(rng, T, K, E, D, F, dtype, bm, bias: bool, skew=0.0):
    """A layer's rows in the tile layout: x, routing weights (some 0), per-row biases, weights."""
    ids = _ids(rng, T, K, E, skew)
    pair_of_row, row_of_pair, tile_E = ge.tile_layout(jnp.asarray(ids), E, bm)
    filled = np.asarray(pair_of_row) < T * K
    pair = np.where(filled, np.asarray(pair_of_row), 0)
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    w[::5, 0] = 0.0  # pairs another strategy computes
    x_P = np.where(filled[:, None], x[pair // K], 0)
    w_P = np.where(filled, w.reshape(-1)[pair], 0)
    mats = [rng.standard_normal(s).astype(np.float32) * 0.2 for s in ((E, F, D), (E, F, D), (E, D, F))]
    P = pair_of_row.shape[0]
    b = tuple(rng.standard_normal((P, n)).astype(np.float32) * 0.1 for n in (F, F)) if bias else None
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return dict(x=cast(x), tok_P=jnp.asarray(pair // K), w_P=jnp.asarray(w_P), mats=[cast(m) for m in mats], tile_E=tile_E,
                bias=b and tuple(map(cast, b)), np=(x_P, w_P, mats, np.asarray(tile_E), b), cast=cast)  # fmt: skip


def _float64(x_P, w_P, mats, tile_E, b, bm):
    g, u, d = (m.astype(np.float64) for m in mats)
    E = g.shape[0]
    h = np.zeros((x_P.shape[0], g.shape[1]))
    y = np.zeros((x_P.shape[0], d.shape[1]))
    for r in range(x_P.shape[0]):
        e = tile_E[r // bm]
        if e >= E:
            continue
        gx, ux = g[e] @ x_P[r], u[e] @ x_P[r]
        if b is not None:
            gx, ux = gx + b[0][r], ux + b[1][r]
        h[r] = gx / (1 + np.exp(-gx)) * ux * w_P[r]
    for r in range(x_P.shape[0]):
        e = tile_E[r // bm]
        if e < E:
            y[r] = d[e] @ h[r]
    return h, y


# T, K, E, D, F, bm, dtype, bias, skew
SHAPES = [
    (40, 3, 5, 64, 128, 16, jnp.float32, False, 0.0),
    (60, 2, 6, 32, 48, 16, jnp.float32, True, 0.6),  # F = 48: blocks of 16
    (50, 4, 7, 128, 64, 32, jnp.float32, True, 0.0),  # D = 128: two blocks of 64 inputs a loop
    (33, 2, 5, 64, 64, 16, jnp.bfloat16, False, 0.3),
]


@pytest.mark.parametrize("T,K,E,D,F,bm,dtype,bias,skew", SHAPES)
def test_kernels_match_float64_and_reference(T, K, E, D, F, bm, dtype, bias, skew):
    rng = np.random.default_rng(T * K + D)
    c = _case(rng, T, K, E, D, F, dtype, bm, bias, skew)
    g, u, d = c["mats"]
    h = ge.gate_up(c["x"], c["tok_P"], g, u, c["tile_E"], c["w_P"], silu, c["bias"], interpret=not GPU)
    y = ge.down(h, d, c["tile_E"], interpret=not GPU)
    assert h.dtype == dtype and y.dtype == jnp.float32
    used = np.repeat(np.asarray(c["tile_E"]) < E, bm)
    h_ref = ge.gate_up_ref(c["x"], c["tok_P"], g, u, c["tile_E"], c["w_P"], silu, c["bias"])
    y_ref = ge.down_ref(h_ref, d, c["tile_E"])
    x_P, w_P, mats, tile_E, b = c["np"]
    if dtype == jnp.float32:  # float64 from the same inputs
        h64, y64 = _float64(x_P, w_P, mats, tile_E, b, bm)
        for got, want in ((h, h64), (y, y64)):
            got = np.asarray(got, np.float64)[used]
            np.testing.assert_allclose(got, want[used], rtol=1e-4, atol=1e-4 * np.abs(want).max())
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for got, want in ((h, h_ref), (y, y_ref)):
        got, want = np.asarray(got, np.float32)[used], np.asarray(want, np.float32)[used]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    assert not np.asarray(h, np.float32)[used][np.asarray(c["w_P"])[used] == 0].any()  # weight 0: exactly 0


@pytest.mark.parametrize("block_n,block_k", [(16, 16), (32, 64), (64, 32)])
def test_blocks_give_the_same_rows(block_n, block_k):
    """Blocks of other sizes than the defaults (the loop over inputs in 1-4 steps) compute the same."""
    rng = np.random.default_rng(block_n + block_k)
    T, K, E, D, F, bm = 30, 2, 4, 64, 64, 16
    c = _case(rng, T, K, E, D, F, jnp.float32, bm, True)
    g, u, d = c["mats"]
    used = np.repeat(np.asarray(c["tile_E"]) < E, bm)
    args = (c["x"], c["tok_P"], g, u, c["tile_E"], c["w_P"], silu, c["bias"])
    h0, h1 = ge.gate_up(*args, interpret=not GPU), ge.gate_up(*args, block_n=block_n, block_k=block_k, interpret=not GPU)
    np.testing.assert_allclose(np.asarray(h1)[used], np.asarray(h0)[used], rtol=1e-5, atol=1e-6)
    y0, y1 = (
        ge.down(h0, d, c["tile_E"], interpret=not GPU),
        ge.down(h0, d, c["tile_E"], block_n=block_n, block_k=block_k, interpret=not GPU),
    )
    np.testing.assert_allclose(np.asarray(y1)[used], np.asarray(y0)[used], rtol=1e-5, atol=1e-6)


def test_bad_shapes_raise():
    x, w, tok = jnp.zeros((32, 40)), jnp.zeros((2, 64, 40)), jnp.zeros((32,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of 16"):
        ge.gate_up(x, tok, w, w, jnp.zeros((2,), jnp.int32), jnp.zeros((32,)), silu, interpret=True)
    x, w = jnp.zeros((32, 64)), jnp.zeros((2, 64, 64))
    with pytest.raises(ValueError, match=r"up \(2, 32, 64\) is not \[2, 64, 64\]"):
        ge.gate_up(x, tok, w, jnp.zeros((2, 32, 64)), jnp.zeros((2,), jnp.int32), jnp.zeros((32,)), silu, interpret=True)
    with pytest.raises(ValueError, match="block_m=15 must be a power of two"):
        ge.down(jnp.zeros((30, 64)), w, jnp.zeros((2,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="not whole blocks of 16 rows, 32 outputs"):
        ge.down(jnp.zeros((32, 64)), jnp.zeros((2, 48, 64)), jnp.zeros((2,), jnp.int32), block_n=32, interpret=True)


@pytest.mark.parametrize("fmt", ge.FORMATS)
@pytest.mark.parametrize(
    "T,K,E,D,F,bm,dtype,bias,extra", [(40, 3, 5, 64, 96, 16, jnp.float32, True, 7), (33, 2, 5, 128, 64, 32, jnp.bfloat16, False, 0)]
)
def test_kernels_decode_4bit_banks_as_they_load_them(fmt, T, K, E, D, F, bm, dtype, bias, extra):
    """Banks of q4_0 / mxfp4 bytes (rows `extra` bytes wider than the matrices, as slots are):
    against float64 over the dequantized matrices and against the references, which dequantize
    the banks to x's dtype first."""
    from freetoken_jax.quant.formats import get_format

    rng = np.random.default_rng(D + F + extra)
    c = _case(rng, T, K, E, D, F, dtype, bm, bias)
    Q = get_format(fmt)
    banks, mats = [], []
    for w, (o, i) in zip(c["np"][2], ((F, D), (F, D), (D, F))):
        b = np.stack([Q.quantize_ref(m) for m in w])
        mats.append(np.stack([Q.dequantize_ref(r, o, i) for r in b]))
        banks.append(jnp.asarray(np.concatenate([b, rng.integers(0, 256, (E, extra), dtype=np.uint8)], axis=1)))
    g, u, d = banks
    h = ge.gate_up(c["x"], c["tok_P"], g, u, c["tile_E"], c["w_P"], silu, c["bias"], F=F, fmt=fmt, interpret=not GPU)
    y = ge.down(h, d, c["tile_E"], D=D, fmt=fmt, interpret=not GPU)
    used = np.repeat(np.asarray(c["tile_E"]) < E, bm)
    x_P, w_P, _, tile_E, b = c["np"]
    if dtype == jnp.float32:
        h64, y64 = _float64(x_P, w_P, mats, tile_E, b, bm)
        for got, want in ((h, h64), (y, y64)):
            np.testing.assert_allclose(np.asarray(got, np.float64)[used], want[used], rtol=1e-4, atol=1e-4 * np.abs(want).max())
    h_ref = ge.gate_up_ref(c["x"], c["tok_P"], g, u, c["tile_E"], c["w_P"], silu, c["bias"], F=F, fmt=fmt)
    y_ref = ge.down_ref(h_ref, d, c["tile_E"], D=D, fmt=fmt)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for got, want in ((h, h_ref), (y, y_ref)):
        got, want = np.asarray(got, np.float32)[used], np.asarray(want, np.float32)[used]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_rows_of_whole_blocks_only():
    """Rows of inputs that are not whole blocks of 32 are refused before anything runs (the
    formats store no such matrix either)."""
    b = jnp.zeros((4, 1024), jnp.uint8)
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        ge.gate_up(jnp.zeros((32, 48)), jnp.zeros((32,), jnp.int32), b, b, jnp.zeros((2,), jnp.int32), jnp.zeros((32,)), silu, F=64,
                   fmt="q4_0", interpret=True)  # fmt: skip


def test_kernels_lower_to_triton_for_the_gpu():
    """At Qwen3-30B-A3B's shape and an 8192-token chunk: two Triton calls."""
    sds = jax.ShapeDtypeStruct
    T, K, E, D, F = 8192, 8, 128, 2048, 768
    bm = ge.block_m_for(T * K, E)
    P = ge.padded_rows(T * K, E, bm)

    def f(x, tok, g, u, d, tile_E, w):
        return ge.down(ge.gate_up(x, tok, g, u, tile_E, w, silu), d, tile_E)

    args = (sds((T, D), jnp.bfloat16), sds((P,), jnp.int32), sds((E, F, D), jnp.bfloat16), sds((E, F, D), jnp.bfloat16),
            sds((E, D, F), jnp.bfloat16), sds((P // bm,), jnp.int32), sds((P,), jnp.float32))  # fmt: skip
    exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        *args
    )
    text = exp.mlir_module()
    assert bm == 128 and text.count("__gpu$xla.gpu.triton") == 2 and "grouped_gate_up" in text and "grouped_down" in text

    def q(x, tok, g, u, d, tile_E, w):  # q4_0 banks as the slots hold them
        return ge.down(ge.gate_up(x, tok, g, u, tile_E, w, silu, F=F, fmt="q4_0"), d, tile_E, D=D, fmt="q4_0")

    banks = (sds((E, 884736), jnp.uint8),) * 3
    exp = export.export(jax.jit(q), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        *args[:2], *banks, *args[5:]
    )
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 2


RAGGED = ("ref", "mosaic") if GPU else ("ref",)


@pytest.mark.parametrize("impl", RAGGED)
@pytest.mark.parametrize("M,K,N,sizes", [(40, 64, 128, [10, 0, 25, 5]), (300, 128, 256, [0, 0, 300]), (200, 64, 128, [64, 64, 64, 8])])
def test_ragged_dot_matches_float64(impl, M, K, N, sizes):
    rng = np.random.default_rng(M + N)
    dtype = jnp.bfloat16 if impl == "mosaic" else jnp.float32
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((len(sizes), N, K)).astype(np.float32) * 0.2
    x, w = (np.asarray(jnp.asarray(a, dtype), np.float32) for a in (x, w))  # the inputs as the kernel sees them
    got = ge.ragged_dot(jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes, jnp.int32), implementation=impl)
    assert got.dtype == dtype
    g = np.repeat(np.arange(len(sizes)), sizes)
    want = np.einsum("mk,mnk->mn", x.astype(np.float64), w.astype(np.float64)[g])
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())


def test_mosaic_ragged_dot_lowers_for_the_gpu():
    """jax's Mosaic GPU kernel takes our call at Qwen3-30B-A3B's shape (the gate's product of an
    8192-token chunk) and lowers, here, to one Mosaic GPU custom call."""
    if ge._mosaic_ragged_dot() is None:
        pytest.fail("this jax has no jax.experimental.pallas.ops.gpu.ragged_dot_mgpu")
    sds = jax.ShapeDtypeStruct
    f = jax.jit(lambda x, w, s: ge.ragged_dot(x, w, s, implementation="mosaic"))
    exp = export.export(f, platforms=["cuda"])(
        sds((65536, 2048), jnp.bfloat16), sds((128, 768, 2048), jnp.bfloat16), sds((128,), jnp.int32)
    )
    assert exp.mlir_module().count("stablehlo.custom_call") == 1
    # rows not a multiple of the kernel's tile of 8 (on the H200 it refused 300 rows before they were padded)
    exp = export.export(f, platforms=["cuda"])(sds((300, 128), jnp.bfloat16), sds((3, 256, 128), jnp.bfloat16), sds((3,), jnp.int32))
    assert exp.mlir_module().count("stablehlo.custom_call") == 1 and exp.out_avals[0].shape == (300, 256)
