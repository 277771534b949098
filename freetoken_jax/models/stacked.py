"""The layers' weights stacked: every layer's copy of a weight in one array (FREETOKEN_WEIGHTS).

A step's call pays jit's dispatch for each array it takes (about 1.4 µs a buffer on an H100:
benchmarks/RESULTS.md), and a model passes a dozen weights a layer. `stack_layers` gathers the
leaves that differ only by their layer (`['layers'][i]...`, same shape, dtype and placement) into
one array each, `[L, ...]`; the routed experts' banks too where they are resident (strategy
"fused": a decode step gathers its experts' rows from the stack itself, `quant.layout.gather`),
not host banks (the expert backends and the CPU executor address those per layer). In a step,
`unstack` gives the model each layer's weight back as a slice of its stack (`take`), which XLA
reads where it can fuse it into its reader (the CPU backend copies a matmul's operand first), and
the kernels take the stack itself with the layer's offset (`kernel_operand` turns such a slice
back into a `pallas_kernels.Stacked` operand), so that no kernel operand is copied.
"""

from __future__ import annotations

import collections
import weakref

import jax
import jax.numpy as jnp

from freetoken_jax.config import env_choice
from pallas_kernels import Stacked

_SOURCES: dict[int, tuple] = {}  # id of a slice `take` made -> (its weak reference, its stack's, its index)


def weights_layout() -> str:
    """How the layers' weights are kept (FREETOKEN_WEIGHTS): "stacked" — every layer's copy of a
    weight in one array; "layers" — an array per layer and weight; "auto" (the default) — stacked
    on a GPU (on an H100 the fused step's calling thread took 0.52-0.67 ms a step instead of
    1.12-1.36 at the same tokens/s: benchmarks/RESULTS.md), per layer on the CPU backend (whose
    matmuls copy a stacked weight's slice first)."""
    layout = env_choice("FREETOKEN_WEIGHTS", "auto", ("auto", "layers", "stacked"))
    if layout == "auto":
        return "layers" if jax.default_backend() == "cpu" else "stacked"
    return layout


def take(stack, index: int):
    """`stack[index]`, remembered as entry `index` of `stack` for `kernel_operand` while both live."""
    x = stack[index]
    _SOURCES[id(x)] = (weakref.ref(x), weakref.ref(stack), index)
    weakref.finalize(x, _SOURCES.pop, id(x), None)
    return x


def kernel_operand(x):
    """A kernel's operand for x: `Stacked(stack, index)` where x is a slice `take` made of a stack
    still alive (the kernel reads it in place), else x itself (None stays None)."""
    entry = None if x is None else _SOURCES.get(id(x))
    if entry is not None:
        ref, stack_ref, index = entry
        stack = stack_ref()
        if ref() is x and stack is not None:
            return Stacked(stack, index)
    return x


def _in_layer(path, experts: bool) -> tuple | None:
    """The leaf's path past `['layers'][i]` for a leaf of a layer (outside the routed experts
    unless `experts`), else None."""
    names = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
    if len(names) < 3 or names[0] != "layers" or not isinstance(names[1], int) or (not experts and "experts" in names[2:]):
        return None
    return tuple(names[2:])


def _placement(a) -> tuple:
    sharding = getattr(a, "sharding", None)
    return (tuple(a.shape), str(a.dtype), getattr(sharding, "memory_kind", None))


def stack_layers(params, experts: bool = False, consume: bool = False) -> tuple[tuple, tuple]:
    """(arrays, plan): `params`' leaves with each weight that two or more layers hold alike
    stacked into one array (the layers in order; the routed experts' banks too with `experts`),
    and for each leaf of `params` its (array index, entry index or None) in them. The stacks are
    new arrays; `params` is left as it is, unless `consume`: then each stacked leaf is deleted
    once its stack is made, so that the weights are held twice only one weight at a time (the
    caller owns `params` and drops it)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    groups: dict[tuple, list[int]] = {}
    for n, (path, leaf) in enumerate(flat):
        key = _in_layer(path, experts)
        if key is not None:
            groups.setdefault((key, _placement(leaf)), []).append(n)
    arrays, plan = [], [None] * len(flat)
    holders = collections.Counter(id(leaf) for _, leaf in flat) if consume else None
    for n, (_, leaf) in enumerate(flat):
        if plan[n] is not None:
            continue
        key = _in_layer(flat[n][0], experts)
        members = groups.get((key, _placement(leaf))) if key is not None else None
        if not members or len(members) < 2 or _placement(leaf)[2] not in (None, "device"):
            plan[n] = (len(arrays), None)
            arrays.append(leaf)
            continue
        for j, m in enumerate(members):
            plan[m] = (len(arrays), j)
        arrays.append(jnp.stack([flat[m][1] for m in members]))
        if consume:
            for m in members:
                if holders[id(flat[m][1])] == 1:  # an array two leaves hold is left alone
                    flat[m][1].delete()
    return tuple(arrays), tuple(plan)


def unstack(arrays, plan, entry=take) -> list:
    """The leaves `stack_layers` gathered, each stacked one `entry(stack, index)` (a `take` of
    its stack by default)."""
    return [arrays[k] if j is None else entry(arrays[k], j) for k, j in plan]
