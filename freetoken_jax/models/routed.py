"""How a layer's routed experts are computed from their banks: Σ_k w[t,k] · down(act(gate x_t,
up x_t)) over each token's chosen experts (`routed_experts`), by the implementation that suits the
step — a gather for decode's few pairs, matmuls over groups of rows for a prefill chunk's many.
The strategies (`runtime/experts.py`) call it with the banks where they are: resident, slots, or
a layer copied in for a prefill chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from freetoken_jax.config import ACTIVATIONS, env_choice
from freetoken_jax.models.grouping import GroupPlan, group_plans, pair_rows
from freetoken_jax.quant.layout import ExpertLayout
from freetoken_jax.runtime import cuda_experts
from pallas_kernels import gathered_experts, grouped_experts, value


def activation(name: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The gated activation h(gate x, up x) of `name` (config.ACTIVATIONS)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; use one of {tuple(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def pair_biases(bias, ids_TK):
    """The biases of each token's chosen experts: (gate [T, K, F], up [T, K, F], down [T, K, D]),
    from per-expert `bias` (`Experts.biases`); None without."""
    return None if bias is None else tuple(b[ids_TK] for b in bias)


def weighted(v: jax.Array, w: jax.Array) -> jax.Array:
    """v · w, and exactly 0 where w is 0, whatever v holds there: an unrouted pair (or an empty
    row of a layout) adds nothing to the sum over a token's pairs."""
    return jnp.where(w != 0, v * w, 0.0)


# "dense" computes at most this many bytes of float32 expert activations at once (a 512-token
# chunk of Qwen3-30B-A3B needs 0.4 GB and goes in one piece).
DENSE_SLICE_BYTES = 1 << 30


def routed_experts(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, impl: str = "auto", bias=None) -> jax.Array:
    """Σ_k w[t,k] · down(act(gate(x_t), up(x_t))) over each token's chosen experts, from `banks`
    (gate, up, down of every expert, `layout`; arrays, or `Stacked` entries of the layers' stacked
    banks, which "gather" reads in place and the others as slices); `bias`: each pair's biases
    (`pair_biases`), added to the gate, up and down projections, or None.

    - "gather" (few token-expert pairs: decode): one fused gather-and-reduce per projection over
      the chosen experts, dequantizing what it gathers — only the chosen experts' stored bytes
      are read; each pair's routing weight scales its activations (rounded as "dense" and
      "grouped" round them), so that the down projection and the sum over the pairs are one
      reduction;
    - "dense" (many pairs): every token through every expert, weighted by its routing weights
      (0 where not routed): E/K times the work of the pairs, but plain batched matmuls over the
      bank (dequantized once into a scratch of the activations' dtype). On the H200 a 512-token
      chunk's experts took 2.2 ms per layer dense against 8.2 ms through `ragged_dot_general`
      (benchmarks/RESULTS.md);
    - "grouped" (many pairs: prefill): the pairs sorted by expert into groups of rows, then the
      same batched matmuls as "dense" over the groups' rows instead of E·T (`group_plans`): C
      rows per expert (C: twice the mean pairs an expert gets, rounded up to a power of two; E /
      2K times less work than dense, 8 × for 128 experts, top-8) where no expert gets more;
      before it, for spread routing, a tight ranked plan (C rows for the busiest E/32, then
      1.5 and 1.25 × the mean pairs: 0.64 × C's rows at 128 experts, top-8); else, ranking the
      experts by their pairs, a steep plan (T rows for the busiest E/32, T/2 for the next E/32,
      T/4 for the next E/16, C for the rest: 5.8 × less work than dense at 128 experts, top-8,
      8192 tokens), 2C, or a broad plan (T, max(T/2, 2C) for the next E/16, 2C for the rest:
      3.5 ×), the first of the plans, fewest rows first, that holds every group. The ranked
      plans hold skewed routing (at 128 experts, top-8: synthetic Zipf routing up to an exponent
      of about 1.5; trained routers are nearer 1). Where no plan holds, the layer runs "dense"
      (`lax.switch` on the counts). On the H200 under spread routing a 2048-token q4_0 chunk of
      24 Qwen3-30B-A3B layers took 236 ms against 329 ms dense; on an H100 the tight plan took
      an 8192-token chunk's offload prefill from 181 to 175 ms, the steep plan a Zipf-1 one from
      249 to 202 ms (benchmarks/RESULTS.md);
    - "tiles" (many pairs): each expert's pairs in a group of whole tiles of rows and two Triton
      kernels over the tiles, each multiplying its rows by its own expert's weights
      (`pallas_kernels/grouped_experts.py`; q4_0 and mxfp4 blocks decoded as they are loaded,
      other formats dequantized into a scratch first): the padding is under a tile an expert
      instead of a plan's power of two (`tiles_fit` says which layers);
    - "ragged" (many pairs): the pairs sorted by expert, unpadded, through jax's Mosaic GPU
      grouped matmul for Hopper where it fits (`grouped_experts.ragged_dot`), else XLA's
      `ragged_dot_general`; gate, up and each pair's down come out rounded to x's dtype;
    - "cuda" (few pairs: decode, q4_0 on a GPU): the CUDA kernels of `runtime/cuda_experts.py`
      (one launch a layer: gate and up, a grid-wide barrier, down; or two launches); where
      `cuda_experts.fits` says not, "gather";
    - "kernel": as "auto", but the few-pairs case through the two Pallas kernels of
      `pallas_kernels/gathered_experts.py` (q4_0 or mxfp4 experts without biases; `kernel_fits`
      says which layers): each gathered block's scale and codes read together;
    - "auto": gather when T·k ≤ E (a quantized layer: ≤ GATHER_QUANTIZED · E unless the many
      pairs go through "tiles"; "cuda" in its place where it fits and
      FREETOKEN_DECODE_EXPERTS=cuda or cuda2 asks for it), else `many_pairs_impl` (grouped unless
      FREETOKEN_PREFILL_EXPERTS asks for tiles or ragged).
    """
    T, K = ids_TK.shape
    E = banks[0].shape[0]
    stacked, banks = banks, tuple(value(b) for b in banks)  # `Stacked` banks: the gather reads the stacks, the rest their slices
    if impl == "kernel":
        if not kernel_fits(layout, bias):
            raise ValueError(f"the 'kernel' expert implementation takes {'/'.join(gathered_experts.FORMATS)} experts without "
                             f"biases, not {layout.fmts} {layout.act}{' with biases' if bias is not None else ''}")  # fmt: skip
        if T * K <= E:
            # the banks as stored (`Stacked` entries read in place): given their 16-bit words (a
            # bitcast of the banks) the fused step ran 4.2 × slower on an H100, about the time of a
            # copy of every bank each step (benchmarks/RESULTS.md)
            return gathered_experts.experts(layout.fmt, x_TD, ids_TK, w_TK, *stacked, F=layout.F, D=layout.D, act=activation(layout.act),
                                            interpret=jax.default_backend() == "cpu")  # fmt: skip
        impl = "grouped"
    if impl == "auto":
        many = many_pairs_impl(layout, E)
        impl = "gather" if T * K <= E * (GATHER_QUANTIZED if layout.quantized and many != "tiles" else 1) else many
        if impl == "gather" and layout.quantized and cuda_experts.choice() != "xla":
            impl = "cuda"
    if impl == "cuda":
        if cuda_experts.fits(layout, x_TD.dtype, K, bias, T * K):
            return cuda_experts.experts(x_TD, ids_TK, w_TK, stacked, layout).astype(x_TD.dtype)
        impl = "gather"
    if impl == "gather":
        return _gathered(x_TD, ids_TK, w_TK, stacked, layout, bias)
    if impl == "tiles":
        if not tiles_fit(layout, E):
            raise ValueError(f"the 'tiles' expert implementation takes F and D in multiples of {grouped_experts.MIN_BLOCK}, one of "
                             f"{gathered_experts.ACTS} and fewer than 2^31 weights a bank, not {E} x [{layout.F}, {layout.D}] {layout.act}")  # fmt: skip
        return _tiled(x_TD, ids_TK, w_TK, banks, layout, bias)
    if impl == "ragged":
        return _ragged(x_TD, ids_TK, w_TK, banks, layout, bias)
    if impl not in ("dense", "grouped"):
        raise ValueError(f"unknown expert implementation {impl!r}: auto, cuda, kernel, gather, dense, grouped, tiles or ragged")
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


PREFILL_EXPERTS = ("grouped", "tiles", "ragged")

# "auto" gathers a quantized layer's pairs up to this many times its experts. Past E pairs a bf16
# layer's matmuls read each expert once where the gather reads it once a pair; but grouped and
# ragged first write and read a dequantized copy of a quantized bank (q4_0: 1.2 GB of bf16 for its
# 340 MB of blocks at Qwen3-30B-A3B's shape, about 8 × the blocks' bytes moved: as much as
# gathering 8 pairs an expert). Fused q4_0 decode at batch 17-64 (top-8 of 128) gathers.
GATHER_QUANTIZED = 4


def many_pairs_impl(layout: ExpertLayout, E: int) -> str:
    """How "auto" computes a step of more token-expert pairs than experts
    (FREETOKEN_PREFILL_EXPERTS, default "grouped"): "tiles" where `tiles_fit`, "ragged"; else
    "grouped"."""
    how = env_choice("FREETOKEN_PREFILL_EXPERTS", "grouped", PREFILL_EXPERTS)
    return "grouped" if how == "tiles" and not tiles_fit(layout, E) else how


def tiles_fit(layout: ExpertLayout, E: int) -> bool:
    """Whether "tiles" computes this layer's E experts: an activation the kernels lower (not
    exact-erf "gelu"), F and D multiples of Triton's smallest block (16), and a bank of fewer
    than 2³¹ weights (the kernels' offsets are 32-bit: DeepSeek-V3's 256 experts of 7168 × 2048
    are 3.8 × 10⁹)."""
    return (layout.act in gathered_experts.ACTS and not layout.F % grouped_experts.MIN_BLOCK and not layout.D % grouped_experts.MIN_BLOCK
            and E * layout.F * layout.D < 2**31)  # fmt: skip


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
    h = f(layout.matvec(0, g, xk) + bg, layout.matvec(1, u, xk) + bu)
    if layout.mixed:  # a slot may hold another layer's bytes (non-finite here): each pair's result masked apart
        y = jnp.where((w_TK != 0)[..., None], layout.matvec(2, d, h.astype(dt)) + bd, 0.0)  # an unrouted pair adds exactly 0
        return jnp.einsum("tkd,tk->td", y, w_TK).astype(dt)
    # Each pair's routing weight scales its h (as `_dense` and `_grouped` round it), so that the
    # down rows of the K pairs and their sum are one reduction over (k, f): XLA fuses the sum
    # into the down projection's kernel (the fused q4_0 step of the Qwen3-30B-A3B shape on an
    # H200: one kernel a layer fewer and 2.0 µs less, benchmarks/RESULTS.md).
    w = w_TK.astype(jnp.float32)[..., None]
    h = weighted(h, w).astype(dt)  # (an unrouted pair's slot holds this format's finite bytes)
    y = jnp.sum(layout.matvec(2, d, h), axis=1)
    if bias is not None:
        y = y + jnp.sum(weighted(bd, w), axis=1)
    return y.astype(dt)


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
        h = weighted(h, w[:, :, None])
        y = jnp.einsum("etf,edf->td", h.astype(dt), down_EDF, **mm)
        if bias is not None:
            y = y + jnp.sum(weighted(bias[2][t0:t1], w_TK[t0:t1].astype(jnp.float32)[..., None]), axis=1)
        return y.astype(dt)

    return jnp.concatenate([dense(t, min(T, t + step)) for t in range(0, T, step)])


def _grouped(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, bias, counts, plan: GroupPlan) -> jax.Array:
    # Pair p (token t, k) sorted by expert goes to row `rank` of its expert's group (every group
    # fits: `routed_experts` checked `counts`, the pairs per expert, against the plan); empty rows
    # carry zeros and weight 0. Rows are filled and results collected by gathers (only int32
    # maps are scattered), and each token sums its K results in order: no float scatter-add, so
    # the result does not depend on the order in which a GPU's atomics land; each pair's result
    # is rounded to x's dtype before that sum, as "ragged" rounds it (and transformers' experts
    # do), which halves the rows' bytes written, concatenated and gathered. A tier's experts
    # go through in slices whose float32 activations [e, C, F] stay within DENSE_SLICE_BYTES;
    # a ranked plan dequantizes each slice's experts as it gathers them from the banks.
    T, K = ids_TK.shape
    E, D, R = counts.shape[0], x_TD.shape[1], plan.rows
    f, dt, mm = activation(layout.act), x_TD.dtype, dict(preferred_element_type=jnp.float32)
    order_E = plan.order(counts)  # expert at each place of the plan
    starts = jnp.asarray(plan.starts())
    start_E = jnp.zeros((E,), jnp.int32).at[order_E].set(starts) if plan.ranked else starts  # first row of each expert
    pair_of_row, row_of_pair = pair_rows(ids_TK, counts, start_E, R)
    x_RD, w_R, b, _ = _rows(x_TD, w_TK, bias, pair_of_row, K)
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
        h = weighted(h, w)
        y = jnp.einsum("ecf,edf->ecd", h.astype(dt), down_EDF, **mm)
        y = y if b is None else y + weighted(b[2][rows].reshape(n, C, -1), w)
        return y.reshape(n * C, D).astype(dt)

    parts, r0, e0 = [], 0, 0
    for n, C in plan.tiers:
        step = max(1, DENSE_SLICE_BYTES // (2 * 4 * C * layout.F))
        for e in range(0, n, step):
            m = min(step, n - e)
            parts.append(group(r0 + e * C, e0 + e, m, C))
        r0, e0 = r0 + n * C, e0 + n
    y_RD = jnp.concatenate(parts)
    return y_RD[row_of_pair].reshape(T, K, D).astype(jnp.float32).sum(1).astype(dt)


def _rows(x_TD, w_TK, bias, pair_of_row, K: int):
    """The inputs of each row of a layout of pairs (`pair_of_row`: the flat pair t·K + k of a
    row, T·K for an empty one): x of the pair's token, its routing weight (float32) and its
    biases, zeros in the empty rows; and the row's token (0 in an empty row)."""
    N = w_TK.size
    filled = pair_of_row < N
    pair = jnp.where(filled, pair_of_row, 0)

    def place(v, at):
        return jnp.where(filled.reshape(-1, *(1,) * (v.ndim - 1)), v[at], 0)

    b = None if bias is None else tuple(place(v.reshape(N, -1), pair) for v in bias)
    return place(x_TD, pair // K), place(w_TK.reshape(-1).astype(jnp.float32), pair), b, pair // K


def _tiled(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, bias, gate_up_kw=None, down_kw=None) -> jax.Array:
    # The pairs in groups of whole tiles (`grouped_experts.tile_layout`); h is weighted and
    # rounded to x's dtype, the down projection summed over each token's pairs in float32, as
    # "grouped" computes them. `*_kw`: the kernels' blocks, warps and stages (benchmarks).
    T, K = ids_TK.shape
    E, D, dt = banks[0].shape[0], x_TD.shape[1], x_TD.dtype
    pair_of_row, row_of_pair, tile_E = grouped_experts.tile_layout(ids_TK, E, grouped_experts.block_m_for(T * K, E))
    _, w_P, b, tok_P = _rows(x_TD, w_TK, bias, pair_of_row, K)  # x read where it lies, row by row

    def read(k, decode=True):  # as stored where the kernels decode the format's blocks, else dequantized
        f = layout.fmts[k]
        return (banks[k], f) if decode and f in grouped_experts.FORMATS else (layout.matrix(k, banks[k], dt), None)

    (g, fg), (u, fu), (d, fd) = read(0), read(1), read(2)
    if fg != fu:  # one kernel reads gate and up: one way for both
        (g, fg), (u, fu) = read(0, False), read(1, False)
    interpret = jax.default_backend() == "cpu"
    h_PF = grouped_experts.gate_up(x_TD, tok_P, g, u, tile_E, w_P, activation(layout.act), None if b is None else b[:2], F=layout.F, fmt=fg,
                                   interpret=interpret, **gate_up_kw or {})  # fmt: skip
    y_PD = grouped_experts.down(h_PF, d, tile_E, D=D, fmt=fd, interpret=interpret, **down_kw or {})
    if b is not None:
        y_PD = y_PD + weighted(b[2], w_P[:, None])
    return y_PD[row_of_pair].reshape(T, K, D).sum(1).astype(dt)


def _ragged(x_TD, ids_TK, w_TK, banks, layout: ExpertLayout, bias) -> jax.Array:
    # The pairs sorted by expert, unpadded: each expert's group starts where the one before ends.
    T, K = ids_TK.shape
    E, D, dt = banks[0].shape[0], x_TD.shape[1], x_TD.dtype
    sizes = jnp.zeros((E,), jnp.int32).at[ids_TK.reshape(-1)].add(1)
    pair_of_row, row_of_pair = pair_rows(ids_TK, sizes, jnp.cumsum(sizes) - sizes, T * K)
    x_ND, w_N, b, _ = _rows(x_TD, w_TK, bias, pair_of_row, K)
    gate_EFD, up_EFD, down_EDF = layout.matrices(banks, dt)
    f = activation(layout.act)

    def rdot(a, w):
        impl = "mosaic" if grouped_experts.mosaic_fits(dt, w.shape[1], w.shape[2]) else "ref"
        return grouped_experts.ragged_dot(a, w, sizes, implementation=impl).astype(jnp.float32)

    g, u = rdot(x_ND, gate_EFD), rdot(x_ND, up_EFD)
    if b is not None:
        g, u = g + b[0], u + b[1]
    w = w_N[:, None]
    h = weighted(f(g, u), w).astype(dt)
    y = rdot(h, down_EDF)
    if b is not None:
        y = y + weighted(b[2], w)
    return y[row_of_pair].reshape(T, K, D).sum(1).astype(dt)
