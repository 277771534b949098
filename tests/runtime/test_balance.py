"""Hybrid's q controller (`runtime/balance.py`) against a plain model of a layer's two sides, and
the runner moving q by it without a new executable."""

import pytest

from freetoken_jax.runtime import balance
from freetoken_jax.runtime.balance import QBalance


def _sides(q, misses=6.0, fetch_us=56.0, gpu_fixed_us=44.0, cpu_us=45.0, cpu_fixed_us=60.0):
    """A layer's GPU side (fetch of q·misses, then the GPU experts) and CPU side (a job's fixed
    start, then its experts), in µs."""
    return gpu_fixed_us + q * misses * fetch_us, cpu_fixed_us + (1 - q) * misses * cpu_us


def _handoff(q, layers=192):
    """What the handoff records for `layers` windows at q: the CPU side, and the GPU side, or the
    CPU side where the GPU arrived first (it cannot tell by how much)."""
    g, c = _sides(q)
    return layers, max(g, c) * layers * 1e-6, c * layers * 1e-6


def test_q_settles_where_both_sides_end_together():
    lo, hi = 0.0, 1.0  # the balance of the model: bisection on g - c
    for _ in range(60):
        mid = (lo + hi) / 2
        g, c = _sides(mid)
        lo, hi = (lo, mid) if g > c else (mid, hi)
    for start in (0.9, 0.5, 0.1):
        qb, total = QBalance(start), [0, 0.0, 0.0]
        assert qb.observe(dict(count=0, gpu_s=0.0, cpu_s=0.0)) is None  # the first call sets the baseline
        for _ in range(200):
            n, g, c = _handoff(qb.q)
            total = [total[0] + n, total[1] + g, total[2] + c]
            qb.observe(dict(count=total[0], gpu_s=total[1], cpu_s=total[2]))
        assert abs(qb.q - lo) <= balance.STEP_UP, (start, qb.q, lo)
        window, best = max(_sides(qb.q)), max(_sides(lo))
        assert window <= 1.02 * best, (start, window, best)


def test_nothing_moves_without_handoffs_and_q_stays_in_range():
    qb = QBalance(0.4)
    assert qb.observe(dict(count=10, gpu_s=1.0, cpu_s=0.5)) is None
    assert qb.observe(dict(count=10, gpu_s=2.0, cpu_s=0.5)) is None  # no new handoff
    assert qb.observe(dict(count=0, gpu_s=0.0, cpu_s=0.0)) is None  # counters reset: a new baseline
    q = qb.observe(dict(count=100, gpu_s=3.0, cpu_s=1.0))  # GPU side 3 × the CPU side's: down by half the gain
    assert q == pytest.approx(0.4 - balance.GAIN / 2)
    for n in range(2, 200):
        qb.observe(dict(count=100 * n, gpu_s=3.0 * n, cpu_s=1.0 * n))
    assert qb.q == balance.Q_RANGE[0]
    ups = [qb.observe(dict(count=100 * n, gpu_s=3.0 * 199 + (n - 199), cpu_s=1.0 * 199 + (n - 199))) for n in range(200, 260)]
    assert ups[:4] == pytest.approx([0.03, 0.05, 0.09, 0.17])  # sides together: q rises, its step doubling up to MAX_UP
    assert qb.q == balance.Q_RANGE[1]


def test_runner_moves_q_every_few_steps(monkeypatch):
    """The runner asks the controller every BALANCE_STEPS decode steps and runs later steps with
    its q; with `balance=False` q stays."""
    from freetoken_jax.config import Strategy
    from freetoken_jax.runtime import runner as runner_mod

    class Backend:
        strategy = Strategy.HYBRID
        uses_slots = True

        def __init__(self, q):
            self.q = q

        def with_q(self, q):
            return Backend(q)

    class Stub(runner_mod.ModelRunner):
        def __init__(self):  # only what `use` and `_rebalance` touch
            from freetoken_jax.config import EngineConfig

            self.engine_config = EngineConfig(moe_strategy="hybrid")
            self.experts, self.state, self._balance_steps = Backend(0.5), None, 0
            self._balance = self._balancer(self.experts)

    stats = iter([dict(count=0, gpu_s=0.0, cpu_s=0.0), dict(count=10, gpu_s=3.0, cpu_s=1.0)])
    monkeypatch.setattr(runner_mod._cpu_ext, "handoff_stats", lambda reset=False: next(stats))
    r = Stub()
    for _ in range(2 * runner_mod.BALANCE_STEPS):
        r._rebalance()
    assert r.experts.q == pytest.approx(0.5 - balance.GAIN * 0.5) == r.engine_config.hybrid_q
    r.use(Backend(0.3), balance=False)
    for _ in range(4 * runner_mod.BALANCE_STEPS):
        r._rebalance()
    assert r.experts.q == 0.3
