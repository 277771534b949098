"""The prefill chunk left to the engine: under offload / hybrid the largest candidate whose
estimated activations fit half of what the memory plan leaves free, else the default; a given
chunk is kept. Then how a layer comes in: whole-bank copies on a GPU where a layer's bank fits
beside the activations, else the fetch. Checked against plain restatements of the rules over
made-up budgets."""

import pytest

from freetoken_jax import EngineConfig, FreeTokenEngine, MoEModelConfig
from freetoken_jax.config import DEFAULT_PREFILL_CHUNK
from freetoken_jax.memory.budget import (
    GB,
    PREFILL_CHUNKS,
    choose_prefill_chunk,
    choose_prefill_load,
    plan_memory,
    prefill_activation_bytes,
)
from freetoken_jax.models.grouping import group_plans

CFG = MoEModelConfig(vocab_size=64, hidden_dim=32, intermediate_dim=48, num_layers=2, num_experts=8, top_k=2, num_heads=4, num_kv_heads=2)


def expected(ecfg, free):
    fits = [t for t in PREFILL_CHUNKS if t <= ecfg.max_context and prefill_activation_bytes(CFG, ecfg, t) <= 0.5 * free]
    return max(fits) if fits else DEFAULT_PREFILL_CHUNK


@pytest.mark.parametrize("strategy", ["offload", "cpu"])  # cpu: its long chunks stream the banks to the device
@pytest.mark.parametrize("budget_gb", [0.01, 0.02, 0.05, 0.2, 1.0, 8.0])
@pytest.mark.parametrize("max_context", [2048, 16384])
def test_the_largest_chunk_that_fits_what_the_plan_leaves(strategy, budget_gb, max_context):
    slots = dict(expert_slots=8) if strategy == "offload" else {}
    ecfg = EngineConfig(dtype="float32", moe_strategy=strategy, **slots, max_context=max_context, max_batch=1, total_vram_gb=budget_gb)
    plan = plan_memory(CFG, ecfg, dense_bytes=10_000, kv_bytes=20_000, itemsize=4, device_bytes=None)
    free = int(budget_gb * GB) - plan.dense_bytes - plan.kv_bytes - plan.slot_bytes
    chunk, why = choose_prefill_chunk(CFG, ecfg, plan)
    assert chunk == expected(ecfg, free), why
    assert prefill_activation_bytes(CFG, ecfg, 2048) == 2 * prefill_activation_bytes(CFG, ecfg, 1024)  # linear in the chunk


def test_given_chunks_and_other_strategies_keep_theirs():
    big = dict(dtype="float32", max_context=16384, max_batch=1, total_vram_gb=8.0)
    for ecfg in (
        EngineConfig(**big, moe_strategy="fused"),
        EngineConfig(dtype="float32", moe_strategy="cpu", max_batch=1),
        EngineConfig(dtype="float32", moe_strategy="offload", expert_slots=8, max_batch=1),
    ):  # fmt: skip  (no budget: the default)
        plan = plan_memory(CFG, ecfg, 10_000, 20_000, 4, None)
        assert choose_prefill_chunk(CFG, ecfg, plan)[0] == DEFAULT_PREFILL_CHUNK
    given = EngineConfig(**big, moe_strategy="offload", expert_slots=8, prefill_chunk=64)
    assert choose_prefill_chunk(CFG, given, plan_memory(CFG, given, 10_000, 20_000, 4, None)) == (64, "prefill_chunk was given")


def test_the_engine_runs_with_the_chunk_it_chose():
    ecfg = EngineConfig(dtype="float32", moe_strategy="offload", expert_slots=16, max_context=2048, max_batch=1, total_vram_gb=1.0)
    eng = FreeTokenEngine(CFG, ecfg)
    assert eng.engine_config.prefill_chunk == 2048  # the context's whole length fits
    ref = FreeTokenEngine(CFG, ecfg.replace(prefill_chunk=16))
    prompt = list(range(1, 60))
    assert list(eng.generate(prompt, max_new_tokens=4, ignore_eos=True)) == list(ref.generate(prompt, max_new_tokens=4, ignore_eos=True))


def test_attention_scores_are_estimated_over_one_block():
    """Many-token attention reads the context in blocks of ATTN_BLOCK positions: past one block,
    a longer context adds nothing to a chunk's activations."""
    from freetoken_jax.memory.kv_cache import ATTN_BLOCK

    def est(max_context):
        return prefill_activation_bytes(CFG, EngineConfig(dtype="float32", max_context=max_context, max_batch=1, page_size=16), 512)

    assert est(ATTN_BLOCK // 2) < est(ATTN_BLOCK) == est(4 * ATTN_BLOCK) == est(16 * ATTN_BLOCK)
    per_token = 8 * CFG.hidden_dim + 2 * CFG.num_heads * ATTN_BLOCK + CFG.top_k * (3 * CFG.intermediate_dim + CFG.hidden_dim)
    rows = max(p.rows for p in group_plans(512, CFG.top_k, CFG.num_experts))  # the grouped experts' largest plan
    assert est(16 * ATTN_BLOCK) == 4 * (512 * per_token + 2 * rows * CFG.hidden_dim)


@pytest.mark.parametrize("strategy", ["offload", "cpu"])  # cpu: "fetch" leaves every chunk on the CPU
@pytest.mark.parametrize("budget_gb", [0.0002, 0.0005, 0.001, 0.01, 1.0])
def test_whole_bank_copies_where_a_layer_fits_beside_the_activations(strategy, budget_gb):
    slots = dict(expert_slots=8) if strategy == "offload" else {}
    ecfg = EngineConfig(dtype="float32", moe_strategy=strategy, **slots, max_context=64, max_batch=1, total_vram_gb=budget_gb,
                        prefill_chunk=16)  # fmt: skip
    plan = plan_memory(CFG, ecfg, dense_bytes=10_000, kv_bytes=20_000, itemsize=4, device_bytes=None)
    free = int(budget_gb * GB) - plan.dense_bytes - plan.kv_bytes - plan.slot_bytes

    def fits(banks):
        return prefill_activation_bytes(CFG, ecfg, 16) + banks * CFG.num_experts * plan.expert_bytes <= 0.5 * free

    assert choose_prefill_load(CFG, ecfg, plan, gpu=True)[0] == ("copy2" if fits(3) else "copy" if fits(2) else "fetch")
    assert choose_prefill_load(CFG, ecfg, plan, gpu=False)[0] == "auto"  # the CPU backend: the executor's rule
    for given in ("copy", "copy2", "fetch"):
        assert choose_prefill_load(CFG, ecfg.replace(prefill_load=given), plan, gpu=True)[0] == given
    unknown = plan_memory(CFG, ecfg.replace(total_vram_gb=None), 10_000, 20_000, 4, None)
    assert choose_prefill_load(CFG, ecfg.replace(total_vram_gb=None), unknown, gpu=True)[0] == "auto"


def test_sizes_are_said_in_a_unit_that_shows_them():
    """`size`: GiB from a tenth of one, MiB from a tenth of one, else KiB; two decimals."""
    from freetoken_jax.memory.budget import size

    for b, want in ((3 * GB, "3.00 GiB"), (GB // 10 + 1, "0.10 GiB"), (GB // 10 - 1, "102.40 MiB"), (1 << 20, "1.00 MiB"),
                    ((1 << 20) // 10 - 1, "102.40 KiB"), (0, "0.00 KiB")):  # fmt: skip
        assert size(b) == want, (b, size(b))
