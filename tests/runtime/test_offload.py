"""Strategy "offload": experts in host banks, a slot cache on the device, misses fetched by the
Pallas kernel inside the decode step. It must give the fused strategy's tokens and logits, and
its slot maps must follow a plain-Python LRU model driven by the same routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import make_checkpoint

from freetoken_jax import ConfigError, EngineConfig, FreeTokenEngine, MoEModelConfig
from freetoken_jax.runtime.steps import DecodeBatch

# qwen3_moe, deepseek_v3 and mixtral run offload in tests/quant/test_quantized_strategies.py
# (mixtral's bf16 offload decode also in tests/runtime/test_prefill.py)
FAMILIES = ["qwen2_moe", "deepseek_v2"]
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [27, 18, 28]]


def engines(path, **offload_kw):
    # both rows decode together even with the minimum slots (one step's experts for max_batch rows)
    base = dict(dtype="float32", max_context=48, max_batch=2, max_running=2, page_size=4, prefill_chunk=16)
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**base))
    off = FreeTokenEngine.from_pretrained(path, EngineConfig(**base, moe_strategy="offload", **offload_kw))
    return fused, off


@pytest.mark.parametrize("family", FAMILIES)
def test_offload_matches_fused(family, ckpt_root):
    path = make_checkpoint(family, ckpt_root)
    fused, _ = engines(path)
    want = fused.generate_batch(PROMPTS, max_new_tokens=12, ignore_eos=True)
    cfg = fused.model_config
    minimum = 2 * cfg.top_k
    for slots in (minimum, (cfg.num_moe_layers + 2) * cfg.num_experts + 5):
        _, off = engines(path, expert_slots=slots)
        assert off.generate_batch(PROMPTS, max_new_tokens=12, ignore_eos=True) == want, (family, slots)
        m = off.get_metrics()
        assert m["expert_slots"] == min(slots, (cfg.num_moe_layers + 2) * cfg.num_experts)
        assert m["bytes_fetched"] == m["experts_fetched"] * 3 * cfg.hidden_dim * cfg.moe_intermediate_dim * 4
        # with the minimum, decode must fetch; with room for all, prefill's buffers may have left every expert needed resident
        assert m["experts_fetched"] > 0 or slots != minimum
        np.testing.assert_allclose(off.logits(PROMPTS[0]), fused.logits(PROMPTS[0]), atol=1e-5, rtol=0)
        assert off.compilations()["decode"] == 1


def test_all_hits_after_warmup(ckpt_root):
    path = make_checkpoint("qwen3_moe", ckpt_root)
    _, off = engines(path, expert_slots=10_000)
    off.generate_batch(PROMPTS, max_new_tokens=4, ignore_eos=True)
    before = off.get_metrics()
    # Every expert is resident by now? Not necessarily; repeat until no new fetches happen.
    for _ in range(3):
        off.generate_batch(PROMPTS, max_new_tokens=4, ignore_eos=True)
    a = off.get_metrics()
    off.generate_batch(PROMPTS, max_new_tokens=4, ignore_eos=True)
    b = off.get_metrics()
    assert b["experts_fetched"] == a["experts_fetched"], "repeating the same requests with room for every expert must fetch nothing"
    assert b["expert_hit_rate"] > before["expert_hit_rate"]


class LRUModel:
    """A plain-Python model of the slot cache's global LRU."""

    def __init__(self, cache):
        """Starts from the maps and clocks of `cache` (a SlotCache of numpy arrays)."""
        self.slot_for_id: dict[int, int] = {i: int(s) for i, s in enumerate(cache.slot_for_id) if s >= 0}
        self.id_of_slot = cache.id_of_slot.tolist()
        self.last_use = cache.last_use.tolist()
        self.clock = int(cache.clock)

    def layer_step(self, needed: list[int]) -> None:
        distinct = list(dict.fromkeys(i for i in needed if i >= 0))
        in_use = {self.slot_for_id[i] for i in distinct if i in self.slot_for_id}
        order = sorted(range(len(self.id_of_slot)), key=lambda s: (float("inf") if s in in_use else self.last_use[s], s))
        misses = [i for i in distinct if i not in self.slot_for_id]
        for victim, i in zip(order, misses):
            assert victim not in in_use, "a victim must never be a slot this layer needs"
            old = self.id_of_slot[victim]
            if old >= 0:
                del self.slot_for_id[old]
            self.slot_for_id[i], self.id_of_slot[victim] = victim, i
        for i in distinct:
            self.last_use[self.slot_for_id[i]] = self.clock
        self.clock += 1


@pytest.mark.parametrize("slots,place", [(4, "xla"), (7, "kernel"), (20, "xla"), (20, "kernel")])
def test_slot_maps_follow_the_lru_model(slots, place, monkeypatch):
    """4 and 7 slots: each layer sorts its own victims, after a prefill that leaves the cache
    empty; 20 ≥ (3 layers + 1) × 4 entries: one sort a step (`StepVictims`), after a prefill
    through two borrowed layer buffers that leaves two layers resident. Misses placed by XLA's
    computation or by `pallas_kernels/slot_place.py` (FREETOKEN_SLOT_PLACE)."""
    monkeypatch.setenv("FREETOKEN_SLOT_PLACE", place)
    cfg = MoEModelConfig(
        vocab_size=64, hidden_dim=32, intermediate_dim=48, num_layers=3, num_experts=8, top_k=2, num_heads=4, num_kv_heads=2
    )
    eng = FreeTokenEngine(
        cfg, EngineConfig(dtype="float32", max_context=40, max_batch=2, page_size=4, moe_strategy="offload", expert_slots=slots)
    )
    from freetoken_jax.runtime.steps import PrefillBatch, Sampling

    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]
    runner = eng.runner
    table = np.zeros((2, eng.engine_config.pages_per_sequence), np.int32)
    for b, p in enumerate(prompts):
        pages = runner.pages.allocate(len(p) + 20)
        table[b, : len(pages)] = pages
    first = runner.prefill(PrefillBatch.chunk(prompts, [0, 0], table, 16, Sampling.greedy(2)))
    runner.set_rows(np.arange(2), first, [6, 3])
    batch = DecodeBatch(jnp.asarray(table), jnp.asarray([True, True]), Sampling.greedy(2))
    model = LRUModel(jax.tree.map(np.asarray, runner.slots))
    assert (sum(i >= 0 for i in model.id_of_slot) > 0) == (slots >= 2 * cfg.num_experts)
    E = cfg.num_experts
    banks = [
        [np.asarray(layer["mlp"]["experts"][k].get_value()) for k in ("gate", "up", "down")]
        for layer in eng.weights.params["layers"].values()
    ]
    for _ in range(16):
        runner.decode(batch)
        c = jax.tree.map(np.asarray, runner.slots)
        for layer in range(cfg.num_moe_layers):
            model.layer_step(c.routed_LN[layer].tolist())
        slot_for_id = {i: int(s) for i, s in enumerate(c.slot_for_id) if s >= 0}
        assert slot_for_id == model.slot_for_id
        assert c.id_of_slot.tolist() == model.id_of_slot
        assert c.last_use.tolist() == model.last_use and int(c.clock) == model.clock
        for s, i in enumerate(c.id_of_slot):  # bijection, and each slot holds its expert's rows
            if i >= 0:
                assert c.slot_for_id[i] == s
                for k, arr in enumerate((c.gate_SR, c.up_SR, c.down_SR)):
                    np.testing.assert_array_equal(arr[s], banks[i // E][k][i % E])


def test_budget_too_small_is_refused_before_allocation():
    cfg = MoEModelConfig(
        vocab_size=64, hidden_dim=32, intermediate_dim=48, num_layers=3, num_experts=8, top_k=2, num_heads=4, num_kv_heads=2
    )
    with pytest.raises(ConfigError, match="routes up to 8 experts"):
        FreeTokenEngine(cfg, EngineConfig(dtype="float32", max_context=40, max_batch=4, moe_strategy="offload", expert_slots=7))
    expert = 3 * 32 * 48 * 4
    with pytest.raises(ConfigError, match="one decode step"):
        FreeTokenEngine(
            cfg,
            EngineConfig(
                dtype="float32", max_context=40, max_batch=4, moe_strategy="offload", total_vram_gb=(0.2e6 + 3 * expert) / (1 << 30)
            ),
        )
    with pytest.raises(ConfigError, match="alone exceed the budget") as err:
        FreeTokenEngine(cfg, EngineConfig(dtype="float32", max_context=40, max_batch=4, moe_strategy="offload", total_vram_gb=1e-5))
    assert "of 10.49 KiB" in str(err.value)  # small sizes in the unit that says something (1e-5 GiB), not "0.00 GiB"
    with pytest.raises(ConfigError, match="use moe_strategy='offload'"):
        FreeTokenEngine(cfg, EngineConfig(dtype="float32", max_context=40, max_batch=4, total_vram_gb=1e-4))


def test_budget_plans_slots():
    from freetoken_jax.memory.kv_cache import cache_bytes

    cfg = MoEModelConfig(
        vocab_size=64, hidden_dim=32, intermediate_dim=48, num_layers=3, num_experts=8, top_k=2, num_heads=4, num_kv_heads=2
    )
    expert = 3 * 32 * 48 * 4
    base = EngineConfig(dtype="float32", max_context=40, max_batch=2, moe_strategy="offload", base_model_vram_gb=0.0)
    kv = cache_bytes(cfg, base, 4)
    eng = FreeTokenEngine(cfg, base.replace(total_vram_gb=(kv + 10 * expert + 100) / (1 << 30)))
    assert eng.plan.slots == 10 and eng.plan.kv_bytes == kv and eng.plan.expert_bytes == expert
    assert eng.get_metrics()["expert_slots"] == 10
    roomy = FreeTokenEngine(cfg, base.replace(total_vram_gb=1.0))
    assert roomy.plan.slots == (cfg.num_moe_layers + 2) * cfg.num_experts  # every expert and the two prefill buffers, no more
    capped = FreeTokenEngine(cfg, base.replace(total_vram_gb=1.0, initial_expert_capacity=5))
    assert capped.plan.slots == 5 and "initial_expert_capacity" in capped.get_metrics()["memory_plan"]


def test_host_memory_is_checked(monkeypatch):
    from freetoken_jax import engine as engine_mod

    monkeypatch.setattr(engine_mod, "host_memory_available", lambda: 1000)
    cfg = MoEModelConfig(
        vocab_size=64, hidden_dim=32, intermediate_dim=48, num_layers=3, num_experts=8, top_k=2, num_heads=4, num_kv_heads=2
    )
    ecfg = EngineConfig(dtype="float32", max_context=40, max_batch=2, moe_strategy="offload", expert_slots=4)
    with pytest.raises(ConfigError, match="host RAM"):
        FreeTokenEngine(cfg, ecfg)
    # On a GPU the banks also have to fit XLA's pinned pool: its cap is checked the same way.
    monkeypatch.setattr(engine_mod, "host_memory_available", lambda: 1 << 40)
    monkeypatch.setattr(engine_mod, "pinned_host_limit", lambda: 1000)
    with pytest.raises(ConfigError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
        FreeTokenEngine(cfg, ecfg)
    monkeypatch.setattr(engine_mod, "pinned_host_limit", lambda: 1 << 40)
    FreeTokenEngine(cfg, ecfg)  # both checks pass: the engine is built


def test_slots_beyond_every_expert_are_capped_and_said(ckpt_root):
    path = make_checkpoint("mixtral", ckpt_root)
    _, off = engines(path, expert_slots=10_000)
    cfg = off.model_config
    most = (cfg.num_moe_layers + 2) * cfg.num_experts
    assert off.plan.slots == most and f"capped at {most}" in off.plan.describe()
