"""Expert weight formats: byte layouts, jnp quantizers and dequantizers, numpy references.

A format stores one matrix W [O, I] (O output rows, I the input dimension: the checkpoints'
layout) as O rows of blocks along I, each block its scale bytes followed by its quant bytes, then
an optional trailer: `nbytes(O, I)` uint8 in all. A bank holds one such matrix per expert and
projection, one expert per row (`docs/FORMATS.md` gives every layout byte by byte):

| format | weights per block | block bytes | layout of a block | trailer |
|---|---|---|---|---|
| q8_0 | 32 | 34 | f16 d, 32 × int8 q; w = d·q (GGUF Q8_0) | — |
| q4_0 | 32 | 18 | f16 d, 16 bytes: byte j = q[j] ∣ q[j+16] ≪ 4; w = d·(q − 8) (GGUF Q4_0) | — |
| mxfp4 | 32 | 17 | e8m0 e, 16 bytes of e2m1 as q4_0; w = 2^(e−127)·v (GGUF MXFP4) | — |
| nvfp4 | 64 | 36 | 4 × e4m3 s (one per 16), 4 × 8 bytes of e2m1, byte j of 16 = v[j] ∣ v[j+8] ≪ 4 (GGUF NVFP4) | f32 g; w = g·s·v |
| fp8 | 128 | 132 | f32 s, 128 × e4m3 q; w = s·q (a short last block is zero-padded) | — |
| q4_k | 256 | 144 | f16 d, f16 m, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles (GGUF Q4_K) | — |
| q5_k | 256 | 176 | as q4_k, then 32 bytes of fifth bits before the nibbles (GGUF Q5_K) | — |
| q6_k | 256 | 210 | 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 × int8 scales, f16 d (GGUF Q6_K) | — |

The jnp functions run inside jitted steps (dequantize, on the device or the CPU backend) and at
load (quantize, one layer at a time). `quantize_ref` / `dequantize_ref` are the numpy
references: quantizers compute in float32 with ggml's arithmetic (so that q8_0, q4_0 and mxfp4
bytes equal the `gguf` package's), dequantizers are exact in float64. The K-quants' quantizer
is one function over either array library (`_kquant`): a plain min/max fit per sub-block (GGUF
files bring ggml's own search; their bytes load as they are).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from freetoken_jax.config import EXPERT_FORMATS, ConfigError

# e2m1 magnitudes by code (bit 3 is the sign).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_MAX, FP4_MAX = 448.0, 6.0
# Scales multiply by these float32 reciprocals (XLA rewrites a division by a constant so).
_INV_FP8, _INV_NV = np.float32(1 / FP8_MAX), np.float32(1 / (FP4_MAX * FP8_MAX))


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    block: int  # weights per block along the input dimension
    block_bytes: int
    trailer: int = 0  # bytes after the rows (nvfp4: the float32 tensor scale)
    pads: bool = False  # a short last block is zero-padded (fp8); otherwise I must be a multiple of `block`

    def blocks(self, I: int) -> int:
        return -(-I // self.block)

    def row_bytes(self, I: int) -> int:
        return self.blocks(I) * self.block_bytes

    def nbytes(self, O: int, I: int) -> int:
        """Bytes of one [O, I] matrix."""
        return O * self.row_bytes(I) + self.trailer

    def check(self, O: int, I: int, what: str = "a matrix") -> None:
        if O <= 0 or I <= 0:
            raise ConfigError(f"{what} of shape [{O}, {I}] cannot be stored")
        if not self.pads and I % self.block:
            raise ConfigError(f"{self.name} stores blocks of {self.block} along the input dimension; {what} has {I} inputs")

    # jnp -----------------------------------------------------------------------------------------
    def quantize(self, w: jax.Array) -> jax.Array:
        """[..., O, I] (any float dtype) → uint8 [..., nbytes(O, I)]."""
        *lead, O, I = w.shape
        self.check(O, I)
        w = jnp.asarray(w).astype(jnp.float32)
        return _QUANTIZE[self.name](self, w).reshape(*lead, self.nbytes(O, I))

    def dequantize(self, b: jax.Array, O: int, I: int, dtype=jnp.float32) -> jax.Array:
        """uint8 [..., nbytes(O, I)] → [..., O, I] in `dtype` (scales applied in float32)."""
        rows, trailer = self._split(b, O, I)
        w = _DEQUANTIZE[self.name](self, rows, trailer)
        return w.reshape(*b.shape[:-1], O, self.blocks(I) * self.block)[..., :I].astype(dtype)

    def _split(self, b: jax.Array, O: int, I: int) -> tuple[jax.Array, jax.Array]:
        """uint8 [..., nbytes(O, I)] → its blocks [..., O, blocks, block_bytes] and trailer."""
        if b.shape[-1] != self.nbytes(O, I):
            raise ValueError(f"{self.name} [{O}, {I}] is {self.nbytes(O, I)} bytes, got rows of {b.shape[-1]}")
        at = O * self.row_bytes(I)
        return b[..., :at].reshape(*b.shape[:-1], O, self.blocks(I), self.block_bytes), b[..., at:]

    def matvec(self, b: jax.Array, x: jax.Array, O: int, I: int) -> jax.Array:
        """Σ_i W[o, i]·x[i] in float32: uint8 [..., nbytes(O, I)] (or, for q4_0, the same bytes
        as uint16 words [..., nbytes / 2]: `words`) and x [..., I] → [..., O].
        q4_0, mxfp4, nvfp4 and q4_k never form W: each byte's two codes meet their two inputs
        (a byte of a group holds weights j and j + n/2 of the group's n) and the scales (and
        q4_k's mins) apply inside the same sum, one reduction over the stored bytes. Other
        formats dequantize block by block inside one reduction over (block, weight), x
        zero-padded to whole blocks, never reshaped to [O, I] and sliced (on the CPU backend
        about 4 x faster for q8_0, 1.6 x for fp8)."""
        if b.dtype == jnp.uint16 and self.name == "q4_0":
            return _q4_0_words_matvec(b, x, O, I)
        lead, nb = b.shape[:-1], self.blocks(I)
        rows, trailer = self._split(b, O, I)
        nib = _NIBBLES.get(self.name)
        if nib is None:
            w = _DEQUANTIZE[self.name](self, rows, trailer).reshape(*lead, O, nb, self.block)
            xb = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, nb * self.block - I)])
            return jnp.sum(w * xb.reshape(*x.shape[:-1], 1, nb, self.block), axis=(-2, -1))
        head, groups, params, code = nib
        n = self.block // groups  # weights a group of bytes holds: n/2 bytes, two codes each
        grp = (groups,) if groups > 1 else ()  # (a unit axis here made XLA's CPU reduction 5 x slower)
        q = rows[..., head:].reshape(*lead, O, nb, *grp, n // 2)
        xb = x.astype(jnp.float32).reshape(*x.shape[:-1], 1, nb, *grp, 2, n // 2)
        s_lo, s_hi, m_lo, m_hi = (None if a is None else a.reshape(*lead, O, nb, *grp, 1) for a in params(rows[..., :head]))
        v = s_lo * code(q & 15) * xb[..., 0, :] + s_hi * code(q >> 4) * xb[..., 1, :]
        if m_lo is not None:  # q4_k: each sub-block's min
            v = v - m_lo * xb[..., 0, :] - m_hi * xb[..., 1, :]
        y = jnp.sum(v, axis=tuple(range(-2 - len(grp), 0)))
        if self.trailer:  # nvfp4: the tensor's float32 scale
            y = y * _from_bytes(trailer, jnp.float32)[..., None]
        return y

    def words(self, b: jax.Array) -> jax.Array | None:
        """q4_0's rows uint8 [..., n] (n even) as the uint16 words `matvec` reads: a block (18
        bytes) is 9 words, its f16 scale one of them, so that no scale is composed of two bytes
        (on the GPU XLA composed them in a kernel of its own before the reductions, reading the
        gathered blocks twice; the words of a whole bank are a free bitcast there, and 8
        gathered experts of the Qwen3-30B-A3B shape took 32.6 against 43.1 µs a layer,
        benchmarks/RESULTS.md). None for the other formats, and for rows of an odd length."""
        if self.name != "q4_0" or b.shape[-1] % 2:
            return None
        return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // 2, 2), jnp.uint16)

    # numpy references ----------------------------------------------------------------------------
    def quantize_ref(self, w: np.ndarray) -> np.ndarray:
        O, I = w.shape
        self.check(O, I)
        return _QUANTIZE_REF[self.name](self, np.asarray(w, np.float32)).reshape(-1)

    def dequantize_ref(self, b: np.ndarray, O: int, I: int) -> np.ndarray:
        b = np.asarray(b, np.uint8).reshape(-1)
        rows = b[: O * self.row_bytes(I)].reshape(O, self.blocks(I), self.block_bytes)
        w = _DEQUANTIZE_REF[self.name](self, rows, b[O * self.row_bytes(I) :])
        return w.reshape(O, -1)[:, :I]


FORMATS = {
    "q8_0": Format("q8_0", 32, 34),
    "q4_0": Format("q4_0", 32, 18),
    "mxfp4": Format("mxfp4", 32, 17),
    "nvfp4": Format("nvfp4", 64, 36, trailer=4),
    "fp8": Format("fp8", 128, 132, pads=True),
    "q4_k": Format("q4_k", 256, 144),
    "q5_k": Format("q5_k", 256, 176),
    "q6_k": Format("q6_k", 256, 210),
}
assert {n: 1 if f.pads else f.block for n, f in FORMATS.items()} == {n: m for n, m in EXPERT_FORMATS.items() if n != "bf16"}


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ConfigError(f"unknown expert format {name!r}; choose from {EXPERT_FORMATS}")
    return FORMATS[name]


# Shared pieces ------------------------------------------------------------------------------------
def _as_bytes(x: jax.Array) -> jax.Array:
    """The bytes of each element, little-endian, along a new last axis (none for 1-byte types)."""
    if x.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8)[..., None]
    return jax.lax.bitcast_convert_type(x, jnp.uint8)


def _from_bytes(b: jax.Array, dtype) -> jax.Array:
    """[..., itemsize] bytes → [...] of `dtype`. A multi-byte value is first composed as an
    unsigned integer of its width (little-endian), then bitcast element for element: a bitcast
    that folds an axis of bytes needs those bytes contiguous, and on the GPU XLA copied a gathered
    expert's scale bytes out of its blocks in a kernel of their own before every dequantizing
    reduction; composed so, the scales are read inside that reduction."""
    n = jnp.dtype(dtype).itemsize
    if n == 1:
        return jax.lax.bitcast_convert_type(b[..., 0], dtype)
    uint = {2: jnp.uint16, 4: jnp.uint32}[n]
    v = b[..., 0].astype(uint)
    for i in range(1, n):
        v = v | (b[..., i].astype(uint) << (8 * i))
    return jax.lax.bitcast_convert_type(v, dtype)


def _blocks(w: jax.Array, block: int) -> jax.Array:
    """[..., O, I] → [..., O, ceil(I/block), block], zero-padded."""
    *lead, O, I = w.shape
    pad = (-I) % block
    if pad:
        w = jnp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, pad)])
    return w.reshape(*lead, O, -1, block)


def _roundf(x):
    """ggml's roundf: halves away from zero."""
    a = jnp.abs(x)
    f = jnp.floor(a)
    return jnp.sign(x) * (f + jnp.floor(2 * (a - f)))


def _inv(d):
    return jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))


def _pack_halves(q: jax.Array) -> jax.Array:
    """Codes [..., 2n] (uint8 < 16) → [..., n] bytes: q[j] | q[j+n] << 4."""
    n = q.shape[-1] // 2
    return q[..., :n] | (q[..., n:] << 4)


def _unpack_halves(b: jax.Array) -> jax.Array:
    return jnp.concatenate([b & 15, b >> 4], axis=-1)


def small_ints(c: jax.Array, minus: float = 0.0) -> jax.Array:
    """Non-negative integers c < 2^23 (a quantized weight's code) minus `minus`, as float32, by
    their bits: c set into the mantissa of 2^23, then 2^23 + minus subtracted (exact). An integer
    OR and a float subtraction where `c.astype(float32) - minus` takes an integer-to-float
    conversion, which a GPU issues at a fraction of the rate of either (CUDA C++ Programming
    Guide, arithmetic instructions) — once for every weight a matvec over codes reads."""
    bits = c.astype(jnp.uint32) | jnp.uint32(0x4B000000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(8388608.0 + minus)


def _e2m1(code: jax.Array) -> jax.Array:
    """e2m1 codes (< 16) → float32, composed as float32 bits (no table lookup and no conversion:
    it fuses): sign, exponent e − 1 + 127 and the mantissa bit, or 0.5 · m where e is 0."""
    c = code.astype(jnp.uint32)
    e, m = (c >> 1) & 3, c & 1
    bits = jnp.where(e == 0, m * jnp.uint32(126 << 23), ((e + 126) << 23) | (m << 22)) | ((c >> 3) << 31)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _nearest_e2m1(x: jax.Array, scale: jax.Array) -> jax.Array:
    """The e2m1 code whose value × scale is nearest to x (first code on ties, as ggml)."""
    err = jnp.abs(scale[..., None] * jnp.asarray(E2M1, jnp.float32) - x[..., None])
    return jnp.argmin(err, axis=-1).astype(jnp.uint8)


def _e8m0_half(e):
    """2^(e − 128) as float32 (ggml_e8m0_to_fp32_half)."""
    e = e.astype(jnp.uint32)
    bits = jnp.where(e < 2, jnp.uint32(0x00200000) << e, (e - 1) << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


# q8_0 ---------------------------------------------------------------------------------------------
def _q8_0_q(f, w):
    b = _blocks(w, 32)
    d = jnp.max(jnp.abs(b), axis=-1, keepdims=True) / 127
    q = _roundf(jax.lax.optimization_barrier(b * _inv(d))).astype(jnp.int8)
    return jnp.concatenate([_as_bytes(d[..., 0].astype(jnp.float16)), _as_bytes(q)[..., 0]], axis=-1)


def _q8_0_dq(f, rows, trailer):
    d = _from_bytes(rows[..., 0:2], jnp.float16).astype(jnp.float32)
    return small_ints(rows[..., 2:] ^ 0x80, 128.0) * d[..., None]  # int8 byte b: (b ^ 0x80) − 128


# q4_0 ---------------------------------------------------------------------------------------------
def _q4_0_q(f, w):
    b = _blocks(w, 32)
    mx = jnp.take_along_axis(b, jnp.argmax(jnp.abs(b), axis=-1, keepdims=True), axis=-1)
    d = mx / -8
    t = jax.lax.optimization_barrier(b * _inv(d))  # rounded before the + 8.5, as ggml (no fused multiply-add)
    q = jnp.clip(jnp.trunc(t + 8.5), 0, 15).astype(jnp.uint8)
    return jnp.concatenate([_as_bytes(d[..., 0].astype(jnp.float16)), _pack_halves(q)], axis=-1)


def _q4_0_dq(f, rows, trailer):
    d = _from_bytes(rows[..., 0:2], jnp.float16).astype(jnp.float32)
    return small_ints(_unpack_halves(rows[..., 2:]), 8.0) * d[..., None]


# mxfp4 --------------------------------------------------------------------------------------------
def _mxfp4_q(f, w):
    b = _blocks(w, 32)
    amax = jnp.max(jnp.abs(b), axis=-1)
    exp = ((jax.lax.bitcast_convert_type(amax, jnp.uint32) >> 23) & 255).astype(jnp.int32) - 127  # ⌊log2 amax⌋
    e = jnp.where(amax > 0, jnp.clip(exp - 2 + 127, 0, 254), 0).astype(jnp.uint8)
    q = _nearest_e2m1(b, 2 * _e8m0_half(e)[..., None])
    return jnp.concatenate([e[..., None], _pack_halves(q)], axis=-1)


def _mxfp4_dq(f, rows, trailer):
    scale = 2 * _e8m0_half(rows[..., 0])
    return _e2m1(_unpack_halves(rows[..., 1:])) * scale[..., None]


# nvfp4 --------------------------------------------------------------------------------------------
def _nvfp4_q(f, w):
    g = jnp.max(jnp.abs(w), axis=(-2, -1)) * _INV_NV
    g = jnp.where(g > 0, g, 1.0)
    b = _blocks(w, 16)  # [..., O, I/16, 16]
    s = (jnp.max(jnp.abs(b), axis=-1) / FP4_MAX / g[..., None, None]).astype(jnp.float8_e4m3fn)
    q = _nearest_e2m1(b, (s.astype(jnp.float32) * g[..., None, None])[..., None])
    O = w.shape[-2]
    s4 = _as_bytes(s)[..., 0].reshape(*s.shape[:-1], -1, 4)  # [..., O, I/64, 4]
    q4 = _pack_halves(q).reshape(*q.shape[:-2], -1, 32)  # [..., O, I/64, 4 × 8]
    rows = jnp.concatenate([s4, q4], axis=-1).reshape(*w.shape[:-2], O * s4.shape[-2] * 36)
    return jnp.concatenate([rows, _as_bytes(g.astype(jnp.float32))], axis=-1)


def _nvfp4_dq(f, rows, trailer):
    g = _from_bytes(trailer, jnp.float32)
    s = _from_bytes(rows[..., 0:4, None], jnp.float8_e4m3fn).astype(jnp.float32)  # [..., O, nb, 4]
    q = rows[..., 4:].reshape(*rows.shape[:-1], 4, 8)
    v = _e2m1(_unpack_halves(q)) * s[..., None]  # [..., O, nb, 4, 16]
    return v.reshape(*rows.shape[:-1], 64) * g[..., None, None, None]


# fp8 ----------------------------------------------------------------------------------------------
def _fp8_q(f, w):
    *lead, O, I = w.shape
    t = f.block
    tiles = jnp.pad(w, [(0, 0)] * len(lead) + [(0, (-O) % t), (0, (-I) % t)])
    tiles = tiles.reshape(*lead, tiles.shape[-2] // t, t, tiles.shape[-1] // t, t)
    s = jnp.max(jnp.abs(tiles), axis=(-3, -1)) * _INV_FP8  # [..., O/t, I/t]
    s = jnp.where(s > 0, s, 1.0)
    s_rows = jnp.repeat(s, t, axis=-2)[..., :O, :]  # [..., O, nb]: each row carries its tile's scale
    q = (_blocks(w, t) / s_rows[..., None]).astype(jnp.float8_e4m3fn)
    return jnp.concatenate([_as_bytes(s_rows), _as_bytes(q)[..., 0]], axis=-1)


def _fp8_dq(f, rows, trailer):
    s = _from_bytes(rows[..., 0:4], jnp.float32)
    return _from_bytes(rows[..., 4:, None], jnp.float8_e4m3fn).astype(jnp.float32) * s[..., None]


# K-quants (GGUF's super-blocks of 256 = 8 sub-blocks of 32) ---------------------------------------
# q4_k / q5_k: w = d·sc[j]·q − dmin·m[j] with 6-bit sc, m per sub-block j packed in 12 bytes;
# q6_k: w = d·sc[i]·(q − 32) with int8 sc per 16 weights. Written once over `xp` (numpy or
# jax.numpy): the dequantizers' arithmetic is exact in float64 (numpy) or float32 (jnp).


def _k_scale_min(xp, s12):
    """12 bytes → (sc, m), 6 bits each, [..., 8] (ggml's get_scale_min_k4)."""
    d, m, md = s12[..., 0:4], s12[..., 4:8], s12[..., 8:12]
    sc = xp.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = xp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def _k_pack_scale_min(xp, sc, mn):
    lo_s, hi_s, lo_m, hi_m = sc[..., :4], sc[..., 4:], mn[..., :4], mn[..., 4:]
    return xp.concatenate([lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_s & 15) | ((hi_m & 15) << 4)], axis=-1)


def _k_codes(xp, rows, name):
    """[..., nb, block_bytes] → unsigned codes [..., nb, 8, 32] (q6_k: still offset by 32)."""
    lead = rows.shape[:-1]
    if name == "q6_k":
        ql = rows[..., 0:128].reshape(*lead, 2, 1, 2, 32)  # half, (shift), 32-run, 32
        low = (ql >> xp.asarray([0, 4], dtype=rows.dtype).reshape(2, 1, 1)) & 15  # [.., 2, 2, 2, 32]: half, shift, run
        qh = rows[..., 128:192].reshape(*lead, 2, 1, 32)
        high = (qh >> xp.asarray([0, 2, 4, 6], dtype=rows.dtype).reshape(4, 1)) & 3  # [.., 2, 4, 32]
        return low.reshape(*lead, 8, 32) | (high.reshape(*lead, 8, 32) << 4)
    qs = rows[..., -128:].reshape(*lead, 4, 1, 32)
    low = ((qs >> xp.asarray([0, 4], dtype=rows.dtype).reshape(2, 1)) & 15).reshape(*lead, 8, 32)
    if name == "q4_k":
        return low
    qh = rows[..., 16:48].reshape(*lead, 1, 32)
    return low | (((qh >> xp.arange(8, dtype=rows.dtype).reshape(8, 1)) & 1) << 4)


def _kdequant(xp, rows, name, f16, f32, i8):
    """[..., nb, block_bytes] → weights [..., nb, 256] in `f32` (float32 or float64)."""
    lead = rows.shape[:-1]
    q = _k_codes(xp, rows, name).astype(f32)
    if name == "q6_k":
        d = f16(rows[..., 208:210]).astype(f32)
        sc = i8(rows[..., 192:208]).astype(f32) * d[..., None]  # [..., nb, 16]
        return ((q - 32).reshape(*lead, 16, 16) * sc[..., None]).reshape(*lead, 256)
    d, dmin = f16(rows[..., 0:2]).astype(f32), f16(rows[..., 2:4]).astype(f32)
    sc, mn = _k_scale_min(xp, rows[..., 4:16])
    w = q * (d[..., None] * sc.astype(f32))[..., None] - (dmin[..., None] * mn.astype(f32))[..., None]
    return w.reshape(*lead, 256)


def _kround(xp, x):
    a = xp.abs(x)
    f = xp.floor(a)
    return xp.sign(x) * (f + xp.floor(2 * (a - f)))


def _kdiv(xp, a, b):
    return xp.where(b == 0, 0.0, a / xp.where(b == 0, 1.0, b))


def _kquant(xp, b, name, to_f16, f16_bytes):
    """Blocks [..., nb, 256] float32 → [..., nb, block_bytes] uint8: a min/max fit per sub-block,
    the sub-block scales (and mins) quantized to 6 bits (q6_k: int8) of the super-block's f16."""
    lead = b.shape[:-1]
    u8 = lambda x: x.astype(xp.uint8)  # noqa: E731
    if name == "q6_k":
        s16 = b.reshape(*lead, 16, 16)
        idx = xp.argmax(xp.abs(s16), axis=-1)[..., None]
        scale = xp.take_along_axis(s16, idx, axis=-1)[..., 0] * np.float32(-1 / 32)  # the extreme weight maps to −32
        d = to_f16(xp.max(xp.abs(scale), axis=-1) * np.float32(1 / 127))
        sc = xp.clip(_kround(xp, _kdiv(xp, scale, d[..., None])), -128, 127)
        eff = (d[..., None] * sc)[..., None]
        q = u8(xp.clip(_kround(xp, _kdiv(xp, s16, eff)), -32, 31) + 32).reshape(*lead, 2, 4, 32)  # half, run, 32
        ql = (q[..., 0:2, :] & 15) | ((q[..., 2:4, :] & 15) << 4)  # [.., 2, 2, 32]: byte l of run r holds runs r and r + 2
        qh = (q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
        parts = [ql.reshape(*lead, 128), qh.reshape(*lead, 64), u8(sc.astype(xp.int8).view(xp.uint8) if xp is np else
                 jax.lax.bitcast_convert_type(sc.astype(jnp.int8), jnp.uint8)), f16_bytes(d)]  # fmt: skip
        return xp.concatenate(parts, axis=-1)
    qmax = 15 if name == "q4_k" else 31
    s32 = b.reshape(*lead, 8, 32)
    lo = xp.minimum(xp.min(s32, axis=-1), 0.0)
    scale, mn = (xp.max(s32, axis=-1) - lo) * np.float32(1 / qmax), -lo
    d, dmin = to_f16(xp.max(scale, axis=-1) * np.float32(1 / 63)), to_f16(xp.max(mn, axis=-1) * np.float32(1 / 63))
    sc = xp.clip(_kround(xp, _kdiv(xp, scale, d[..., None])), 0, 63)
    m = xp.clip(_kround(xp, _kdiv(xp, mn, dmin[..., None])), 0, 63)
    eff_s, eff_m = (d[..., None] * sc)[..., None], (dmin[..., None] * m)[..., None]
    q = u8(xp.clip(_kround(xp, _kdiv(xp, s32 + eff_m, eff_s)), 0, qmax)).reshape(*lead, 4, 2, 32)
    qs = ((q[..., 0, :] & 15) | ((q[..., 1, :] & 15) << 4)).reshape(*lead, 128)
    parts = [f16_bytes(d), f16_bytes(dmin), _k_pack_scale_min(xp, u8(sc), u8(m))]
    if name == "q5_k":
        hi = (q.reshape(*lead, 8, 32) >> 4).astype(xp.uint8)
        parts.append(sum(hi[..., j, :] << j for j in range(8)).astype(xp.uint8))
    return xp.concatenate([*parts, qs], axis=-1)


def _jnp_f16(x):
    return x.astype(jnp.float16).astype(jnp.float32)


def _jnp_f16_bytes(x):
    return _as_bytes(x.astype(jnp.float16))


def _kq(f, w):
    return _kquant(jnp, _blocks(w, 256), f.name, _jnp_f16, _jnp_f16_bytes)


def _kdq(f, rows, trailer):
    f16 = lambda b: _from_bytes(b, jnp.float16)  # noqa: E731
    i8 = lambda b: _from_bytes(b[..., None], jnp.int8)  # noqa: E731
    return _kdequant(jnp, rows, f.name, f16, jnp.float32, i8)


# Formats whose blocks are `head` bytes of scales and then `groups` groups of n/2 bytes of 4-bit
# codes, a byte's low nibble weight j of the group's n and its high nibble weight j + n/2:
# (head, groups, the scales and mins of the low and high halves, [..., groups] each (mins None
# where there are none), the codes' values) for `Format.matvec`.


def _same(s):
    return s, s, None, None


def _q4_k_params(h):
    """q4_k's head (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins): the scale and min of
    each group's low and high half, i.e. of sub-blocks 2g and 2g + 1, without concatenating."""
    d, dmin = (_from_bytes(h[..., i : i + 2], jnp.float16).astype(jnp.float32) for i in (0, 2))
    d4, m4, md = (h[..., i : i + 4][..., None, :] for i in (4, 8, 12))  # [..., 1, 4]
    upper = jnp.arange(2).reshape(2, 1) == 1  # sub-blocks 4..7 (`_k_scale_min`)
    sc = jnp.where(upper, (md & 15) | ((d4 >> 2) & 48), d4 & 63).astype(jnp.float32)  # [..., 2, 4]: sub-block 4h + i
    mn = jnp.where(upper, (md >> 4) | ((m4 >> 2) & 48), m4 & 63).astype(jnp.float32)
    sc, mn = (a.reshape(*a.shape[:-2], 4, 2) for a in (sc, mn))  # [..., group, half]: sub-block 2g + half
    return d[..., None] * sc[..., 0], d[..., None] * sc[..., 1], dmin[..., None] * mn[..., 0], dmin[..., None] * mn[..., 1]


def _q4_0_word_blocks(b: jax.Array, O: int, I: int) -> tuple[jax.Array, jax.Array]:
    """q4_0 rows as uint16 words [..., O·I/32·9] as blocks [..., O, nb, 9] (the scale word, then
    8 words of codes) and each block's scale, float32 [..., O, nb, 1]."""
    blk = b.reshape(*b.shape[:-1], O, I // 32, 9)
    return blk, jax.lax.bitcast_convert_type(blk[..., 0], jnp.float16).astype(jnp.float32)[..., None]


def _q4_0_words_matvec(b: jax.Array, x: jax.Array, O: int, I: int) -> jax.Array:
    """`Format.matvec` of q4_0 rows as uint16 words [..., O·I/32·9]: per block the scale word,
    then 8 words of 4 codes; word i holds bytes 2i and 2i + 1, i.e. the codes of weights 2i,
    2i + 16, 2i + 1 and 2i + 17, low nibble first."""
    nb = I // 32
    if b.shape[-1] != O * nb * 9:
        raise ValueError(f"q4_0 [{O}, {I}] is {O * nb * 9} words, got rows of {b.shape[-1]}")
    blk, s = _q4_0_word_blocks(b, O, I)
    q = blk[..., 1:]
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], 1, nb, 2, 8, 2)  # [half, i, parity]: weight 16·half + 2i + parity
    code = lambda n: small_ints((q >> (4 * n)) & 15, 8.0)  # noqa: E731
    t = code(0) * xb[..., 0, :, 0] + code(1) * xb[..., 1, :, 0] + code(2) * xb[..., 0, :, 1] + code(3) * xb[..., 1, :, 1]
    return jnp.sum(s * t, axis=(-2, -1))


_NIBBLES = {
    "q4_0": (2, 1, lambda h: _same(_from_bytes(h, jnp.float16).astype(jnp.float32)), lambda c: small_ints(c, 8.0)),
    "mxfp4": (1, 1, lambda h: _same(2 * _e8m0_half(h[..., 0])), _e2m1),
    "nvfp4": (4, 4, lambda h: _same(_from_bytes(h[..., None], jnp.float8_e4m3fn).astype(jnp.float32)), _e2m1),
    "q4_k": (16, 4, _q4_k_params, small_ints),
}


def nibble_codec(name: str):
    """(head bytes, the scale from the head [..., head] → [...], the codes' values) of a format
    whose 32-weight blocks are a head and then 16 bytes of nibbles (q4_0, mxfp4), as
    `Format.matvec` reads them; for kernels that decode the same bytes."""
    head, groups, params, code = _NIBBLES[name]
    if groups != 1:  # (one group: one scale, no mins)
        raise ValueError(f"{name} blocks are not a scale and 16 bytes of nibbles")
    return head, lambda h: params(h)[0], code


_QUANTIZE = {"q8_0": _q8_0_q, "q4_0": _q4_0_q, "mxfp4": _mxfp4_q, "nvfp4": _nvfp4_q, "fp8": _fp8_q, "q4_k": _kq, "q5_k": _kq, "q6_k": _kq}
_DEQUANTIZE = {"q8_0": _q8_0_dq, "q4_0": _q4_0_dq, "mxfp4": _mxfp4_dq, "nvfp4": _nvfp4_dq, "fp8": _fp8_dq, "q4_k": _kdq, "q5_k": _kdq,
               "q6_k": _kdq}  # fmt: skip


# numpy references ---------------------------------------------------------------------------------
def _np_blocks(w, block):
    O, I = w.shape
    return np.pad(w, [(0, 0), (0, (-I) % block)]).reshape(O, -1, block)


def _np_roundf(x):
    a = np.abs(x)
    f = np.floor(a)
    return np.sign(x) * (f + np.floor(2 * (a - f)))


def _np_inv(d):
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _np_e2m1_codes(x, scale):
    err = np.abs(scale[..., None] * E2M1.astype(np.float32) - x[..., None])
    return np.argmin(err, axis=-1).astype(np.uint8)


def pack_halves_ref(q):
    """Codes [..., 2n] (uint8 < 16) → [..., n] bytes: q[j] | q[j+n] << 4 (numpy)."""
    n = q.shape[-1] // 2
    return q[..., :n] | (q[..., n:] << np.uint8(4))


def _np_unhalves(b):
    return np.concatenate([b & 15, b >> 4], axis=-1)


def _ref_q8_0(f, w):
    b = _np_blocks(w, 32)
    d = (np.abs(b).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = _np_roundf(b * _np_inv(d)).astype(np.int8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1)


def _ref_q4_0(f, w):
    b = _np_blocks(w, 32)
    mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    d = (mx / np.float32(-8)).astype(np.float32)
    q = np.trunc(b * _np_inv(d) + np.float32(8.5)).clip(0, 15).astype(np.uint8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), pack_halves_ref(q)], axis=-1)


def _ref_mxfp4(f, w):
    b = _np_blocks(w, 32)
    amax = np.abs(b).max(-1)
    exp = ((amax.view(np.uint32) >> 23) & 255).astype(np.int32) - 127
    e = np.where(amax > 0, np.clip(exp - 2 + 127, 0, 254), 0).astype(np.uint8)
    scale = np.exp2(e.astype(np.float64) - 127).astype(np.float32)
    return np.concatenate([e[..., None], pack_halves_ref(_np_e2m1_codes(b, scale[..., None]))], axis=-1)


def _ref_nvfp4(f, w):
    g = np.float32(np.abs(w).max() * _INV_NV)
    g = g if g > 0 else np.float32(1)
    b = _np_blocks(w, 16)
    s = (np.abs(b).max(-1) / np.float32(FP4_MAX) / g).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    q = _np_e2m1_codes(b, (s.astype(np.float32) * g)[..., None])
    O = w.shape[0]
    s4 = s.view(np.uint8).reshape(O, -1, 4)
    q4 = pack_halves_ref(q).reshape(O, -1, 32)
    return np.concatenate([np.concatenate([s4, q4], -1).reshape(-1), np.float32(g).reshape(1).view(np.uint8)])


def _ref_fp8(f, w):
    O, I = w.shape
    t = f.block
    tiles = np.pad(w, [(0, (-O) % t), (0, (-I) % t)])
    tiles = tiles.reshape(tiles.shape[0] // t, t, tiles.shape[1] // t, t)
    s = (np.abs(tiles).max(axis=(1, 3)) * _INV_FP8).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1))
    s_rows = np.repeat(s, t, axis=0)[:O]
    q = (_np_blocks(w, t) / s_rows[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return np.concatenate([s_rows[..., None].view(np.uint8).reshape(O, -1, 4), q.view(np.uint8)], axis=-1)


def _dref_q8_0(f, rows, trailer):
    d = rows[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    return rows[..., 2:].view(np.int8).astype(np.float64) * d[..., None]


def _dref_q4_0(f, rows, trailer):
    d = rows[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    return (_np_unhalves(rows[..., 2:]).astype(np.float64) - 8) * d[..., None]


def _dref_mxfp4(f, rows, trailer):
    scale = np.exp2(rows[..., 0].astype(np.float64) - 127)
    return E2M1[_np_unhalves(rows[..., 1:])] * scale[..., None]


def _dref_nvfp4(f, rows, trailer):
    g = np.float64(trailer.copy().view(np.float32)[0])
    s = rows[..., 0:4].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    v = E2M1[_np_unhalves(rows[..., 4:].reshape(*rows.shape[:-1], 4, 8))] * s[..., None]
    return v.reshape(*rows.shape[:-1], 64) * g


def _dref_fp8(f, rows, trailer):
    s = rows[..., 0:4].copy().view(np.float32)[..., 0].astype(np.float64)
    return rows[..., 4:].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float64) * s[..., None]


def _np_f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _np_f16_bytes(x):
    return np.asarray(x, np.float32).astype(np.float16)[..., None].view(np.uint8)


def _ref_k(f, w):
    return _kquant(np, _np_blocks(w, 256), f.name, _np_f16, _np_f16_bytes)


def _dref_k(f, rows, trailer):
    f16 = lambda b: b.copy().view(np.float16)[..., 0]  # noqa: E731
    i8 = lambda b: b.view(np.int8)  # noqa: E731
    return _kdequant(np, rows, f.name, f16, np.float64, i8)


_QUANTIZE_REF = {"q8_0": _ref_q8_0, "q4_0": _ref_q4_0, "mxfp4": _ref_mxfp4, "nvfp4": _ref_nvfp4, "fp8": _ref_fp8, "q4_k": _ref_k,
                 "q5_k": _ref_k, "q6_k": _ref_k}  # fmt: skip
_DEQUANTIZE_REF = {"q8_0": _dref_q8_0, "q4_0": _dref_q4_0, "mxfp4": _dref_mxfp4, "nvfp4": _dref_nvfp4, "fp8": _dref_fp8,
                   "q4_k": _dref_k, "q5_k": _dref_k, "q6_k": _dref_k}  # fmt: skip


def bytes_per_weight(name: str, O: int = 4096, I: int = 4096) -> float:
    """Average stored bytes per weight of a format (2 for bf16)."""
    if name == "bf16":
        return 2.0
    return get_format(name).nbytes(O, I) / (O * I)


__all__ = ["FORMATS", "Format", "bytes_per_weight", "get_format"]
