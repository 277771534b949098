"""Quantized Hugging Face checkpoints: FP8 block-scaled (DeepSeek-V3 / Qwen3 "-FP8"), NVFP4
(NVIDIA ModelOpt, compressed-tensors "nvfp4-pack-quantized") and MXFP4 (gpt-oss's `*_blocks` /
`*_scales`).

`scheme(raw, path)` reads the checkpoint's quantization config; `QuantView(st, scheme)` serves
the checkpoint's tensors under their plain names: `get(name)` dequantized to float32 (dense
weights; float64-exact arithmetic, rounded once), `native(name)` the matrix's bytes in the
engine's expert format (`docs/FORMATS.md`) without re-quantizing — the stored codes and scales
repacked: fp8 tiles' scales repeated per row, the 4-bit formats' nibbles reordered.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_dtypes
import numpy as np

from freetoken_jax.checkpoint.safetensors_io import CheckpointError
from freetoken_jax.config import ConfigError
from freetoken_jax.quant.formats import E2M1, pack_halves_ref


@dataclasses.dataclass(frozen=True)
class Scheme:
    kind: str  # "fp8" | "nvfp4" (ModelOpt) | "nvfp4_ct" (compressed-tensors) | "mxfp4"
    block: tuple[int, int] = (128, 128)  # fp8: the scale tile [out, in]

    @property
    def fmt(self) -> str:
        """The engine expert format this scheme's experts load into."""
        return {"fp8": "fp8", "nvfp4": "nvfp4", "nvfp4_ct": "nvfp4", "mxfp4": "mxfp4"}[self.kind]

    def why_not_native(self, D: int, F: int) -> str | None:
        """Why experts of hidden size D and width F cannot keep their bytes (None: they can)."""
        if self.kind == "fp8" and self.block[1] != 128:
            return f"its FP8 scale tiles are {self.block[1]} wide along the input; the engine's fp8 banks keep one scale per 128 inputs"
        multiple = {"fp8": 1, "mxfp4": 32}.get(self.kind, 64)
        if D % multiple or F % multiple:
            return f"{self.fmt} banks need input sizes that are multiples of {multiple} (hidden {D}, expert width {F})"
        return None


def scheme(raw: dict, path: str) -> Scheme | None:
    """The quantization scheme of a checkpoint's config (None: not quantized); an unknown one is a
    ConfigError naming it."""
    qc = raw.get("quantization_config")
    hf_quant = os.path.join(path, "hf_quant_config.json")
    if qc is None and os.path.isfile(hf_quant):  # ModelOpt's own file
        with open(hf_quant) as f:
            qc = dict(json.load(f).get("quantization", {}), quant_method="modelopt")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{path}: FP8 format {qc.get('fmt')!r} is not supported (e4m3 is)")
        bo, bi = qc.get("weight_block_size") or (128, 128)
        return Scheme("fp8", (int(bo), int(bi)))
    if method == "modelopt":
        algo = qc.get("quant_algo")
        if algo != "NVFP4" or int(qc.get("group_size", 16)) != 16:
            raise ConfigError(
                f"{path}: ModelOpt quantization {algo!r} (group {qc.get('group_size')}) is not supported (NVFP4, group 16, is)"
            )
        return Scheme("nvfp4")
    if method == "compressed-tensors":
        if qc.get("format") != "nvfp4-pack-quantized":
            raise ConfigError(f"{path}: compressed-tensors format {qc.get('format')!r} is not supported (nvfp4-pack-quantized is)")
        return Scheme("nvfp4_ct")
    if method == "mxfp4":
        return Scheme("mxfp4")
    raise ConfigError(f"{path}: quantization method {method!r} is not supported (fp8, modelopt NVFP4, compressed-tensors NVFP4, mxfp4 are)")


def _e4m3(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(ml_dtypes.float8_e4m3fn) if np.asarray(a).dtype == np.uint8 else np.asarray(a, ml_dtypes.float8_e4m3fn)


def _codes(packed: np.ndarray) -> np.ndarray:
    """Packed e2m1 pairs (low nibble first) → codes [..., 2n]."""
    p = np.asarray(packed, np.uint8)
    return np.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)


class QuantView:
    """A safetensors directory's tensors under their unquantized names."""

    def __init__(self, st, sch: Scheme):
        self.st, self.s = st, sch

    def _parts(self, name: str) -> dict | None:
        """The stored tensors of a quantized weight `name` (None: stored plain, or absent)."""
        st, k = self.st, self.s.kind
        base = name[: -len("weight")] if name.endswith(".weight") else None
        if k == "fp8" and name in st and name + "_scale_inv" in st:
            return dict(q=name, s=name + "_scale_inv")
        if k == "nvfp4" and base and name in st and base + "weight_scale" in st:
            return dict(q=name, s=base + "weight_scale", g=base + "weight_scale_2")
        if k == "nvfp4_ct" and base and base + "weight_packed" in st:
            return dict(q=base + "weight_packed", s=base + "weight_scale", g=base + "weight_global_scale")
        if k == "mxfp4":
            stem = base[:-1] if base else name
            if stem + "_blocks" in st:
                return dict(q=stem + "_blocks", s=stem + "_scales")
        return None

    def __contains__(self, name: str) -> bool:
        return name in self.st or self._parts(name) is not None

    def _load(self, name: str):
        parts = self._parts(name)
        got = {k: self.st.get(v) for k, v in parts.items()}  # memory-mapped views
        q, s = got["q"], got["s"]
        k = self.s.kind
        if k == "fp8":
            bo, bi = self.s.block
            O, I = q.shape[-2:]
            want = (-(-O // bo), -(-I // bi))
            if s.shape[-2:] != want:
                raise CheckpointError(
                    f"{self.st.path}: {parts['s']} has shape {s.shape}; [{O}, {I}] weights in {bo}x{bi} tiles need {want}"
                )
        elif k.startswith("nvfp4"):
            O, I = q.shape[-2], 2 * q.shape[-1]
            if s.shape[-2:] != (O, I // 16):
                raise CheckpointError(f"{self.st.path}: {parts['s']} has shape {s.shape}; [{O}, {I}] weights need ({O}, {I // 16})")
            g = np.asarray(got["g"], np.float32).reshape(-1)
            if g.size != 1:
                raise CheckpointError(f"{self.st.path}: {parts['g']} holds {g.size} scales; one per tensor is the NVFP4 layout")
            got["g"] = np.float32(1) / g[0] if k == "nvfp4_ct" else g[0]  # compressed-tensors stores its reciprocal
        else:
            if q.shape[-1] != 16 or s.shape != q.shape[:-1]:
                raise CheckpointError(f"{self.st.path}: {parts['q']} {q.shape} and {parts['s']} {s.shape} are not MXFP4 blocks and scales")
        return got

    def shape(self, name: str) -> tuple[int, ...]:
        """The unquantized shape, from the headers (scale shapes checked against it; no data read)."""
        if self._parts(name) is None:
            return tuple(self.st.get(name).shape)
        q = self._load(name)["q"]  # memory-mapped views
        if self.s.kind == "fp8":
            return tuple(q.shape)
        if self.s.kind == "mxfp4":
            return (*q.shape[:-2], q.shape[-2] * 32)
        return (*q.shape[:-1], q.shape[-1] * 2)

    def get(self, name: str) -> np.ndarray:
        """The tensor in float32 (dequantized when stored quantized)."""
        if self._parts(name) is None:
            return self.st.get(name)
        got = self._load(name)
        q, s = got["q"], got["s"]
        k = self.s.kind
        if k == "fp8":
            bo, bi = self.s.block
            O, I = q.shape[-2:]
            tile = np.repeat(np.repeat(np.asarray(s, np.float64), bo, axis=-2), bi, axis=-1)[..., :O, :I]
            return (_e4m3(q).astype(np.float64) * tile).astype(np.float32)
        if k == "mxfp4":
            v = E2M1[_codes(q)] * np.exp2(np.asarray(s, np.float64) - 127)[..., None]
            return v.reshape(*q.shape[:-2], -1).astype(np.float32)
        v = E2M1[_codes(q)].reshape(*q.shape[:-1], -1, 16) * _e4m3(s).astype(np.float64)[..., None]
        return (v.reshape(*q.shape[:-1], -1) * np.float64(got["g"])).astype(np.float32)

    def native(self, name: str) -> np.ndarray:
        """The weight [..., O, I] as the engine's `scheme.fmt` bytes [..., nbytes(O, I)] (no re-quantizing)."""
        got = self._load(name)
        q, s = got["q"], got["s"]
        lead = q.shape[:-2] if self.s.kind != "mxfp4" else q.shape[:-3]
        if self.s.kind == "fp8":
            bo = self.s.block[0]
            O, I = q.shape[-2:]
            nb = -(-I // 128)
            rows = np.repeat(np.asarray(s, np.float32), bo, axis=-2)[..., :O, :nb]  # each row its tile's scale
            w = np.zeros((*lead, O, nb * 128), np.uint8)
            w[..., :I] = np.asarray(q).view(np.uint8)
            b = np.concatenate([rows[..., None].view(np.uint8), w.reshape(*lead, O, nb, 128)], axis=-1)
            return b.reshape(*lead, -1)
        if self.s.kind == "mxfp4":
            codes = _codes(q)  # [..., O, nb, 32]
            b = np.concatenate([np.asarray(s, np.uint8)[..., None], pack_halves_ref(codes)], axis=-1)
            return b.reshape(*lead, -1)
        O, I = q.shape[-2], 2 * q.shape[-1]
        codes = _codes(q).reshape(*lead, O, I // 64, 4, 16)
        sc = _e4m3(s).view(np.uint8).reshape(*lead, O, I // 64, 4)
        rows = np.concatenate([sc, pack_halves_ref(codes).reshape(*lead, O, I // 64, 32)], axis=-1).reshape(*lead, -1)
        g = np.broadcast_to(np.float32(got["g"]), (*lead, 1)).copy().view(np.uint8)
        return np.concatenate([rows, g], axis=-1)
