"""The memory planner: how device memory is divided between dense weights, KV pages and expert
slots, decided (and explained) before anything is allocated."""

from __future__ import annotations

import dataclasses

from freetoken_jax.config import ConfigError, EngineConfig, MoEModelConfig, Strategy
from freetoken_jax.memory.kv_cache import ATTN_BLOCK, attention_block_pages
from freetoken_jax.models.grouping import group_plans
from freetoken_jax.quant.layout import expert_bytes
from pallas_kernels import grouped_experts

GB = 1 << 30


def size(b: float) -> str:
    """`b` bytes in GiB, or in MiB / KiB below a tenth of a GiB / MiB (a figure that reads
    0.00 GiB says nothing)."""
    for unit, n in (("GiB", GB), ("MiB", 1 << 20)):
        if b >= n / 10:
            return f"{b / n:.2f} {unit}"
    return f"{b / 1024:.2f} KiB"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    strategy: str
    dense_bytes: int
    kv_bytes: int
    expert_bytes: int  # one routed expert (gate + up + down)
    all_experts_bytes: int
    slots: int  # expert slots on the device (offload); every expert (fused)
    budget_bytes: int | None  # device bytes the plan may use; None when unknown
    source: str  # where the slot count came from

    @property
    def slot_bytes(self) -> int:
        return self.slots * self.expert_bytes

    def describe(self) -> str:
        budget = size(self.budget_bytes) if self.budget_bytes is not None else "unknown"
        return (
            f"strategy {self.strategy}: dense weights {size(self.dense_bytes)}, KV pages {size(self.kv_bytes)}, "
            f"expert slots {self.slots} x {size(self.expert_bytes)} = {size(self.slot_bytes)} "
            f"(all experts {size(self.all_experts_bytes)}); budget {budget}; slots from {self.source}"
        )


def device_memory_bytes() -> int | None:
    """The device allocator's limit where the backend reports one (GPU), else None."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None
    return stats.get("bytes_limit")


def plan_memory(
    cfg: MoEModelConfig, ecfg: EngineConfig, dense_bytes: int, kv_bytes: int, itemsize: int, device_bytes: int | None
) -> MemoryPlan:
    expert = expert_bytes(cfg, itemsize)
    all_experts = cfg.num_moe_layers * cfg.num_experts * expert
    budget = None
    if ecfg.total_vram_gb is not None:
        budget = int(ecfg.total_vram_gb * GB)
    elif device_bytes is not None:
        budget = device_bytes
    reserved = int((ecfg.reserved_vram_gb or 0.0) * GB)
    base = int(ecfg.base_model_vram_gb * GB) if ecfg.base_model_vram_gb is not None else dense_bytes
    if ecfg.moe_strategy is Strategy.FUSED:
        if budget is not None and base + kv_bytes + all_experts + reserved > budget:
            raise ConfigError(
                f"strategy 'fused' needs {size(base + kv_bytes + all_experts + reserved)} (dense {size(base)}, "
                f"experts {size(all_experts)}, KV {size(kv_bytes)}) but the budget is {size(budget)}; use "
                "moe_strategy='offload' or a smaller max_context / max_batch"
            )
        return MemoryPlan("fused", dense_bytes, kv_bytes, expert, all_experts, cfg.num_moe_layers * cfg.num_experts, budget, "all resident")
    if ecfg.moe_strategy is Strategy.CPU:
        if budget is not None and base + kv_bytes + reserved > budget:
            raise ConfigError(f"the dense weights ({size(base)}) and KV pages ({size(kv_bytes)}) exceed the budget of {size(budget)}")
        return MemoryPlan("cpu", dense_bytes, kv_bytes, expert, all_experts, 0, budget, "none: experts run on the CPU")
    need = ecfg.max_batch * cfg.top_k
    # every expert, plus prefill's two layer buffers, so that a cache with room for everything
    # never evicts
    most = (cfg.num_moe_layers + 2) * cfg.num_experts
    if ecfg.expert_slots is not None or ecfg.expert_slots_gb is not None:
        if ecfg.expert_slots is not None:
            slots, source = ecfg.expert_slots, "expert_slots"
        else:
            slots, source = int(ecfg.expert_slots_gb * 1e9 // expert), f"expert_slots_gb={ecfg.expert_slots_gb:g}"
        if budget is not None and base + kv_bytes + slots * expert + reserved > budget:
            raise ConfigError(
                f"{source}: {slots} slots ({size(slots * expert)}) + dense {size(base)} + KV {size(kv_bytes)} "
                f"exceed the budget of {size(budget)}"
            )
    elif budget is not None:
        free = budget - reserved - base - kv_bytes
        if free < 0:
            raise ConfigError(
                f"the dense weights ({size(base)}) and KV pages ({size(kv_bytes)}) alone exceed the budget of "
                f"{size(budget - reserved)}; lower max_context / max_batch / kv_pages or raise total_vram_gb"
            )
        slots, source = free // expert, "the VRAM budget"
        if ecfg.initial_expert_capacity is not None:
            slots, source = min(slots, ecfg.initial_expert_capacity), "initial_expert_capacity"
    else:
        slots, source = max(need, most // 4), "a default (no device memory figure: a quarter of all experts)"
    if slots < need:
        raise ConfigError(
            f"room for {slots} expert slots, but one decode step at max_batch={ecfg.max_batch} routes up to {need} experts per layer "
            f"({size(need * expert)} of slots); raise the budget, or lower max_batch"
        )
    if slots > most:  # more would never be used: say so rather than quietly give fewer
        source += f", capped at {most} (every routed expert, and two layers' worth of prefill buffers)"
    return MemoryPlan(ecfg.moe_strategy.value, dense_bytes, kv_bytes, expert, all_experts, min(slots, most), budget, source)


def pinned_host_limit() -> int | None:
    """The cap on XLA's pinned host pool (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`, freetoken_jax's
    `__init__` sets its default) in bytes, where banks go to pinned host memory (a GPU); None on
    the CPU backend, whose banks are ordinary host memory."""
    import os

    import jax

    if jax.default_backend() != "gpu":
        return None
    return int(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64")) * GB


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# Prefill chunks `choose_prefill_chunk` tries, largest first, and the share of the device memory
# the plan leaves free that a chunk's activations may take (XLA's own buffers, fragmentation).
PREFILL_CHUNKS = (8192, 4096, 2048, 1024)
ACTIVATION_SHARE = 0.5


def prefill_activation_bytes(cfg: MoEModelConfig, ecfg: EngineConfig, tokens: int) -> int:
    """An upper estimate of one prefill chunk's activations in float32: the residual stream and
    its projections, each attention layer's scores over one block of the gathered context (with
    its softmax; `kv_cache.ATTN_BLOCK` positions, or the whole context where it is shorter), and
    the routed experts' gate, up and activation per token and each pair's output before its
    token sums them; and the grouped experts' rows (`models.grouping`: their inputs and outputs,
    in the largest plan of the chunk, or the tiles of `pallas_kernels.grouped_experts`)."""
    context = ecfg.pages_per_sequence * ecfg.page_size
    block = context if context <= ATTN_BLOCK else attention_block_pages(ecfg.page_size) * ecfg.page_size
    per_token = 8 * cfg.hidden_dim + 2 * cfg.num_heads * block + cfg.top_k * (3 * cfg.intermediate_dim + cfg.hidden_dim)
    T = tokens * ecfg.max_batch
    K, E = cfg.top_k, cfg.num_experts
    rows = max([p.rows for p in group_plans(T, K, E)] + [grouped_experts.padded_rows(T * K, E, grouped_experts.block_m_for(T * K, E))])
    return 4 * (T * per_token + 2 * rows * cfg.hidden_dim)


def plan_free_bytes(ecfg: EngineConfig, plan: MemoryPlan) -> int:
    """Device bytes the plan leaves to XLA's own buffers (prefill's activations among them)."""
    reserved = int((ecfg.reserved_vram_gb or 0.0) * GB)
    return plan.budget_bytes - reserved - plan.dense_bytes - plan.kv_bytes - plan.slot_bytes


def choose_prefill_load(cfg: MoEModelConfig, ecfg: EngineConfig, plan: MemoryPlan, gpu: bool) -> tuple[str, str]:
    """(prefill_load, why) for an `ecfg` whose chunk is settled: "auto" becomes "copy2" on a GPU
    when three layers' banks fit beside the chunk's activations in `ACTIVATION_SHARE` of what the
    plan leaves free (a layer computes from its copied bank while the next two layers' copies
    land in device buffers of their own), "copy" when two do, else "fetch" (into the borrowed
    buffers; nothing more; under strategy cpu, the CPU computes every chunk). Unchanged where it
    was given, off a GPU, or without a budget (the executor's own rule: `runtime/offload.py`)."""
    streams = ecfg.moe_strategy.uses_slots or ecfg.moe_strategy is Strategy.CPU
    if ecfg.prefill_load != "auto" or not streams or plan.budget_bytes is None or not gpu:
        return ecfg.prefill_load, "as given, or the executor's rule"
    bank = cfg.num_experts * plan.expert_bytes
    activations = prefill_activation_bytes(cfg, ecfg, ecfg.chunk)
    free = plan_free_bytes(ecfg, plan)
    for load, banks, many in (("copy2", 3, "three"), ("copy", 2, "two")):
        if activations + banks * bank <= ACTIVATION_SHARE * free:
            return (
                load,
                f"{many} layers' banks ({size(banks * bank)}) and the chunk's activations fit half of the {size(free)} the plan leaves free",
            )
    return (
        "fetch",
        f"two layers' banks ({size(2 * bank)}) and the chunk's activations do not fit half of the {size(max(free, 0))} the plan leaves free",
    )


def choose_prefill_chunk(cfg: MoEModelConfig, ecfg: EngineConfig, plan: MemoryPlan) -> tuple[int, str]:
    """(prefill chunk, why) for an `ecfg` that leaves it to be chosen: under offload / hybrid /
    cpu (whose long chunks go to the device, `runtime/offload.device_prefill_pays`), with a known
    budget, the largest of `PREFILL_CHUNKS` no longer than the context whose activations take at
    most `ACTIVATION_SHARE` of what the plan leaves free; else the default."""
    if ecfg.prefill_chunk is not None:
        return ecfg.prefill_chunk, "prefill_chunk was given"
    default = ecfg.chunk
    if not (ecfg.moe_strategy.uses_slots or ecfg.moe_strategy is Strategy.CPU) or plan.budget_bytes is None:
        return default, "the default (larger chunks pay under offload / hybrid / cpu, where each chunk streams the experts)"
    free = plan_free_bytes(ecfg, plan)
    for t in PREFILL_CHUNKS:
        if t <= ecfg.max_context and prefill_activation_bytes(cfg, ecfg, t) <= ACTIVATION_SHARE * free:
            return (
                t,
                f"the largest chunk whose activations (~{size(prefill_activation_bytes(cfg, ecfg, t))}) fit half of the {size(free)} the plan leaves free",
            )
    return (
        default,
        f"the default: a chunk of {PREFILL_CHUNKS[-1]} would not fit half of the {size(max(free, 0))} the plan leaves free",
    )
