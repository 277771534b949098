"""The typed seam for routed experts: one backend object per `Strategy`.

A step asks its backend for the MoE layers' expert functions (`expert_fns`), each
`fn(x_TD, ids_TK, w_TK) -> y_TD`, and for the slot cache they leave behind. Backends are pytrees:
what decides the program (host bank views, handoff mode, prefill loading) is static metadata,
what may change between calls without a new executable (hybrid's q, a benchmark's routing skew)
is a traced leaf. The steps take the backend as an argument beside the weights, so the same
weights run under any backend (the auto probe and `bench` switch backends over one set of banks).

| backend | experts live | computed by | slot cache |
|---|---|---|---|
| `Fused` | device | the GPU, from the resident stacks | none |
| `Offload` | host banks | the GPU, from slots (misses fetched) | yes |
| `Hybrid` | host banks | GPU for fetched misses and hits, CPU executor for the rest | yes |
| `Cpu` | host banks | the CPU executor | none |

`runtime/routing.SyntheticRouting` wraps any of them for benchmarks. The GPU-side backends take
`compute` (static): how a layer's routed experts are computed from its banks, by default
`models.routed.routed_experts`; benchmarks put other implementations there
(`bench/expert_impls.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from freetoken_jax.config import COPY_LOADS, EngineConfig, Strategy
from freetoken_jax.memory.slot_cache import SlotCache


def moe_layer_fns(model, make) -> list:
    """One expert function per layer: `make(m)` for the m-th MoE layer, None for dense layers."""
    fns, m = [], 0
    for layer in model.layers:
        fns.append(make(m) if layer.is_moe else None)
        m += layer.is_moe
    return fns


class ExpertBackend:
    """How a step computes routed experts. `expert_fns(model, valid_T, positions_T, slots,
    buffered)` returns (per-layer expert functions, or None for the model's own resident experts;
    a function giving the slot cache after the layers ran). `valid_T` / `positions_T` are the
    step's tokens flattened (padding invalid). `slots` is the slot cache for decode and slot-cache
    prefill, None for a prefill that streams whole layers; `buffered` asks for the double-buffered
    layer prefill through `slots`."""

    strategy: ClassVar[Strategy]

    @property
    def uses_slots(self) -> bool:
        return self.strategy.uses_slots

    def prefill_path(self, cfg, tokens: int, num_slots: int) -> str:
        """How a prefill chunk of `tokens` (rows × length) runs with a slot cache of `num_slots`:
        "slots" (looked up and fetched per token, as decode), "buffered" (whole layers through
        two borrowed layer buffers) or "stream" (each layer's whole bank copied and dropped)."""
        return "stream"

    def for_prefill(self, cfg, tokens: int) -> ExpertBackend:
        """The backend a prefill chunk of `tokens` (rows × length) runs with: this one, except
        where a strategy computes large chunks elsewhere than its decode steps (`Cpu`)."""
        return self

    def for_probe(self, i: int) -> ExpertBackend:
        """The backend the `auto` probe's i-th measurement runs: this one, except where a
        benchmark's routing is drawn from positions alone (`SyntheticRouting`: each probe a
        fresh draw, so that no probe finds the experts of the one before in the slots)."""
        return self

    def expert_fns(self, model, valid_T: jax.Array, positions_T: jax.Array, slots: SlotCache | None, buffered: bool = False):
        raise NotImplementedError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fused(ExpertBackend):
    """Every expert resident: the model computes from its own stacks."""

    compute: Any = dataclasses.field(default=None, metadata=dict(static=True))
    strategy: ClassVar[Strategy] = Strategy.FUSED

    def expert_fns(self, model, valid_T, positions_T, slots, buffered=False):
        if self.compute is None:
            return None, lambda: slots
        blocks = [layer.mlp for layer in model.layers if layer.is_moe]
        return moe_layer_fns(model, lambda m: blocks[m].expert_fn(self.compute)), lambda: slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Offload(ExpertBackend):
    """Experts in host banks, a slot cache on the device; a layer's misses are fetched into
    victim slots by the Pallas kernel. Without slots (prefill of a small cache, the bench's
    `layer` baseline) each layer's whole bank is streamed. `prefill_load`: see `EngineConfig`;
    `host_banks` (numpy views, as `Hybrid`'s; `bank_copy.carried`: only where the copy stream is
    asked for) lets a prefill copy whole banks on the C++ module's copy stream
    (`runtime/bank_copy.py`)."""

    prefill_load: str = dataclasses.field(default="auto", metadata=dict(static=True))
    compute: Any = dataclasses.field(default=None, metadata=dict(static=True))
    host_banks: Any = dataclasses.field(default=None, metadata=dict(static=True))
    strategy: ClassVar[Strategy] = Strategy.OFFLOAD

    def prefill_path(self, cfg, tokens, num_slots):
        """A chunk whose routed experts would reach few of a layer's experts goes through the slots
        (`slot_prefill_pays`); a longer one through two layer buffers when the cache has 2 ×
        num_experts slots, else streams whole layers."""
        from freetoken_jax.runtime.offload import slot_prefill_pays

        if slot_prefill_pays(cfg, tokens, num_slots):
            return "slots"
        return "buffered" if num_slots >= 2 * cfg.num_experts else "stream"

    def expert_fns(self, model, valid_T, positions_T, slots, buffered=False):
        from freetoken_jax.runtime.offload import OffloadExecutor

        ex = OffloadExecutor(model.cfg, model, slots, valid_T, host_banks=self.host_banks, prefill=buffered, prefill_load=self.prefill_load,
                             compute=self.compute)  # fmt: skip
        return ex.expert_fns(model), ex.result


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Hybrid(ExpertBackend):
    """`Offload`, with a share 1 − q of each decode layer's misses computed by the CPU executor
    straight from the host banks (`host_banks`: numpy views, `handoff`: `runtime/handoff.py`).
    `q` is traced (one executable for any q); `overhead` is the handoff's cost in expert fetches
    (see `EngineConfig.hybrid_overhead`). Prefill loads whole layers as `Offload` does."""

    host_banks: Any = dataclasses.field(default=None, metadata=dict(static=True))
    handoff: str = dataclasses.field(default="callback", metadata=dict(static=True))
    overhead: float = dataclasses.field(default=0.0, metadata=dict(static=True))
    prefill_load: str = dataclasses.field(default="auto", metadata=dict(static=True))
    q: Any = None  # a Python float: traced as a (weakly typed) float32 scalar
    compute: Any = dataclasses.field(default=None, metadata=dict(static=True))
    strategy: ClassVar[Strategy] = Strategy.HYBRID
    prefill_path = Offload.prefill_path

    def expert_fns(self, model, valid_T, positions_T, slots, buffered=False):
        from freetoken_jax.runtime.offload import OffloadExecutor

        hybrid = slots is not None and not buffered
        ex = OffloadExecutor(
            model.cfg, model, slots, valid_T, self.q if hybrid else None, self.host_banks, self.handoff, self.overhead, buffered,
            self.prefill_load, self.compute,
        )  # fmt: skip
        return ex.expert_fns(model), ex.result

    def with_q(self, q: float) -> Hybrid:
        return dataclasses.replace(self, q=float(q))

    def as_offload(self) -> Offload:
        return Offload(self.prefill_load, self.compute, self.host_banks)

    def as_cpu(self) -> Cpu:
        """Every routed expert on the CPU, from the same host banks (a large prefill chunk on the
        device where hybrid's prefill copies whole banks)."""
        return Cpu(self.host_banks, self.handoff, self.prefill_load)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cpu(ExpertBackend):
    """Every routed expert computed by the C++ executor from the host banks; no slots. With
    `prefill_load` "copy" or "copy2" (a GPU with room for two or three layers' banks:
    `EngineConfig.prefill_load`) a prefill chunk whose pairs would keep the CPU busier than the
    layer's copy over PCIe (`offload.device_prefill_pays`) runs on the device instead
    (`on_device`): each layer's bank copied in whole while the layers before compute, as
    offload's prefill copies them."""

    host_banks: Any = dataclasses.field(default=None, metadata=dict(static=True))
    handoff: str = dataclasses.field(default="callback", metadata=dict(static=True))
    prefill_load: str = dataclasses.field(default="auto", metadata=dict(static=True))
    on_device: bool = dataclasses.field(default=False, metadata=dict(static=True))
    strategy: ClassVar[Strategy] = Strategy.CPU

    def for_prefill(self, cfg, tokens):
        from freetoken_jax.runtime.offload import device_prefill_pays, host_memory_kind

        # "auto" left unresolved (no memory budget) copies on a GPU, as offload's executor does
        copy = self.prefill_load in COPY_LOADS or (self.prefill_load == "auto" and host_memory_kind() is not None)
        return dataclasses.replace(self, on_device=copy and device_prefill_pays(cfg, tokens))

    def expert_fns(self, model, valid_T, positions_T, slots, buffered=False):
        from freetoken_jax.runtime.offload import CpuExpertExecutor, OffloadExecutor

        if self.on_device:
            load = "copy2" if self.prefill_load == "copy2" else "copy"
            ex = OffloadExecutor(model.cfg, model, None, valid_T, host_banks=self.host_banks, prefill=True, prefill_load=load)
            return ex.expert_fns(model), lambda: slots
        return CpuExpertExecutor(model.cfg, self.host_banks, valid_T, self.handoff).expert_fns(model), lambda: slots


FUSED = Fused()


def make_backend(ecfg: EngineConfig, params=None, host_banks=None) -> ExpertBackend:
    """The backend of `ecfg.moe_strategy` (resolved: not "auto"). Hybrid and cpu read the host
    banks through numpy views: `host_banks` when given (one static object shared by several
    backends: one executable per backend kind), else made from `params`."""
    from freetoken_jax.runtime.handoff import resolve_mode

    s = Strategy(ecfg.moe_strategy)
    if s is Strategy.FUSED:
        return FUSED
    if s is Strategy.AUTO:
        raise ValueError("resolve moe_strategy 'auto' before making its backend")
    from freetoken_jax.runtime.bank_copy import carried, streams

    if host_banks is None and (s is not Strategy.OFFLOAD or streams()):  # offload keeps them only for the stream: `carried`
        from freetoken_jax.runtime.offload import host_bank_views

        host_banks = host_bank_views(params)
    if s is Strategy.OFFLOAD:
        return Offload(ecfg.prefill_load, host_banks=carried(host_banks))
    handoff = resolve_mode(ecfg.cpu_handoff)
    if s is Strategy.CPU:
        return Cpu(host_banks, handoff, ecfg.prefill_load)
    return Hybrid(host_banks, handoff, ecfg.hybrid_overhead, ecfg.prefill_load, float(ecfg.hybrid_q))
