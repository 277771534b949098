"""GGUF files written from the tiny Hugging Face checkpoints, as llama.cpp's converter names and
lays out their tensors, and the float reference model made from the `gguf` package's own
dequantization of what was written."""

from __future__ import annotations

import os

import gguf
import numpy as np
import torch
from hf_models import load_hf

from freetoken_jax.quant.formats import get_format

Q = gguf.GGMLQuantizationType
ARCH = {"qwen3_moe": "qwen3moe", "qwen3_moe_norm": "qwen3moe", "qwen3_moe_k": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
        "deepseek_v2": "deepseek2", "deepseek_v2_qlora": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss"}  # fmt: skip
# llama.cpp's newer converters split MLA's kv_b into attn_k_b / attn_v_b; older ones keep attn_kv_b
SPLIT_KV_B = {"deepseek_v3", "deepseek_v2_qlora"}
OURS = {Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k"}  # no quantizer in `gguf`: ours makes valid blocks


def quantize(w: np.ndarray, qtype) -> np.ndarray:
    """float32 [..., O, I] → the GGUF tensor's data in `qtype` (numpy order, bytes per row)."""
    w = np.ascontiguousarray(w, np.float32)
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype in OURS:
        f = get_format(OURS[qtype])
        rows = w.reshape(-1, w.shape[-1])
        return f.quantize_ref(rows).reshape(*w.shape[:-1], -1)
    return gguf.quants.quantize(w, qtype)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` of q/k rows for `llama` (rope pairs interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF tensor of a layer ← transformers state-dict name (after "model.layers.N.")
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_experts.gate_proj.weight"),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", "mlp.shared_experts.up_proj.weight"),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.down_proj.weight"),
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


# gpt-oss: its own names (llama.cpp's `gpt-oss`), the router's and experts' biases, and the
# experts' interleaved [E, in, 2 x out] gate_up stack split into gate and up
_GPT_OSS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
}  # fmt: skip


def _gpt_oss_experts(sd, p):
    """{GGUF expert tensor: [E, out, in] or bias [E, out]} of one gpt-oss layer."""
    gu, gub, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.gate_up_proj_bias"], sd[p + "mlp.experts.down_proj"]
    return {"ffn_gate_exps.weight": gu[..., ::2].transpose(0, 2, 1), "ffn_up_exps.weight": gu[..., 1::2].transpose(0, 2, 1),
            "ffn_down_exps.weight": down.transpose(0, 2, 1), "ffn_gate_exps.bias": gub[:, ::2], "ffn_up_exps.bias": gub[:, 1::2],
            "ffn_down_exps.bias": sd[p + "mlp.experts.down_proj_bias"]}  # fmt: skip


def gguf_tensors(model, variant: str, expert_type, dense_type=Q.F32):
    """[(gguf name, float32 array, type)] of a transformers model, in llama.cpp's naming and
    layout (q/k rows permuted for llama, experts as [E, out, in] stacks, 1-d tensors float32)."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    llama = ARCH[variant] == "llama"
    out = [("token_embd.weight", sd["model.embed_tokens.weight"], dense_type)]
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        if variant == "gpt_oss":
            out += [
                (b + g, sd[p + hf], Q.F32 if sd[p + hf].ndim == 1 or g == "ffn_gate_inp.weight" else dense_type)
                for g, hf in _GPT_OSS.items()
            ]
            for g, a in _gpt_oss_experts(sd, p).items():
                out.append((b + g, np.ascontiguousarray(a), Q.F32 if g.endswith(".bias") else expert_type))
            continue
        for g, hfs in _LAYER.items():
            hf = next((h for h in ((hfs,) if isinstance(hfs, str) else hfs) if p + h in sd), None)
            if hf is None:
                continue
            a = sd[p + hf]
            if g == "attn_kv_b.weight" and variant in SPLIT_KV_B:  # [H·(nope+v), rank] → k_b [H, rank, nope], v_b [H, v, rank]
                kv = a.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
                out.append((b + "attn_k_b.weight", np.ascontiguousarray(kv[:, : cfg.qk_nope_head_dim].transpose(0, 2, 1)), dense_type))
                out.append((b + "attn_v_b.weight", np.ascontiguousarray(kv[:, cfg.qk_nope_head_dim :]), dense_type))
                continue
            if llama and g in ("attn_q.weight", "attn_k.weight"):
                a = permute(a, cfg.num_attention_heads if g == "attn_q.weight" else cfg.num_key_value_heads)
            if g == "ffn_gate_inp_shexp.weight":
                a = a.reshape(-1)
            out.append((b + g, a, Q.F32 if a.ndim == 1 or g == "ffn_gate_inp.weight" else dense_type))
        if p + "mlp.experts.gate_up_proj" in sd:
            gu, F = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"].shape[-1]
            for g, a in (("ffn_gate_exps", gu[:, :F]), ("ffn_up_exps", gu[:, F:]), ("ffn_down_exps", sd[p + "mlp.experts.down_proj"])):
                qt = expert_type(i, g) if callable(expert_type) else expert_type[g] if isinstance(expert_type, dict) else expert_type
                out.append((b + g + ".weight", a, qt))
    out.append(("output_norm.weight", sd["model.norm.weight"], Q.F32))
    if not cfg.tie_word_embeddings:
        out.append(("output.weight", sd["lm_head.weight"], dense_type))
    return out


def write_metadata(w: gguf.GGUFWriter, cfg, variant: str, tokenizer=None) -> None:
    """The keys llama.cpp's converter writes for `variant`'s architecture."""
    arch = ARCH[variant]
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or rp.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "deepseek2":
        deepseek_metadata(w, cfg, variant, rp)
    elif arch == "gpt-oss":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    elif arch == "llama":
        w.add_expert_count(cfg.num_local_experts)
    else:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch != "deepseek2" and getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if tokenizer is None:
        w.add_tokenizer_model("no_vocab")
    else:
        tokenizer(w)


def deepseek_metadata(w, cfg, variant, rp) -> None:
    """deepseek2's own keys (MLA ranks, shared experts, gating, groups, YaRN)."""
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(float(cfg.routed_scaling_factor))
    v3 = variant == "deepseek_v3"
    w.add_expert_weights_norm(bool(cfg.norm_topk_prob) if v3 else False)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if getattr(cfg, "topk_method", "greedy") != "greedy" or v3:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])


def write_gguf(hf_dir: str, out: str, variant: str, expert_type, dense_type=Q.F32, tokenizer=None, split_max_tensors: int = 0) -> str:
    """Writes `out` (a split set when split_max_tensors > 0: returns its first file)."""
    model = load_hf(hf_dir)
    cfg = model.config
    tensors = gguf_tensors(model, variant, expert_type, dense_type)
    w = gguf.GGUFWriter(out, ARCH[variant], split_max_tensors=split_max_tensors)
    write_metadata(w, cfg, variant, tokenizer)
    for name, a, qt in tensors:
        data = quantize(a, qt)
        w.add_tensor(name, data, raw_dtype=qt if qt not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        stem = out[: -len(".gguf")]
        first = [f for f in sorted(os.listdir(os.path.dirname(out))) if f.startswith(os.path.basename(stem) + "-00001-of-")]
        return os.path.join(os.path.dirname(out), first[0])
    return out


def reference_model(hf_dir: str, gguf_path: str, variant: str):
    """The transformers model of `hf_dir` with every weight replaced by the `gguf` package's
    dequantization of the GGUF file's tensor (q/k un-permuted for llama): the float reference."""
    model = load_hf(hf_dir)
    cfg = model.config
    r = gguf.GGUFReader(gguf_path)
    deq = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32) for t in r.tensors}
    sd = model.state_dict()
    new = {"model.embed_tokens.weight": deq["token_embd.weight"], "model.norm.weight": deq["output_norm.weight"],
           "lm_head.weight": deq.get("output.weight", deq["token_embd.weight"])}  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        if variant == "gpt_oss":
            new.update({p + hf: deq[b + g] for g, hf in _GPT_OSS.items()})
            interleave = lambda g, u: np.stack([g, u], axis=-1).reshape(*g.shape[:-1], -1)  # noqa: E731
            new[p + "mlp.experts.gate_up_proj"] = interleave(
                deq[b + "ffn_gate_exps.weight"].transpose(0, 2, 1), deq[b + "ffn_up_exps.weight"].transpose(0, 2, 1)
            )
            new[p + "mlp.experts.gate_up_proj_bias"] = interleave(deq[b + "ffn_gate_exps.bias"], deq[b + "ffn_up_exps.bias"])
            new[p + "mlp.experts.down_proj"] = deq[b + "ffn_down_exps.weight"].transpose(0, 2, 1)
            new[p + "mlp.experts.down_proj_bias"] = deq[b + "ffn_down_exps.bias"]
            continue
        if b + "attn_k_b.weight" in deq:
            k_b, v_b = deq[b + "attn_k_b.weight"], deq[b + "attn_v_b.weight"]
            deq[b + "attn_kv_b.weight"] = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
        for g, hfs in _LAYER.items():
            hf = next((h for h in ((hfs,) if isinstance(hfs, str) else hfs) if p + h in sd), None)
            if b + g in deq and hf is not None:
                a = deq[b + g]
                if ARCH[variant] == "llama" and g in ("attn_q.weight", "attn_k.weight"):
                    n = cfg.num_attention_heads if g == "attn_q.weight" else cfg.num_key_value_heads
                    a = a.reshape(n, a.shape[0] // n // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
                new[p + hf] = a
        if b + "ffn_gate_exps.weight" in deq:
            new[p + "mlp.experts.gate_up_proj"] = np.concatenate([deq[b + "ffn_gate_exps.weight"], deq[b + "ffn_up_exps.weight"]], axis=1)
            new[p + "mlp.experts.down_proj"] = deq[b + "ffn_down_exps.weight"]
    missing = {k for k in sd if not k.endswith("e_score_correction_bias")} - set(new)
    assert not missing, sorted(missing)[:5]
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)).reshape(sd[k].shape) for k, v in new.items()}, strict=False)
    return model
