"""GGUF files as checkpoints: the model config from the metadata, every parameter by its GGUF
tensor, routed experts byte for byte where the engine has their type natively.

`GGUFCheckpoint(path)` opens one `.gguf` file or a split set (`…-00001-of-0000N.gguf`: give any
part) through the `gguf` package's memory-mapped reader, checks every tensor's bytes against
the file, and maps GGUF architectures onto the engine's families (`ARCHS`). The routed experts
of a file whose expert tensors have native types (`native_types`) become banks of those formats
as they are stored, each layer and projection in its own (a Q4_K_M file keeps some down
projections in Q6_K: `MoEModelConfig.expert_formats`); float types become the model dtype;
types the engine has no kernel for, or gate and up of different types, are refused naming the
tensor, unless the caller asks for a format to re-quantize to (`requantize`). Dense tensors of
any type are dequantized (the `gguf` package's dequantizers). Nothing is read until a parameter
is asked for: `checkpoint.hf.load_params` streams a tensor at a time from the mapping.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from freetoken_jax.checkpoint.safetensors_io import CheckpointError
from freetoken_jax.config import ConfigError, MoEModelConfig
from freetoken_jax.quant.layout import PROJECTIONS, ExpertLayout

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


def native_types() -> dict[Any, str]:
    """GGUF tensor types that are engine expert formats, byte for byte ('bf16': float types, cast)."""
    from gguf import GGMLQuantizationType as Q

    return {Q.Q8_0: "q8_0", Q.Q4_0: "q4_0", Q.MXFP4: "mxfp4", Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k", Q.F32: "bf16",
            Q.F16: "bf16", Q.BF16: "bf16"}  # fmt: skip


def _reader(path: str):
    import gguf

    class Reader(gguf.GGUFReader):
        """The package's reader, with each tensor's type and bytes checked against the file
        before its view is made (a truncated file names the first tensor it cuts)."""

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, name, _, dims, raw, offset = field.parts
                name = bytes(name).decode("utf-8", "replace")
                try:
                    qt = gguf.GGMLQuantizationType(int(raw[0]))
                except ValueError as e:
                    raise CheckpointError(f"{path}: tensor {name} has unknown GGUF type {int(raw[0])}") from e
                block, size = gguf.GGML_QUANT_SIZES[qt]
                n = int(np.prod(dims.astype(np.int64)))
                if n % block:
                    raise CheckpointError(f"{path}: tensor {name} ({qt.name}) has {n} elements, not whole blocks of {block}")
                end = int(start_offs + offset[0]) + n // block * size
                if end > len(self.data):
                    raise CheckpointError(
                        f"{path}: tensor {name} needs bytes up to {end} but the file has {len(self.data)}; the file is truncated or corrupt"
                    )
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(path)
    except CheckpointError:
        raise
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from e


def _parts(path: str) -> list[str]:
    m = _SPLIT.match(os.path.basename(path))
    if not m:
        return [path]
    n = int(m["n"])
    d = os.path.dirname(path)
    parts = [os.path.join(d, f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        raise CheckpointError(f"{path} is part of a set of {n} files; missing: {', '.join(map(os.path.basename, missing))}")
    return parts


class GGUFCheckpoint:
    """The metadata and tensors of a GGUF file or split set, read lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise CheckpointError(f"no GGUF file at {self.path!r}")
        self.readers = [_reader(p) for p in _parts(self.path)]
        self.fields: dict[str, Any] = {}
        for r in reversed(self.readers):  # the first part's metadata wins
            for k, f in r.fields.items():
                if not k.startswith("GGUF."):
                    self.fields[k] = f
        self.tensors = {}
        for r in self.readers:
            for t in r.tensors:
                if t.name in self.tensors:
                    raise CheckpointError(f"{self.path}: tensor {t.name} appears in more than one file of the set")
                self.tensors[t.name] = t
        want = self.get("split.tensors.count")
        if want is not None and int(want) != len(self.tensors):
            raise CheckpointError(f"{self.path}: the set declares {want} tensors but its files hold {len(self.tensors)}")
        self.arch = self.get("general.architecture")
        if self.arch not in ARCHS:
            raise ConfigError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; supported: {', '.join(sorted(ARCHS))}")

    # Metadata --------------------------------------------------------------------------------------
    def get(self, key: str, default=None):
        f = self.fields.get(key)
        return default if f is None else f.contents()

    def arch_get(self, key: str, default=None):
        return self.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        v = self.arch_get(key)
        if v is None:
            raise ConfigError(f"{self.path}: the GGUF metadata lacks {self.arch}.{key}, which {self.arch} models need")
        return v

    # Tensors ---------------------------------------------------------------------------------------
    def tensor(self, name: str):
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        return self.tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in numpy order ([out, in] for a matrix)."""
        return tuple(int(d) for d in reversed(self.tensor(name).shape.tolist()))

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy order (any type the `gguf` package can dequantize)."""
        import gguf

        t = self.tensor(name)
        try:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(f"{self.path}: tensor {name} has type {t.tensor_type.name}, which cannot be dequantized") from e
        return np.asarray(a, np.float32).reshape(self.shape(name))

    def raw_rows(self, name: str) -> np.ndarray:
        """A [n, ...] tensor's stored bytes, one row of bytes per leading index (a view of the file)."""
        t = self.tensor(name)
        return t.data.reshape(t.data.shape[0], -1).view(np.uint8)


# Architectures -------------------------------------------------------------------------------------
def _common(ck: GGUFCheckpoint, window: bool = False) -> dict[str, Any]:
    """The keys every architecture shares; `window`: the architecture says which layers a
    `attention.sliding_window` applies to (elsewhere one is refused: llama.cpp ignores it there)."""
    if ck.arch_get("attention.sliding_window") and not window:
        raise ConfigError(f"{ck.path}: {ck.arch}.attention.sliding_window is set, and {ck.arch} does not say which layers it applies to")
    n_layers = int(ck.need("block_count"))
    vocab = ck.arch_get("vocab_size") or ck.shape("token_embd.weight")[0]
    d = dict(
        vocab_size=int(vocab),
        hidden_size=int(ck.need("embedding_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=int(ck.need("attention.head_count")),
        num_key_value_heads=int(ck.arch_get("attention.head_count_kv") or ck.need("attention.head_count")),
        max_position_embeddings=int(ck.arch_get("context_length") or 4096),
        rms_norm_eps=float(ck.arch_get("attention.layer_norm_rms_epsilon") or 1e-6),
        rope_theta=float(ck.arch_get("rope.freq_base") or 10000.0),
        tie_word_embeddings="output.weight" not in ck.tensors,
        bos_token_id=ck.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=ck.get("tokenizer.ggml.eos_token_id"),
        # layers without a router are dense (Qwen's mlp_only_layers)
        mlp_only_layers=[i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in ck.tensors],
    )
    if ck.arch_get("attention.key_length"):
        d["head_dim"] = int(ck.arch_get("attention.key_length"))
    kind = ck.arch_get("rope.scaling.type")
    if kind not in (None, "none"):
        if kind not in ("linear", "yarn"):
            raise ConfigError(f"{ck.path}: rope scaling {kind!r} is not supported")
        d["rope_scaling"] = dict(rope_type=kind, factor=float(ck.need("rope.scaling.factor")))
        if kind == "yarn":
            d["rope_scaling"]["original_max_position_embeddings"] = int(ck.need("rope.scaling.original_context_length"))
    return d


def _qwen3moe(ck):
    return dict(_common(ck), architectures=["Qwen3MoeForCausalLM"], intermediate_size=int(ck.arch_get("feed_forward_length") or 0),
                moe_intermediate_size=int(ck.need("expert_feed_forward_length")), num_experts=int(ck.need("expert_count")),
                num_experts_per_tok=int(ck.need("expert_used_count")), norm_topk_prob=True)  # fmt: skip


def _qwen2moe(ck):
    return dict(_common(ck), architectures=["Qwen2MoeForCausalLM"], intermediate_size=int(ck.arch_get("feed_forward_length") or 0),
                moe_intermediate_size=int(ck.need("expert_feed_forward_length")), num_experts=int(ck.need("expert_count")),
                num_experts_per_tok=int(ck.need("expert_used_count")), norm_topk_prob=False, qkv_bias=True,
                shared_expert_intermediate_size=int(ck.arch_get("expert_shared_feed_forward_length") or 0))  # fmt: skip


def _llama(ck):
    if not ck.arch_get("expert_count"):
        raise ConfigError(f"{ck.path}: a llama GGUF without experts is a dense model; the engine runs mixture-of-experts models")
    F = ck.arch_get("expert_feed_forward_length") or ck.need("feed_forward_length")
    return dict(_common(ck), architectures=["MixtralForCausalLM"], intermediate_size=int(F), num_local_experts=int(ck.need("expert_count")),
                num_experts_per_tok=int(ck.need("expert_used_count")))  # fmt: skip


def _gpt_oss(ck):
    """llama.cpp's `gpt-oss`: sliding-window and full layers alternating (layers 0, 2, ... slide),
    YaRN rope without truncation (the released config's), the experts' gate and up apart."""
    d = _common(ck, window=True)
    n = d["num_hidden_layers"]
    d["rope_scaling"] = dict(d.get("rope_scaling") or {}, beta_fast=32.0, beta_slow=1.0, truncate=False)
    return dict(d, architectures=["GptOssForCausalLM"], intermediate_size=int(ck.need("expert_feed_forward_length")),
                num_local_experts=int(ck.need("expert_count")), num_experts_per_tok=int(ck.need("expert_used_count")),
                sliding_window=int(ck.need("attention.sliding_window")),
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])  # fmt: skip


def _deepseek2(ck):
    """DeepSeek-V2 / V3 (llama.cpp's `deepseek2`: V3 when its gating is sigmoid)."""
    d = _common(ck)
    rope = int(ck.need("rope.dimension_count"))
    key = ck.arch_get("attention.key_length_mla") or ck.need("attention.key_length")
    value = ck.arch_get("attention.value_length_mla") or ck.need("attention.value_length")
    v3 = int(ck.arch_get("expert_gating_func") or 1) == 2
    groups = int(ck.arch_get("expert_group_count") or 1)
    d.update(
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        intermediate_size=int(ck.need("feed_forward_length")),
        moe_intermediate_size=int(ck.need("expert_feed_forward_length")),
        n_routed_experts=int(ck.need("expert_count")),
        num_experts_per_tok=int(ck.need("expert_used_count")),
        n_shared_experts=int(ck.arch_get("expert_shared_count") or 0),
        first_k_dense_replace=int(ck.arch_get("leading_dense_block_count") or 0),
        routed_scaling_factor=float(ck.arch_get("expert_weights_scale") or 1.0),
        norm_topk_prob=bool(ck.arch_get("expert_weights_norm", v3)),
        q_lora_rank=int(ck.arch_get("attention.q_lora_rank") or 0) or None,
        kv_lora_rank=int(ck.need("attention.kv_lora_rank")),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=int(key) - rope,
        v_head_dim=int(value),
        n_group=groups,
        topk_group=int(ck.arch_get("expert_group_used_count") or 1),
        topk_method="noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy",
    )
    d.pop("head_dim", None)
    d["num_key_value_heads"] = d["num_attention_heads"]
    if d.get("rope_scaling", {}).get("rope_type") == "yarn":  # llama.cpp keeps 0.1 · mscale_all_dim
        m = float(ck.arch_get("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1
        d["rope_scaling"].update(mscale=m, mscale_all_dim=m, beta_fast=float(ck.arch_get("rope.scaling.yarn_beta_fast") or 32),
                                 beta_slow=float(ck.arch_get("rope.scaling.yarn_beta_slow") or 1))  # fmt: skip
    return d


# GGUF architecture → (HF config builder, whether attn_q / attn_k rows are in GGML's interleaved
# rope order: llama.cpp's converter permutes them for `llama`, the engine uses Hugging Face's).
ARCHS = {"qwen3moe": (_qwen3moe, False), "qwen2moe": (_qwen2moe, False), "llama": (_llama, True), "deepseek2": (_deepseek2, False),
         "gpt-oss": (_gpt_oss, False)}  # fmt: skip

_LAYER = {
    ("input_layernorm", "weight"): "attn_norm.weight",
    ("post_attention_layernorm", "weight"): "ffn_norm.weight",
    ("self_attn", "q_proj", "weight"): "attn_q.weight",
    ("self_attn", "k_proj", "weight"): "attn_k.weight",
    ("self_attn", "v_proj", "weight"): "attn_v.weight",
    ("self_attn", "o_proj", "weight"): "attn_output.weight",
    ("self_attn", "q_proj", "bias"): "attn_q.bias",
    ("self_attn", "k_proj", "bias"): "attn_k.bias",
    ("self_attn", "v_proj", "bias"): "attn_v.bias",
    ("self_attn", "o_proj", "bias"): "attn_output.bias",
    ("self_attn", "q_norm", "weight"): "attn_q_norm.weight",
    ("self_attn", "k_norm", "weight"): "attn_k_norm.weight",
    ("mlp", "gate", "weight"): "ffn_gate_inp.weight",
    ("mlp", "experts", "gate"): "ffn_gate_exps.weight",
    ("mlp", "experts", "up"): "ffn_up_exps.weight",
    ("mlp", "experts", "down"): "ffn_down_exps.weight",
    ("mlp", "shared_expert_gate", "weight"): "ffn_gate_inp_shexp.weight",
    ("mlp", "shared_experts", "gate_proj", "weight"): "ffn_gate_shexp.weight",
    ("mlp", "shared_experts", "up_proj", "weight"): "ffn_up_shexp.weight",
    ("mlp", "shared_experts", "down_proj", "weight"): "ffn_down_shexp.weight",
    ("mlp", "gate_proj", "weight"): "ffn_gate.weight",
    ("mlp", "up_proj", "weight"): "ffn_up.weight",
    ("mlp", "down_proj", "weight"): "ffn_down.weight",
    ("mlp", "gate", "bias"): "exp_probs_b.bias",
    ("self_attn", "q_a_proj", "weight"): "attn_q_a.weight",
    ("self_attn", "q_a_layernorm", "weight"): "attn_q_a_norm.weight",
    ("self_attn", "q_b_proj", "weight"): "attn_q_b.weight",
    ("self_attn", "kv_a_proj_with_mqa", "weight"): "attn_kv_a_mqa.weight",
    ("self_attn", "kv_a_layernorm", "weight"): "attn_kv_a_norm.weight",
    ("self_attn", "kv_b_proj", "weight"): "attn_kv_b.weight",
    ("self_attn", "sinks"): "attn_sinks.weight",
    ("mlp", "gate", "logit_bias"): "ffn_gate_inp.bias",
    ("mlp", "experts", "bias", "gate"): "ffn_gate_exps.bias",
    ("mlp", "experts", "bias", "up"): "ffn_up_exps.bias",
    ("mlp", "experts", "bias", "down"): "ffn_down_exps.bias",
}


def gguf_name(ck: GGUFCheckpoint, path: tuple) -> str:
    """The GGUF tensor of an engine parameter path."""
    if path == ("embed", "embedding"):
        return "token_embd.weight"
    if path == ("lm_head", "weight"):
        return "output.weight" if "output.weight" in ck.tensors else "token_embd.weight"
    if path == ("norm", "weight"):
        return "output_norm.weight"
    if path[0] == "layers" and tuple(path[2:]) in _LAYER:
        name = f"blk.{path[1]}.{_LAYER[tuple(path[2:])]}"
        if name.endswith(".ffn_norm.weight") and name not in ck.tensors:  # gpt-oss's name for it
            name = name.replace(".ffn_norm.", ".post_attention_norm.")
        return name
    raise CheckpointError(f"{ck.path}: no GGUF tensor is known for the parameter {'/'.join(map(str, path))}")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of attn_q / attn_k rows (interleaved rope pairs → halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expert_tensors(ck: GGUFCheckpoint) -> list[str]:
    return sorted(n for n in ck.tensors if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", n))


def stored_expert_format(ck: GGUFCheckpoint, moe_blocks: list[int]) -> tuple[str | None, tuple, str]:
    """(the engine format of the file's routed experts — the most common one —, the (gate, up,
    down) formats of each MoE layer where they are not all that one, else (); or None and why
    they cannot load as stored). `moe_blocks`: the GGUF block of each MoE layer."""
    names = expert_tensors(ck)
    if not names:
        if any(re.fullmatch(r"blk\.\d+\.ffn_gate\.\d+\.weight", n) for n in ck.tensors):
            raise CheckpointError(
                f"{ck.path}: experts stored one tensor per expert (an old GGUF layout); re-convert the model with current llama.cpp"
            )
        raise CheckpointError(f"{ck.path}: no routed expert tensors (blk.N.ffn_*_exps.weight)")
    native = native_types()
    types = {n: ck.tensor(n).tensor_type for n in names}
    bad = [n for n, t in types.items() if t not in native]
    if bad:
        return None, (), f"tensor {bad[0]} has type {types[bad[0]].name}, which the engine has no expert kernels for"
    fmts = {native[t] for t in types.values()}
    if len(fmts) == 1:
        return fmts.pop(), (), ""
    per_layer = []
    for i in moe_blocks:
        g, u, d = (native[types[f"blk.{i}.ffn_{p}_exps.weight"]] for p in PROJECTIONS)
        if g != u or "bf16" in (g, d):
            a, b = (f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight") if g != u else \
                (f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_down_exps.weight")  # fmt: skip
            return None, (), (f"the routed experts mix types ({a} is {types[a].name}, {b} is {types[b].name}); the engine keeps gate "
                              "and up in one block format per layer, down in one of its own")  # fmt: skip
        per_layer.append((g, u, d))
    counts = {}
    for fs in per_layer:
        for f in fs:
            counts[f] = counts.get(f, 0) + 1
    return max(counts, key=counts.get), tuple(per_layer), ""


def read_config(ck: GGUFCheckpoint, requantize: str | None = None) -> tuple[dict, MoEModelConfig, bool]:
    """(HF-style config dict, model config, whether the experts are dequantized for re-quantizing).
    `requantize`: the format the caller wants the experts in; re-quantizing happens only then."""
    from freetoken_jax.models.registry import family_for

    raw = ARCHS[ck.arch][0](ck)
    cfg = family_for(raw).parse(raw)
    blocks = [i for i, moe in enumerate(cfg.moe_layers) if moe]
    fmt, per_layer, why = stored_expert_format(ck, blocks)
    if requantize is not None and (requantize != fmt or per_layer):
        return raw, cfg, True  # experts as floats; the engine quantizes them to `requantize`
    if fmt is None:
        raise CheckpointError(f"{ck.path}: {why}. Pass expert_format (--expert-format), e.g. 'q8_0', to re-quantize them on load")
    if fmt != "bf16":
        import dataclasses

        try:
            cfg = dataclasses.replace(cfg, expert_format=fmt, expert_formats=per_layer)
        except ConfigError as e:
            raise CheckpointError(f"{ck.path}: {e}") from e
    return raw, cfg, False


class GGUFParams:
    """Engine parameters from a GGUF checkpoint, a source for `checkpoint.hf.load_params`:
    `check(abstract)` before anything is read, then `get(path)` per parameter (expert banks as
    stored bytes, or floats when `dequantize_experts`)."""

    def __init__(self, ck: GGUFCheckpoint, cfg: MoEModelConfig, dequantize_experts: bool):
        self.ck, self.cfg, self.dequantize_experts = ck, cfg, dequantize_experts
        self.permuted = ARCHS[ck.arch][1]

    def _expected_gguf_shape(self, path, want: tuple) -> tuple:
        if path[-2:] == ("shared_expert_gate", "weight"):
            return (want[-1],)
        if path[-2] == "experts" and not self.dequantize_experts and self.cfg.expert_format != "bf16":
            return (want[0], *ExpertLayout.of(self.cfg).shape_of(path[-1]))  # the same in every layer
        return want

    def _split_kv_b(self, name: str) -> tuple[str, str] | None:
        """(attn_k_b, attn_v_b) where the file splits MLA's kv_b (newer llama.cpp converters:
        k_b [heads, kv_lora_rank, nope] transposed, v_b [heads, v, kv_lora_rank])."""
        if name.endswith("attn_kv_b.weight") and name not in self.ck.tensors:
            k, v = name.replace("attn_kv_b", "attn_k_b"), name.replace("attn_kv_b", "attn_v_b")
            if k in self.ck.tensors and v in self.ck.tensors:
                return k, v
        return None

    def _shape(self, name: str) -> tuple[int, ...]:
        split = self._split_kv_b(name)
        if split is None:
            return self.ck.shape(name)
        (h, rank, nope), (h2, v, rank2) = self.ck.shape(split[0]), self.ck.shape(split[1])
        if (h, rank) != (h2, rank2):
            raise CheckpointError(f"{self.ck.path}: {split[0]} {self.ck.shape(split[0])} and {split[1]} {self.ck.shape(split[1])} disagree")
        return (h * (nope + v), rank)

    def check(self, abstract) -> None:
        for p, var in abstract:
            name = gguf_name(self.ck, p)
            want = self._expected_gguf_shape(p, tuple(var.get_value().shape))
            got = self._shape(name)
            if got != want:
                raise CheckpointError(f"{self.ck.path}: {name} has shape {got}, the config needs {want} for {'/'.join(map(str, p))}")

    def get(self, path: tuple) -> np.ndarray:
        name = gguf_name(self.ck, path)
        if path[-2] == "experts" and not self.dequantize_experts and self.cfg.expert_format != "bf16":
            return self.ck.raw_rows(name)  # [E, nbytes]: the bank as stored
        split = self._split_kv_b(name)
        if split is not None:
            k_b, v_b = (self.ck.dequantized(n) for n in split)  # [H, rank, nope], [H, v, rank]
            return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
        a = self.ck.dequantized(name)
        if path[-2:] == ("shared_expert_gate", "weight"):
            a = a.reshape(1, -1)
        if self.permuted and path[-2] in ("q_proj", "k_proj") and path[-1] == "weight":
            heads = self.cfg.num_heads if path[-2] == "q_proj" else self.cfg.num_kv_heads
            a = _unpermute(a, heads)
        return a
