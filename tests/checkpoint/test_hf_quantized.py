"""Quantized Hugging Face checkpoints load as they are: FP8 block-scaled, NVFP4 (ModelOpt and
compressed-tensors) and MXFP4 (gpt-oss's blocks / scales) experts keep their stored codes in the
matching expert format, dense weights are dequantized, and the logits equal transformers run on
this file's own float64 dequantization of what was written."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from hf_models import load_hf, make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.checkpoint.safetensors_io import CheckpointError, save_file

BASE = dict(dtype="float32", max_context=48, max_batch=2, page_size=4, prefill_chunk=16)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def e2m1_codes(x):
    return np.abs(x[..., None] - E2M1).argmin(-1).astype(np.uint8)


def pack(codes):  # low nibble: the even element
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


# Each writer: float32 [O, I] → ({suffix: stored array}, its float64 dequantization).
def fp8(w, block):
    bo, bi = block
    O, I = w.shape
    t = np.pad(w, [(0, -O % bo), (0, -I % bi)]).reshape(-(-O // bo), bo, -(-I // bi), bi)
    s = (np.abs(t).max(axis=(1, 3)) / 448).astype(np.float32) + np.float32(1e-12)
    tile = np.repeat(np.repeat(s, bo, 0), bi, 1)[:O, :I]
    q = (w / tile).astype(ml_dtypes.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": s}, q.astype(np.float64) * tile


def nvfp4(w, compressed):
    O, I = w.shape
    g = np.float32(np.abs(w).max() / (448 * 6))
    s = (np.abs(w.reshape(O, -1, 16)).max(-1) / 6 / g).astype(ml_dtypes.float8_e4m3fn)
    scale = s.astype(np.float64) * g
    codes = e2m1_codes(w.reshape(O, -1, 16) / np.where(scale == 0, 1, scale)[..., None]).reshape(O, I)
    deq = (E2M1[codes].reshape(O, -1, 16) * scale[..., None]).reshape(O, I)
    if compressed:  # compressed-tensors stores the reciprocal global scale
        return {"weight_packed": pack(codes), "weight_scale": s, "weight_global_scale": np.array([1 / g], np.float32)}, deq
    return {
        "weight": pack(codes),
        "weight_scale": s,
        "weight_scale_2": np.array(g, np.float32),
        "input_scale": np.array(1.0, np.float32),
    }, deq


def mxfp4(w):  # [..., O, I] → blocks [..., O, I/32, 16], scales [..., O, I/32]
    b = w.reshape(*w.shape[:-1], -1, 32)
    e = np.clip(np.floor(np.log2(np.maximum(np.abs(b).max(-1), 1e-30))) - 2 + 127, 0, 254).astype(np.uint8)
    scale = np.exp2(e.astype(np.float64) - 127)
    codes = e2m1_codes(b / scale[..., None])
    return {"_blocks": pack(codes), "_scales": e}, (E2M1[codes] * scale[..., None]).reshape(w.shape)


def write(variant, kind, root, out, block=(128, 128)):
    """A quantized copy of a tiny checkpoint and the transformers model of its dequantization."""
    model = load_hf(make_checkpoint(variant, root))
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    tensors, ref = {}, {}

    def quant(name, w):  # name ends in ".weight"
        if kind == "fp8":
            parts, deq = fp8(w, block)
        else:
            parts, deq = nvfp4(w, kind == "nvfp4_ct")
        for k, v in parts.items():
            tensors[name[: -len("weight")] + k] = v
        return deq

    for k, w in sd.items():
        if ".experts." in k and not k.endswith("_bias"):
            E = w.shape[0]
            if kind == "mxfp4":  # gpt-oss's fused blocks and scales
                t = variant == "gpt_oss"  # transformers keeps its banks [E, in, out]; the MXFP4 blocks are [E, out, in]
                parts, deq = mxfp4(np.swapaxes(w, 1, 2) if t else w)
                for suffix, v in parts.items():
                    tensors[k + suffix] = v
                ref[k] = np.swapaxes(deq, 1, 2) if t else deq
                continue
            F = sd[k.replace("gate_up_proj", "down_proj")].shape[-1]
            gate, up, down = ("w1", "w3", "w2") if variant == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            deq = []
            for e in range(E):  # per-expert tensors, as the FP8 / NVFP4 exports name them
                p = k.rsplit(".", 1)[0].replace(".mlp.", ".block_sparse_moe." if variant == "mixtral" else ".mlp.") + f".{e}."
                if k.endswith("gate_up_proj"):
                    deq.append(np.concatenate([quant(p + gate + ".weight", w[e, :F]), quant(p + up + ".weight", w[e, F:])]))
                else:
                    deq.append(quant(p + down + ".weight", w[e]))
            ref[k] = np.stack(deq)
        elif kind != "mxfp4" and k.endswith("_proj.weight") and "layers" in k:  # dense linears; routers and lm_head stay float
            ref[k] = quant(k, w)
        else:  # Mixtral checkpoints name the MoE block block_sparse_moe
            tensors[k.replace(".mlp.", ".block_sparse_moe.") if variant == "mixtral" else k], ref[k] = w, w
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "fp8": dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block)),
        "nvfp4": dict(quant_method="modelopt", quant_algo="NVFP4", group_size=16),
        "nvfp4_ct": dict(quant_method="compressed-tensors", format="nvfp4-pack-quantized"),
        "mxfp4": dict(quant_method="mxfp4"),
    }[kind]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in ref.items()}, strict=False)
    return model


@pytest.mark.parametrize("variant,kind", [("qwen3_moe_norm", "fp8"), ("mixtral", "fp8"), ("qwen3_moe_k", "nvfp4"), ("qwen3_moe_k", "nvfp4_ct"),
                                          ("qwen3_moe_norm", "mxfp4"), ("gpt_oss", "mxfp4")])  # fmt: skip
def test_quantized_checkpoint_logits_equal_transformers_on_its_dequantization(variant, kind, ckpt_root, tmp_path):
    ref = write(variant, kind, ckpt_root, str(tmp_path / "q"))
    eng = FreeTokenEngine.from_pretrained(str(tmp_path / "q"), EngineConfig(**BASE, moe_strategy="fused"))
    assert eng.model_config.expert_format == {"nvfp4_ct": "nvfp4"}.get(kind, kind)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(eng.logits(PROMPT)), want, atol=2e-4 * np.abs(want).max(), rtol=0)


def test_fp8_strategies_agree_and_tiles_that_are_not_128_wide_need_a_requantize(ckpt_root, tmp_path, monkeypatch):
    write("qwen3_moe_norm", "fp8", ckpt_root, str(tmp_path / "a"), block=(32, 128))  # tiles shorter than the rows
    monkeypatch.setenv("FREETOKEN_CPU_TIER", "avx512f")
    fused = FreeTokenEngine.from_pretrained(str(tmp_path / "a"), EngineConfig(**BASE, moe_strategy="fused"))
    want = fused.generate_batch([PROMPT], max_new_tokens=6, ignore_eos=True)
    for strategy, kw in (("offload", dict(expert_slots=4)), ("cpu", {})):
        eng = FreeTokenEngine.from_pretrained(str(tmp_path / "a"), EngineConfig(**BASE, moe_strategy=strategy, **kw))
        assert eng.generate_batch([PROMPT], max_new_tokens=6, ignore_eos=True) == want, strategy
    ref = write("qwen3_moe_norm", "fp8", ckpt_root, str(tmp_path / "b"), block=(64, 32))
    with pytest.raises(CheckpointError, match="32 wide along the input.*expert_format"):
        FreeTokenEngine.from_pretrained(str(tmp_path / "b"), EngineConfig(**BASE))
    eng = FreeTokenEngine.from_pretrained(str(tmp_path / "b"), EngineConfig(**BASE, expert_format="q8_0"))  # asked for
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(np.asarray(eng.logits(PROMPT)) - want).max() < 0.02 * np.abs(want).max()


def test_mismatched_scales_and_unknown_methods_are_refused(ckpt_root, tmp_path):
    from freetoken_jax.checkpoint.safetensors_io import SafetensorsDir

    write("qwen3_moe_norm", "fp8", ckpt_root, str(tmp_path / "a"))
    st = SafetensorsDir(str(tmp_path / "a"))
    tensors = {k: np.asarray(st.get(k)) for k in st.where}
    bad = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    tensors[bad] = np.ones((3, 3), np.float32)
    save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=bad.replace(".", r"\.") + r" has shape \(3, 3\)"):
        FreeTokenEngine.from_pretrained(str(tmp_path / "a"), EngineConfig(**BASE, moe_strategy="fused"))
    cfg = json.load(open(tmp_path / "a" / "config.json"))
    cfg["quantization_config"] = dict(quant_method="awq")
    json.dump(cfg, open(tmp_path / "a" / "config.json", "w"))
    with pytest.raises(Exception, match="quantization method 'awq' is not supported"):
        FreeTokenEngine.from_pretrained(str(tmp_path / "a"), EngineConfig(**BASE))


def test_loading_streams_a_tensor_at_a_time(ckpt_root):
    """Every tensor (a layer's expert stack) is read, placed and let go before the next is read:
    reads and placements alternate, and no read array is still referenced once it is placed."""
    import gc
    import weakref

    from freetoken_jax.checkpoint.hf import HFSource, load_params

    src = HFSource(make_checkpoint("qwen2_moe", ckpt_root))
    events, alive = [], []
    get = src.get

    def traced_get(path):
        a = get(path)
        events.append("read")
        alive.append(weakref.ref(a) if a.base is None else None)
        return a

    def place(path, a):
        events.append("place")
        return np.array(a)

    src.get = traced_get
    load_params(src, "float32", place)
    gc.collect()
    assert events == ["read", "place"] * (len(events) // 2) and len(events) > 40
    assert all(r is None or r() is None for r in alive)  # the stacks the loader made are gone
