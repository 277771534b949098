"""Hybrid's split, kept where both sides of a layer end together.

A hybrid decode layer fetches a share q of its misses and computes the rest on the CPU; the
layer waits for the later of the two sides. q* = Bp / (Bp + Bh) from bandwidth probes leaves out
each side's fixed cost (the GPU computes every slot expert after the fetch; a CPU job has a fixed
start), and on the H200 it left the GPU side 22-53 µs a layer longer than the CPU side
(benchmarks/RESULTS.md). `QBalance` moves q from the FFI handoff's own timing, summed over the
layers of the last steps (`_cpu_ext.handoff_stats`): where the GPU side ran longer, q falls by a
Newton-like step of the imbalance; where the GPU arrived before the CPU job ended, the handoff
records both sides as the job's length — the timing cannot tell by how much the CPU was later —
and q rises by a step that doubles while it keeps rising (from STEP_UP, at most MAX_UP). q then
settles within STEP_UP of the balance.
"""

from __future__ import annotations

GAIN = 0.5  # q falls by GAIN × (gpu − cpu) / (gpu + cpu): about 0.6 of the way to balance at the H200's rates
STEP_UP = 0.01  # q rises by this where the GPU side ended first, doubling while it keeps rising
MAX_UP = 0.08
TOLERANCE = 0.02  # sides within 2 % count as together
Q_RANGE = (0.02, 0.98)


class QBalance:
    """Follows the handoff's cumulative timing (`observe`) and says where q goes next."""

    def __init__(self, q: float):
        self.q = float(q)
        self._last: tuple[int, float, float] | None = None
        self._up = STEP_UP

    def observe(self, stats: dict) -> float | None:
        """`stats`: `handoff_stats()` now (count, gpu_s, cpu_s summed since the last reset).
        Returns the new q, or None while it stays (no handoff since the last call: no FFI
        handoff, or the counters were reset)."""
        now = (int(stats["count"]), float(stats["gpu_s"]), float(stats["cpu_s"]))
        last, self._last = self._last, now
        if last is None or now[0] <= last[0]:
            return None
        gpu, cpu = now[1] - last[1], now[2] - last[2]
        if gpu > cpu * (1 + TOLERANCE):
            q, self._up = self.q - GAIN * (gpu - cpu) / (gpu + cpu), STEP_UP
        elif gpu >= cpu * (1 - TOLERANCE):  # the GPU arrived while (or before) the job ended
            q, self._up = self.q + self._up, min(MAX_UP, 2 * self._up)
        else:
            return None
        q = min(Q_RANGE[1], max(Q_RANGE[0], q))
        if q == self.q:
            return None
        self.q = q
        return q
