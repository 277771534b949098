"""Every family against transformers: logits at every position and 16-token greedy continuations.

Tolerance: both sides compute in float32 from the same float32 weights; they differ only in the
order of summations (fused einsums, grouped matmuls, paged attention), which moves logits of
magnitude ~1 by a few 1e-6. 1e-4 absolute is tight enough to catch any wrong weight, scale,
rotation or routing decision (those move logits by 1e-2 or more).
"""

import numpy as np
import pytest
import torch
from hf_models import VARIANTS, load_hf, make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.models.registry import config_from_hf

ATOL = 1e-4
PROMPTS = [list(np.random.default_rng(i).integers(0, 96, n)) for i, n in enumerate((21, 7, 1, 13))]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, ckpt_root, small_engine_config):
    path = make_checkpoint(request.param, ckpt_root)
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    return request.param, hf, FreeTokenEngine.from_pretrained(path, small_engine_config)


def hf_greedy(hf, prompt, n=16):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_logits_match(pair):
    name, hf, engine = pair
    for prompt in PROMPTS[:2]:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].numpy()
        got = engine.logits(prompt)
        assert got.shape == ref.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0, err_msg=name)


def test_greedy_matches_generate(pair):
    name, hf, engine = pair
    prompt = PROMPTS[0]
    assert list(engine.generate(prompt, max_new_tokens=16, ignore_eos=True)) == hf_greedy(hf, prompt), name


def test_batch_of_different_lengths(pair):
    name, hf, engine = pair
    outs = engine.generate_batch(PROMPTS, max_new_tokens=16, ignore_eos=True)
    for prompt, out in zip(PROMPTS, outs):
        assert out == hf_greedy(hf, prompt), (name, len(prompt))


def test_config_from_hf_reads_family(pair, ckpt_root):
    name, hf, engine = pair
    cfg = config_from_hf(make_checkpoint(name, ckpt_root))
    assert cfg == engine.model_config
    assert cfg.num_layers == hf.config.num_hidden_layers and cfg.vocab_size == hf.config.vocab_size
    hash(cfg)  # usable as a static jit argument


def test_bfloat16_close_to_float32(ckpt_root):
    """bf16 weights and activations against the float32 engine; the error is reported and bounded."""
    path = make_checkpoint("qwen3_moe", ckpt_root)
    f32 = FreeTokenEngine.from_pretrained(path, EngineConfig(dtype="float32", max_context=64, max_batch=1))
    bf16 = FreeTokenEngine.from_pretrained(path, EngineConfig(dtype="bfloat16", max_context=64, max_batch=1))
    a, b = f32.logits(PROMPTS[0]), bf16.logits(PROMPTS[0])
    err = np.abs(a - b).max() / np.abs(a).max()
    print(f"bf16 vs f32: max |dlogit| / max |logit| = {err:.4f}")
    assert err < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.8
