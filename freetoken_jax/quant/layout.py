"""`ExpertLayout`: what an expert bank holds, for every module that stores or reads one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.quant.formats import get_format
from pallas_kernels import Stacked

PROJECTIONS = ("gate", "up", "down")  # the banks of a layer, in this order everywhere


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """What an expert bank of one MoE layer holds: the storage format of gate, up and down
    (`config.EXPERT_FORMATS`), the FFN width F, the hidden size D and the activation between the
    projections. A bank of n experts is gate/up [n, F, D] and down [n, D, F] in the model dtype
    ("bf16"), the same flattened to one row per expert (host banks and slots), or one row of
    `format.nbytes` bytes per expert and projection. A row may be longer than its matrix (slots
    are as wide as the widest layer's: `slot_row_sizes`); the matrix is its first bytes.

    `mixed`: the model's layers differ in format, so a slot may hold another layer's bytes when
    it is read under this layer's format (a step computes every slot it indexes, unrouted ones
    with weight 0), so that such a slot contributes exactly nothing: `matrix` reads dequantized
    values that are not finite as 0 (a dense matmul sums them with the others), `matvec` leaves
    each pair's result to its own rows for the caller to mask."""

    fmts: tuple[str, str, str]
    F: int
    D: int
    act: str
    mixed: bool = False
    words: bool | None = None  # read q4_0 banks as 16-bit words (`gather`); None: on a GPU

    @classmethod
    def of(cls, cfg: MoEModelConfig, m: int = 0) -> ExpertLayout:
        """The layout of MoE layer m."""
        return cls(cfg.formats_of(m), cfg.moe_intermediate_dim, cfg.hidden_dim, cfg.hidden_act, bool(cfg.expert_formats))

    @property
    def fmt(self) -> str:
        """The format of gate and up (and down, unless this layer keeps it in another)."""
        return self.fmts[0]

    @property
    def quantized(self) -> bool:
        return self.fmts[0] != "bf16"

    def shapes(self) -> tuple[tuple[int, int], ...]:
        """[out, in] of gate, up and down."""
        return ((self.F, self.D), (self.F, self.D), (self.D, self.F))

    def shape_of(self, proj: str) -> tuple[int, int]:
        """[out, in] of the projection `proj` (a name in PROJECTIONS)."""
        return self.shapes()[PROJECTIONS.index(proj)]

    def row_sizes(self) -> tuple[int, int, int]:
        """Elements of one expert's row in each bank (bytes when quantized)."""
        if not self.quantized:
            return tuple(o * i for o, i in self.shapes())
        return tuple(get_format(f).nbytes(o, i) for f, (o, i) in zip(self.fmts, self.shapes()))

    def matrices(self, banks, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Gate, up, down of the experts in `banks` as [..., out, in] in `dtype` (dequantized)."""
        return tuple(self.matrix(k, b, dtype) for k, b in enumerate(banks))

    def matrix(self, k: int, bank: jax.Array, dtype) -> jax.Array:
        """Projection k (an index into PROJECTIONS) of the experts in `bank` as [..., out, in]."""
        o, i = self.shapes()[k]
        if not self.quantized:  # stacks [..., out, in] or rows [..., out·in]
            return (bank if bank.shape[-2:] == (o, i) else bank.reshape(*bank.shape[:-1], o, i)).astype(dtype)
        w = get_format(self.fmts[k]).dequantize(self._own(k, bank), o, i, dtype)
        return jnp.where(jnp.isfinite(w), w, 0) if self.mixed else w

    def matvec(self, k: int, bank: jax.Array, v: jax.Array) -> jax.Array:
        """Projection k's rows of `bank` ([..., row]) times `v` ([..., in]), in float32 [..., out]:
        a quantized bank is read as stored (`Format.matvec`), never as a dequantized copy. Rows
        of a mixed model's slot that holds another layer's bytes can come out non-finite: the
        caller masks the results of the pairs that index such slots (weight 0), as
        `models/routed._gathered` does; each pair's result depends on its own rows only."""
        if self.quantized:
            return get_format(self.fmts[k]).matvec(self._own(k, bank), v, *self.shapes()[k])
        return jnp.sum(v[..., None, :].astype(jnp.float32) * self.matrix(k, bank, jnp.float32), axis=-1)

    def gather(self, k: int, bank: jax.Array, ids: jax.Array) -> jax.Array:
        """Rows `ids` of projection k's `bank` as `matvec` reads them: a q4_0 bank as 16-bit
        words (`Format.words`) where `words` says so (by default on a GPU, where a whole bank's
        words are a free bitcast and decode's experts read them faster), else as stored (the
        CPU backend computes a bank's words rather than viewing them, and its matvec over
        gathered rows' words ran 2.3 × slower than over their bytes). `bank` may be a `Stacked`
        entry of the layers' stacked banks: its rows are gathered from the stack in place."""
        at = ()
        if isinstance(bank, Stacked):
            bank, at = bank.array, (bank.index,)
        if self.quantized and (jax.default_backend() == "gpu" if self.words is None else self.words):
            w = get_format(self.fmts[k]).words(bank)
            if w is not None:
                return w[(*at, ids)]
        return bank[(*at, ids)]

    def _own(self, k: int, bank: jax.Array) -> jax.Array:
        """Projection k's bytes (or words) of quantized rows that may be wider (slots:
        `slot_row_sizes`)."""
        n = self.row_sizes()[k] // bank.dtype.itemsize
        return bank if bank.shape[-1] == n else bank[..., :n]

    def expert_bytes(self, itemsize: int) -> int:
        """Stored bytes of one expert (its three projections); `itemsize` of the model dtype."""
        rows = sum(self.row_sizes())
        return rows if self.quantized else rows * itemsize

    def bank_dtype(self, dtype):
        """The element type of banks and slots: uint8 when quantized, else the model dtype."""
        return jnp.uint8 if self.quantized else dtype

    def executor_format(self) -> str:
        """The CPU executor's name for this layer's banks: "q4_k", or "q4_k/q6_k" (gate-up / down)."""
        return self.fmts[0] if self.fmts[2] == self.fmts[0] else f"{self.fmts[0]}/{self.fmts[2]}"


def slot_row_sizes(cfg: MoEModelConfig) -> tuple[int, int, int]:
    """Row widths of the slot arrays (and prefill buffers): each projection's widest layer."""
    sizes = [ExpertLayout.of(cfg, m).row_sizes() for m in range(max(1, len(cfg.expert_formats)))]
    return tuple(max(s[k] for s in sizes) for k in range(3))


def expert_bytes(cfg: MoEModelConfig, itemsize: int) -> int:
    """Bytes of one expert slot of `cfg` (its widest layer's rows; `itemsize` of the model dtype)."""
    rows = sum(slot_row_sizes(cfg))
    return rows if ExpertLayout.of(cfg).quantized else rows * itemsize
