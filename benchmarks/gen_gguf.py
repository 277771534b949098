"""Writes a `qwen3moe` GGUF of the Qwen3-30B-A3B shape (N layers) with random weights, tensor by
tensor, as the llama.cpp comparison's file: `--experts` bf16 | q4_0 | q4_k | q6_k | q4_k_m (the
routed expert banks' GGUF type; q4_k_m: gate/up Q4_K, down Q6_K in llama.cpp's "more bits" layers
and Q4_K in the rest, as its Q4_K_M recipe types MoE down projections). Everything else bf16,
norms and routers f32. attn_output and ffn_down_exps are zero, so the residual stream stays each
token's own embedding and the router spreads tokens over the experts as a trained one does; zeros
cost the same to read and multiply as any other values.

    python benchmarks/gen_gguf.py --out /tmp/q4k.gguf --layers 24 --experts q4_k
"""

import argparse
import time

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

V, H, NH, NKV, HD, E, K, F, FD = 151936, 2048, 32, 4, 128, 128, 8, 768, 6144
TYPES = {"bf16": Q.BF16, "q4_0": Q.Q4_0, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K}


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose ffn_down Q4_K_M stores as Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", default="q4_0", choices=[*TYPES, "q4_k_m"])
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    t0 = time.time()
    pool = (rng.standard_normal(360_000_000, dtype=np.float32) * 0.02).view(np.uint32)
    pool = ((pool + 0x7FFF + ((pool >> 16) & 1)) >> 16).astype(np.uint16)  # bf16 bits

    def nbytes(shape, qt):
        block, size = gguf.GGML_QUANT_SIZES[qt]
        return (*shape[:-1], shape[-1] // block * size)

    def make(shape, qt, zero=False):
        b = np.zeros(nbytes(shape, qt), np.uint8)
        if zero:
            return b
        if qt == Q.BF16:
            n = int(np.prod(shape))
            off = int(rng.integers(0, pool.size - n))
            return pool[off : off + n].reshape(shape).view(np.uint8).reshape(b.shape)
        block, size = gguf.GGML_QUANT_SIZES[qt]
        blocks = b.reshape(-1, size)
        blocks[:] = rng.integers(0, 256, size=blocks.shape, dtype=np.uint8)
        d = np.frombuffer(np.float16(0.0025 if qt == Q.Q4_0 else 0.0004).tobytes(), np.uint8)
        for o in {Q.Q4_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[qt]:  # the f16 super-block scales
            blocks[:, o : o + 2] = d
        return b

    def expert_type(i, proj):
        if a.experts != "q4_k_m":
            return TYPES[a.experts]
        return Q.Q6_K if proj == "down" and more_bits(i, a.layers) else Q.Q4_K

    plan = [("token_embd.weight", (V, H), Q.BF16, False)]
    for i in range(a.layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (H,), "ones", 0), (p + "attn_q.weight", (NH * HD, H), Q.BF16, False),
                 (p + "attn_k.weight", (NKV * HD, H), Q.BF16, False), (p + "attn_v.weight", (NKV * HD, H), Q.BF16, False),
                 (p + "attn_output.weight", (H, NH * HD), Q.BF16, True), (p + "attn_q_norm.weight", (HD,), "ones", 0),
                 (p + "attn_k_norm.weight", (HD,), "ones", 0), (p + "ffn_norm.weight", (H,), "ones", 0),
                 (p + "ffn_gate_inp.weight", (E, H), "router", 0), (p + "ffn_gate_exps.weight", (E, F, H), expert_type(i, "gate"), False),
                 (p + "ffn_up_exps.weight", (E, F, H), expert_type(i, "up"), False),
                 (p + "ffn_down_exps.weight", (E, H, F), expert_type(i, "down"), True)]  # fmt: skip
    plan += [("output_norm.weight", (H,), "ones", 0), ("output.weight", (V, H), Q.BF16, False)]

    w = gguf.GGUFWriter(a.out, "qwen3moe")
    w.add_block_count(a.layers)
    w.add_context_length(40960)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FD)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_expert_feed_forward_length(F)
    w.add_vocab_size(V)
    w.add_string("tokenizer.ggml.model", "no_vocab")
    w.add_file_type({"bf16": 32, "q4_0": 2, "q4_k": 15, "q6_k": 18, "q4_k_m": 15}[a.experts])
    for name, shape, kind, _ in plan:
        if isinstance(kind, str):
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            w.add_tensor_info(name, nbytes(shape, kind), np.dtype(np.uint8), int(np.prod(nbytes(shape, kind))), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, shape, kind, zero in plan:
        if isinstance(kind, str):
            arr = np.ones(shape, np.float32) if kind == "ones" else rng.standard_normal(shape, dtype=np.float32) * 0.02
        else:
            arr = make(shape, kind, zero)
        w.write_tensor_data(np.ascontiguousarray(arr))
    w.close()
    print(f"wrote {a.out} in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
