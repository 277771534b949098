"""Model and engine configuration: the leaf every other module imports.

`MoEModelConfig` describes one model's geometry and numerics; it is a frozen, hashable dataclass
so that it can be passed straight through `jax.jit` as a static argument. Per-family parsing of
Hugging Face `config.json` lives in `freetoken_jax.models` (`registry.config_from_hf` dispatches
on `architectures`). `EngineConfig` holds the run-time choices (dtype, KV pages, buckets,
strategy). Each dataclass checks its own fields when built; what depends on the model and the
device together (the memory plan) is checked by `memory/budget.py` before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
from typing import Any

import jax

# gpt-oss's clamped SwiGLU: its one (alpha, limit), the values of every released checkpoint.
SWIGLU_OAI = (1.702, 7.0)


def _swiglu_oai(g, u):
    alpha, limit = SWIGLU_OAI
    g = jax.numpy.minimum(g, limit)
    u = jax.numpy.clip(u, -limit, limit)
    return (u + 1) * g * jax.nn.sigmoid(g * alpha)


def _gated(act):
    return lambda g, u: act(g) * u


# The gated activations of expert and dense FFNs, by name: the jnp function h(gate x, up x) the
# device computes. The C++ executor has its own table of the same names
# (`cpu_ext/src/moe_executor.h`, exported as `_freetoken_cpu.ACTIVATIONS`; a test checks that the
# two agree).
ACTIVATIONS = {
    "silu": _gated(jax.nn.silu),
    "gelu": _gated(functools.partial(jax.nn.gelu, approximate=False)),
    "gelu_tanh": _gated(functools.partial(jax.nn.gelu, approximate=True)),
    "swiglu_oai": _swiglu_oai,
}
DTYPES = ("float32", "bfloat16")
DEFAULT_PREFILL_CHUNK = 512
# The dtype names the command line takes: the long ones and convert's short ones.
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f32": "float32", "float32": "float32"}
# Storage formats of routed experts (`quant/formats.py`), each with the multiple of 32 its blocks
# need along a matrix's input dimension (fp8 pads a short last block). "bf16": the model dtype.
EXPERT_FORMATS = {"bf16": 1, "q8_0": 32, "q4_0": 32, "fp8": 1, "mxfp4": 32, "nvfp4": 64, "q4_k": 256, "q5_k": 256, "q6_k": 256}


class Strategy(enum.StrEnum):
    """Where routed experts live and who computes them (`runtime/experts.py` has one backend per
    strategy). A `str`: `Strategy("offload") == "offload"`."""

    FUSED = "fused"  # every expert resident on the device
    OFFLOAD = "offload"  # experts in host banks; a slot cache on the device; misses fetched
    HYBRID = "hybrid"  # offload, with a share of each layer's misses computed by the CPU
    CPU = "cpu"  # every routed expert computed by the CPU executor from the host banks
    AUTO = "auto"  # chosen at start-up (fits → fused; else a measured profile; else offload)

    @property
    def uses_slots(self) -> bool:
        """Keeps an expert slot cache on the device."""
        return self in (Strategy.OFFLOAD, Strategy.HYBRID)

    @property
    def experts_on_host(self) -> bool:
        """Keeps the experts in host banks (pinned on a GPU)."""
        return self in (Strategy.OFFLOAD, Strategy.HYBRID, Strategy.CPU)


SUPPORTED_STRATEGIES = tuple(s.value for s in Strategy)


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """Environment variable `name` (`default` when unset), one of `choices`; else a ValueError
    that names them (the kernel switches: FREETOKEN_DECODE_ATTENTION, FREETOKEN_ROUTER, ...)."""
    how = os.environ.get(name, default)
    if how not in choices:
        raise ValueError(f"{name}={how!r}: use {', '.join(choices[:-1])} or {choices[-1]}")
    return how


class ConfigError(ValueError):
    """A configuration that the engine cannot run, with the reason and what to change."""


@dataclasses.dataclass(frozen=True)
class MoEModelConfig:
    """Geometry and numerics of a routed-expert decoder-only language model.

    The short form `MoEModelConfig(vocab_size=32000, hidden_dim=2048, intermediate_dim=5632,
    num_layers=12, num_experts=16, top_k=2)` gives a generic top-k softmax-routed model with
    grouped-query attention; every other field has a default derived from these.
    """

    vocab_size: int
    hidden_dim: int
    intermediate_dim: int
    num_layers: int
    num_experts: int
    top_k: int
    family: str = "generic"
    # Expert FFN width; None means `intermediate_dim`.
    moe_intermediate_dim: int | None = None
    # Attention.
    attention: str = "gqa"  # "gqa" or "mla"
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # Sliding-window attention: a token attends to the `sliding_window` positions ending at its
    # own (0: the whole context), in the layers `sliding_layers` marks (empty: every layer).
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    # A learned logit per head in every attention softmax's denominator (gpt-oss "sinks").
    attention_sinks: bool = False
    # Multi-head latent attention (DeepSeek); used when attention == "mla".
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Rotary embedding. `rope_interleave`: rotate (x0, x1), (x2, x3), ... pairs (DeepSeek)
    # instead of the two halves of the head.
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    rope_interleave: bool = False
    # Grouped-query attention: rotate only the first `rotary_dim` dimensions of each head (GLM's
    # partial rotary; 0: the whole head).
    rotary_dim: int = 0
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    mlp_bias: bool = False
    # Router. `router_bias`: a learned bias on the router's logits (gpt-oss).
    router_scoring: str = "softmax"  # "softmax" or "sigmoid"
    router_bias: bool = False
    norm_topk_prob: bool = True
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2), "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    # Per-expert biases on the gate, up and down projections (gpt-oss).
    expert_bias: bool = False
    # Shared experts: width of the always-on expert FFN (0 = none), optionally sigmoid-gated.
    shared_expert_dim: int = 0
    shared_expert_gate: bool = False
    # Which layers are MoE (True) or dense MLP (False); empty means all MoE.
    moe_layers: tuple[bool, ...] = ()
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # How the routed experts are stored (EXPERT_FORMATS): "bf16" (the model dtype) or a block format.
    expert_format: str = "bf16"
    # Per MoE layer, the (gate, up, down) formats where they differ from `expert_format` (a GGUF
    # Q4_K_M file keeps some layers' down projections in Q6_K); empty: `expert_format` everywhere.
    # All block formats, gate and up alike; `expert_format` is then the most common one.
    expert_formats: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for name in ("vocab_size", "hidden_dim", "num_layers"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_experts <= 0 or not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"need num_experts > 0 and 0 < top_k <= num_experts, got {self.num_experts=} {self.top_k=}")
        if self.moe_intermediate_dim is None:
            set_("moe_intermediate_dim", self.intermediate_dim)
        if self.num_heads is None:
            set_("num_heads", max(1, self.hidden_dim // 128))
        if self.num_kv_heads is None:
            set_("num_kv_heads", self.num_heads)
        if self.head_dim is None:
            set_("head_dim", self.hidden_dim // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.attention not in ("gqa", "mla"):
            raise ConfigError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        if self.attention == "mla" and min(self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim) <= 0:
            raise ConfigError("MLA needs kv_lora_rank, qk_rope_head_dim and v_head_dim > 0")
        if not 0 <= self.rotary_dim <= self.head_dim:
            raise ConfigError(f"rotary_dim must be in [0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if self.rope_dim % 2:
            raise ConfigError(f"the rotary dimension must be even, got {self.rope_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; use one of {tuple(ACTIVATIONS)}")
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"router_scoring must be 'softmax' or 'sigmoid', got {self.router_scoring!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ConfigError(f"unknown topk_method {self.topk_method!r}")
        if self.topk_method != "greedy":
            if self.n_group <= 0 or self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ConfigError(
                    f"group-limited routing needs num_experts % n_group == 0 and 0 < topk_group <= n_group, got "
                    f"{self.num_experts=} {self.n_group=} {self.topk_group=}"
                )
            if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
                raise ConfigError("topk_group groups hold fewer experts than top_k")
        if self.sliding_window < 0:
            raise ConfigError(f"sliding_window must not be negative, got {self.sliding_window}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ConfigError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.sliding_window and self.attention == "mla":
            raise ConfigError("sliding-window attention with MLA is not supported")
        set_("sliding_layers", tuple(bool(b) for b in self.sliding_layers))
        if not self.moe_layers:
            set_("moe_layers", (True,) * self.num_layers)
        if len(self.moe_layers) != self.num_layers:
            raise ConfigError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        set_("moe_layers", tuple(bool(b) for b in self.moe_layers))
        set_("expert_formats", tuple(tuple(str(f) for f in fs) for fs in self.expert_formats))
        self._check_formats()
        set_("eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        set_("rope_scaling", tuple(sorted((str(k), _hashable(v)) for k, v in dict(self.rope_scaling).items())))

    def _check_formats(self) -> None:
        per_layer = self.expert_formats
        if per_layer and len(per_layer) != sum(self.moe_layers):
            raise ConfigError(f"expert_formats has {len(per_layer)} entries for {sum(self.moe_layers)} MoE layers")
        if any(len(fs) != 3 or fs[0] != fs[1] for fs in per_layer):
            raise ConfigError("expert_formats entries are (gate, up, down) with gate and up alike")
        used = {self.expert_format} | {f for fs in per_layer for f in fs}
        for fmt in sorted(used):
            if fmt not in EXPERT_FORMATS:
                raise ConfigError(f"unknown expert format {fmt!r}; choose from {tuple(EXPERT_FORMATS)}")
            multiple = EXPERT_FORMATS[fmt]
            if self.hidden_dim % multiple or self.moe_intermediate_dim % multiple:
                raise ConfigError(
                    f"expert format {fmt} stores blocks of {multiple} weights along each input dimension; "
                    f"hidden_dim {self.hidden_dim} and moe_intermediate_dim {self.moe_intermediate_dim} must be multiples of it"
                )
        if per_layer and "bf16" in used:
            raise ConfigError("per-layer expert formats are block formats only")

    def formats_of(self, m: int) -> tuple[str, str, str]:
        """(gate, up, down) formats of MoE layer m."""
        return self.expert_formats[m] if self.expert_formats else (self.expert_format,) * 3

    def window_of(self, i: int) -> int:
        """The attention window of layer i (0: the whole context)."""
        return self.sliding_window if not self.sliding_layers or self.sliding_layers[i] else 0

    # Derived sizes -----------------------------------------------------------------------------
    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else (self.rotary_dim or self.head_dim)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_dim * self.moe_intermediate_dim

    def with_expert_format(self, fmt: str | None) -> MoEModelConfig:
        """This model with its experts stored as `fmt` (None: as they are). Only unquantized
        experts are quantized; a quantized model keeps its format."""
        if fmt is None or (fmt == self.expert_format and not self.expert_formats):
            return self
        if self.expert_format != "bf16":
            raise ConfigError(f"the experts are stored as {self.expert_format}; quantizing them again to {fmt} is not supported")
        return dataclasses.replace(self, expert_format=fmt)

    def kv_entry_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shapes of what one layer's KV cache stores.

        GQA stores K and V per KV head; MLA stores the compressed latent and the shared rope key,
        not the expanded keys and values.
        """
        if self.attention == "mla":
            return ((self.kv_lora_rank,), (self.qk_rope_head_dim,))
        return ((self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim))


def _hashable(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    return v


# EngineConfig.prefill_load's values
PREFILL_LOADS = ("auto", "fetch", "copy", "copy2")
COPY_LOADS = ("copy", "copy2")  # the loads that copy whole banks in


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Run-time choices of the engine.

    `max_context` bounds prompt + generated tokens of one sequence; `max_batch` bounds the
    sequences decoded together. KV memory is `kv_pages` pages of `page_size` tokens per layer
    (default: enough for `max_batch` full-length sequences); sliding-window layers keep a ring
    pool of their own (`memory/kv_cache.py`). Any page size is correct for every architecture
    here: windows are masked per position and rings are sized from the page, and MLA pages hold
    latents like any other entry; the size only trades gather granularity against waste.

    Expert placement: `moe_strategy` "fused" keeps every expert on the device; "offload" keeps
    them in host RAM with `expert_slots` slots on the device — given directly (or as
    `expert_slots_gb`, GB = 1e9 bytes of slots, what `bench --slots-gb` takes), or planned from
    FreeToken's budget fields (`total_vram_gb`, `base_model_vram_gb` for the dense weights,
    `reserved_vram_gb`, `initial_expert_capacity` as a cap), or from the device's memory; "cpu"
    computes every routed expert on the CPU from host RAM (no slots), for devices with almost
    no memory to spare; "auto" picks fused when everything fits the budget; otherwise, with a
    matching `benchbw.json` (`python -m freetoken_jax.bench bw`), hybrid, offload or cpu by a
    short decode probe of the three (`auto_probe_steps`; its outcome kept in the profile for the next start
    of the same model and settings), or the profile's recommendation as is when the probe is
    off; otherwise offload — never hybrid without evidence.
    """

    dtype: str = "bfloat16"
    moe_strategy: Strategy = Strategy.FUSED  # a name is accepted too
    expert_slots: int | None = None
    expert_slots_gb: float | None = None
    total_vram_gb: float | None = None
    base_model_vram_gb: float | None = None
    reserved_vram_gb: float | None = None
    initial_expert_capacity: int | None = None
    # Strategy "hybrid": q* = Bp / (Bp + Bh), the share of a layer's missed experts fetched over
    # PCIe; the rest are computed by the CPU where they lie. Measured values replace this default.
    hybrid_q: float = 0.35
    # Strategy "hybrid" over the FFI handoff: q starts at hybrid_q and follows the handoff's timing
    # every few decode steps, so that a layer's fetch side and CPU side end together
    # (`runtime/balance.py`); False keeps q where it is set.
    hybrid_balance: bool = True
    # How CPU expert work leaves the jitted step (strategies "cpu" and "hybrid"): "ffi" (split
    # XLA FFI submit/wait: the CPU job overlaps the layer's fetch and GPU experts; recorded into
    # XLA's CUDA graphs), "ffi_nograph" (the same, launched outside the graphs), "callback"
    # (jax.pure_callback, no overlap) or "auto" (ffi on a GPU, callback on the CPU backend).
    cpu_handoff: str = "auto"
    # Strategy "hybrid": the handoff's fixed cost per layer in units of one expert's PCIe fetch
    # time; misses go to the CPU only when that pays (0: FreeToken's split as is). Measured on the
    # H200 with Qwen3-30B-A3B experts: 55 µs per layer (the FFI pair recorded into XLA's CUDA
    # graphs) against 190 µs per 9.4 MB expert → 0.3.
    # Strategy "auto" takes it from benchbw.json (`handoff_ffi_us` over one expert's fetch time).
    hybrid_overhead: float = 0.3
    # Strategies "offload" / "hybrid": how prefill brings a layer's experts into its borrowed
    # buffer: "fetch" (the Pallas kernel, per missing expert; resident experts are not copied),
    # "copy" (the whole bank in one in-jit device_put, which XLA runs on its own stream beside
    # the compute; the next layer's bank in flight while a layer computes), "copy2" (the same, the
    # next two layers' banks in flight: the copies never wait for a layer's compute to reach the
    # point that issues the next one; one more bank on the device) or "auto": on a GPU, copy2
    # where three layers' banks fit beside the chunk's activations in half of the device memory
    # the plan leaves free, copy where two do, else fetch (`memory.budget.choose_prefill_load`;
    # the log says which); on the CPU backend copy when an expert row is under 256 KB, else
    # fetch. Strategy "cpu": "copy" or "copy2" computes a prefill chunk of at least 4 routed pairs
    # an expert on the device, each layer's bank copied in while the layers before compute
    # (`runtime/offload.device_prefill_pays`); otherwise the CPU computes every chunk.
    prefill_load: str = "auto"
    # Strategy "auto": with a benchbw.json, the engine first decodes this many steps under hybrid,
    # offload and cpu (batch 1, sampled) and keeps the fastest, whatever the profile's bandwidth
    # rule recommends; 0: trust the recommendation. On the H200 the rule said offload (CPU 76 <
    # 2 × PCIe 44 GB/s) where hybrid decodes 2.1 × faster.
    auto_probe_steps: int = 16
    # Strategy "auto", with the probe above: hybrid is also measured at the recommended q plus
    # each of these (clamped to [0, 1]; q is traced, so no step compiles again), and at the q*
    # of the profile's figures measured apart (`choice.apart_q`), and keeps the fastest. On the
    # H200 (Qwen3-30B-A3B shape, 16 GB of slots) the best q was 0.05-0.1 below q* = Bp / (Bp +
    # Bh): the GPU side of a layer also places its misses and computes its hits while the CPU
    # computes, and both read host memory at once. On an H100 with q4_0 experts the apart q*
    # (0.35: 201 tok/s) beat the contended pair's (0.09: 153).
    auto_probe_q_offsets: tuple[float, ...] = (-0.05, -0.1, 0.05)
    page_size: int = 16
    max_context: int = 4096
    max_batch: int = 8
    # Requests the scheduler runs at once (None: `max_batch`, and under offload / hybrid no more
    # rows than one step's routed experts fit the slots: slots // (top_k × MoE layers), at least
    # 1; beyond that every step evicts experts the next step needs again, and adding rows lowers
    # throughput). A value given here is used as it is (at most `max_batch`).
    max_running: int | None = None
    kv_pages: int | None = None
    # Keep the KV pages of finished sequences in a radix tree and reuse them for later prompts
    # that start with the same tokens (serving and the offline API alike).
    prefix_cache: bool = True
    # Tokens of a prompt prefilled per step (a power of two). None: 512, or under offload /
    # hybrid / cpu on a device with memory to spare the largest of 1024-8192 whose activations fit it
    # (`memory.budget.choose_prefill_chunk`): every chunk streams the experts that are not in
    # the slots, so fewer, larger chunks prefill faster (H200, 24-layer Qwen3-30B-A3B shape, bf16,
    # 8 GB of slots, 8192 tokens: 873 tok/s in chunks of 512, 4244 in chunks of 4096).
    prefill_chunk: int | None = None
    seed: int = 0
    # Routed experts quantized to this format (EXPERT_FORMATS) as the weights are loaded or made;
    # None: as the checkpoint stores them. A checkpoint already quantized loads as it is.
    expert_format: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.moe_strategy not in SUPPORTED_STRATEGIES:
            raise ConfigError(f"moe_strategy {self.moe_strategy!r} is not available; choose from {SUPPORTED_STRATEGIES}")
        object.__setattr__(self, "moe_strategy", Strategy(self.moe_strategy))
        for name in ("page_size", "max_context", "max_batch") + (("prefill_chunk",) if self.prefill_chunk is not None else ()):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefill_chunk is not None and self.prefill_chunk & (self.prefill_chunk - 1):
            raise ConfigError(f"prefill_chunk must be a power of two, got {self.prefill_chunk}")
        if self.cpu_handoff not in ("auto", "ffi", "ffi_nograph", "callback"):
            raise ConfigError(f"cpu_handoff must be auto, ffi, ffi_nograph or callback, got {self.cpu_handoff!r}")
        if not all(isinstance(d, (int, float)) and -1.0 <= d <= 1.0 for d in self.auto_probe_q_offsets):
            raise ConfigError(f"auto_probe_q_offsets must be numbers in [-1, 1], got {self.auto_probe_q_offsets!r}")
        if self.auto_probe_steps < 0:
            raise ConfigError(f"auto_probe_steps must not be negative, got {self.auto_probe_steps}")
        if self.prefill_load not in PREFILL_LOADS:
            raise ConfigError(f"prefill_load must be one of {', '.join(PREFILL_LOADS)}, got {self.prefill_load!r}")
        if self.hybrid_overhead < 0:
            raise ConfigError(f"hybrid_overhead must not be negative, got {self.hybrid_overhead}")
        if not 0.0 <= self.hybrid_q <= 1.0:
            raise ConfigError(f"hybrid_q must be in [0, 1], got {self.hybrid_q}")
        for name in ("expert_slots", "initial_expert_capacity", "max_running"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.expert_slots is not None and self.expert_slots_gb is not None:
            raise ConfigError("give expert_slots or expert_slots_gb, not both")
        if self.expert_slots_gb is not None and self.expert_slots_gb <= 0:
            raise ConfigError(f"expert_slots_gb must be positive, got {self.expert_slots_gb}")
        for name in ("total_vram_gb", "base_model_vram_gb", "reserved_vram_gb"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.expert_format is not None and self.expert_format not in EXPERT_FORMATS:
            raise ConfigError(f"unknown expert format {self.expert_format!r}; choose from {tuple(EXPERT_FORMATS)}")
        if self.kv_pages is not None and self.kv_pages < 2:
            raise ConfigError(f"kv_pages must be at least 2 (page 0 is reserved), got {self.kv_pages}")

    @property
    def uses_slots(self) -> bool:
        """Whether the strategy keeps an expert slot cache on the device."""
        return self.moe_strategy.uses_slots

    @property
    def pages_per_sequence(self) -> int:
        return -(-self.max_context // self.page_size)

    @property
    def chunk(self) -> int:
        """`prefill_chunk`, or the default where it is left to be chosen (`FreeTokenEngine` chooses it)."""
        return self.prefill_chunk or DEFAULT_PREFILL_CHUNK

    @property
    def total_kv_pages(self) -> int:
        """Pages in the pool, page 0 (the write target of padding) included."""
        if self.kv_pages is not None:
            return self.kv_pages
        return 1 + self.max_batch * self.pages_per_sequence

    def replace(self, **kw: Any) -> EngineConfig:
        return dataclasses.replace(self, **kw)
