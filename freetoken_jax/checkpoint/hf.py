"""Loading a Hugging Face safetensors checkpoint into the engine's parameter tree.

Each parameter path of the model (e.g. `layers/3/self_attn/q_proj/weight`) maps to one checkpoint
tensor, in the same [out, in] layout, or, for expert banks, to the per-expert tensors of a layer
stacked into `[E, ...]` (or the fused `gate_up_proj` / `down_proj` banks of newer exports).
Quantized checkpoints (`checkpoint/hf_quant.py`: FP8, NVFP4, MXFP4) are read through their
unquantized names: dense weights dequantized, routed experts kept as stored in the matching
expert format unless the caller names another one to re-quantize to.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from freetoken_jax.checkpoint.hf_quant import QuantView, scheme
from freetoken_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir
from freetoken_jax.models.registry import Family, family_for, read_hf_config


def _hf_prefix(path: tuple, fam: Family) -> str:
    renames = dict(fam.renames)
    return ".".join(str(renames.get(p, p)) if not isinstance(p, int) else str(p) for p in path)


class HFSource:
    """A Hugging Face checkpoint directory as the engine reads it: its family, its model config
    (with `expert_format` set when the experts keep their quantized bytes) and a tensor per
    parameter path (`get`, `shape`). `expert_format`: the format the caller asked for (None: as
    stored); a quantized checkpoint's experts are re-quantized only to a format named here."""

    def __init__(self, path: str, expert_format: str | None = None):
        self.path = path
        raw = read_hf_config(path)
        self.fam = family_for(raw)
        self.cfg = self.fam.parse(raw)
        self.scheme = scheme(raw, path)
        st = SafetensorsDir(path)
        self.ckpt = QuantView(st, self.scheme) if self.scheme else st
        self.native = False  # experts as stored bytes
        if self.scheme is not None and expert_format in (None, self.scheme.fmt):
            why = self.scheme.why_not_native(self.cfg.hidden_dim, self.cfg.moe_intermediate_dim)
            if why:
                raise CheckpointError(f"{path}: the experts cannot load as stored: {why}. Pass expert_format (--expert-format), "
                                      "e.g. 'q8_0', to re-quantize them on load")  # fmt: skip
            self.native = True
            self.cfg = dataclasses.replace(self.cfg, expert_format=self.scheme.fmt)

    def _name(self, path: tuple) -> tuple[str, str | None]:
        """(checkpoint tensor name, how to take it: None as it is, 'stack' per expert, 'gate' / 'up'
        of the fused bank (or of its biases: 'gate_bias' / 'up_bias'), 'down_t' a down bank stored
        [E, in, out])."""
        fam, ckpt = self.fam, self.ckpt
        if fam.name == "generic":
            return "/".join(map(str, path)), None
        head, leaf = path[:-1], path[-1]
        if path == ("embed", "embedding"):
            return "model.embed_tokens.weight", None
        if path == ("lm_head", "weight"):
            return "lm_head.weight", None
        if head[-2:] == ("experts", "bias"):  # per-expert biases: gate_up_proj_bias [E, 2F], down_proj_bias [E, D]
            name = "model." + _hf_prefix(head[:-1], fam)
            return (name + ".down_proj_bias", None) if leaf == "down" else (name + ".gate_up_proj_bias", leaf + "_bias")
        if head[-1] == "gate" and leaf == "logit_bias":  # gpt-oss's router bias
            return "model." + _hf_prefix(head, fam) + ".bias", None
        name = ("model." if path[0] in ("layers", "norm") else "") + _hf_prefix(head, fam)
        if head[-1] == "experts":
            if name + ".gate_up_proj" in ckpt:  # [E, 2F, D] / [E, D, F]
                return (name + ".down_proj", "down_t" if self._transposed else None) if leaf == "down" else (name + ".gate_up_proj", leaf)
            proj = dict(zip(("gate", "up", "down"), fam.expert_names))[leaf]
            return f"{name}.{{e}}.{proj}.weight", "stack"
        if head[-1] == "gate" and head[-2] == "mlp" and leaf == "bias":  # V3's routing correction
            return name + ".e_score_correction_bias", None
        return f"{name}.{leaf}", None

    def _read(self, name: str, native: bool) -> np.ndarray:
        return self.ckpt.native(name) if native else self.ckpt.get(name)

    @property
    def _transposed(self) -> bool:
        """Unquantized gpt-oss banks are stored [E, in, out]; its MXFP4 blocks are [E, out, in]."""
        return self.fam.interleaved_gate_up and self.scheme is None

    def get(self, path: tuple) -> np.ndarray:
        """The tensor(s) of one parameter path, in the engine's layout (not yet cast); expert
        banks as [E, nbytes] bytes when the experts keep their stored format."""
        name, how = self._name(path)
        native = self.native and path[-2] == "experts"
        F = self.cfg.moe_intermediate_dim
        if how == "stack":
            return np.stack([self._read(name.format(e=e), native) for e in range(self.cfg.num_experts)])
        if how in ("gate_bias", "up_bias"):  # [E, 2F]
            a = self._read(name, False)
            return self._split(a, how[:-5], F, axis=1)
        if how in ("gate", "up"):
            a = self._read(name, native)
            if self._transposed:
                return np.swapaxes(self._split(a, how, F, axis=2), 1, 2)
            if not native:
                return self._split(a, how, F, axis=1)
            from freetoken_jax.quant.formats import get_format

            f = get_format(self.cfg.expert_format)
            rb = f.row_bytes(self.cfg.hidden_dim)
            rows = self._split(a[:, : 2 * F * rb].reshape(a.shape[0], 2 * F, rb), how, F, axis=1).reshape(a.shape[0], F * rb)
            return np.concatenate([rows, a[:, 2 * F * rb :]], axis=1)
        if how == "down_t":
            return np.swapaxes(self._read(name, native), 1, 2)
        return self._read(name, native)

    def _split(self, a: np.ndarray, how: str, F: int, axis: int) -> np.ndarray:
        """The gate or up part of a fused gate-up `a` along `axis`: alternate entries
        (`interleaved_gate_up`) or the two halves."""
        idx = [slice(None)] * a.ndim
        if self.fam.interleaved_gate_up:
            idx[axis] = slice(0 if how == "gate" else 1, None, 2)
        else:
            idx[axis] = slice(0, F) if how == "gate" else slice(F, 2 * F)
        return a[tuple(idx)]

    def shape(self, path: tuple) -> tuple[int, ...]:
        """The parameter's shape as stored, before anything is read (experts: [E, out, in])."""
        name, how = self._name(path)
        shape = self.ckpt.shape if isinstance(self.ckpt, QuantView) else (lambda n: tuple(self.ckpt.get(n).shape))
        if how == "stack":
            shapes = {shape(name.format(e=e)) for e in range(self.cfg.num_experts)}
            if len(shapes) != 1:
                raise CheckpointError(f"{self.path}: the experts of {name} have different shapes {sorted(shapes)}")
            return (self.cfg.num_experts, *shapes.pop())
        s = shape(name)
        if how in ("gate_bias", "up_bias"):
            return (s[0], s[1] // 2)
        if how in ("gate", "up"):
            s = (s[0], s[2], s[1]) if self._transposed else s
            return (s[0], s[1] // 2, *s[2:])
        if how == "down_t":
            return (s[0], s[2], s[1])
        return s

    def check(self, abstract) -> None:
        """Every parameter present with the shape the config needs (nothing is read)."""
        from freetoken_jax.quant.layout import ExpertLayout

        layout = ExpertLayout.of(self.cfg)
        for p, var in abstract:
            want = tuple(var.get_value().shape)
            if p[-2] == "experts" and self.native:
                want = (want[0], *layout.shape_of(p[-1]))
            got = self.shape(p)
            if got != want:
                raise CheckpointError(f"{self.path}: {'/'.join(map(str, p))} has shape {got}, the config needs {want}")


def load_params(src, dtype: str, place=None):
    """The parameter state of `src.cfg` filled from its checkpoint, a tensor (a layer's expert
    stack) at a time. `src`: any source with `cfg`, `check(abstract)` and `get(path)` (`HFSource`,
    `gguf_file.GGUFParams`). Every shape is checked from the headers first, so a bad checkpoint
    raises `CheckpointError` with nothing allocated. `place(path, host_array)`, when given, makes
    the array of a leaf (e.g. a host bank for experts) instead of the device."""
    import jax.numpy as jnp
    from flax import nnx

    from freetoken_jax.models import build_abstract
    from freetoken_jax.progress import progress

    abstract = list(build_abstract(src.cfg, dtype).flat_state())
    src.check(abstract)
    flat = []
    with progress(sum(v.get_value().size * v.get_value().dtype.itemsize for _, v in abstract), "loading weights") as bar:
        for p, var in abstract:
            dt = var.get_value().dtype
            a = src.get(p)
            a = a if a.dtype == dt else np.asarray(np.asarray(a, np.float32), dtype=dt)
            flat.append((p, var.replace(place(p, a) if place else jnp.asarray(a))))
            bar.update(var.get_value().size * dt.itemsize)
    return nnx.State.from_flat_path(flat)
