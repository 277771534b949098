"""Pallas kernels of freetoken_jax: one module per kernel, each with a jnp reference beside it
and an `interpret` switch (interpret mode is how they run on the CPU backend)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Stacked:
    """A kernel operand given as entry `index` of the stacked array that holds it (one layer's
    weight among every layer's: `freetoken_jax.models.stacked`): the kernel reads the entry in
    place through an offset, where slicing it out first would make XLA copy it before the call.
    `shape`, `dtype` and `ndim` are the entry's."""

    array: Any
    index: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple:
        return tuple(self.array.shape[1:])

    @property
    def dtype(self):
        return self.array.dtype

    @property
    def ndim(self) -> int:
        return self.array.ndim - 1

    def get(self):
        """The entry itself (a slice: a copy where XLA cannot fuse it into its reader)."""
        return self.array[self.index]


def rows_of(x) -> tuple[Any, int]:
    """(an array whose rows hold x's, the index of x's first row there): x and 0, or for a
    `Stacked` operand its stacked array with the first axis folded into the rows
    ([L · n, ...]) and entry index · n."""
    if isinstance(x, Stacked):
        n = x.shape[0]
        return x.array.reshape(x.array.shape[0] * n, *x.shape[1:]), x.index * n
    return x, 0


def value(x):
    """x's entry (`Stacked.get`) or x itself: for the references."""
    return x.get() if isinstance(x, Stacked) else x


def call_params(interpret: bool, num_warps: int, num_stages: int | None = None) -> dict:
    """`pallas_call`'s keywords for a kernel: interpret mode, or Triton's warps a program (and
    its software pipeline's stages, where given)."""
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
