"""`ExpertLayout`: what an expert bank holds, for every module that stores or reads one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.quant.formats import get_format


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """What an expert bank holds: the storage format (`config.EXPERT_FORMATS`), the FFN width F,
    the hidden size D and the activation between the projections. A bank of n experts is gate/up
    [n, F, D] and down [n, D, F] in the model dtype ("bf16"), the same flattened to one row per
    expert (host banks and slots), or one row of `format.nbytes` bytes per expert and projection."""

    fmt: str
    F: int
    D: int
    act: str

    @classmethod
    def of(cls, cfg: MoEModelConfig) -> ExpertLayout:
        return cls(cfg.expert_format, cfg.moe_intermediate_dim, cfg.hidden_dim, cfg.hidden_act)

    @property
    def quantized(self) -> bool:
        return self.fmt != "bf16"

    def shapes(self) -> tuple[tuple[int, int], ...]:
        """[out, in] of gate, up and down."""
        return ((self.F, self.D), (self.F, self.D), (self.D, self.F))

    def row_sizes(self) -> tuple[int, int, int]:
        """Elements of one expert's row in each bank (bytes when quantized)."""
        if not self.quantized:
            return tuple(o * i for o, i in self.shapes())
        f = get_format(self.fmt)
        return tuple(f.nbytes(o, i) for o, i in self.shapes())

    def matrices(self, banks, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Gate, up, down of the experts in `banks` as [..., out, in] in `dtype` (dequantized)."""
        if not self.quantized:  # stacks [..., out, in] or rows [..., out·in]
            return tuple((b if b.shape[-2:] == (o, i) else b.reshape(*b.shape[:-1], o, i)).astype(dtype)
                         for b, (o, i) in zip(banks, self.shapes()))  # fmt: skip
        f = get_format(self.fmt)
        return tuple(f.dequantize(b, o, i, dtype) for b, (o, i) in zip(banks, self.shapes()))

    def expert_bytes(self, itemsize: int) -> int:
        """Stored bytes of one expert (its three projections); `itemsize` of the model dtype."""
        rows = sum(self.row_sizes())
        return rows if self.quantized else rows * itemsize

    def bank_dtype(self, dtype):
        """The element type of banks and slots: uint8 when quantized, else the model dtype."""
        return jnp.uint8 if self.quantized else dtype


def expert_bytes(cfg: MoEModelConfig, itemsize: int) -> int:
    """Stored bytes of one routed expert of `cfg` (its format; `itemsize` of the model dtype)."""
    return ExpertLayout.of(cfg).expert_bytes(itemsize)
