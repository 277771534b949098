"""FTW: format round trips, both read paths, conversion from Hugging Face and Orbax, and every
error the issue lists."""

import json
import os
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.checkpoint import ftw
from freetoken_jax.checkpoint.convert import convert, main
from freetoken_jax.checkpoint.safetensors_io import CheckpointError
from freetoken_jax.config import ConfigError

EC = EngineConfig(dtype="float32", max_context=64, max_batch=1, page_size=4, prefill_chunk=16)
PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33]


def odd_tensors():
    rng = np.random.default_rng(0)
    return {
        "odd": rng.standard_normal((3, 1001)).astype(np.float32),
        "big": rng.standard_normal((5, 4099)).astype(np.float32),  # spans several tiny shards
        "bf16": rng.standard_normal((7, 33)).astype(ml_dtypes.bfloat16),
        "empty": np.zeros((0, 4), np.float32),
        "scalar": np.array(3.5, np.float32),
        "ints": np.arange(13, dtype=np.int32),
    }


def o_direct_supported(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("direct", [True, False])
def test_format_round_trip(tmp_path, direct):
    t = odd_tensors()
    with ftw.FTWWriter(str(tmp_path / "c"), shard_bytes=4 * 4096) as w:
        for k, v in t.items():
            w.add(k, v, "experts_bank" if k == "big" else "weight")
    names = sorted(os.listdir(tmp_path / "c"))
    assert len([n for n in names if n.endswith(".ftw")]) > 3 and "freetoken_weight.json" in names
    idx = json.loads((tmp_path / "c" / "freetoken_weight.json").read_text())
    assert len(idx["tensors"]["big"]["segments"]) > 1
    for tinfo in idx["tensors"].values():
        assert all(s["offset"] % 4096 == 0 for s in tinfo["segments"])
    with ftw.FTWReader(str(tmp_path / "c"), direct=direct, threads=3, chunk_bytes=8192, verify=True) as r:
        shard0 = str(tmp_path / "c" / ftw.shard_name(0))
        assert r.direct_io == (direct and o_direct_supported(shard0))
        assert r.names(["experts_bank"]) == ["big"]
        for k, v in t.items():
            got = r.get(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            np.testing.assert_array_equal(got, v)


def test_no_partial_output_on_failure(tmp_path, monkeypatch):
    dst = str(tmp_path / "out")
    with pytest.raises(RuntimeError):
        with ftw.FTWWriter(dst, shard_bytes=8192) as w:
            w.add("a", np.ones(100, np.float32))
            raise RuntimeError("interrupted")
    assert not os.path.exists(dst) and not os.path.exists(dst + ".partial")


@pytest.fixture(scope="module")
def hf_and_ftw(ckpt_root, tmp_path_factory):
    out = {}
    root = tmp_path_factory.mktemp("ftw")
    for fam in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"):
        src = make_checkpoint(fam, ckpt_root)
        out[fam] = (src, convert(src, str(root / fam), dtype="f32", shard_gib=64 * 4096 / (1 << 30), progress=False))
    return out


@pytest.mark.parametrize("fam", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_hf_to_ftw_gives_identical_logits(hf_and_ftw, fam):
    src, dst = hf_and_ftw[fam]
    assert len([f for f in os.listdir(dst) if f.endswith(".ftw")]) > 1  # sharded
    assert os.path.isfile(os.path.join(dst, "config.json"))  # non-weight files copied
    idx = json.load(open(os.path.join(dst, "freetoken_weight.json")))
    assert len(idx["source"]["fingerprint"]) == 64 and idx["source"]["kind"] == "safetensors"
    assert {t["kind"] for t in idx["tensors"].values()} == {"weight", "experts_bank"}
    a = FreeTokenEngine.from_pretrained(src, EC).logits(PROMPT)
    b = FreeTokenEngine.from_pretrained(dst, EC, verify=True).logits(PROMPT)
    np.testing.assert_array_equal(a, b)


def test_orbax_round_trip(hf_and_ftw, tmp_path):
    src, _ = hf_and_ftw["qwen2_moe"]
    engine = FreeTokenEngine.from_pretrained(src, EC)
    engine.export_orbax(str(tmp_path / "orbax"))
    dst = convert(str(tmp_path / "orbax"), str(tmp_path / "ftw"), dtype="f32", progress=False)
    assert json.load(open(os.path.join(dst, "freetoken_weight.json")))["source"]["kind"] == "orbax"
    np.testing.assert_array_equal(FreeTokenEngine.from_pretrained(dst, EC).logits(PROMPT), engine.logits(PROMPT))


def test_orbax_export_of_stacked_weights_copies_a_slice_at_a_time(hf_and_ftw, tmp_path, monkeypatch):
    """Weights stacked over the layers (the GPU's default) export as the same tree: each stacked
    leaf copied out of its stack on its own (`Weights.host_params`), equal to `params`' slices."""
    monkeypatch.setenv("FREETOKEN_WEIGHTS", "stacked")
    src, _ = hf_and_ftw["qwen2_moe"]
    engine = FreeTokenEngine.from_pretrained(src, EC)
    w = engine.weights
    assert w.plan is not None and any(j is not None for _, j in w.plan)
    host, dev = jax.tree.leaves(w.host_params), jax.tree.leaves(w.params)
    assert len(host) == len(dev) and all(isinstance(a, np.ndarray) for a in host)
    for a, b in zip(host, dev):
        np.testing.assert_array_equal(a, np.asarray(b))
    engine.export_orbax(str(tmp_path / "orbax"))
    dst = convert(str(tmp_path / "orbax"), str(tmp_path / "ftw"), dtype="f32", progress=False)
    np.testing.assert_array_equal(FreeTokenEngine.from_pretrained(dst, EC).logits(PROMPT), engine.logits(PROMPT))


def test_bf16_conversion_loads(hf_and_ftw, tmp_path):
    src, _ = hf_and_ftw["mixtral"]
    dst = convert(src, str(tmp_path / "bf16"), dtype="bf16", progress=False)
    idx = json.load(open(os.path.join(dst, "freetoken_weight.json")))
    assert {t["dtype"] for n, t in idx["tensors"].items() if "gate/weight" not in n and "norm" not in n} == {"BF16"}
    a = FreeTokenEngine.from_pretrained(src, EC.replace(dtype="bfloat16")).logits(PROMPT)
    b = FreeTokenEngine.from_pretrained(dst, EC.replace(dtype="bfloat16")).logits(PROMPT)
    np.testing.assert_array_equal(a, b)


def test_convert_quantizes_experts_and_loads_without_a_flag(hf_and_ftw, tmp_path):
    src, _ = hf_and_ftw["qwen3_moe"]
    dst = convert(src, str(tmp_path / "q4"), dtype="f32", progress=False, expert_format="q4_0")
    idx = json.load(open(os.path.join(dst, "freetoken_weight.json")))
    assert idx["model_config"]["freetoken_config"]["expert_format"] == "q4_0"
    banks = {t["dtype"] for t in idx["tensors"].values() if t["kind"] == "experts_bank"}
    assert banks == {"U8"}
    loaded = FreeTokenEngine.from_pretrained(dst, EC)  # no expert_format given: the index says q4_0
    on_load = FreeTokenEngine.from_pretrained(src, EC.replace(expert_format="q4_0"))
    assert loaded.model_config.expert_format == "q4_0"
    np.testing.assert_array_equal(loaded.logits(PROMPT), on_load.logits(PROMPT))  # the same bytes either way
    with pytest.raises(ConfigError, match="quantizing them again"):
        FreeTokenEngine.from_pretrained(dst, EC.replace(expert_format="q8_0"))
    with pytest.raises(ConfigError, match="unknown expert format"):
        convert(src, str(tmp_path / "bad"), progress=False, expert_format="q3_k")
    assert not os.path.exists(tmp_path / "bad")


def copy_ftw(hf_and_ftw, tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(hf_and_ftw["mixtral"][1], dst)
    return dst


def test_truncated_shard(hf_and_ftw, tmp_path):
    d = copy_ftw(hf_and_ftw, tmp_path)
    f = d / ftw.shard_name(1)
    f.write_bytes(f.read_bytes()[:-5000])
    with pytest.raises(CheckpointError, match="truncated"):
        FreeTokenEngine.from_pretrained(d, EC)


def test_wrong_magic_and_version(hf_and_ftw, tmp_path):
    d = copy_ftw(hf_and_ftw, tmp_path)
    f = d / ftw.shard_name(0)
    data = bytearray(f.read_bytes())
    data[:8] = b"NOTFTW!!"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="magic"):
        FreeTokenEngine.from_pretrained(d, EC)
    data[:8] = ftw.MAGIC
    data[8:12] = struct.pack("<I", 99)
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="version"):
        FreeTokenEngine.from_pretrained(d, EC)
    idx = json.loads((d / ftw.INDEX).read_text())
    idx["version"] = 2
    (d / ftw.INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="version 2"):
        FreeTokenEngine.from_pretrained(d, EC)


def test_checksum_mismatch(hf_and_ftw, tmp_path):
    d = copy_ftw(hf_and_ftw, tmp_path)
    idx = json.loads((d / ftw.INDEX).read_text())
    seg = idx["tensors"]["layers/1/mlp/experts/down"]["segments"][0]
    f = d / ftw.shard_name(seg["shard"])
    data = bytearray(f.read_bytes())
    data[seg["offset"] + 10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor layers/1/mlp/experts/down"):
        FreeTokenEngine.from_pretrained(d, EC, verify=True)


def test_missing_tensor_and_bad_shape(hf_and_ftw, tmp_path):
    d = copy_ftw(hf_and_ftw, tmp_path)
    idx = json.loads((d / ftw.INDEX).read_text())
    saved = idx["tensors"].pop("layers/0/self_attn/q_proj/weight")
    (d / ftw.INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="layers/0/self_attn/q_proj/weight.*missing"):
        FreeTokenEngine.from_pretrained(d, EC)
    saved["shape"] = [saved["shape"][1], saved["shape"][0]]
    idx["tensors"]["layers/0/self_attn/q_proj/weight"] = saved
    idx["tensors"]["layers/0/self_attn/q_proj/weight"]["shape"] = [7, 7]
    (d / ftw.INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="shape"):
        FreeTokenEngine.from_pretrained(d, EC)


def test_incomplete_conversion_is_refused(hf_and_ftw, tmp_path):
    d = copy_ftw(hf_and_ftw, tmp_path)
    idx = json.loads((d / ftw.INDEX).read_text())
    idx["complete"] = False
    (d / ftw.INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="incomplete"):
        FreeTokenEngine.from_pretrained(d, EC)


def test_disk_full_leaves_nothing(hf_and_ftw, tmp_path, monkeypatch):
    src = hf_and_ftw["mixtral"][0]
    calls = {"n": 0}
    real_add = ftw.FTWWriter.add

    def failing_add(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        return real_add(self, *a, **k)

    monkeypatch.setattr(ftw.FTWWriter, "add", failing_add)
    dst = tmp_path / "full"
    with pytest.raises(CheckpointError, match="No space left"):
        convert(src, str(dst), progress=False)
    assert not dst.exists() and not (tmp_path / "full.partial").exists()


def test_cli(hf_and_ftw, tmp_path, capsys):
    src = hf_and_ftw["qwen3_moe"][0]
    assert main([src, str(tmp_path / "cli"), "--dtype", "f32", "--shard-gib", "0.001"]) == 0
    assert capsys.readouterr().out.strip().endswith("cli")
    assert main([src, str(tmp_path / "cli")]) == 2  # exists: refused, nothing overwritten
    assert "exists" in capsys.readouterr().err


def test_orbax_round_trip_keeps_the_tokenizer(tmp_path):
    engine = FreeTokenEngine.from_pretrained("demo", EC)
    engine.export_orbax(str(tmp_path / "orbax"))
    dst = convert(str(tmp_path / "orbax"), str(tmp_path / "ftw"), dtype="f32", progress=False)
    back = FreeTokenEngine.from_pretrained(dst, EC)
    assert back.tokenizer is not None and back.tokenizer.encode("héllo") == engine.tokenizer.encode("héllo")
    assert list(back.generate("Hi", max_new_tokens=4)) == list(engine.generate("Hi", max_new_tokens=4))
