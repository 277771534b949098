"""Building blocks shared by every model family (Flax NNX): linears, norms, rotary embeddings,
the dense MLP, the router and the routed experts (attention: `models/attention.py`).

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

from freetoken_jax.config import ACTIVATIONS, MoEModelConfig, env_choice
from freetoken_jax.models.grouping import GroupPlan, group_plans
from freetoken_jax.quant.layout import ExpertLayout
from pallas_kernels import gathered_experts, norm_matvec, route_topk

_INIT = nnx.initializers.normal(0.02)


def activation(name: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The gated activation h(gate x, up x) of `name` (config.ACTIVATIONS)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; use one of {tuple(ACTIVATIONS)}")
    return ACTIVATIONS[name]


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
    attention's q, k and v; the MoE router), FREETOKEN_NORM_MATVEC: "kernel" — in one kernel of
    `pallas_kernels/norm_matvec.py` where it fits; "xla" — two kernels for the norm and one or
    two for the projections; "auto" (unset) — the kernel on a GPU (on the H200 it took q4_0
    hybrid decode at the 30B shape from 164.9 to 171.3 tok/s: benchmarks/RESULTS.md), else XLA."""
    how = env_choice("FREETOKEN_NORM_MATVEC", "auto", ("auto", "xla", "kernel"))
    if how == "auto":
        return "kernel" if jax.default_backend() == "gpu" else "xla"
    return how


def use_norm_matvec(B: int, T: int, D: int, F) -> bool:
    return T == 1 and norm_matvec_kernel() == "kernel" and norm_matvec.fits(B, D, tuple(F))


def normed_projections(norm: RMSNorm, x_BD, weights, biases=None, out_dtypes=None, keep_h: bool = False, add_BD=None):
    """`norm(x_BD + add_BD)` (x_BD alone where `add_BD` is None) times each of `weights`
    ([F_i, D], + its bias where given) in one kernel: (their outputs [B, F_i], the normed rows
    where `keep_h`, the sum x_BD + add_BD where given)."""
    ys, h, s = norm_matvec.norm_matvec(x_BD, norm.weight[...], norm.eps, weights, biases, out_dtypes, keep_h, add_BD,
                                       interpret=jax.default_backend() == "cpu")  # fmt: skip
    return (*ys, *[a for a in (h, s) if a is not None])


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


def pair_biases(bias, ids_TK):
    """The biases of each token's chosen experts: (gate [T, K, F], up [T, K, F], down [T, K, D]),
    from per-expert `bias` (`Experts.biases`); None without."""
    return None if bias is None else tuple(b[ids_TK] for b in bias)


# "dense" computes at most this many bytes of float32 expert activations at once (a 512-token
# chunk of Qwen3-30B-A3B needs 0.4 GB and goes in one piece).
DENSE_SLICE_BYTES = 1 << 30


def routed_experts(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, impl: str = "auto", bias=None) -> jax.Array:
    """Σ_k w[t,k] · down(act(gate(x_t), up(x_t))) over each token's chosen experts, from `banks`
    (gate, up, down of every expert, `layout`); `bias`: each pair's biases (`pair_biases`), added
    to the gate, up and down projections, or None.

    - "gather" (few token-expert pairs: decode): one fused gather-and-reduce per projection over
      the chosen experts, dequantizing what it gathers — only the chosen experts' stored bytes
      are read;
    - "dense" (many pairs): every token through every expert, weighted by its routing weights
      (0 where not routed): E/K times the work of the pairs, but plain batched matmuls over the
      bank (dequantized once into a scratch of the activations' dtype). On the H200 a 512-token
      chunk's experts took 2.2 ms per layer dense against 8.2 ms through `ragged_dot_general`
      (benchmarks/RESULTS.md);
    - "grouped" (many pairs: prefill): the pairs sorted by expert into groups of rows, then the
      same batched matmuls as "dense" over the groups' rows instead of E·T (`group_plans`): C
      rows per expert (C: twice the mean pairs an expert gets, rounded up to a power of two; E /
      2K times less work than dense, 8 × for 128 experts, top-8) where no expert gets more, or
      2C; else, ranking the experts by their pairs, T rows for the busiest E/32, T/2 for the
      next E/16 and 2C for the rest (3.5 × less work than dense at 128 experts, top-8), which
      holds skewed routing (at 128 experts, top-8: synthetic Zipf routing up to an exponent of
      about 1.5; trained routers are nearer 1). Where no plan holds, the layer runs "dense"
      (`lax.switch` on the counts). On the H200 under spread routing a 2048-token q4_0 chunk of
      24 Qwen3-30B-A3B layers took 236 ms against 329 ms dense (benchmarks/RESULTS.md; the
      ranked plan is not measured there yet);
    - "kernel": as "auto", but the few-pairs case through the two Pallas kernels of
      `pallas_kernels/gathered_experts.py` (q4_0 or mxfp4 experts without biases; `kernel_fits`
      says which layers): each gathered block's scale and codes read together;
    - "auto": gather when T·k ≤ E, else grouped.
    """
    T, K = ids_TK.shape
    E = banks[0].shape[0]
    if impl == "kernel":
        if not kernel_fits(layout, bias):
            raise ValueError(f"the 'kernel' expert implementation takes {'/'.join(gathered_experts.FORMATS)} experts without "
                             f"biases, not {layout.fmts} {layout.act}{' with biases' if bias is not None else ''}")  # fmt: skip
        if T * K <= E:
            return gathered_experts.experts(layout.fmt, x_TD, ids_TK, w_TK, *banks, F=layout.F, D=layout.D, act=activation(layout.act),
                                            interpret=jax.default_backend() == "cpu")  # fmt: skip
        impl = "grouped"
    if impl == "auto":
        impl = "gather" if T * K <= E else "grouped"
    if impl == "gather":
        return _gathered(x_TD, ids_TK, w_TK, banks, layout, bias)
    if impl not in ("dense", "grouped"):
        raise ValueError(f"unknown expert implementation {impl!r}: auto, kernel, gather, dense or grouped")
    if impl == "dense":
        return _dense(x_TD, ids_TK, w_TK, layout.matrices(banks, x_TD.dtype), layout, bias)
    plans = group_plans(T, K, E)
    if not plans:  # so few tokens that a group is as large as the chunk
        return _dense(x_TD, ids_TK, w_TK, layout.matrices(banks, x_TD.dtype), layout, bias)
    counts = jnp.zeros((E,), jnp.int32).at[ids_TK.reshape(-1)].add(1)  # pairs per expert
    fits = jnp.stack([plan.fits(counts) for plan in plans])
    which = jnp.where(fits.any(), jnp.argmax(fits), len(plans))  # the first plan that holds every group, else dense
    grouped = [lambda x, i, w, bk, b, n, plan=plan: _grouped(x, i, w, bk, layout, b, n, plan) for plan in plans]
    dense = lambda x, i, w, bk, b, n: _dense(x, i, w, layout.matrices(bk, x.dtype), layout, b)  # noqa: E731
    return jax.lax.switch(which, [*grouped, dense], x_TD, ids_TK, w_TK, tuple(banks), bias, counts)


def kernel_fits(layout: ExpertLayout, bias=None) -> bool:
    """Whether the "kernel" implementation computes this layer's experts: gate, up and down in one
    format of `gathered_experts.FORMATS`, no biases, an activation the kernels lower (not exact-erf
    "gelu")."""
    return (layout.fmt in gathered_experts.FORMATS and layout.fmts == (layout.fmt,) * 3 and not layout.mixed and bias is None and layout.act in gathered_experts.ACTS
            and not layout.F % gathered_experts.BLOCK_ROWS and not layout.D % gathered_experts.BLOCK_ROWS)  # fmt: skip


def _gathered(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, bias) -> jax.Array:
    # Written as multiply + reduce over the weights' contiguous rows so that XLA fuses the
    # gather (and the dequantization) into one reduction per projection: each chosen expert is
    # read once, in place.
    T, K = ids_TK.shape
    f, dt = activation(layout.act), x_TD.dtype
    g, u, d = (layout.gather(k, b, ids_TK) for k, b in enumerate(banks))
    bg, bu, bd = bias or (0.0, 0.0, 0.0)
    xk = jnp.broadcast_to(x_TD[:, None, :], (T, K, x_TD.shape[1]))
    h = f(layout.matvec(0, g, xk) + bg, layout.matvec(1, u, xk) + bu).astype(dt)
    y = jnp.where((w_TK != 0)[..., None], layout.matvec(2, d, h) + bd, 0.0)  # an unrouted pair adds exactly 0
    return jnp.einsum("tkd,tk->td", y, w_TK).astype(dt)


def _dense(x_TD, ids_TK, w_TK, mats, layout: ExpertLayout, bias) -> jax.Array:
    # The routing weight scales each expert's hidden activations (0 where not routed), so the
    # down projection and the sum over experts are one matmul contracting (e, f). Tokens go
    # through in slices whose float32 activations [E, t, F] (gate and up) stay within
    # DENSE_SLICE_BYTES.
    T = x_TD.shape[0]
    gate_EFD, up_EFD, down_EDF = mats
    E = gate_EFD.shape[0]
    f, dt, mm = activation(layout.act), x_TD.dtype, dict(preferred_element_type=jnp.float32)
    w_ET = jnp.zeros((E, T), jnp.float32).at[ids_TK, jnp.arange(T)[:, None]].add(w_TK.astype(jnp.float32))
    step = max(1, DENSE_SLICE_BYTES // (2 * 4 * E * layout.F))

    def dense(t0, t1):
        x, w = x_TD[t0:t1], w_ET[:, t0:t1]
        g, u = jnp.einsum("td,efd->etf", x, gate_EFD, **mm), jnp.einsum("td,efd->etf", x, up_EFD, **mm)
        if bias is not None:  # each pair's gate/up biases in place; other (expert, token) pairs get weight 0 below
            at = (ids_TK[t0:t1], jnp.arange(t1 - t0)[:, None])
            g, u = g.at[at].add(bias[0][t0:t1]), u.at[at].add(bias[1][t0:t1])
        h = f(g, u)
        h = jnp.where(w[:, :, None] != 0, h * w[:, :, None], 0.0)  # an unrouted pair adds exactly 0
        y = jnp.einsum("etf,edf->td", h.astype(dt), down_EDF, **mm)
        if bias is not None:
            y = y + jnp.einsum("tkd,tk->td", bias[2][t0:t1], w_TK[t0:t1].astype(jnp.float32))
        return y.astype(dt)

    return jnp.concatenate([dense(t, min(T, t + step)) for t in range(0, T, step)])


def _grouped(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, bias, counts, plan: GroupPlan) -> jax.Array:
    # Pair p (token t, k) sorted by expert goes to row `rank` of its expert's group (every group
    # fits: `routed_experts` checked `counts`, the pairs per expert, against the plan); empty rows
    # carry zeros and weight 0. Rows are filled and results collected by gathers (only int32
    # maps are scattered), and each token sums its K results in order: no float scatter-add, so
    # the result does not depend on the order in which a GPU's atomics land. A tier's experts
    # go through in slices whose float32 activations [e, C, F] stay within DENSE_SLICE_BYTES;
    # a ranked plan dequantizes each slice's experts as it gathers them from the banks.
    T, K = ids_TK.shape
    E, D, R = counts.shape[0], x_TD.shape[1], plan.rows
    f, dt, mm = activation(layout.act), x_TD.dtype, dict(preferred_element_type=jnp.float32)
    order_E = plan.order(counts)  # expert at each place of the plan
    starts = jnp.asarray(plan.starts())
    start_E = jnp.zeros((E,), jnp.int32).at[order_E].set(starts) if plan.ranked else starts  # first row of each expert
    flat = ids_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    e_sorted = flat[order]
    rank = jnp.arange(T * K, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[e_sorted]
    row = start_E[e_sorted] + rank  # the row of the i-th pair in expert order
    pair_of_row = jnp.full((R,), T * K, jnp.int32).at[row].set(order.astype(jnp.int32))  # T·K: empty
    filled = pair_of_row < T * K
    pair = jnp.where(filled, pair_of_row, 0)

    def place(v, at):  # rows `at` of v in the filled rows, zeros in the empty ones, as [R, ...]
        return jnp.where(filled.reshape(-1, *(1,) * (v.ndim - 1)), v[at], 0)

    x_RD = place(x_TD, pair // K)
    w_R = place(w_TK.reshape(-1).astype(jnp.float32), pair)
    b = None if bias is None else tuple(place(v.reshape(T * K, -1), pair) for v in bias)
    mats = None if plan.ranked else layout.matrices(banks, dt)

    def group(r0, e0, n, C):  # experts e0 .. e0+n of the plan's order, C rows each from row r0
        if plan.ranked:
            gate_EFD, up_EFD, down_EDF = layout.matrices(tuple(bk[order_E[e0 : e0 + n]] for bk in banks), dt)
        else:
            gate_EFD, up_EFD, down_EDF = (m[e0 : e0 + n] for m in mats)
        rows = slice(r0, r0 + n * C)
        x, w = x_RD[rows].reshape(n, C, D), w_R[rows].reshape(n, C, 1)
        g, u = jnp.einsum("ecd,efd->ecf", x, gate_EFD, **mm), jnp.einsum("ecd,efd->ecf", x, up_EFD, **mm)
        if b is not None:
            g, u = g + b[0][rows].reshape(n, C, -1), u + b[1][rows].reshape(n, C, -1)
        h = f(g, u)
        h = jnp.where(w != 0, h * w, 0.0)  # an unrouted pair (and an empty row) adds exactly 0
        y = jnp.einsum("ecf,edf->ecd", h.astype(dt), down_EDF, **mm)
        y = y if b is None else y + jnp.where(w != 0, b[2][rows].reshape(n, C, -1) * w, 0.0)
        return y.reshape(n * C, D)

    parts, r0, e0 = [], 0, 0
    for n, C in plan.tiers:
        step = max(1, DENSE_SLICE_BYTES // (2 * 4 * C * layout.F))
        for e in range(0, n, step):
            m = min(step, n - e)
            parts.append(group(r0 + e * C, e0 + e, m, C))
        r0, e0 = r0 + n * C, e0 + n
    y_RD = jnp.concatenate(parts)
    row_of_pair = jnp.zeros((T * K,), jnp.int32).at[order].set(row)
    return y_RD[row_of_pair].reshape(T, K, D).sum(1).astype(dt)


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
        ids_TK, w_TK, banks, layout)` (default `routed_experts`)."""
        e, layout = self.experts, self.layout
        return lambda x, ids, w, bias=None: (compute or routed_experts)(
            x, ids, w, (e.gate[...], e.up[...], e.down[...]), layout, bias=pair_biases(bias, ids)
        )

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
