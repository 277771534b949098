"""Quantized experts through every strategy: for each format (on one family each; GQA and MLA
attention), fused, offload, hybrid and cpu give the same greedy
tokens and logits within 1e-4 of each other on the same quantized weights (the CPU executor's
int8-activation kernels within their rounding), and stay within the format's tolerance of the
unquantized model."""

import numpy as np
import pytest
from helpers import float_tier, int8_activations
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.config import MoEModelConfig
from freetoken_jax.runtime.cpu_executor import supported_tiers

BASE = dict(dtype="float32", max_context=48, max_batch=2, max_running=2, page_size=4, prefill_chunk=16, hybrid_overhead=0.0)
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [27, 18, 28]]
# Largest logit change against the unquantized model, relative to the largest logit. Per weight, a
# format errs by at most half a step of its block scale: 1/254 of the block's largest weight for
# q8_0, 1/16 for fp8 (3 mantissa bits), 1/16-1/4 for the 4-bit formats; over a layer's inputs these
# errors mostly cancel. Measured on these models: q8_0 0.0024, fp8 0.021, nvfp4 0.017, mxfp4 0.056,
# q4_0 0.068 (Mixtral) and 0.18 (DeepSeek-V3, whose sigmoid router then picks another expert for
# one token). The bounds leave about twice that.
TOLERANCE = {"q8_0": 0.005, "fp8": 0.05, "nvfp4": 0.04, "mxfp4": 0.12, "q4_0": 0.36}
# (the K-quants go through every strategy in tests/checkpoint/test_gguf.py, on a Q4_K_M-typed file)
CASES = [("mixtral", "q4_0"), ("qwen3_moe", "mxfp4"), ("deepseek_v2", "fp8"), ("generic", "nvfp4"), ("generic", "q8_0")]
GENERIC = {
    "generic": MoEModelConfig(vocab_size=96, hidden_dim=64, intermediate_dim=128, num_layers=2, num_experts=6, top_k=2, num_heads=4,
                              num_kv_heads=2),
}  # fmt: skip


def engine(family, path, **kw):
    ecfg = EngineConfig(**BASE, **kw)
    return FreeTokenEngine(GENERIC[family], ecfg) if family in GENERIC else FreeTokenEngine.from_pretrained(path, ecfg)


@pytest.mark.parametrize("family,fmt", CASES)
def test_strategies_agree_on_quantized_experts(family, fmt, ckpt_root, monkeypatch):
    path = None if family in GENERIC else make_checkpoint(family, ckpt_root)
    plain = engine(family, path, moe_strategy="fused")
    fused = engine(family, path, moe_strategy="fused", expert_format=fmt)
    assert fused.model_config.expert_format == fmt and fused.get_metrics()["expert_format"] == fmt
    want = fused.generate_batch(PROMPTS, max_new_tokens=8, ignore_eos=True)
    logits = np.asarray(fused.logits(PROMPTS[0]))
    ref = np.asarray(plain.logits(PROMPTS[0]))
    rel = np.abs(logits - ref).max() / np.abs(ref).max()
    assert 0 < rel <= TOLERANCE[fmt], rel  # quantized: not the same numbers, but close
    k = fused.model_config.top_k
    # the executor's int8 kernels (VNNI from the avx512_bf16 tier up, and AVX2's for the 4-bit
    # formats) multiply activations rounded to int8 blocks, as llama.cpp does; with float32
    # activations the CPU's experts give the device's tokens and logits
    vnni = int8_activations(supported_tiers()[-1], fmt)
    if vnni:
        monkeypatch.setenv("FREETOKEN_CPU_TIER", float_tier(supported_tiers()))
    for strategy, kw in (("offload", dict(expert_slots=2 * k)), ("hybrid", dict(expert_slots=2 * k, hybrid_q=0.5)), ("cpu", {})):
        eng = engine(family, path, moe_strategy=strategy, expert_format=fmt, **kw)
        assert eng.generate_batch(PROMPTS, max_new_tokens=8, ignore_eos=True) == want, (family, fmt, strategy)
        np.testing.assert_allclose(np.asarray(eng.logits(PROMPTS[0])), logits, atol=1e-4, rtol=0)
        if strategy == "hybrid":
            m = eng.get_metrics()
            assert m["experts_on_cpu"] > 0 and m["experts_fetched"] > 0
    # the default tier, int8 activations end to end on one format (each format's int8 kernels
    # against the dequantized reference: tests/runtime/test_cpu_executor_formats.py)
    if vnni and fmt == "q4_0":  # logits within the int8 rounding (5.4e-3 measured)
        monkeypatch.delenv("FREETOKEN_CPU_TIER")
        eng = engine(family, path, moe_strategy="cpu", expert_format=fmt)
        got = np.asarray(eng.logits(PROMPTS[0]))
        assert 0 < np.abs(got - logits).max() < 2e-2


@pytest.mark.parametrize("family,fmt", [("mixtral", "q4_0"), ("qwen3_moe", "mxfp4"), ("generic", "q8_0")])
def test_prefill_over_tiles_reads_quantized_banks(family, fmt, ckpt_root, monkeypatch):
    """A prompt's prefill with FREETOKEN_PREFILL_EXPERTS=tiles — q4_0 and mxfp4 blocks decoded by
    the kernels as they load them, q8_0 dequantized first — gives "grouped"'s logits, fused and
    offload (each layer's bank copied in whole: 2E slots)."""
    path = None if family in GENERIC else make_checkpoint(family, ckpt_root)
    for strategy, kw in (("fused", {}), ("offload", dict(expert_slots=2 * 8))):
        monkeypatch.setenv("FREETOKEN_PREFILL_EXPERTS", "grouped")
        want = np.asarray(engine(family, path, moe_strategy=strategy, expert_format=fmt, **kw).logits(PROMPTS[0]))
        monkeypatch.setenv("FREETOKEN_PREFILL_EXPERTS", "tiles")
        got = np.asarray(engine(family, path, moe_strategy=strategy, expert_format=fmt, **kw).logits(PROMPTS[0]))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=strategy)
