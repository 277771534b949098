"""Decode's routed experts over 4-bit slots in two kernels that read each chosen expert's bytes once.

`experts(fmt, x_TD, ids_TK, w_TK, gate_SR, up_SR, down_SR, F=, D=, act=)` computes
Σ_k w[t,k] · down(act(gate x_t, up x_t)) over the slots `ids_TK` picks, for rows as the banks
store them in the formats whose blocks of 32 weights are a scale, then 16 bytes whose low
nibbles are weights 0-15 and high nibbles 16-31 (`FORMATS`; docs/FORMATS.md): q4_0 (an f16
scale, each code minus 8) and mxfp4 (an e8m0 scale, e2m1 codes):

- `_gate_up`: grid (pair, block of `block_rows` rows of F): the pair's gate and up rows against
  x_t, the activation, rounded to x's dtype → h [T·K, F];
- `_down`: grid (token, block of rows of D): each of the token's K pairs' down rows against its
  h, times its routing weight (a pair of weight 0 adds exactly 0, whatever its slot holds),
  summed in float32 → [T, D] in x's dtype.

Each program loads its rows' scales and codes as two gathers of the same bytes, so the codes and
the scales come from memory together (XLA's fusion of the same computation reads every block's
scale in a kernel of its own first: benchmarks/RESULTS.md). A row of blocks that is not a power
of two is read in power-of-two runs (24 blocks: 16, then 8). `experts_ref` is the jnp
reference: every slot dequantized to float32, the same rounding of h.

q4_0 slots may come as their 16-bit words (`Format.words`: 9 a block), which `_words_dot` reads
as each row's contiguous runs of words (loads the GPU can vectorize, where a block of 18 bytes
starts at any even byte). Made inside the fused step from the stored bytes (a bitcast), they
cost about a copy of every bank a step on an H100 (benchmarks/RESULTS.md): the engine gives the
kernels the bytes. The slots may be `Stacked` entries of the layers' stacked banks, read in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from freetoken_jax.quant.formats import get_format, nibble_codec
from pallas_kernels import call_params, rows_of, value

ACTS = ("silu", "gelu_tanh", "swiglu_oai")  # config.ACTIVATIONS that lower to Triton (exact gelu's erfc does not)
# On the H200, 16 rows a program ran 1.5-3.9 × slower than 4 in benchmarks/bench_expert_kernels.py's
# loop (whose iterations cost 20-40 µs of their own); inside the decode step the kernels at 4 rows
# still lost to XLA's fusion (benchmarks/RESULTS.md).
BLOCK_ROWS = 4
NUM_WARPS = 4


# The formats of 32-weight blocks whose head (the scale) is followed by 16 bytes of nibbles,
# decoded as `Format.matvec` decodes them (`formats.nibble_codec`: scale from the head bytes, and
# the codes' values).
FORMATS = ("q4_0", "mxfp4")


def _pieces(nb: int) -> list[tuple[int, int]]:
    """(first block, blocks) of the powers of two that make up nb blocks, largest first (Triton's
    arrays have power-of-two sizes): 24 → (0, 16), (16, 8)."""
    out, start = [], 0
    for bit in reversed(range(nb.bit_length())):
        if nb >> bit & 1:
            out.append((start, 1 << bit))
            start += 1 << bit
    return out


class HeadBytes:
    """A block's head bytes as the scale decoders index them (`h[..., i]`), each gathered from the
    slot where it is used (Triton lowers no slice of a loaded array)."""

    def __init__(self, load):
        self._load = load

    def __getitem__(self, index):
        return self._load(index[-1])


def _rows_dot(fmt: str, w_ref, s, rows, v_ref, vrow, nb: int):
    """float32 [rows] · v: rows `rows` (nb blocks each) of slot `s` in `w_ref` against row `vrow`
    of `v_ref`, a power-of-two run of blocks at a time."""
    head, scale_of, value = nibble_codec(fmt)
    block = head + 16
    j = jnp.arange(16, dtype=jnp.int32)
    acc = jnp.zeros(rows.shape, jnp.float32)
    for b0, n in _pieces(nb):
        b = b0 + jnp.arange(n, dtype=jnp.int32)
        blk = rows[:, None] * (nb * block) + b[None, :] * block  # [R, n]: each block's first byte
        codes = w_ref[s, blk[:, :, None] + head + j[None, None, :]].astype(jnp.int32)  # [R, n, 16]
        scale = scale_of(HeadBytes(lambda i, blk=blk: w_ref[s, blk + i]))  # [R, n]
        vi = b[:, None] * 32 + j[None, :]
        lo = v_ref[vrow, vi].astype(jnp.float32)  # weights 0-15 of each block
        hi = v_ref[vrow, vi + 16].astype(jnp.float32)  # 16-31
        part = jnp.sum(value(codes & 15) * lo[None] + value(codes >> 4) * hi[None], axis=2)
        acc = acc + jnp.sum(part * scale, axis=1)
    return acc


def _words_dot(w_ref, s, rows, v_ref, vrow, nb: int):
    """`_rows_dot` of q4_0 rows as 16-bit words (`Format.words`: 9 a block, the f16 scale first,
    then word i the codes of weights 2i, 2i + 16, 2i + 1, 2i + 17): each row's words are read as
    contiguous power-of-two runs (whole-row loads the GPU vectorizes); a word's block scale is a
    second read of the same bytes, and its weights' values are gathered from v (the scale word's
    taken as 0)."""
    W = 9 * nb
    acc = jnp.zeros(rows.shape, jnp.float32)
    for c0, n in _pieces(W):
        c = c0 + jnp.arange(n, dtype=jnp.int32)
        b = c // 9
        i = c - 9 * b - 1  # the word's index among its block's codes; -1: the scale
        k = 32 * b + 2 * jnp.maximum(i, 0)
        code = i >= 0
        xs = [jnp.where(code, v_ref[vrow, k + o].astype(jnp.float32), 0.0)[None, :] for o in (0, 16, 1, 17)]
        at = rows[:, None] * W
        q = w_ref[s, at + c[None, :]].astype(jnp.int32)  # [R, n]
        scale = jax.lax.bitcast_convert_type(w_ref[s, at + 9 * b[None, :]], jnp.float16).astype(jnp.float32)
        t = sum(((q >> (4 * j)) & 15).astype(jnp.float32) * xs[j] for j in range(4)) - 8.0 * sum(xs)  # (code - 8) · x
        acc = acc + jnp.sum(scale * t, axis=1)
    return acc


def _gate_up(ids_ref, x_ref, g_ref, u_ref, h_ref, *, K: int, R: int, dot, act):
    p, r = pl.program_id(0), pl.program_id(1)
    s, t = ids_ref[p], p // K
    rows = r * R + jnp.arange(R, dtype=jnp.int32)
    g = dot(g_ref, s, rows, x_ref, t)
    u = dot(u_ref, s, rows, x_ref, t)
    h_ref[p, rows] = act(g, u).astype(h_ref.dtype)


def _down(ids_ref, w_ref, h_ref, *refs, K: int, R: int, dot):
    """Program (t, r): rows r·R.. of y[t] = Σ_k w[t,k] · (the down rows of slot ids[t,k]) · h[t,k];
    `dot(weight_refs, slot, rows, h_ref, pair)` reads the rows from `refs` less the last (y)."""
    *d_refs, y_ref = refs
    t, r = pl.program_id(0), pl.program_id(1)
    rows = r * R + jnp.arange(R, dtype=jnp.int32)
    acc = jnp.zeros((R,), jnp.float32)
    for k in range(K):
        p = t * K + k
        w = w_ref[p]
        acc = acc + jnp.where(w != 0, w * dot(d_refs, ids_ref[p], rows, h_ref, p), 0.0)
    y_ref[t, rows] = acc.astype(y_ref.dtype)


def check_shapes(F: int, D: int, block_rows: int) -> None:
    """Raises ValueError unless experts of FFN width F and hidden size D fit the kernels."""
    if F % 32 or D % 32:
        raise ValueError(f"rows are whole blocks of 32: F={F}, D={D}")
    if block_rows & (block_rows - 1) or F % block_rows or D % block_rows:
        raise ValueError(f"block_rows={block_rows} must be a power of two dividing F={F} and D={D}")


def experts(fmt: str, x_TD, ids_TK, w_TK, gate_SR, up_SR, down_SR, *, F: int, D: int, act, interpret: bool = False,
            block_rows: int = BLOCK_ROWS, num_warps: int = NUM_WARPS) -> jax.Array:  # fmt: skip
    """The routed experts' output [T, D] in x's dtype (module docstring) for experts in `fmt` (a
    name in FORMATS). Slot rows may be wider than a projection's bytes (the first bytes are its
    matrix); q4_0 slots may be given as their 16-bit words (`Format.words`, uint16), read by
    `_words_dot`; the three may be `Stacked` entries of the layers' stacked banks (read in place
    through an offset on the slot index). `act(g, u)` in float32."""
    if fmt not in FORMATS:
        raise ValueError(f"no expert kernels for format {fmt!r}; they take {tuple(FORMATS)}")
    T, K = ids_TK.shape
    check_shapes(F, D, block_rows)
    if x_TD.shape != (T, D):
        raise ValueError(f"x {x_TD.shape} is not [{T}, {D}]")
    (gate_SR, off), (up_SR, _), (down_SR, _) = (rows_of(a) for a in (gate_SR, up_SR, down_SR))
    words = fmt == "q4_0" and gate_SR.dtype == jnp.uint16
    n = get_format(fmt).nbytes(F, D) // (2 if words else 1)
    for a in (gate_SR, up_SR, down_SR):
        if a.ndim != 2 or a.dtype != (jnp.uint16 if words else jnp.uint8) or a.shape[1] < n:
            raise ValueError(f"slots {a.shape} {a.dtype} cannot hold {fmt} [{F}, {D}] rows of {n} {'words' if words else 'bytes'}")

    def dot(nb):
        if words:
            return lambda w_ref, s, rows, v_ref, vrow: _words_dot(w_ref, s, rows, v_ref, vrow, nb)
        return lambda w_ref, s, rows, v_ref, vrow: _rows_dot(fmt, w_ref, s, rows, v_ref, vrow, nb)

    ids = ids_TK.reshape(-1).astype(jnp.int32) + off
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    R, tag = block_rows, f"{fmt}{'_words' if words else ''}"
    h = pl.pallas_call(
        functools.partial(_gate_up, K=K, R=R, dot=dot(D // 32), act=act),
        grid=(T * K, F // R),
        in_specs=[any_spec] * 4,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((T * K, F), x_TD.dtype),
        name=f"{tag}_gate_up",
        **call_params(interpret, num_warps),
    )(ids, x_TD, gate_SR, up_SR)
    down_dot = dot(F // 32)
    return pl.pallas_call(
        functools.partial(_down, K=K, R=R, dot=lambda refs, s, rows, v, p: down_dot(refs[0], s, rows, v, p)),
        grid=(T, D // R),
        in_specs=[any_spec] * 4,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((T, D), x_TD.dtype),
        name=f"{tag}_down",
        **call_params(interpret, num_warps),
    )(ids, w_TK.reshape(-1).astype(jnp.float32), h, down_SR)


def experts_ref(fmt: str, x_TD, ids_TK, w_TK, gate_SR, up_SR, down_SR, *, F: int, D: int, act) -> jax.Array:
    """Reference: the chosen slots dequantized to float32 [F, D] / [D, F] (`Format.dequantize`)
    and multiplied in jnp."""
    q = get_format(fmt)
    n = q.nbytes(F, D)
    gate_SR, up_SR, down_SR = (value(a) for a in (gate_SR, up_SR, down_SR))
    if gate_SR.dtype == jnp.uint16:  # q4_0 words: their bytes
        gate_SR, up_SR, down_SR = (jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(a.shape[0], -1) for a in (gate_SR, up_SR, down_SR))
    g, u, d = (q.dequantize(a[ids_TK][..., :n], *shape) for a, shape in zip((gate_SR, up_SR, down_SR), ((F, D), (F, D), (D, F))))
    x = x_TD.astype(jnp.float32)
    h = act(jnp.einsum("tkfd,td->tkf", g, x), jnp.einsum("tkfd,td->tkf", u, x)).astype(x_TD.dtype).astype(jnp.float32)
    y = jnp.einsum("tkdf,tkf->tkd", d, h)
    w = w_TK.astype(jnp.float32)[..., None]
    return jnp.sum(jnp.where(w != 0, w * y, 0.0), axis=1).astype(x_TD.dtype)
