"""A prefill chunk's routed experts as matmuls over groups of rows padded to whole tiles.

A layer's token-expert pairs, sorted by expert, fill the rows of [P, ...] arrays in which each
expert's group starts at a multiple of `block_m` (`tile_layout`): every tile of `block_m` rows
belongs to one expert (`tile_E`), so a program multiplies its rows by its own expert's weights
and no row is multiplied by an expert it was not routed to. The padding is under `block_m` rows
an expert — P ≤ T·K + E·(block_m − 1) — where `models.grouping`'s plans give every expert the
same power of two over twice the mean (2 × the pairs under uniform routing, 4-5 × under a trained
router's skew).

- `gate_up(x_TD, tok_P, gate, up, tile_E, w_P, act)`: h = act(x·gateᵀ + b_g, x·upᵀ + b_u) · w
  per row, x the row's token's (`tok_P`: read where it lies, no [P, D] copy of the rows is
  made), 0 where w is 0, in x's dtype [P, F] (gate and up accumulated in float32 side by side);
- `down(h_PF, down, tile_E)`: h·downᵀ in float32 [P, D].

The weights are matrices in x's dtype, or (`fmt`: q4_0, mxfp4) the banks' bytes as the slots hold
them: each block of 32 weights is decoded where it is loaded (in x's dtype, as `Format.dequantize`
gives it), its low nibbles (weights 0-15) multiplied with their 16 inputs and its high nibbles
with theirs — no dequantized copy of a layer's experts is written (1.2 GB of bf16 at
Qwen3-30B-A3B's 128 experts) and the kernels read 0.56 bytes a weight instead of 2.

Grid (column block, tile): the column blocks of one tile run next to each other and share its
rows. A tile whose expert is E (past the last group) is skipped, its rows left unwritten; the
rows of a group past its pairs are computed on whatever the caller put there and are not read.
`gate_up_ref` / `down_ref` are the jnp references: every row against its tile's expert.

`ragged_dot(x_MK, w_GNK, sizes_G)` is the same product over unpadded groups (the pairs sorted by
expert, group g the next sizes_G[g] rows): jax's Mosaic GPU kernel for Hopper
(`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, wgmma; tiles that straddle two groups are
computed once for each) where it fits, XLA's `ragged_dot_general` as its reference. Its result is
in x's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from freetoken_jax.models.grouping import pair_rows
from freetoken_jax.quant.formats import get_format, nibble_codec
from pallas_kernels import call_params
from pallas_kernels.gathered_experts import FORMATS, HeadBytes

BLOCK_K = 64  # the most a program's loop step contracts; columns a program: 64 (gate/up), 128 (down)
MIN_BLOCK = 16  # Triton's smallest dot


def _block(n: int, most: int) -> int:
    """The largest power of two up to `most` that divides n (at least MIN_BLOCK, else ValueError)."""
    b = most
    while b > MIN_BLOCK and n % b:
        b //= 2
    if n % b:
        raise ValueError(f"{n} is not a multiple of {MIN_BLOCK}: the grouped expert kernels take whole blocks")
    return b


def block_m_for(pairs: int, experts: int) -> int:
    """Rows a tile for `pairs` over `experts`: Triton's smallest (16) while an expert gets up to 16
    pairs on average (decode-sized steps), 32 up to 64, 64 below 256, else 128 — the padding,
    about half a tile an expert, stays at most half the pairs' own rows from 32 pairs an expert
    on, a quarter from 256 (larger tiles multiply at a higher rate)."""
    mean = pairs / experts
    return 16 if mean <= 16 else 32 if mean <= 64 else 64 if mean < 256 else 128


def padded_rows(pairs: int, experts: int, block_m: int) -> int:
    """P: rows that hold `pairs` pairs in groups of whole tiles, whatever the routing."""
    return -(-(pairs + experts * (block_m - 1)) // block_m) * block_m


def tile_layout(ids_TK: jax.Array, E: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(pair_of_row [P] — the flat pair index t·K + k at each row, T·K in a padding row;
    row_of_pair [T·K]; tile_E [P / block_m] — each tile's expert, E past the last group). Pairs
    of one expert keep their order (token, then k)."""
    N = ids_TK.size
    P = padded_rows(N, E, block_m)
    counts = jnp.zeros((E,), jnp.int32).at[ids_TK.reshape(-1)].add(1)
    tiles = -(-counts // block_m)  # each expert's tiles
    pair_of_row, row_of_pair = pair_rows(ids_TK, counts, (jnp.cumsum(tiles) - tiles) * block_m, P)
    t = jnp.arange(P // block_m, dtype=jnp.int32)
    tile_E = jnp.searchsorted(jnp.cumsum(tiles), t, side="right").astype(jnp.int32)  # E past the last
    return pair_of_row, row_of_pair, tile_E


def check_shapes(P: int, N: int, K: int, block_m: int, block_n: int, block_k: int) -> None:
    """Raises ValueError unless P rows of K inputs and N outputs are whole blocks."""
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if v < MIN_BLOCK or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two of at least {MIN_BLOCK}")
    if P % block_m or N % block_n or K % block_k:
        raise ValueError(f"[{P}, {K}] -> [{P}, {N}] is not whole blocks of {block_m} rows, {block_n} outputs and {block_k} inputs")


_NT = (((1,), (1,)), ((), ()))  # [m, k] · [n, k]ᵀ


def _dot(x, w):
    return jax.lax.dot_general(x, w.astype(x.dtype), _NT, preferred_element_type=jnp.float32)


def _matmul_tile(x_ref, rows, w_refs, e, t, n, *, bm: int, bn: int, bk: int, nk: int, fmt: str | None, K: int):
    """float32 x[rows] · w[e, column block n]ᵀ for each ref in `w_refs`, over nk blocks of bk
    inputs; `rows`: tile t's rows of x, a slice, or [bm, 1] indices of x's rows. `fmt` None: w
    [E, N, K] in x's dtype; else a format of
    `gathered_experts.FORMATS` whose [N, K] matrices are the first bytes of each expert's row: a
    block of weights is decoded as it is loaded (in x's dtype, as `Format.dequantize` would give
    it), weights 0-15 of each 32 (the low nibbles) against their inputs and 16-31 against theirs."""
    zero = jnp.zeros((bm, bn), jnp.float32)
    gathered = not isinstance(rows, pl.Slice)
    if fmt is None:
        cols = pl.ds(pl.multiple_of(n * bn, bn), bn)

        def body(i, accs):
            k0 = pl.multiple_of(i * bk, bk)
            x = x_ref[rows, (k0 + jnp.arange(bk, dtype=jnp.int32))[None, :]] if gathered else x_ref[rows, pl.ds(k0, bk)]
            return tuple(a + _dot(x, w[e, cols, pl.ds(k0, bk)]) for a, w in zip(accs, w_refs))

        return jax.lax.fori_loop(0, nk, body, (zero,) * len(w_refs))

    head, scale_of, value = nibble_codec(fmt)
    block, row_bytes = head + 16, K // 32 * (head + 16)
    if not gathered:
        rows = (rows.start + jnp.arange(bm, dtype=jnp.int32))[:, None]
    out = (n * bn + jnp.arange(bn, dtype=jnp.int32))[:, None] * row_bytes
    c = jnp.arange(bk // 2, dtype=jnp.int32)
    j = c % 16

    def body(i, accs):
        blk = i * (bk // 32) + c // 16  # the 32-weight block of each column of a half
        x_lo, x_hi = x_ref[rows, (blk * 32 + j)[None, :]], x_ref[rows, (blk * 32 + 16 + j)[None, :]]
        at = out + (blk * block)[None, :]  # each (output, column)'s block
        new = []
        for a, w in zip(accs, w_refs):
            codes = w[e, at + head + j[None, :]].astype(jnp.int32)
            scale = scale_of(HeadBytes(lambda h, w=w: w[e, at + h]))
            lo, hi = (value(codes & 15) * scale).astype(x_lo.dtype), (value(codes >> 4) * scale).astype(x_lo.dtype)
            new.append(a + _dot(x_lo, lo) + _dot(x_hi, hi))
        return tuple(new)

    return jax.lax.fori_loop(0, nk, body, (zero,) * len(w_refs))


def _gate_up_kernel(tile_ref, x_ref, tok_ref, g_ref, u_ref, w_ref, *refs, act, E: int, P: int, bias: bool, **mm):
    h_ref = refs[-1]
    n, t = pl.program_id(0), pl.program_id(1)
    e = tile_ref[t]
    bm, bn = mm["bm"], mm["bn"]

    @pl.when(e < E)
    def _():
        rows, cols = pl.ds(pl.multiple_of(t * bm, bm), bm), pl.ds(pl.multiple_of(n * bn, bn), bn)
        g, u = _matmul_tile(x_ref, tok_ref[rows][:, None], (g_ref, u_ref), e, t, n, **mm)
        if bias:
            g, u = g + refs[0][rows, cols].astype(jnp.float32), u + refs[1][rows, cols].astype(jnp.float32)
        w = w_ref[rows][:, None]
        h_ref[rows, cols] = jnp.where(w != 0, act(g, u) * w, 0.0).astype(h_ref.dtype)


def _down_kernel(tile_ref, h_ref, d_ref, y_ref, *, E: int, P: int, **mm):
    n, t = pl.program_id(0), pl.program_id(1)
    e = tile_ref[t]
    bm, bn = mm["bm"], mm["bn"]

    @pl.when(e < E)
    def _():
        rows = pl.ds(pl.multiple_of(t * bm, bm), bm)
        (y,) = _matmul_tile(h_ref, rows, (d_ref,), e, t, n, **mm)
        y_ref[rows, pl.ds(pl.multiple_of(n * bn, bn), bn)] = y


def _check_weights(name: str, w, E: int, N: int, K: int, fmt: str | None) -> None:
    if w.size >= 2**31:
        raise ValueError(f"{name} {w.shape}: 2^31 elements or more, past the kernels' 32-bit offsets")
    if fmt is None:
        if w.shape != (E, N, K):
            raise ValueError(f"{name} {w.shape} is not [{E}, {N}, {K}]")
        return
    if fmt not in FORMATS:
        raise ValueError(f"the grouped expert kernels decode {'/'.join(FORMATS)} blocks, not {fmt}")
    if K % 32:
        raise ValueError(f"{name}: rows of {K} inputs are not whole blocks of 32")
    n = get_format(fmt).nbytes(N, K)
    if w.ndim != 2 or w.shape[0] != E or w.dtype != jnp.uint8 or w.shape[1] < n:
        raise ValueError(f"{name} {w.shape} {w.dtype} cannot hold {E} {fmt} [{N}, {K}] matrices of {n} bytes")


def _plan(P: int, tile_E, weights: dict, N: int, K: int, block_n: int, block_k: int | None, fmt: str | None) -> dict:
    """The static arguments of a kernel over P rows in tiles (`tile_E`) with `weights` (name ->
    array) of [N, K] matrices: E, the blocks, the loop's steps, the format; checked first."""
    E, bm = next(iter(weights.values())).shape[0], P // tile_E.shape[0]
    block_k = block_k or _block(K, BLOCK_K)
    check_shapes(P, N, K, bm, block_n, block_k)
    for name, w in weights.items():
        _check_weights(name, w, E, N, K, fmt)
    return dict(E=E, bm=bm, bn=block_n, bk=block_k, nk=K // block_k, fmt=fmt, K=K, P=P)


def _call(kernel, name: str, N: int, out_dtype, args, mm: dict, num_warps: int, num_stages: int, interpret: bool):
    """One kernel over (column block, tile) writing [P, N] of `out_dtype`; every operand in place."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        grid=(N // mm["bn"], mm["P"] // mm["bm"]),
        in_specs=[any_spec] * len(args),
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((mm["P"], N), out_dtype),
        name=name,
        **call_params(interpret, num_warps, num_stages),
    )(*args)


def gate_up(x_TD, tok_P, gate, up, tile_E, w_P, act, bias=None, *, F: int | None = None, fmt: str | None = None,
            block_n: int | None = None, block_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
            interpret: bool = False) -> jax.Array:  # fmt: skip
    """h [P, F] in x's dtype (module docstring): row p multiplies token tok_P[p]'s x (a valid
    index also in the rows nobody reads); `bias`: (gate [P, F], up [P, F]) of each row, or None;
    `act(g, u)` in float32. gate and up: [E, F, D] in x's dtype, or with `fmt` (a name in
    `FORMATS`) the banks' bytes [E, ≥ nbytes(F, D)] (then F must be given). Blocks: by default
    the largest powers of two up to 64 that divide F and D."""
    D = x_TD.shape[1]
    F = F or gate.shape[1]
    mm = _plan(tok_P.shape[0], tile_E, {"gate": gate, "up": up}, F, D, block_n or _block(F, 64), block_k, fmt)
    kernel = functools.partial(_gate_up_kernel, act=act, bias=bias is not None, **mm)
    args = (tile_E, x_TD, tok_P.astype(jnp.int32), gate, up, w_P.astype(jnp.float32), *(() if bias is None else bias))
    return _call(kernel, "grouped_gate_up", F, x_TD.dtype, args, mm, num_warps, num_stages, interpret)


def down(h_PF, down_w, tile_E, *, D: int | None = None, fmt: str | None = None, block_n: int | None = None, block_k: int | None = None,
         num_warps: int = 4, num_stages: int = 3, interpret: bool = False) -> jax.Array:  # fmt: skip
    """h·downᵀ of each row's expert, float32 [P, D]; down: [E, D, F] in h's dtype, or with `fmt`
    the banks' bytes (then D must be given). Blocks: by default the largest powers of two up to
    128 dividing D and up to 64 dividing F."""
    F = h_PF.shape[1]
    D = D or down_w.shape[1]
    mm = _plan(h_PF.shape[0], tile_E, {"down": down_w}, D, F, block_n or _block(D, 128), block_k, fmt)
    kernel = functools.partial(_down_kernel, **mm)
    return _call(kernel, "grouped_down", D, jnp.float32, (tile_E, h_PF, down_w), mm, num_warps, num_stages, interpret)


def _row_experts(tile_E, P: int, E: int):
    """Each row's expert (clamped to E − 1 past the last group) and whether its tile is used."""
    e_P = jnp.repeat(tile_E, P // tile_E.shape[0])
    return jnp.minimum(e_P, E - 1), e_P < E


def _matrices(w, N: int | None, K: int, fmt: str | None, dtype):
    if fmt is None:
        return w
    return get_format(fmt).dequantize(w[:, : get_format(fmt).nbytes(N, K)], N, K, dtype)


def gate_up_ref(x_TD, tok_P, gate, up, tile_E, w_P, act, bias=None, *, F: int | None = None, fmt: str | None = None) -> jax.Array:
    """Reference of `gate_up`: each row against its tile's expert in jnp (a format's blocks
    dequantized to x's dtype first); unused tiles' rows 0."""
    x_PD = x_TD[tok_P]
    D = x_PD.shape[1]
    gate_EFD, up_EFD = (_matrices(w, F, D, fmt, x_PD.dtype) for w in (gate, up))
    P, E = x_PD.shape[0], gate_EFD.shape[0]
    e_P, used = _row_experts(tile_E, P, E)
    mm = dict(preferred_element_type=jnp.float32)
    g = jnp.einsum("pd,pfd->pf", x_PD, gate_EFD[e_P], **mm)
    u = jnp.einsum("pd,pfd->pf", x_PD, up_EFD[e_P], **mm)
    if bias is not None:
        g, u = g + bias[0].astype(jnp.float32), u + bias[1].astype(jnp.float32)
    w = w_P.astype(jnp.float32)[:, None]
    h = jnp.where((w != 0) & used[:, None], act(g, u) * w, 0.0)
    return h.astype(x_PD.dtype)


def down_ref(h_PF, down_w, tile_E, *, D: int | None = None, fmt: str | None = None) -> jax.Array:
    """Reference of `down`; unused tiles' rows 0."""
    down_EDF = _matrices(down_w, D, h_PF.shape[1], fmt, h_PF.dtype)
    P, E = h_PF.shape[0], down_EDF.shape[0]
    e_P, used = _row_experts(tile_E, P, E)
    y = jnp.einsum("pf,pdf->pd", h_PF, down_EDF[e_P], preferred_element_type=jnp.float32)
    return jnp.where(used[:, None], y, 0.0)


@functools.cache
def _mosaic_ragged_dot():
    """jax's Mosaic GPU ragged dot, or None where this jax has none."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        return ragged_dot_mgpu.ragged_dot
    except ImportError:
        return None


def mosaic_fits(dtype, N: int, K: int) -> bool:
    """Whether the Mosaic kernel takes an [·, K] · [G, N, K]ᵀ product here: a GPU (Hopper's wgmma),
    bf16/fp16, N a multiple of 128 and K of 64."""
    ok = jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and not N % 128 and not K % BLOCK_K
    return ok and _mosaic_ragged_dot() is not None


def ragged_dot(x_MK, w_GNK, sizes_G, *, implementation: str = "ref") -> jax.Array:
    """x·w[g]ᵀ for each group of consecutive rows (group g: the next sizes_G[g] rows; Σ sizes_G =
    M), accumulated in float32, in x's dtype. `implementation` "mosaic" (`mosaic_fits`) or "ref"."""
    if implementation == "ref":
        dims = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        return jax.lax.ragged_dot_general(x_MK, w_GNK, sizes_G, dims, preferred_element_type=jnp.float32).astype(x_MK.dtype)
    if implementation != "mosaic":
        raise ValueError(f"ragged_dot implementation {implementation!r}: mosaic or ref")
    M, N = x_MK.shape[0], w_GNK.shape[1]
    pad = -M % 8  # the kernel takes rows in whole tiles of 8: zero rows more, in the last group, cut off after
    x = jnp.pad(x_MK, ((0, pad), (0, 0)))
    sizes = sizes_G.astype(jnp.int32).at[-1].add(pad)
    y = _mosaic_ragged_dot()(x, w_GNK.astype(x_MK.dtype), group_sizes=sizes, block_m=128, block_n=128, block_k=BLOCK_K,
                             max_concurrent_steps=4, grid_block_n=2 if N % 256 == 0 else 1, transpose_rhs=True)  # fmt: skip
    return y[:M]
