"""The C++ executor on quantized banks: every format on every ISA tier this machine has equals the
float64 matmul of the dequantized reference weights."""

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import executor_reference as reference
from helpers import int8_activations

from freetoken_jax import _cpu_ext
from freetoken_jax.quant.formats import FORMATS, get_format
from freetoken_jax.runtime.cpu_executor import CpuExecutor, supported_tiers


def quantized_banks(fmt, E, F, H, rng):
    f = get_format(fmt)
    banks, dense = [], []
    for O, I in ((F, H), (F, H), (H, F)):
        rows = [f.quantize_ref(rng.standard_normal((O, I)).astype(np.float32) * 0.2) for _ in range(E)]
        banks.append(np.stack(rows))
        dense.append(np.stack([f.dequantize_ref(r, O, I).reshape(-1) for r in rows]))
    return banks, dense


def q8_round_trip(v):
    """Blocks of 32 quantized to int8 as the executor's VNNI kernels do, in float32, then exact."""
    b = np.asarray(v, np.float32).reshape(-1, 32)
    d = (np.abs(b).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d)).astype(np.float32)
    t = (b * inv).astype(np.float32)
    q = np.sign(t) * np.floor(np.abs(t) + np.float32(0.5))  # halves away from zero (lround)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(np.shape(v))


def shapes(fmt):
    f = FORMATS[fmt]
    m = 1 if f.pads else f.block
    out = [(1, 2 * m, m, 4, 2), (3, m, 3 * m, 5, 9), (4, 4 * m, 2 * m, 3, 0)]
    return out + ([(2, 200, 72, 3, 5)] if f.pads else [])  # rows that end in a short block


@pytest.mark.parametrize("tier", supported_tiers())
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantized_banks_match_the_dequantized_reference(tier, fmt):
    ex = CpuExecutor(threads=3, max_tier=tier)
    for T, H, F, E, N in shapes(fmt):
        rng = np.random.default_rng(T + H + F + N)
        (gate, up, down), (g64, u64, d64) = quantized_banks(fmt, E, F, H, rng)
        x = rng.standard_normal((T, H)).astype(np.float32)
        tokens, experts, weights = rng.integers(0, T, N), rng.integers(0, E, N), rng.random(N).astype(np.float32)
        got = ex.run(x, tokens, experts, weights, gate, up, down, "silu", fmt)
        if N == 0:
            assert not got.any()
            continue
        if int8_activations(tier, fmt):
            # the VNNI kernels multiply activations quantized to int8 blocks (as llama.cpp): the
            # reference quantizes x and the hidden vector the same way; float64 and float32 hidden
            # vectors may round an element to neighbouring codes, hence the looser bound
            ref = reference(x, tokens, experts, weights, g64, u64, d64, F, "silu", round_activations=q8_round_trip)
            tol = 1e-3
        else:
            ref, tol = reference(x, tokens, experts, weights, g64, u64, d64, F, "silu"), 2e-5
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < tol, (tier, fmt, (T, H, F), err)
        if int8_activations(tier, fmt):  # and against float32 activations: within the int8 rounding
            plain = reference(x, tokens, experts, weights, g64, u64, d64, F, "silu")
            assert np.linalg.norm(got - plain) / np.linalg.norm(plain) < 2e-2


@pytest.mark.parametrize("tier", supported_tiers())
def test_nvfp4_scales_of_every_e4m3_code(tier):
    """nvfp4's block scales are converted in registers: expert e's scales all one e4m3 code, every
    finite code in turn (zero, subnormals, both signs), each expert's output against float64."""
    f, ex = get_format("nvfp4"), CpuExecutor(threads=2, max_tier=tier)
    T, H, F = 1, 128, 64
    codes = [c for c in range(256) if c & 0x7F != 0x7F]  # 0x7f / 0xff are NaN
    rng = np.random.default_rng(5)
    banks, dense = quantized_banks("nvfp4", len(codes), F, H, rng)
    for bank, d64, (O, I) in zip(banks, dense, ((F, H), (F, H), (H, F))):
        for e, c in enumerate(codes):
            bank[e, : O * f.row_bytes(I)].reshape(O, I // 64, 36)[..., :4] = c
            d64[e] = f.dequantize_ref(bank[e], O, I).reshape(-1)
    x = rng.standard_normal((T, H)).astype(np.float32)
    rnd = q8_round_trip if int8_activations(tier, "nvfp4") else None
    for e, c in enumerate(codes):
        got = ex.run(x, [0], [e], [1.0], *banks, "silu", "nvfp4")
        ref = reference(x, [0], [e], [1.0], *dense, F, "silu", round_activations=rnd)
        if c & 0x7F == 0:
            assert not got.any() and not ref.any(), c
        else:
            assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (1e-3 if rnd else 2e-5), (tier, hex(c))


@pytest.mark.parametrize("tier", supported_tiers())
def test_mxfp4_scales_of_every_e8m0_code(tier):
    """mxfp4's exponents are converted in registers (2^(e − 127), e = 0 the subnormal 2^−127): the
    gate and up blocks of expert e all carry one code, every finite code in turn, x scaled by
    2^(127 − e) to keep the products in float32's range; each output against float64."""
    f, ex = get_format("mxfp4"), CpuExecutor(threads=2, max_tier=tier)
    T, H, F = 1, 96, 64  # three blocks of 32 a gate/up row: two a step and the last alone
    codes = list(range(255))  # 0xff is NaN
    rng = np.random.default_rng(6)
    banks, dense = quantized_banks("mxfp4", len(codes), F, H, rng)
    for bank, d64 in zip(banks[:2], dense[:2]):
        for e, c in enumerate(codes):
            bank[e].reshape(F, H // 32, 17)[..., 0] = c
            d64[e] = f.dequantize_ref(bank[e], F, H).reshape(-1)
    rnd = q8_round_trip if int8_activations(tier, "mxfp4") else None
    for e, c in enumerate(codes):
        x = (rng.standard_normal((T, H)) * 2.0 ** np.clip(127 - c, -100, 120)).astype(np.float32)
        got = ex.run(x, [0], [e], [1.0], *banks, "silu", "mxfp4")
        with np.errstate(over="ignore"):  # silu's exp(−gate) of the largest gates: inf, as it should
            ref = reference(x, [0], [e], [1.0], *dense, F, "silu", round_activations=rnd)
        assert np.isfinite(got).all() and np.linalg.norm(got - ref) / np.linalg.norm(ref) < (1e-3 if rnd else 2e-5), (tier, c)


def test_the_executor_sizes_formats_as_python_does():
    for name, f in FORMATS.items():
        for O, I in ((3, 128), (64, 256), (7, 200 if f.pads else 192)):
            assert _cpu_ext.format_nbytes(name, O, I) == f.nbytes(O, I)


def test_bad_quantized_banks_are_refused():
    ex = CpuExecutor(threads=1)
    (gate, up, down), _ = quantized_banks("q4_0", 2, 32, 64, np.random.default_rng(0))
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ValueError, match="not q4_0 matrices"):
        ex.run(x, [0], [0], [1.0], gate[:, :-1], up, down, "silu", "q4_0")
    with pytest.raises(ValueError, match="one expert per row"):  # the C++ check, past the Python one
        _cpu_ext.CpuMoeExecutor(1).run(
            x,
            np.zeros(1, np.int32),
            np.zeros(1, np.int32),
            np.ones(1, np.float32),
            gate,
            up,
            down[:, :-18],
            32,
            "silu",
            np.zeros_like(x),
            "q4_0",
        )
    with pytest.raises(ValueError, match="not q8_0 matrices"):  # read as q8_0, the rows are too short
        ex.run(x, [0], [0], [1.0], gate, up, down, "silu", "q8_0")
    with pytest.raises(TypeError, match="uint8"):
        ex.run(x, [0], [0], [1.0], gate.astype(np.float32), up, down, "silu", "q4_0")
    with pytest.raises(ValueError, match="unknown bank format"):
        _cpu_ext.format_nbytes("q3_k", 1, 32)


@pytest.mark.parametrize("tier", supported_tiers())
def test_down_in_another_format_than_gate_and_up(tier):
    """A GGUF Q4_K_M layer: gate and up q4_k, down q6_k ("q4_k/q6_k"), against float64."""
    ex = CpuExecutor(threads=2, max_tier=tier)
    T, H, F, E, N = 3, 512, 256, 4, 7
    rng = np.random.default_rng(11)
    (gate, up, _), (g64, u64, _) = quantized_banks("q4_k", E, F, H, rng)
    (_, _, down), (_, _, d64) = quantized_banks("q6_k", E, F, H, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    tokens, experts, weights = rng.integers(0, T, N), rng.integers(0, E, N), rng.random(N).astype(np.float32)
    got = ex.run(x, tokens, experts, weights, gate, up, down, "silu", "q4_k/q6_k")
    ref = reference(x, tokens, experts, weights, g64, u64, d64, F, "silu")
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (2e-2 if int8_activations(tier, "q4_k") else 2e-5)
    with pytest.raises(ValueError, match="one expert per row"):  # down read as q4_k: rows of the wrong length
        ex.run(x, tokens, experts, weights, gate, up, down, "silu", "q4_k")


def test_the_one_block_vnni_kernels_and_a_bad_width():
    """FREETOKEN_VNNI_BITS is read once a process: in one whose value is 256 the one-block VNNI
    kernels pass this file's format tests; another value is refused when an executor is made."""
    env = {**os.environ, "FREETOKEN_VNNI_BITS": "256"}
    tests = "match_the_dequantized_reference or every_e4m3_code or every_e8m0_code"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
                         env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:]
    env["FREETOKEN_VNNI_BITS"] = "128"
    bad = "from freetoken_jax.runtime.cpu_executor import CpuExecutor; CpuExecutor(threads=1)"
    run = subprocess.run([sys.executable, "-c", bad], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "FREETOKEN_VNNI_BITS must be 512 or 256, not '128'" in run.stderr, run.stderr[-2000:]
