"""gpt-oss against transformers on a tiny random checkpoint (sliding window 6 on alternate layers,
attention sinks, every bias nonzero, YaRN rope, clamped SwiGLU): logits at 1, 7, 37 and 150
tokens and greedy continuations, under every strategy (the CPU executor computes the experts'
biases and activation itself)."""

import numpy as np
import pytest
import torch
from hf_models import load_hf, make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine

ATOL = 1e-4  # float32 on both sides (tests/models/test_models_hf.py)
LENGTHS = (1, 7, 37, 150)


@pytest.fixture(scope="module")
def hf_and_path(ckpt_root):
    path = make_checkpoint("gpt_oss", ckpt_root)
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    refs = {}
    for n in LENGTHS:
        prompt = [int(t) for t in np.random.default_rng(n).integers(0, 96, n)]
        with torch.no_grad():
            refs[n] = (prompt, hf(torch.tensor([prompt])).logits[0].numpy())
    prompt = refs[37][0]
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()
    return path, refs, greedy


@pytest.mark.parametrize("strategy", ["fused", "offload", "hybrid", "cpu"])
def test_gpt_oss_matches_transformers(hf_and_path, strategy):
    path, refs, greedy = hf_and_path
    kw = dict(expert_slots=6, hybrid_q=0.5, hybrid_overhead=0.0) if strategy in ("offload", "hybrid") else {}
    ecfg = EngineConfig(dtype="float32", max_context=192, max_batch=2, page_size=4, prefill_chunk=32, moe_strategy=strategy, **kw)
    engine = FreeTokenEngine.from_pretrained(path, ecfg)
    cfg = engine.model_config
    assert cfg.family == "gpt_oss" and [cfg.window_of(i) for i in range(3)] == [6, 0, 6]
    for n, (prompt, ref) in refs.items():
        np.testing.assert_allclose(engine.logits(prompt), ref, atol=ATOL, rtol=0, err_msg=f"{strategy} at {n} tokens")
    assert list(engine.generate(refs[37][0], max_new_tokens=12, ignore_eos=True)) == greedy, strategy
    if strategy == "hybrid":
        m = engine.get_metrics()
        assert m["experts_on_cpu"] > 0 and m["experts_fetched"] > 0
