"""The C++ extension is built by the package's own install and detects the CPU's ISA tiers."""

import platform

import numpy as np
import pytest

from freetoken_jax import _cpu_ext


def test_tiers_agree_with_the_kernel():
    tiers = _cpu_ext.supported_tiers()
    assert tiers[0] == "scalar"
    order = ["scalar", "avx2_fma", "avx512f", "avx512_bf16"]
    assert tiers == order[: len(tiers)]  # tiers are cumulative
    if platform.machine() != "x86_64":
        return
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert ("avx2_fma" in tiers) == ({"avx2", "fma"} <= flags and "avx" in flags)
    if {"avx2", "fma"} <= flags:
        assert ("avx512f" in tiers) == ({"avx512f", "avx512bw", "avx512vl"} <= flags)


def _int8_blocks(x: np.ndarray, offset: int, nvfp4_order: bool) -> bytes:
    """The int8 blocks of the executor's Prepare, by numpy: per block of 32, d = max|x| / 127 and
    q = round(x / d) halves away from zero (float32 arithmetic as the C++ does it), codes in nvfp4's
    order [0..7, 16..23, 8..15, 24..31] where asked, −offset × each group of 4 codes' sum, d, and
    d × the block's sum of codes."""
    xb = x.reshape(-1, 32)
    d = (np.abs(xb).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    if nvfp4_order:
        xb = xb[:, np.r_[0:8, 16:24, 8:16, 24:32]]
    v = (xb * inv[:, None]).astype(np.float32).astype(np.float64)
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int32)
    groups = q.reshape(-1, 8, 4).sum(axis=2)
    sums = q.sum(axis=1)
    return b"".join([q.astype(np.int8).tobytes(), (-offset * groups).astype(np.int32).tobytes(), d.tobytes(),
                     (d * sums.astype(np.float32)).astype(np.float32).tobytes()])  # fmt: skip


@pytest.mark.parametrize("n", [32, 96, 768, 2048])
def test_int8_prepare_matches_numpy(n):
    """The executor's int8 activations (its vector code and the scalar loop it is checked against)
    equal numpy's blocks byte for byte: normal values, a zero block, ties at .5 after scaling (a
    block whose maximum is 127 scales by 1), tiny and huge magnitudes."""
    tiers = [t for t in _cpu_ext.supported_tiers() if t != "scalar"]
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    if n >= 96:
        x[:32] = 0.0
        x[32:64] = np.float32(127.0) * np.sign(rng.standard_normal(32)).astype(np.float32)
        x[33:64] = (rng.integers(-126, 126, 31) + 0.5).astype(np.float32)
        x[64:96] *= np.float32(1e-30) if n > 96 else np.float32(3e30)
    if not tiers:  # the int8 kernels are x86's, AVX2 and up: the scalar tier reads x alone
        assert _cpu_ext.prepare(x, "q4_0", "scalar") == b""
        return
    # the tiers whose kernels read int8 activations: AVX2's for q4_0, mxfp4 and nvfp4, VNNI's
    # (avx512_bf16) for those and q8_0; avx512f's float kernels read x alone
    int8 = {
        "q4_0": ("avx2_fma", "avx512_bf16"),
        "mxfp4": ("avx2_fma", "avx512_bf16"),
        "nvfp4": ("avx2_fma", "avx512_bf16"),
        "q8_0": ("avx512_bf16",),
    }
    for fmt, offset in [("q4_0", 8), ("mxfp4", 12), ("nvfp4", 12), ("q8_0", 128)]:
        want = _int8_blocks(x, offset, fmt == "nvfp4")
        for tier in tiers:
            got = _cpu_ext.prepare(x, fmt, tier)
            assert got == (want if tier in int8[fmt] else b""), (fmt, tier)
            if got:
                assert _cpu_ext.prepare(x, fmt, tier, reference=True) == want, (fmt, tier)
