"""The kernel profile's arithmetic over a trace (benchmarks/profile_step.py), against counting
each microsecond of a made-up trace."""

import importlib.util
import os
import types

import numpy as np

spec = importlib.util.spec_from_file_location(
    "profile_step", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "profile_step.py")
)
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)


def event(name, start, end):
    return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=start, end=end))


def test_the_compute_outside_the_copies_is_what_no_copy_covers():
    rng = np.random.default_rng(0)
    events = []
    for _ in range(200):
        s = int(rng.integers(0, 5000))
        kind = rng.choice(["Memcpy HtoD (Pinned -> Device)", "Memcpy DtoD", "gemm", "fusion_7", "flash_attn"])
        events.append(event(str(kind), s, s + int(rng.integers(1, 300))))
    covered = np.zeros(6000, bool)
    for e in events:
        if e.name.startswith("Memcpy HtoD"):
            covered[e.time_range.start : e.time_range.end] = True
    want = {}
    for e in events:
        if not e.name.startswith("Memcpy"):
            want[e.name] = want.get(e.name, 0) + int((~covered[e.time_range.start : e.time_range.end]).sum())
    got = profile_step.exposed_time(events)
    assert set(got) == set(want) and all(abs(got[k] - want[k]) < 1e-9 for k in want), (got, want)
    assert 0 < sum(want.values()) < sum(e.time_range.end - e.time_range.start for e in events if not e.name.startswith("Memcpy"))
