"""Decode's q4_0 CUDA expert kernels (`runtime/cuda_experts.py`, `cpu_ext/cuda/q4_0_experts.cu`):
against float64 and XLA's gathered reductions over shapes on a GPU; here, without one, the
committed PTX against nvcc's output of the source, which layers the kernels take, the engine's
choice of them, and their lowering (the banks' stacks read in place)."""

import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

from freetoken_jax.models import routed
from freetoken_jax.quant.formats import get_format
from freetoken_jax.quant.layout import ExpertLayout
from freetoken_jax.runtime import cuda_experts
from pallas_kernels import Stacked

ROOT = Path(__file__).resolve().parents[2]
GPU = jax.default_backend() == "gpu"


def _banks(rng, S, F, D, extra=0, layers=0):
    """q4_0 gate, up, down banks of S experts (rows `extra` bytes wider than the matrices; stacked
    over `layers` copies when given, entry 1 the one returned) and their float64 matrices."""
    Q = get_format("q4_0")
    out, mats = [], []
    for o, i in ((F, D), (F, D), (D, F)):
        b = np.stack([Q.quantize_ref(w) for w in rng.standard_normal((S, o, i)).astype(np.float32) * 0.05])
        mats.append(np.stack([Q.dequantize_ref(r, o, i) for r in b]))
        b = np.concatenate([b, rng.integers(0, 256, (S, extra), dtype=np.uint8)], axis=1)
        if layers:
            b = np.stack([rng.integers(0, 256, b.shape, dtype=np.uint8) if k != 1 else b for k in range(layers)])
        out.append(b)
    return out, mats


def _bf16(v):
    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _float64(x, ids, w, mats):
    """The kernels' sum in float64, each pair's h rounded to bfloat16 as they (and `_gathered`) round it."""
    g, u, d = (m[ids] for m in mats)
    gx, ux = np.einsum("tkfd,td->tkf", g, x), np.einsum("tkfd,td->tkf", u, x)
    h = _bf16(w[..., None] * gx / (1 + np.exp(-gx)) * ux)
    return np.einsum("tkdf,tkf->td", d, h)


# S, F, D, T, K, extra bytes a row, stacked layers
SHAPES = [(6, 256, 256, 1, 2, 0, 0), (9, 512, 768, 3, 4, 32, 3), (20, 768, 2048, 1, 8, 0, 2), (5, 256, 1024, 2, 1, 16, 0)]


@pytest.mark.skipif(not GPU, reason="the CUDA kernels run on a GPU (their checks on this machine: the tests below)")
@pytest.mark.parametrize("launches", ["cuda", "cuda2"])  # one launch a layer where it fits, or always two
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_float64_and_xla_on_a_gpu(shape, launches, monkeypatch):
    monkeypatch.setenv("FREETOKEN_DECODE_EXPERTS", launches)
    S, F, D, T, K, extra, layers = shape
    assert cuda_experts.unavailable() is None
    rng = np.random.default_rng(S * F + D + T * K)
    banks, mats = _banks(rng, S, F, D, extra, layers)
    x = _bf16(rng.standard_normal((T, D)))
    ids = rng.integers(0, S, (T, K)).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    w[0, -1] = 0.0  # an unrouted pair adds nothing
    layout = ExpertLayout(("q4_0",) * 3, F, D, "silu")
    assert cuda_experts.fits(layout, jnp.bfloat16, K) and cuda_experts.one_fits(layout, T, K) == (launches == "cuda")
    dev = tuple(Stacked(jnp.asarray(b), 1) if layers else jnp.asarray(b) for b in banks)
    args = jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(w)
    got = np.asarray(jax.jit(lambda *a: cuda_experts.experts(*a, dev, layout))(*args), np.float64)
    want = _float64(x, ids, w.astype(np.float64), mats)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=2e-3 * scale)
    xla = np.asarray(jax.jit(lambda *a: routed.routed_experts(*a, dev, layout, impl="gather"))(*args), np.float64)
    np.testing.assert_allclose(got, xla, rtol=2**-7, atol=2e-3 * scale)


def test_committed_ptx_is_nvccs_output_of_the_source(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH (the PTX is rebuilt with `make ptx`)")
    committed = (ROOT / "cpu_ext/cuda/q4_0_experts.ptx").read_text()
    wrote = next(line for line in committed.splitlines() if line.startswith("// Cuda compilation tools"))
    version = subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout
    if wrote[3:] not in version:
        pytest.skip(f"this nvcc is not the one that wrote the PTX ({wrote[3:]}): another makes other PTX")
    out = tmp_path / "q4_0_experts.ptx"
    cmd = [nvcc, "-ptx", "-O3", "-arch=compute_80", "-o", str(out), str(ROOT / "cpu_ext/cuda/q4_0_experts.cu")]
    subprocess.run(cmd, check=True, capture_output=True)
    assert out.read_text() == committed, "run `make ptx` and commit the PTX"


def test_geometry_matches_the_kernels_header():
    text = (ROOT / "cpu_ext/cuda/q4_0_experts.h").read_text()
    assert f"kGateUpRows = {cuda_experts.GATE_UP_ROWS}," in text and f"kDownRows = {cuda_experts.DOWN_ROWS}," in text
    assert f"kPad = {cuda_experts.PAD};" in text


def test_fits_only_q4_0_silu_bf16_layers_of_multiples_of_256(monkeypatch):
    from freetoken_jax import _cpu_ext

    L = ExpertLayout(("q4_0",) * 3, 768, 2048, "silu")
    if not GPU:
        assert "backend has no CUDA kernels" in cuda_experts.unavailable()
        assert not cuda_experts.fits(L, jnp.bfloat16, 8)
    monkeypatch.setattr(cuda_experts, "unavailable", lambda: None)
    monkeypatch.setattr(_cpu_ext, "expert_kernels_shared_memory", lambda ordinal: 227 * 1024)
    assert cuda_experts.fits(L, jnp.bfloat16, 8) and cuda_experts.fits(L, jnp.bfloat16, 8, pairs=65535)
    assert not cuda_experts.fits(L, jnp.bfloat16, 8, pairs=65536)
    assert not cuda_experts.fits(L, jnp.float32, 8)
    assert not cuda_experts.fits(L, jnp.bfloat16, 8, bias=(0, 0, 0))
    for other in (
        ExpertLayout(("q4_0",) * 3, 768, 2048, "gelu_tanh"),
        ExpertLayout(("mxfp4",) * 3, 768, 2048, "silu"),
        ExpertLayout(("q4_0", "q4_0", "q8_0"), 768, 2048, "silu"),
        ExpertLayout(("q4_0",) * 3, 768, 2048, "silu", mixed=True),
        ExpertLayout(("q4_0",) * 3, 96, 2048, "silu"),
        ExpertLayout(("q4_0",) * 3, 768, 2112, "silu"),
    ):
        assert not cuda_experts.fits(other, jnp.bfloat16, 8), other
    # Mixtral's 14336 × 4096 experts: top-2's h (28672 floats, padded) fits a block; top-4's, 238 KB, does not
    big = ExpertLayout(("q4_0",) * 3, 14336, 4096, "silu")
    assert cuda_experts.fits(big, jnp.bfloat16, 2)
    assert cuda_experts.shared_bytes(big, 4) > 227 * 1024 and not cuda_experts.fits(big, jnp.bfloat16, 4)
    assert cuda_experts.shared_bytes(L, 8) == 4 * max(2048 + 32 * 4, 8 * 768 + 96 * 4)
    # one launch: T tokens' x or one token's h, whichever is larger
    assert cuda_experts.one_bytes(L, 1, 8) == cuda_experts.shared_bytes(L, 8) and cuda_experts.one_bytes(L, 4, 8) == 4 * 4 * 2176
    monkeypatch.delenv("FREETOKEN_DECODE_EXPERTS", raising=False)
    assert cuda_experts.one_fits(L, 26, 8) and not cuda_experts.one_fits(L, 27, 8)  # 26 · 8704 bytes ≤ 227 KB < 27 · 8704
    monkeypatch.setenv("FREETOKEN_DECODE_EXPERTS", "cuda2")
    assert not cuda_experts.one_fits(L, 1, 8)


def test_the_engine_takes_the_kernels_for_decode_only_where_they_fit(monkeypatch):
    rng = np.random.default_rng(3)
    S, F, D = 16, 256, 256
    banks, _ = _banks(rng, S, F, D)
    banks = tuple(jnp.asarray(b) for b in banks)
    L = ExpertLayout(("q4_0",) * 3, F, D, "silu")
    x = jnp.asarray(rng.standard_normal((1, D)), jnp.bfloat16)
    ids, w = jnp.asarray([[3, 7]], jnp.int32), jnp.asarray([[0.6, 0.4]], jnp.float32)
    gather = routed.routed_experts(x, ids, w, banks, L, impl="gather")
    # where they do not fit (here: no GPU) "cuda" computes as "gather"
    if not GPU:
        np.testing.assert_array_equal(np.asarray(routed.routed_experts(x, ids, w, banks, L, impl="cuda")), np.asarray(gather))
    calls = []
    monkeypatch.setattr(cuda_experts, "fits", lambda *a: True)
    monkeypatch.setattr(cuda_experts, "experts", lambda x, ids, w, banks, layout: calls.append(ids.shape) or jnp.zeros_like(x))
    monkeypatch.delenv("FREETOKEN_DECODE_EXPERTS", raising=False)  # the default: XLA's reductions
    np.testing.assert_array_equal(np.asarray(routed.routed_experts(x, ids, w, banks, L)), np.asarray(gather))
    assert calls == []
    monkeypatch.setenv("FREETOKEN_DECODE_EXPERTS", "cuda")
    routed.routed_experts(x, ids, w, banks, L)  # decode: T·K ≤ E
    assert calls == [(1, 2)]
    routed.routed_experts(x, ids, w, banks, L, impl="cuda")
    assert calls == [(1, 2), (1, 2)]
    monkeypatch.setenv("FREETOKEN_DECODE_EXPERTS", "cuda2")
    routed.routed_experts(x, ids, w, banks, L)
    assert calls == [(1, 2), (1, 2), (1, 2)]
    monkeypatch.setenv("FREETOKEN_DECODE_EXPERTS", "xla")
    np.testing.assert_array_equal(np.asarray(routed.routed_experts(x, ids, w, banks, L)), np.asarray(gather))
    assert calls == [(1, 2), (1, 2), (1, 2)]
    monkeypatch.setenv("FREETOKEN_DECODE_EXPERTS", "cuda")
    many = jnp.asarray(rng.integers(0, S, (40, 2)), jnp.int32)  # 80 pairs of 16 experts: grouped, not a decode gather
    routed.routed_experts(jnp.zeros((40, D), jnp.bfloat16), many, jnp.ones((40, 2)), banks, L)
    assert calls == [(1, 2), (1, 2), (1, 2)]


@pytest.mark.parametrize("launches", [1, 2])
def test_kernels_lower_to_ffi_calls_reading_the_stacks_in_place(launches, monkeypatch):
    from freetoken_jax import _cpu_ext

    # the device's shared memory as an H100's where one launch may take the layer; none where it may not
    monkeypatch.setattr(_cpu_ext, "expert_kernels_shared_memory", lambda ordinal: 227 * 1024 if launches == 1 else 0)
    sds = jax.ShapeDtypeStruct
    L = ExpertLayout(("q4_0",) * 3, 768, 2048, "silu")
    row = L.row_sizes()
    stacks = tuple(sds((24, 128, r), jnp.uint8) for r in row)

    def step(x, ids, w, g, u, d):
        return cuda_experts.experts(x, ids, w, (Stacked(g, 5), Stacked(u, 5), Stacked(d, 5)), L)

    args = (sds((1, 2048), jnp.bfloat16), sds((1, 8), jnp.int32), sds((1, 8), jnp.float32)) + stacks
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in (cuda_experts.GATE_UP, cuda_experts.DOWN, cuda_experts.MOE)]
    text = export.export(jax.jit(step), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
    assert "slice" not in text and "tensor<24x128x884736xui8>" in text  # the whole stacks, entry 5 an attribute
    if launches == 1:
        assert text.count(f"custom_call @{cuda_experts.MOE}(") == 1 and "custom_call @freetoken_q4_0_gate_up" not in text
        assert text.count("index = 5 : i64") == 2 and text.count("down_index = 5 : i64") == 1 and "ffn = 768 : i64" in text
        return
    assert text.count(f"custom_call @{cuda_experts.GATE_UP}(") == 1 and text.count(f"custom_call @{cuda_experts.DOWN}(") == 1
    assert f"custom_call @{cuda_experts.MOE}" not in text
    assert text.count("index = 5 : i64") == 2 and "down_index" not in text and "ffn = 768 : i64" in text
