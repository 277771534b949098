"""How "grouped" routed experts (`models.routed.routed_experts`) lay out a layer's token-expert
pairs: each expert gets a group of rows, and the experts' matmuls run over the groups' rows
instead of every token. A plan is static (one executable holds every plan of a chunk size and
picks by the counts at run time); the memory plan reads the largest one's rows."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """How "grouped" lays out a layer's pairs: `tiers` of (experts, rows each), in order, E
    experts in all. Unranked: expert e is the e-th (one tier). Ranked: the experts in order of
    their pairs, most first (ties by id), so the busiest get the tiers of most rows."""

    tiers: tuple[tuple[int, int], ...]
    ranked: bool

    @property
    def rows(self) -> int:
        return sum(n * c for n, c in self.tiers)

    def caps(self) -> np.ndarray:
        """Rows of the i-th expert (in the plan's order), [E]."""
        return np.concatenate([np.full(n, c, np.int32) for n, c in self.tiers])

    def starts(self) -> np.ndarray:
        """First row of the i-th expert (in the plan's order), [E]."""
        caps = self.caps()
        return np.concatenate([[0], np.cumsum(caps)[:-1]]).astype(np.int32)

    def order(self, counts_E: jax.Array) -> jax.Array:
        """The experts in the plan's order."""
        E = counts_E.shape[0]
        return jnp.argsort(-counts_E, stable=True).astype(jnp.int32) if self.ranked else jnp.arange(E, dtype=jnp.int32)

    def fits(self, counts_E: jax.Array) -> jax.Array:
        """Whether every expert's pairs fit its rows."""
        return jnp.all(counts_E[self.order(counts_E)] <= jnp.asarray(self.caps()))


def group_plans(T: int, K: int, E: int) -> list[GroupPlan]:
    """The layouts "grouped" tries in turn for T tokens, top-K of E experts, fewest rows first: C
    rows per expert (C: a power of two ≥ 2·T·K / E), 2C rows per expert (each under T), and three
    by rank — tight, for spread routing: C rows for the busiest E/32, 1.5·T·K/E for the next
    E/32 and 1.25·T·K/E for the rest (rounded up to a multiple of C/32, at least 8; where it has
    at most 0.8 × C's rows: 0.64 × at 128 experts, top-8, 2048 or 8192 tokens); steep: T rows
    for the busiest E/32 (at least one), T/2 for the next E/32, T/4 for the next E/16 and C for
    the rest; broad: T for the busiest E/32, max(T/2, 2C) for the next E/16 and 2C for the rest
    — each where it is under half of dense's E·T rows (steep only where it has fewer rows than
    broad); none where a group would be as large as the chunk. Synthetic Zipf routing that broad
    holds (exponents up to about 1.5 at 128 experts, top-8), steep holds too, in 0.59 × its rows
    at 8192 tokens; broad stays for busy experts past the busiest E/32 + E/32 + E/16 (steep's
    T/4 and C tiers)."""
    c = max(8, 1 << max(0, -(-2 * T * K // E) - 1).bit_length())  # a power of two ≥ 2·T·K / E
    plans = [GroupPlan(((E, cap),), ranked=False) for cap in (c, 2 * c) if cap < T]
    a = max(1, E // 32)
    q = max(8, c // 32)  # the tight plan's rows, rounded up to a multiple of q
    up = lambda v: min(T, c, -(-int(np.ceil(v)) // q) * q)  # noqa: E731
    m = T * K / E
    tight = _by_rank(([min(T, c)] * a + [up(1.5 * m)] * a + [up(1.25 * m)] * E)[:E])
    plans += [tight] if 5 * tight.rows <= 4 * E * min(T, c) else []
    broad = _by_rank([T] * a + [min(T, max(T // 2, 2 * c))] * min(2 * a, E - a) + [min(T, 2 * c)] * max(0, E - 3 * a))
    steep = _by_rank(([T] * a + [min(T, max(T // 2, c))] * a + [min(T, max(T // 4, c))] * 2 * a + [min(T, c)] * E)[:E])
    plans += [p for p in (steep, broad) if 2 * p.rows < E * T and (p is broad or p.rows < broad.rows)]
    return sorted(plans, key=lambda p: p.rows)


def _by_rank(caps: list[int]) -> GroupPlan:
    """The ranked plan of each rank's rows (non-increasing)."""
    return GroupPlan(tuple((len(list(run)), cap) for cap, run in itertools.groupby(caps)), ranked=True)


def pair_rows(ids_TK: jax.Array, counts_E: jax.Array, start_E: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """Each pair's row in a layout where expert e's pairs, in their order (token, then k), fill
    the rows from start_E[e] on: (pair_of_row [rows] — the flat pair t·K + k of each row, T·K
    where a row is empty; row_of_pair [T·K]). `counts_E`: the pairs of each expert."""
    flat = ids_TK.reshape(-1)
    N = flat.shape[0]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    e_sorted = flat[order]
    rank = jnp.arange(N, dtype=jnp.int32) - (jnp.cumsum(counts_E) - counts_E)[e_sorted]
    row = (start_E[e_sorted] + rank).astype(jnp.int32)  # the row of the i-th pair in expert order
    pair_of_row = jnp.full((rows,), N, jnp.int32).at[row].set(order)
    return pair_of_row, jnp.zeros((N,), jnp.int32).at[order].set(row)
