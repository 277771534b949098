"""Building blocks shared by every model family (Flax NNX): linears, norms, rotary embeddings,
the dense MLP, the router and the MoE block (attention: `models/attention.py`; how the routed
experts are computed: `models/routed.py`).

Array names carry their shape as a suffix: B batch, T tokens of this step, S cached key
positions, P pages, D hidden, H heads, K KV heads (or top-k in routing code), F FFN width,
E experts, R latent rank, V vocabulary. Matmuls accumulate in float32; norms, softmax and
routing are computed in float32 whatever the parameter dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from freetoken_jax.config import MoEModelConfig, env_choice
from freetoken_jax.models.routed import activation, pair_biases, routed_experts
from freetoken_jax.models.stacked import kernel_operand
from freetoken_jax.quant.layout import ExpertLayout
from pallas_kernels import norm_matvec, route_topk

_INIT = nnx.initializers.normal(0.02)


class Linear(nnx.Module):
    """y = x Wᵀ + b with W stored [out, in] (the checkpoints' layout): a decode matvec then
    reduces along W's contiguous rows, which XLA fuses into one pass over the weights."""

    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_INIT(rngs.params(), (dout, din), dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...d,fd->...f", x, self.weight[...], preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype)


def linear(din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs) -> Linear:
    return Linear(din, dout, bias=bias, dtype=dtype, rngs=rngs)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


# Rotary position embedding ------------------------------------------------------------------------
def rope_frequencies(cfg: MoEModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rope_dim/2] and the cos/sin scale (YaRN's attention factor)."""
    dim, base = cfg.rope_dim, cfg.rope_theta
    rs = dict(cfg.rope_scaling)
    kind = rs.get("rope_type", rs.get("type", "default"))
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if kind == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    if kind == "linear":
        return (1.0 / pos_freqs / np.float32(rs["factor"])).astype(np.float32), 1.0
    if kind != "yarn":
        raise ValueError(f"rope scaling {kind!r} is not supported (default, linear and yarn are)")
    factor = rs.get("factor")
    orig = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
    if factor is None:
        factor = cfg.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv.astype(np.float32), float(attn_factor)


def softmax_scale(cfg: MoEModelConfig) -> float:
    scale = cfg.qk_head_dim**-0.5
    rs = dict(cfg.rope_scaling)
    if cfg.attention == "mla" and rs.get("rope_type", rs.get("type", "default")) != "default":
        m_all = rs.get("mscale_all_dim", 0)
        factor = rs.get("factor", 1.0)
        if m_all and factor > 1:
            m = 0.1 * m_all * math.log(factor) + 1.0
            scale *= m * m
    return scale


def rope_cos_sin(cfg: MoEModelConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    inv_freq, scale = rope_frequencies(cfg)
    freqs = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x_BTHd: jax.Array, cos_BTd: jax.Array, sin_BTd: jax.Array, interleave: bool) -> jax.Array:
    """Rotates the last axis. With `interleave`, pairs are (x0, x1), (x2, x3), ... and the output
    lists the rotated first elements, then the second ones (the same layout for queries and keys,
    so dot products equal those of the interleaved form)."""
    dtype = x_BTHd.dtype
    x = x_BTHd.astype(jnp.float32)
    cos, sin = cos_BTd[:, :, None, :], sin_BTd[:, :, None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)


def norm_matvec_kernel() -> str:
    """How a step of one token a row computes an RMSNorm and the projections that read it (the
    attention's q, k and v; the MoE router) and the attention's output projection,
    FREETOKEN_NORM_MATVEC: "kernel" — each in one kernel of `pallas_kernels/norm_matvec.py` where
    it fits; "normed" — the normed projections so, the output projection by XLA; "xla" — two
    kernels for the norm and one or two for the projections; "auto" (unset) — the kernel on a GPU
    (on the H200 it took q4_0 hybrid decode at the 30B shape from 164.9 to 171.3 tok/s:
    benchmarks/RESULTS.md), else XLA."""
    how = env_choice("FREETOKEN_NORM_MATVEC", "auto", ("auto", "xla", "normed", "kernel"))
    if how == "auto":
        return "kernel" if jax.default_backend() == "gpu" else "xla"
    return how


def use_norm_matvec(B: int, T: int, D: int, F, normed: bool = True) -> bool:
    """Whether a step of T tokens a row takes the kernel: for the normed projections (`normed`),
    or for a projection without a norm before it."""
    how = norm_matvec_kernel()
    return T == 1 and (how == "kernel" or (normed and how == "normed")) and norm_matvec.fits(B, D, tuple(F))


def normed_projections(norm: RMSNorm, x_BD, weights, biases=None, out_dtypes=None, keep_h: bool = False, add_BD=None):
    """`norm(x_BD + add_BD)` (x_BD alone where `add_BD` is None) times each of `weights`
    ([F_i, D], + its bias where given) in one kernel: (their outputs [B, F_i], the normed rows
    where `keep_h`, the sum x_BD + add_BD where given)."""
    weights, biases = [kernel_operand(w) for w in weights], None if biases is None else [kernel_operand(b) for b in biases]
    ys, h, s = norm_matvec.norm_matvec(x_BD, kernel_operand(norm.weight[...]), norm.eps, weights, biases, out_dtypes, keep_h, add_BD,
                                       interpret=jax.default_backend() == "cpu")  # fmt: skip
    return (*ys, *[a for a in (h, s) if a is not None])


def project(p: Linear, x_BTD):
    """`p(x_BTD)`; a step of one token a row through the matvec kernel where it fits
    (`norm_matvec_kernel`): the attention's output projection."""
    B, T, D = x_BTD.shape
    if not use_norm_matvec(B, T, D, [p.weight.shape[0]], normed=False):
        return p(x_BTD)
    (y,), _, _ = norm_matvec.norm_matvec(x_BTD[:, 0], None, 0.0, [kernel_operand(p.weight[...])],
                                         [None if p.bias is None else kernel_operand(p.bias[...])], interpret=jax.default_backend() == "cpu")  # fmt: skip
    return y[:, None]


def residual(x_BTD, add_BTD):
    """The residual stream x + add (x where nothing is pending)."""
    return x_BTD if add_BTD is None else x_BTD + add_BTD


class MLP(nnx.Module):
    def __init__(self, cfg: MoEModelConfig, width: int, dtype, rngs: nnx.Rngs):
        D = cfg.hidden_dim
        self.gate_proj = linear(D, width, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.up_proj = linear(D, width, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = linear(width, D, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.down_proj(activation(self.act)(self.gate_proj(x), self.up_proj(x)))


# Routing and experts ----------------------------------------------------------------------------
class Router(nnx.Module):
    """Top-k expert choice. Returns expert ids [T, k] and their combine weights [T, k] (float32)."""

    def __init__(self, cfg: MoEModelConfig, rngs: nnx.Rngs):
        # Router weights stay float32 whatever the model dtype (as the reference models keep them).
        self.weight = nnx.Param(_INIT(rngs.params(), (cfg.num_experts, cfg.hidden_dim), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32)) if cfg.score_correction_bias else None
        self.logit_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32)) if cfg.router_bias else None
        self.cfg = cfg

    def __call__(self, x_TD: jax.Array, draw=None) -> tuple[jax.Array, jax.Array]:
        logits_TE = jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), self.weight[...], precision=jax.lax.Precision.HIGHEST)
        return self.choose(logits_TE, draw)

    def choose(self, logits_TE: jax.Array, draw=None) -> tuple[jax.Array, jax.Array]:
        """The routing of logits x·Wᵀ (float32 [T, E]); `draw`: `route`'s."""
        if self.logit_bias is not None:
            logits_TE = logits_TE + self.logit_bias[...]
        bias = None if self.bias is None else self.bias[...]
        return route(self.cfg, logits_TE, bias, draw)


ROUTER_KERNEL_ROWS = 64  # "auto" takes the router kernel for steps of up to this many rows (decode)


def router_kernel(cfg: MoEModelConfig, T: int) -> str:
    """How a step of T rows chooses its experts (FREETOKEN_ROUTER): "xla" — the softmax or
    sigmoid, `lax.top_k` and the gather as XLA compiles them, four kernels a layer; "kernel" —
    `pallas_kernels/route_topk.py`, one kernel, for greedy routers; "auto" (unset) — the kernel on
    a GPU for steps of up to `ROUTER_KERNEL_ROWS` rows, else "xla"."""
    how = env_choice("FREETOKEN_ROUTER", "auto", ("auto", "xla", "kernel"))
    if cfg.topk_method != "greedy" or how == "xla":
        return "xla"
    if how == "auto":
        return "kernel" if jax.default_backend() == "gpu" and T <= ROUTER_KERNEL_ROWS else "xla"
    return "kernel"


def route(cfg: MoEModelConfig, logits_TE: jax.Array, bias_E: jax.Array | None = None, draw=None):
    """(ids [T, k], weights [T, k]) of the router's logits. `draw` (a benchmark's synthetic
    routing, `runtime/routing.Draw`) puts its ids in place of the router's, the weights kept."""
    T, E = logits_TE.shape
    if router_kernel(cfg, T) == "kernel":
        return route_topk.route(logits_TE, cfg.top_k, scoring=cfg.router_scoring, norm=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor,
                                bias_E=bias_E, draw=None if draw is None else draw.kernel(), interpret=jax.default_backend() == "cpu")  # fmt: skip
    ids_TK, w_TK = _xla_route(cfg, logits_TE, bias_E)
    return (ids_TK, w_TK) if draw is None else (draw.ids(ids_TK, w_TK), w_TK)


def _xla_route(cfg: MoEModelConfig, logits_TE: jax.Array, bias_E: jax.Array | None):
    T, E = logits_TE.shape
    scores = jax.nn.sigmoid(logits_TE) if cfg.router_scoring == "sigmoid" else jax.nn.softmax(logits_TE, axis=-1)
    choice = scores if bias_E is None else scores + bias_E
    if cfg.topk_method != "greedy":
        grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], top_groups].set(True)
        keep = jnp.repeat(keep, E // cfg.n_group, axis=1)
        # V3 masks excluded experts out of the choice; V2 zeroes their scores (same top-k unless
        # fewer than k positive scores remain, which softmax scores never allow).
        choice = jnp.where(keep, choice, -jnp.inf if cfg.topk_method == "noaux_tc" else 0.0)
    _, ids_TK = jax.lax.top_k(choice, cfg.top_k)
    w_TK = jnp.take_along_axis(scores, ids_TK, axis=-1)
    if cfg.norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(-1, keepdims=True) + (1e-20 if cfg.router_scoring == "sigmoid" else 0.0))
    return ids_TK, w_TK * cfg.routed_scaling_factor


class Experts(nnx.Module):
    """The routed experts of one layer, stacked in the checkpoints' [out, in] layout:
    gate/up [E, F, D], down [E, D, F]; with a quantized `expert_format`, one row of bytes per
    expert and projection ([E, nbytes], `quant/formats.py`)."""

    def __init__(self, cfg: MoEModelConfig, dtype, rngs: nnx.Rngs, m: int = 0):
        E, D, F = cfg.num_experts, cfg.hidden_dim, cfg.moe_intermediate_dim
        layout = ExpertLayout.of(cfg, m)  # m: the MoE layer (its formats)
        if layout.quantized:
            rows = layout.row_sizes()
            self.gate, self.up, self.down = (nnx.Param(jnp.zeros((E, r), jnp.uint8)) for r in rows)
        else:
            self.gate = nnx.Param(_INIT(rngs.params(), (E, F, D), dtype))
            self.up = nnx.Param(_INIT(rngs.params(), (E, F, D), dtype))
            self.down = nnx.Param(_INIT(rngs.params(), (E, D, F), dtype))
        # Per-expert biases (gpt-oss), float32 and small: they stay on the device (and are copied
        # for the CPU executor) whatever the strategy; not banks.
        zeros = lambda *shape: nnx.Param(jnp.zeros(shape, jnp.float32))  # noqa: E731
        self.bias = nnx.Dict(gate=zeros(E, F), up=zeros(E, F), down=zeros(E, D)) if cfg.expert_bias else None

    def biases(self):
        """(gate [E, F], up [E, F], down [E, D]) float32 biases, or None."""
        return None if self.bias is None else tuple(self.bias[k][...] for k in ("gate", "up", "down"))


# fn(x_TD, ids_TK, w_TK, bias) -> y_TD; `bias`: the layer's per-expert biases (`Experts.biases`) or None.
ExpertFn = Callable[..., jax.Array]


class MoEBlock(nnx.Module):
    """Router + routed experts + optional (gated) shared expert. How the routed experts are
    computed is pluggable: `expert_fn(x_TD, ids_TK, w_TK, bias)`; by default from this layer's own
    resident weights (strategy "fused")."""

    def __init__(self, cfg: MoEModelConfig, dtype, rngs: nnx.Rngs, m: int = 0):
        self.gate = Router(cfg, rngs)
        self.experts = Experts(cfg, dtype, rngs, m)
        self.shared_experts = MLP(cfg, cfg.shared_expert_dim, dtype, rngs) if cfg.shared_expert_dim else None
        self.shared_expert_gate = linear(cfg.hidden_dim, 1, bias=False, dtype=dtype, rngs=rngs) if cfg.shared_expert_gate else None
        self.layout = ExpertLayout.of(cfg, m)

    def expert_fn(self, compute=None) -> ExpertFn:
        """This layer's routed experts computed from its own resident banks by `compute(x_TD,
        ids_TK, w_TK, banks, layout)` (default `routed_experts`, given stacked banks as `Stacked`
        operands: `models.stacked`)."""
        e, layout = self.experts, self.layout
        banks = lambda: (e.gate[...], e.up[...], e.down[...])  # noqa: E731
        if compute is None:
            return lambda x, ids, w, bias=None: routed_experts(
                x, ids, w, tuple(map(kernel_operand, banks())), layout, bias=pair_biases(bias, ids)
            )
        return lambda x, ids, w, bias=None: compute(x, ids, w, banks(), layout, bias=pair_biases(bias, ids))

    def __call__(self, x_BTD: jax.Array, expert_fn: ExpertFn | None = None, norm: RMSNorm | None = None, add=None):
        """(output, the residual stream x_BTD + add). `norm`: the layer's post-attention norm,
        applied here to that stream so that a step of one token a row may compute the add, the
        norm and the router in one kernel (`norm_matvec_kernel`)."""
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        draw = getattr(expert_fn, "draw", None)  # a benchmark's synthetic routing (`runtime/routing.py`)
        if norm is not None and use_norm_matvec(B, T, D, [self.gate.weight.shape[0]]):
            pending = None if add is None else add.reshape(B * T, D)
            logits, x_TD, *s = normed_projections(
                norm, x_TD, [self.gate.weight[...]], out_dtypes=[jnp.float32], keep_h=True, add_BD=pending
            )
            stream = s[0].reshape(B, T, D) if s else x_BTD
            ids, w = self.gate.choose(logits, draw)
        else:
            stream = residual(x_BTD, add)
            x_TD = stream.reshape(B * T, D)
            x_TD = x_TD if norm is None else norm(x_TD)
            ids, w = self.gate(x_TD, draw)
        out = (expert_fn or self.expert_fn())(x_TD, ids, w, self.experts.biases())
        if self.shared_experts is not None:
            shared = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x_TD)) * shared
            out = out + shared
        return out.reshape(B, T, D), stream
