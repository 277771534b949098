"""Bad input gets a clear error before anything is allocated, and the engine keeps working."""

import json
import os
import shutil

import numpy as np
import pytest
from hf_models import make_checkpoint

from freetoken_jax import ConfigError, FreeTokenEngine, RequestError
from freetoken_jax.checkpoint.safetensors_io import CheckpointError


@pytest.fixture
def ckpt_copy(ckpt_root, tmp_path):
    src = make_checkpoint("mixtral", ckpt_root)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_missing_directory():
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        FreeTokenEngine.from_pretrained("/nonexistent/model")


def test_text_prompts(small_engine_config):
    eng = FreeTokenEngine.from_pretrained("demo", small_engine_config)
    ids = eng.tokenizer.encode("Hello there")
    assert list(eng.generate("Hello there", max_new_tokens=5)) == list(eng.generate(ids, max_new_tokens=5))
    assert eng.generate_batch(["Hello there"], max_new_tokens=3) == eng.generate_batch([ids], max_new_tokens=3)
    np.testing.assert_array_equal(eng.logits("Hello there"), eng.logits(ids))
    eng.tokenizer = None
    with pytest.raises(RequestError, match="no tokenizer"):
        list(eng.generate("Hello there", max_new_tokens=2))


def test_missing_safetensors(ckpt_copy, small_engine_config):
    os.remove(ckpt_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        FreeTokenEngine.from_pretrained(ckpt_copy, small_engine_config)


def test_truncated_safetensors(ckpt_copy, small_engine_config):
    f = ckpt_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        FreeTokenEngine.from_pretrained(ckpt_copy, small_engine_config)


def test_garbage_header(ckpt_copy, small_engine_config):
    (ckpt_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError):
        FreeTokenEngine.from_pretrained(ckpt_copy, small_engine_config)


def test_missing_tensor_is_named(ckpt_copy, small_engine_config):
    from freetoken_jax.checkpoint.safetensors_io import SafetensorsFile, save_file

    f = SafetensorsFile(str(ckpt_copy / "model.safetensors"))
    tensors = {k: f.get(k).copy() for k in f.keys() if k != "model.layers.1.self_attn.k_proj.weight"}
    del f
    save_file(tensors, str(ckpt_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_proj.weight"):
        FreeTokenEngine.from_pretrained(ckpt_copy, small_engine_config)


def test_shape_disagreeing_with_config(ckpt_copy, small_engine_config):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        FreeTokenEngine.from_pretrained(ckpt_copy, small_engine_config)


def test_unsupported_architecture(ckpt_copy, small_engine_config):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture.*MixtralForCausalLM"):
        FreeTokenEngine.from_pretrained(ckpt_copy, small_engine_config)


def test_corrupt_config(ckpt_copy, small_engine_config):
    (ckpt_copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        FreeTokenEngine.from_pretrained(ckpt_copy, small_engine_config)


@pytest.mark.parametrize(
    "prompt, kw, match",
    [
        ([], {}, "empty"),
        ([1, 2, 400], {}, "out of range"),
        ([-1], {}, "out of range"),
        ([1, 2], dict(max_new_tokens=0), "max_new_tokens"),
        ([1, 2], dict(max_new_tokens=-3), "max_new_tokens"),
        ([1] * 120, dict(max_new_tokens=16), "exceeds the configured context"),
        ([1, 2], dict(top_p=0.0), "top_p"),
    ],
    ids=["empty", "id_over_vocab", "negative_id", "zero_new", "negative_new", "over_context", "zero_top_p"],
)
def test_bad_requests_leave_engine_working(demo_engine, prompt, kw, match):
    free = demo_engine.pages.free_pages
    with pytest.raises(RequestError, match=match):
        list(demo_engine.generate(prompt, **kw))
    with pytest.raises(RequestError, match=match):
        demo_engine.generate_batch([[5, 6], prompt], **kw)
    assert demo_engine.pages.free_pages == free
    assert len(list(demo_engine.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True))) == 3
