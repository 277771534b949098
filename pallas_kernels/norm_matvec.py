"""A decode step's RMSNorm and the projections that read its output, in one kernel.

`norm_matvec(x_BD, norm_D, eps, weights, biases=None, out_dtypes=None, keep_h=False, add_BD=None)`
is, for each of a few rows b (one token each),

    s[b] = round(x[b] + add[b])   (where `add_BD` is given: a residual stream's pending term; else x[b]),
    h[b] = norm ⊙ round(s[b] · rsqrt(mean(s[b]²) + eps))   (`layers.RMSNorm`: float32, rounded to x's dtype),
    y_i[b] = h[b] · W_iᵀ (+ bias_i), accumulated in float32, stored as out_dtypes[i]

for every weight W_i [F_i, D] (the checkpoints' [out, in] layout): the attention's q, k and v
projections, or the MoE router. XLA compiles the same as two kernels for the norm (the sum of
squares, then the scaling) and one reduction kernel per projection (q apart from k and v); here
one launch does all of it. With `norm_D=None` there is no norm (h[b] = s[b]): a plain matvec,
the attention's output projection. Program p computes R_i rows of one W_i (the programs of W_0
first, then W_1's, ...), each row against every b; each program normalises x itself (D values a
row: cheaper than a launch), and program 0 writes h where `keep_h` asks for it (the router's input
feeds the experts too) and s where `add_BD` is given (the residual stream, whose add then costs
no kernel of its own). The norm, weights and biases may be `Stacked` operands (a layer's among
every layer's, read in place through an offset). `norm_matvec_ref` is the jnp reference: the add,
`RMSNorm`, then `Linear`'s einsum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import call_params, rows_of, value

NUM_WARPS = 4
TILE = 8192  # the most weight values a program holds by default: R_i · D ≤ TILE
MAX_ROWS = 8  # the most rows b a call takes (each a loop of its own in every program)


def fits(B: int, D: int, F: tuple[int, ...]) -> bool:
    """Whether B rows of width D and weights of F_i rows fit the kernel: D a power of two whose
    rows fit a program (Triton's arrays are powers of two), B at most `MAX_ROWS`."""
    return 0 < B <= MAX_ROWS and D & (D - 1) == 0 and 0 < D <= TILE and all(f > 0 for f in F)


def _rows_per_program(F: int, D: int, tile: int = TILE) -> int:
    """The largest power of two R ≤ tile / D dividing F."""
    R = max(1, tile // D)
    while F % R:
        R //= 2
    return R


def _kernel(*refs, eps: float, B: int, D: int, parts: tuple, biases: tuple, keep_h: bool, add: bool, norm: bool, offsets: tuple):
    n = len(parts)
    x_ref, *rest = refs
    g_ref = rest.pop(0) if norm else None
    a_ref = rest.pop(0) if add else None
    w_refs, rest = rest[:n], rest[n:]
    b_refs = []
    for has in biases:
        b_refs.append(rest.pop(0) if has else None)
    y_refs, rest = rest[:n], rest[n:]
    h_ref = rest.pop(0) if keep_h else None
    s_ref = rest.pop(0) if add else None
    p = pl.program_id(0)
    d = jnp.arange(D, dtype=jnp.int32)
    g_off, w_offs, b_offs = offsets  # each operand's first row in its (stacked) array
    g = g_ref[g_off + d] if norm else None
    hs, ss = [], []
    for b in range(B):
        xb = x_ref[b, d]
        if add:
            xb = (xb.astype(jnp.float32) + a_ref[b, d].astype(jnp.float32)).astype(xb.dtype)
            ss.append(xb)
        if not norm:
            hs.append(xb)
            continue
        xf = xb.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.sum(xf * xf) / D + eps)
        hs.append(g * (xf * inv).astype(xb.dtype))
    for i, (start, blocks, R) in enumerate(parts):

        @pl.when((p >= start) & (p < start + blocks))
        def _(i=i, start=start, R=R):
            rows = (p - start) * R + jnp.arange(R, dtype=jnp.int32)
            w = w_refs[i][(w_offs[i] + rows)[:, None], d[None, :]].astype(jnp.float32)  # [R, D]
            bias = None if b_refs[i] is None else b_refs[i][b_offs[i] + rows].astype(jnp.float32)
            for b in range(B):
                y = jnp.sum(w * hs[b].astype(jnp.float32)[None, :], axis=1)
                if bias is not None:
                    y = y + bias
                y_refs[i][b, rows] = y.astype(y_refs[i].dtype)

    if keep_h or add:

        @pl.when(p == 0)
        def _():
            for b in range(B):
                if keep_h:
                    h_ref[b, d] = hs[b].astype(h_ref.dtype)
                if add:
                    s_ref[b, d] = ss[b]


def norm_matvec(x_BD, norm_D, eps: float, weights, biases=None, out_dtypes=None, keep_h: bool = False, add_BD=None, *,
                interpret: bool = False, num_warps: int = NUM_WARPS, tile: int = TILE):  # fmt: skip
    """(y_i [B, F_i] for each weight, h [B, D] where `keep_h` else None, s [B, D] where `add_BD`
    else None) (module docstring). `norm_D`: None for no norm; `biases`: per weight a [F_i] vector
    or None; `out_dtypes`: per weight (default x's dtype); `tile`: the most weight values a program
    holds (a power of two). The norm, weights and biases: arrays or `Stacked` operands."""
    B, D = x_BD.shape
    F = tuple(w.shape[0] for w in weights)
    if (norm_D is not None and norm_D.shape != (D,)) or any(w.ndim != 2 or w.shape[1] != D for w in weights):
        raise ValueError(
            f"norm {None if norm_D is None else norm_D.shape} and weights {[w.shape for w in weights]} do not match x {x_BD.shape}"
        )
    if add_BD is not None and add_BD.shape != x_BD.shape:
        raise ValueError(f"add {add_BD.shape} does not match x {x_BD.shape}")
    if not fits(B, D, F):
        raise ValueError(f"{B} rows of width {D} do not fit the kernel (D a power of two ≤ {TILE}, at most {MAX_ROWS} rows)")
    biases = list(biases or [None] * len(weights))
    out_dtypes = list(out_dtypes or [x_BD.dtype] * len(weights))
    for w, bias in zip(weights, biases):
        if bias is not None and bias.shape != (w.shape[0],):
            raise ValueError(f"bias {bias.shape} does not match weight {w.shape}")
    parts, start = [], 0
    for f in F:
        R = _rows_per_program(f, D, tile)
        parts.append((start, f // R, R))
        start += f // R
    add = add_BD is not None
    (norm_D, g_off), weights, biases = rows_of(norm_D), [rows_of(w) for w in weights], [None if b is None else rows_of(b) for b in biases]
    offsets = (g_off, tuple(o for _, o in weights), tuple(0 if b is None else b[1] for b in biases))
    weights, biases = [w for w, _ in weights], [None if b is None else b[0] for b in biases]
    ins = [x_BD, *([] if norm_D is None else [norm_D]), *([add_BD] if add else []), *weights, *[b for b in biases if b is not None]]
    outs = [jax.ShapeDtypeStruct((B, f), dt) for f, dt in zip(F, out_dtypes)]
    outs += [jax.ShapeDtypeStruct((B, D), x_BD.dtype)] * (int(keep_h) + int(add))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, eps=float(eps), B=B, D=D, parts=tuple(parts), biases=tuple(b is not None for b in biases),
                               keep_h=keep_h, add=add, norm=norm_D is not None, offsets=offsets)  # fmt: skip
    res = pl.pallas_call(
        kernel,
        grid=(start,),
        in_specs=[any_spec] * len(ins),
        out_specs=[any_spec] * len(outs),
        out_shape=outs,
        name="norm_matvec" if norm_D is not None else "matvec",
        **call_params(interpret, num_warps),
    )(*ins)
    rest = list(res[len(F) :])
    return tuple(res[: len(F)]), (rest.pop(0) if keep_h else None), (rest.pop(0) if add else None)


def norm_matvec_ref(x_BD, norm_D, eps: float, weights, biases=None, out_dtypes=None, keep_h: bool = False, add_BD=None):
    """Reference: the residual's add as the model writes it, `layers.RMSNorm` (none where `norm_D`
    is None), then each weight as `layers.Linear` computes it (the router's float32 weight at full
    precision)."""
    norm_D, weights, biases = value(norm_D), [value(w) for w in weights], None if biases is None else [value(b) for b in biases]
    s = None if add_BD is None else x_BD + add_BD
    x_BD = x_BD if s is None else s
    xf = x_BD.astype(jnp.float32)
    h = x_BD if norm_D is None else norm_D * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x_BD.dtype)
    biases = list(biases or [None] * len(weights))
    out_dtypes = list(out_dtypes or [x_BD.dtype] * len(weights))
    ys = []
    for w, bias, dt in zip(weights, biases, out_dtypes):
        y = jnp.einsum("bd,fd->bf", h.astype(jnp.promote_types(h.dtype, w.dtype)), w, preferred_element_type=jnp.float32,
                       precision=jax.lax.Precision.HIGHEST)  # fmt: skip
        if bias is not None:
            y = y + bias
        ys.append(y.astype(dt))
    return tuple(ys), (h if keep_h else None), s
