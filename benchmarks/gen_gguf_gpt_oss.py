"""Writes a `gpt-oss` GGUF of the gpt-oss-120b shape (N layers) with random weights for llama.cpp,
streaming tensor by tensor, as `../shared/bench/llamacpp/gen_gguf.py` does for qwen3moe: routed
experts MXFP4 (as released), everything else bf16 (norms, sinks, biases, router f32);
`attn_output` and `ffn_down_exps` (and their biases) are zero, so each token's residual stream
stays its embedding and the router spreads tokens over the experts as a trained one does. Our
side runs the same shape as `bench decode --preset gpt-oss-120b --layers N --routing-skew 0`.

    python benchmarks/gen_gguf_gpt_oss.py --out /tmp/gptoss.gguf --layers 12 --gguf-py .llamacpp/gguf-py
"""

import argparse
import sys
import time

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--layers", type=int, default=12)
ap.add_argument("--experts", type=int, default=128)
ap.add_argument("--gguf-py", default="gguf-py")
a = ap.parse_args()
sys.path.insert(0, a.gguf_py)
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

V, H, NH, NKV, HD, E, K, F = 201088, 2880, 64, 8, 64, a.experts, 4, 2880
rng = np.random.default_rng(0)
t0 = time.time()
pool = (rng.standard_normal(600_000_000, dtype=np.float32) * 0.02).view(np.uint32)  # more than the embedding
pool = ((pool + 0x7FFF + ((pool >> 16) & 1)) >> 16).astype(np.uint16)  # bf16 bits
print(f"pool {time.time() - t0:.1f}s", flush=True)


def bf16(shape):
    n = int(np.prod(shape))
    off = int(rng.integers(0, pool.size - n))
    return pool[off : off + n].reshape(shape).view(np.uint8).reshape(*shape[:-1], shape[-1] * 2)


def mxfp4(shape):  # blocks of 32: an e8m0 scale (2^-7) + 16 bytes of e2m1 pairs
    nb = int(np.prod(shape)) // 32
    b = np.empty((nb, 17), np.uint8)
    b[:, 0] = 127 - 7
    b[:, 1:] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    return b.reshape(*shape[:-1], shape[-1] // 32 * 17)


KINDS = {"bf16": (Q.BF16, lambda s: s[:-1] + (s[-1] * 2,)), "mxfp4": (Q.MXFP4, lambda s: s[:-1] + (s[-1] // 32 * 17,))}

plan = [("token_embd.weight", (V, H), "bf16")]
for i in range(a.layers):
    p = f"blk.{i}."
    plan += [
        (p + "attn_norm.weight", (H,), "ones"), (p + "post_attention_norm.weight", (H,), "ones"),
        (p + "attn_q.weight", (NH * HD, H), "bf16"), (p + "attn_k.weight", (NKV * HD, H), "bf16"), (p + "attn_v.weight", (NKV * HD, H), "bf16"),
        (p + "attn_q.bias", (NH * HD,), "f32"), (p + "attn_k.bias", (NKV * HD,), "f32"), (p + "attn_v.bias", (NKV * HD,), "f32"),
        (p + "attn_output.weight", (H, NH * HD), "zero_bf16"), (p + "attn_output.bias", (H,), "zero_f32"),
        (p + "attn_sinks.weight", (NH,), "f32"),
        (p + "ffn_gate_inp.weight", (E, H), "router"), (p + "ffn_gate_inp.bias", (E,), "f32"),
        (p + "ffn_gate_exps.weight", (E, F, H), "mxfp4"), (p + "ffn_up_exps.weight", (E, F, H), "mxfp4"),
        (p + "ffn_down_exps.weight", (E, H, F), "zero_mxfp4"),
        (p + "ffn_gate_exps.bias", (E, F), "f32"), (p + "ffn_up_exps.bias", (E, F), "f32"), (p + "ffn_down_exps.bias", (E, H), "zero_f32"),
    ]  # fmt: skip
plan += [("output_norm.weight", (H,), "ones"), ("output.weight", (V, H), "bf16")]

w = gguf.GGUFWriter(a.out, "gpt-oss")
w.add_block_count(a.layers)
w.add_context_length(131072)
w.add_embedding_length(H)
w.add_feed_forward_length(F)
w.add_head_count(NH)
w.add_head_count_kv(NKV)
w.add_rope_freq_base(150000.0)
w.add_layer_norm_rms_eps(1e-5)
w.add_expert_count(E)
w.add_expert_used_count(K)
w.add_key_length(HD)
w.add_value_length(HD)
w.add_expert_feed_forward_length(F)
w.add_sliding_window(128)
w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
w.add_rope_scaling_factor(32.0)
w.add_rope_scaling_orig_ctx_len(4096)
w.add_vocab_size(V)
w.add_string("tokenizer.ggml.model", "no_vocab")
w.add_file_type(38)  # MOSTLY_MXFP4_MOE
for name, shape, kind in plan:
    base = kind.removeprefix("zero_")
    if base in KINDS:
        qt, bshape = KINDS[base]
        w.add_tensor_info(name, bshape(shape), np.dtype(np.uint8), int(np.prod(bshape(shape))), raw_dtype=qt)
    else:
        w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_ti_data_to_file()
for _name, shape, kind in plan:
    base = kind.removeprefix("zero_")
    if kind.startswith("zero_"):
        arr = np.zeros(KINDS[base][1](shape), np.uint8) if base in KINDS else np.zeros(shape, np.float32)
    elif base in KINDS:
        arr = {"bf16": bf16, "mxfp4": mxfp4}[base](shape)
    elif kind == "ones":
        arr = np.ones(shape, np.float32)
    else:
        arr = rng.standard_normal(shape, dtype=np.float32) * (0.02 if kind == "router" else 0.1)
    w.write_tensor_data(np.ascontiguousarray(arr))
w.close()
print(f"wrote {a.out} in {time.time() - t0:.1f}s", flush=True)
