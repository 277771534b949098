"""The C++ extension is built by the package's own install and detects the CPU's ISA tiers."""

import platform

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
