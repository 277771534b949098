"""Which strategy `moe_strategy="auto"` runs, from the machine's measured bandwidth profile.

`python -m freetoken_jax.bench bw` measures the machine and writes `<cache dir>/benchbw.json`
(schema version, time, device, CPU model, dtype, figures, recommendation); `load_profile` reads
it back, ignoring — with a message, never an exception — a missing, corrupt, old-schema or
foreign (other GPU or CPU) profile. `resolve_auto` picks fused when every expert fits the
device budget, else offload without a profile (hybrid only on evidence); with one,
`FreeTokenEngine` measures hybrid (at the profile's q and beside it), offload and cpu with a
short decode probe whatever the profile's bandwidth rule recommends (the rule orders nothing
more than the starting q), and keeps the probe's outcome in the profile for the next start of
the same model and settings (`probe_key`).
"""

from __future__ import annotations

import json
import logging
import os
import platform

from freetoken_jax.config import ConfigError, EngineConfig, MoEModelConfig, Strategy
from freetoken_jax.memory.budget import device_memory_bytes, plan_memory
from freetoken_jax.paths import cache_dir
from freetoken_jax.quant.layout import expert_bytes

log = logging.getLogger("freetoken_jax")

SCHEMA = 1
THRESHOLD = 2.0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')}"


def profile_path(path: str | None = None) -> str:
    return path or os.path.join(cache_dir(), "benchbw.json")


def recommend(fig: dict, threshold: float = THRESHOLD, fmt: str = "bf16") -> dict:
    """Strategy and q* from measured figures (contended ones when present), for experts stored as
    `fmt`: the executor's rate on that format (`cpu_moe_<fmt>_gb_s`, scaled by the contention
    measured on bf16) against the link, both in bytes of the format."""
    cpu = fig.get("contended_cpu_moe_gb_s") or fig.get("cpu_moe_gb_s")
    own = fig.get(f"cpu_moe_{fmt}_gb_s") if fmt != "bf16" else None
    if own and cpu and fig.get("cpu_moe_gb_s"):
        cpu = own * cpu / fig["cpu_moe_gb_s"]
    pcie = fig.get("contended_fetch_gb_s") or fig.get("fetch_gb_s") or fig.get("h2d_gb_s")
    if not pcie:
        return dict(strategy="fused", q=None, reason="no accelerator link measured: the experts are in host memory already")
    if not cpu:
        return dict(strategy="offload", q=1.0, reason="no CPU executor figure")
    q = min(1.0, max(0.0, pcie / (pcie + cpu)))
    if cpu > threshold * pcie:
        return dict(strategy="hybrid", q=q, reason=f"CPU {cpu:.1f} GB/s > {threshold} x PCIe {pcie:.1f} GB/s")
    return dict(strategy="offload", q=q, reason=f"CPU {cpu:.1f} GB/s <= {threshold} x PCIe {pcie:.1f} GB/s")


def apart_q(fig: dict, fmt: str = "bf16") -> float | None:
    """q* = Bp / (Bp + Bh) from a profile's figures measured apart (no contended pair: the link
    and the executor each alone), for experts stored as `fmt`; None without those figures. The
    `auto` probe measures hybrid at it beside the recommendation's q, which takes the contended
    pair: on an H100, q4_0 experts, that gave 0.19 (a contended link of 12.6 GB/s) where
    hybrid's balance settled at 0.39 and the figures apart give 0.39 (benchmarks/RESULTS.md)."""
    alone = {k: v for k, v in fig.items() if not k.startswith("contended_")}
    if not (alone.get("cpu_moe_gb_s") and (alone.get("fetch_gb_s") or alone.get("h2d_gb_s"))):
        return None
    return recommend(alone, fmt=fmt)["q"]


def load_profile(path: str | None = None) -> dict | None:
    """The saved profile if it is readable, current and from this machine's device and CPU."""
    p = profile_path(path)
    if not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            prof = json.load(f)
        if not isinstance(prof, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: unreadable (%s); run `python -m freetoken_jax.bench bw` again", p, e)
        return None
    if prof.get("schema") != SCHEMA:
        log.warning("ignoring %s: schema %s, this engine writes %s; run the bench again", p, prof.get("schema"), SCHEMA)
        return None
    if prof.get("device") != device_name() or prof.get("cpu_model") != cpu_model():
        log.warning(
            "ignoring %s: measured on %s / %s, this is %s / %s", p, prof.get("device"), prof.get("cpu_model"), device_name(), cpu_model()
        )
        return None
    if not isinstance(prof.get("recommendation"), dict) or "strategy" not in prof["recommendation"]:
        log.warning("ignoring %s: no recommendation in it", p)
        return None
    return prof


def resolve_auto(cfg: MoEModelConfig, ecfg: EngineConfig, dense: int, kv: int,
                 itemsize: int) -> tuple[EngineConfig, str, tuple[float, ...]]:  # fmt: skip
    """(config with the strategy chosen, why, the values of q at which a decode probe is still to
    measure hybrid before deciding between hybrid, offload and cpu — none: no probe): fused when
    everything fits; else, with a matching benchbw.json, hybrid to be probed against offload (or
    the kept outcome of an earlier probe, or the profile's recommendation as is when
    `auto_probe_steps` is 0); else offload. The probe's q: the recommendation's, it plus each of
    `auto_probe_q_offsets`, and `apart_q` (clamped to [0, 1], each once)."""
    try:
        plan_memory(cfg, ecfg.replace(moe_strategy=Strategy.FUSED), dense, kv, itemsize, device_memory_bytes())
        return ecfg.replace(moe_strategy=Strategy.FUSED), "every expert fits the device budget", ()
    except ConfigError:
        pass
    prof = load_profile()
    if prof is None:
        return (
            ecfg.replace(moe_strategy=Strategy.OFFLOAD),
            ("the experts do not fit and no benchbw.json was measured here: offload (hybrid only on evidence)"),
            (),
        )
    rec = prof["recommendation"]
    if cfg.expert_format != "bf16" and isinstance(prof.get("figures"), dict):
        rec = recommend(prof["figures"], prof.get("threshold", THRESHOLD), cfg.expert_format)
    strategy = Strategy.HYBRID if rec["strategy"] == "hybrid" else Strategy.OFFLOAD
    q = rec.get("q")
    why = f"the experts do not fit; benchbw.json recommends {strategy.value} ({rec.get('reason', '')})"
    cached = cached_probe(prof, probe_key(cfg, ecfg))
    if cached is not None:
        strategy, q = Strategy(cached["strategy"]), cached.get("q", q)
        why += f"; a decode probe of this model here chose {strategy.value} ({cached.get('reason', '')})"
    elif rec["strategy"] == "offload" and ecfg.auto_probe_steps > 0:
        # the bandwidth rule is a hint: hybrid is measured against offload before it is ruled out
        strategy = Strategy.HYBRID
        why += "; hybrid is measured against it by a decode probe"
    new = ecfg.replace(moe_strategy=strategy, hybrid_q=float(q) if q is not None else ecfg.hybrid_q)
    fig = prof.get("figures") or {}
    us, link = fig.get("handoff_ffi_us"), fig.get("contended_fetch_gb_s", fig.get("fetch_gb_s"))
    if isinstance(us, (int, float)) and isinstance(link, (int, float)) and us > 0 and link > 0:
        # the handoff's measured cost in units of one expert's PCIe fetch time
        new = new.replace(hybrid_overhead=us * 1e-6 / (expert_bytes(cfg, itemsize) / (link * 1e9)))
    if not (cached is None and strategy is Strategy.HYBRID and ecfg.auto_probe_steps > 0 and ecfg.max_context >= 4):
        return new, why, ()
    apart = apart_q(fig, cfg.expert_format)
    qs = [new.hybrid_q + d for d in (0.0, *ecfg.auto_probe_q_offsets)] + ([apart] if apart is not None else [])
    return new, why, tuple(dict.fromkeys(round(min(1.0, max(0.0, q)), 6) for q in qs))


def probe_key(cfg: MoEModelConfig, ecfg: EngineConfig) -> str:
    """What a decode probe's outcome depends on: the model's shape and formats, the dtype, the
    slot budget and the batch (the machine is the profile's)."""
    import hashlib

    shape = json.dumps([repr(cfg), ecfg.dtype, ecfg.max_batch, ecfg.expert_slots, ecfg.expert_slots_gb, ecfg.total_vram_gb,
                        ecfg.reserved_vram_gb, ecfg.base_model_vram_gb])  # fmt: skip
    return hashlib.sha256(shape.encode()).hexdigest()[:16]


def cached_probe(prof: dict, key: str) -> dict | None:
    entry = (prof.get("probes") or {}).get(key)
    return entry if isinstance(entry, dict) and entry.get("strategy") in ("hybrid", "offload", "cpu") else None


def remember_probe(key: str, outcome: dict, path: str | None = None) -> None:
    """Adds a decode probe's outcome ({"strategy", "q", "reason"}) to the profile, so that the
    next start with the same model and settings skips the probe. A profile that cannot be
    written is left as it is (the probe runs again next time)."""
    prof = load_profile(path)
    if prof is None:
        return
    prof.setdefault("probes", {})[key] = outcome
    p = profile_path(path)
    try:
        with open(p + ".partial", "w") as f:
            json.dump(prof, f, indent=1)
        os.replace(p + ".partial", p)
    except OSError as e:
        log.warning("could not keep the decode probe's outcome in %s: %s", p, e)
