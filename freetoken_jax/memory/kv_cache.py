"""The paged KV cache as device state.

Every layer owns a pool of pages `[num_pages, page_size, *entry]` per stored tensor (K and V for
grouped-query attention; the latent and the rope key for MLA). A sequence's page table row lists
its pages in order, so the gathered page run is the sequence's KV in position order. Page 0 is
never handed to a sequence: writes of padding tokens go there and are never read unmasked.

Sliding-window layers whose window is shorter than a sequence can grow (`ring_pages`) keep a
smaller pool of their own: each sequence holds a ring of R pages there, position p in page
`ring[(p // page_size) % R]`, so it holds at most R pages whatever its length. R covers the
window, the longest step's tokens and the decode steps the host lets run ahead, so every page a
step reads is still in its ring: the pages that fall out of the window are written again.
Their attention reads the R ring pages, not the whole context.

Layers whose pools have the same shape keep them stacked (`kv_groups`): the cache is a tuple of
groups, each a tuple of arrays `[L, num_pages, page_size, *entry]` (one per stored tensor) that
hold their L layers' pools — the shared pool's layers in one group, the rings' in another. A step
then takes two or four cache arrays, donated and returned in place, however many layers the model
has (each such argument costs a call's dispatch microseconds: benchmarks/RESULTS.md). A layer
reads and writes its pools through `LayerKV` (its group's arrays and its place among them), and
the attention kernels index the stacked arrays in place. FREETOKEN_KV_LAYOUT=layers gives every
layer a group of its own instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from freetoken_jax.config import EngineConfig, MoEModelConfig, env_choice

# Key positions per block of a many-token step's attention (`models.attention.attend_paged`).
ATTN_BLOCK = 1024


def attention_block_pages(page_size: int) -> int:
    """Whole pages in one block of a many-token step's attention (at least one)."""
    return max(1, ATTN_BLOCK // page_size)


# Positions a sequence may write past its last token while the host reads its tokens behind the
# device (`batcher.LENGTH_ONLY_AHEAD` steps, and one more): pages a ring keeps intact for them.
RUN_AHEAD = 4


def _widest_window(cfg: MoEModelConfig) -> int:
    return max(cfg.window_of(i) for i in range(cfg.num_layers))


def ring_pages(cfg: MoEModelConfig, ecfg: EngineConfig) -> int:
    """R, the pages of each sequence's ring in the sliding-window layers' pool; 0 when no layer
    keeps one (no window, or one a full-length sequence never leaves)."""
    W = _widest_window(cfg)
    if not W or W >= ecfg.max_context:
        return 0
    R = -(-(W - 1 + ecfg.chunk + RUN_AHEAD) // ecfg.page_size) + 1
    return R if R < ecfg.pages_per_sequence else 0


def ring_layers(cfg: MoEModelConfig, ecfg: EngineConfig) -> tuple[bool, ...]:
    """Which layers keep their KV in rings (`ring_pages`)."""
    ring = ring_pages(cfg, ecfg) > 0
    return tuple(ring and cfg.window_of(i) > 0 for i in range(cfg.num_layers))


def window_lookback(cfg: MoEModelConfig, page_size: int) -> int:
    """Whole pages before a position that its sliding layers read: what a cached prefix must
    still hold in their pool to be continued there."""
    W = _widest_window(cfg)
    return -(-(W - 1) // page_size) if W else 0


def ring_pool_pages(cfg: MoEModelConfig, ecfg: EngineConfig) -> int:
    """Pages of the sliding layers' pool: a ring for every row, the window's pages of as many
    cached prefixes, and the reserved page 0 (0 without rings)."""
    R = ring_pages(cfg, ecfg)
    return 1 + ecfg.max_batch * (R + window_lookback(cfg, ecfg.page_size)) if R else 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVView:
    """Where this step's tokens are written and which cached positions each may read."""

    write_page_BT: jax.Array  # int32 page of each new token (0 for padding)
    write_off_BT: jax.Array  # int32 offset inside that page
    page_table_BP: jax.Array  # int32 pages gathered for attention, in the order of `cached_pos_BS`
    positions_BT: jax.Array  # int32 position of each new token
    cached_pos_BS: jax.Array  # int32 position of each gathered entry ([1, S] when in position order)
    valid_BT: jax.Array  # bool: which of this step's tokens are real

    @classmethod
    def build(cls, positions_BT: jax.Array, valid_BT: jax.Array, page_table_BP: jax.Array, page_size: int) -> KVView:
        B, P = page_table_BP.shape
        slot = positions_BT // page_size
        in_table = valid_BT & (slot < P)
        page = jnp.take_along_axis(page_table_BP, jnp.clip(slot, 0, P - 1), axis=1)
        page = jnp.where(in_table, page, 0)
        s = jnp.arange(P * page_size, dtype=positions_BT.dtype)[None]
        return cls(page, positions_BT % page_size, page_table_BP, positions_BT, s, valid_BT)

    @classmethod
    def ring(cls, positions_BT: jax.Array, valid_BT: jax.Array, ring_BR: jax.Array, page_size: int) -> KVView:
        """The view of a sliding layer's ring (module docstring): ring entry r holds, of the
        pages the step's last token can reach, the one whose index is r modulo R."""
        B, R = ring_BR.shape
        slot = positions_BT // page_size
        page = jnp.where(valid_BT, jnp.take_along_axis(ring_BR, slot % R, axis=1), 0)
        hi = jnp.max(jnp.where(valid_BT, slot, 0), axis=1, keepdims=True)  # [B, 1]
        r = jnp.arange(R, dtype=slot.dtype)[None]
        held = hi - (hi - r) % R  # [B, R] the page index ring entry r holds (negative: none yet)
        s = (held[:, :, None] * page_size + jnp.arange(page_size, dtype=slot.dtype)).reshape(B, R * page_size)
        return cls(page, positions_BT % page_size, ring_BR, positions_BT, s, valid_BT)

    @property
    def mask_BTS(self) -> jax.Array:
        """bool [B, T, S]: token t of sequence b may attend to gathered entry s."""
        return _reads(self.cached_pos_BS, self.positions_BT, self.valid_BT)

    def mask(self, window: int = 0) -> jax.Array:
        """`mask_BTS`, limited to the `window` positions ending at each token's own (0: all)."""
        return _reads(self.cached_pos_BS, self.positions_BT, self.valid_BT, window)

    def block_mask(self, lo, width: int, window: int = 0, below=None) -> jax.Array:
        """`mask(window)`'s entries lo … lo + width − 1 ([B, T, width]; entries past the table read
        nothing), made from the positions block by block, so that a many-token step's blocked
        attention never holds all [B, T, S] of it; `below` [B]: only entries at positions under
        it (the cache before a chunk)."""
        s = jnp.pad(self.cached_pos_BS, ((0, 0), (0, width)), constant_values=-1)
        return _reads(jax.lax.dynamic_slice_in_dim(s, lo, width, axis=1), self.positions_BT, self.valid_BT, window, below)

    def entries_read(self, below=None) -> jax.Array:
        """Entries of the table up to the last one any token may read (as `block_mask` with
        `below`; a window, which only narrows from below, is not counted): a scalar."""
        top = jnp.max(jnp.where(self.valid_BT, self.positions_BT, -1), axis=1, keepdims=True)  # [B, 1]: each row's last position
        read = _reads(self.cached_pos_BS, top, top >= 0, below=below)[:, 0]
        return jnp.max(jnp.where(read, jnp.arange(1, read.shape[1] + 1, dtype=jnp.int32), 0))


def _reads(s_BS, positions_BT, valid_BT, window: int = 0, below=None) -> jax.Array:
    """bool [B, T, S]: whether each token may read each entry, at position s_BS ([B or 1, S];
    negative: none held) — an entry at or before its own position (within `window` of it where
    given; under `below` [B] where given)."""
    s, pos = s_BS[:, None, :], positions_BT[:, :, None]
    m = (s >= 0) & (s <= pos) & valid_BT[:, :, None]
    if window:
        m &= s > pos - window
    if below is not None:
        m &= s < below[:, None, None]
    return m


def _layer(layer) -> tuple:
    return () if layer is None else (layer,)


def write_pages(pages, view: KVView, new_BT, layer: int | None = None):
    """Stores this step's entries `[B, T, *entry]` into their pages (of pool `layer` of stacked
    pools `[L, N, page, *entry]`; None: `pages` is one pool `[N, page, *entry]`)."""
    return pages.at[(*_layer(layer), view.write_page_BT, view.write_off_BT)].set(new_BT.astype(pages.dtype))


def gather_pages(pages, view: KVView, layer: int | None = None):
    """Every sequence's cached entries in the view's order: `[B, P * page_size, *entry]` (pool
    `layer` of stacked pools, as `write_pages` takes them)."""
    return take_pages(pages, view.page_table_BP, layer)


def take_pages(pages, pages_BW, layer: int | None = None):
    """The entries of pages `pages_BW` [B, W] of a pool (or of pool `layer` of stacked pools):
    `[B, W * page_size, *entry]`."""
    g = pages[(*_layer(layer), pages_BW)]
    return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])


def page_size_of(pages, layer: int | None = None) -> int:
    return pages.shape[1 if layer is None else 2]


class LayerKV(NamedTuple):
    """One layer's place in the cache: its group's stacked pools (`[L, N, page, *entry]`, one per
    stored tensor) and its index among their L layers."""

    pools: tuple[jax.Array, ...]
    index: int

    def write(self, view: KVView, *new_BT) -> LayerKV:
        """This step's entries (one array per pool) written into the layer's pages."""
        return self._replace(pools=tuple(write_pages(p, view, n, self.index) for p, n in zip(self.pools, new_BT)))


KVCache = tuple[tuple[jax.Array, ...], ...]  # per group of layers (`kv_groups`), their stacked pools


def kv_layout() -> str:
    """How the layers' pools are kept (FREETOKEN_KV_LAYOUT): "stacked" (the default) — one array
    per stored tensor for all layers of a pool's shape; "layers" — arrays of one layer each."""
    return env_choice("FREETOKEN_KV_LAYOUT", "stacked", ("stacked", "layers"))


# Elements of one stacked array at most: the decode attention kernel computes an entry's row of the
# stacked pools, and the row's offset, in int32 (`pallas_kernels/decode_attention.py`), so a group
# holds as many layers as stay under it.
MAX_STACK_ELEMENTS = 2**31 - 1


def kv_groups(rings: tuple[bool, ...], layout: str | None = None, layer_elements: int = 1) -> tuple[tuple[int, ...], ...]:
    """The layers of each group of the cache, for layers that keep their KV in rings or not
    (`ring_layers`): under "stacked", the layers of each kind in layer order, in runs of as many
    layers as `MAX_STACK_ELEMENTS` allows pools of `layer_elements` (the largest pool's); under
    "layers", one group a layer. Groups are ordered by their first layer."""
    if (layout or kv_layout()) == "layers":
        return tuple((i,) for i in range(len(rings)))
    cap = max(1, MAX_STACK_ELEMENTS // max(1, layer_elements))
    groups = []
    for kind in (False, True):
        layers = [i for i, r in enumerate(rings) if r == kind]
        groups += [tuple(layers[i : i + cap]) for i in range(0, len(layers), cap)]
    return tuple(sorted(groups))


def _layout_of(rings: tuple[bool, ...], cache: KVCache) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """(layout, `kv_groups`) of a cache made in either layout, told apart by its groups' sizes
    (where both layouts give the same sizes, they give the same groups)."""
    sizes = tuple(kv[0].shape[0] for kv in cache)
    elements = max(math.prod(a.shape[1:]) for kv in cache for a in kv)
    for layout in ("stacked", "layers"):
        groups = kv_groups(rings, layout, elements)
        if tuple(map(len, groups)) == sizes:
            return layout, groups
    raise ValueError(f"a KV cache of groups of {list(sizes)} layers does not fit {len(rings)} layers (kv_cache.kv_groups)")


def layer_groups(rings: tuple[bool, ...], cache: KVCache) -> tuple[tuple[int, ...], ...]:
    """`kv_groups` of a cache made in either layout (`_layout_of`)."""
    return _layout_of(rings, cache)[1]


def layer_places(rings: tuple[bool, ...], cache: KVCache) -> dict[int, tuple[int, int]]:
    """Each layer's (group, index in the group) in `cache`."""
    return {i: (g, j) for g, layers in enumerate(layer_groups(rings, cache)) for j, i in enumerate(layers)}


def pool_pages(cfg: MoEModelConfig, ecfg: EngineConfig) -> tuple[int, ...]:
    """Pages of each layer's pool: the shared pool's, or the rings' (`ring_pool_pages`)."""
    rings = ring_pool_pages(cfg, ecfg)
    return tuple(rings if ring else ecfg.total_kv_pages for ring in ring_layers(cfg, ecfg))


def gathered_pages(cfg: MoEModelConfig, ecfg: EngineConfig) -> int:
    """Pages a row's attention gathers in one step, summed over the layers."""
    R = ring_pages(cfg, ecfg)
    return sum(R if ring else ecfg.pages_per_sequence for ring in ring_layers(cfg, ecfg))


def init_cache(cfg: MoEModelConfig, ecfg: EngineConfig, dtype, layout: str | None = None) -> KVCache:
    """An empty cache, its layers grouped by `kv_groups` (`layout`: FREETOKEN_KV_LAYOUT's by default)."""
    page, pages = ecfg.page_size, pool_pages(cfg, ecfg)
    elements = max(n * page * math.prod(shape) for n in pages for shape in cfg.kv_entry_shapes())
    groups = kv_groups(ring_layers(cfg, ecfg), layout, elements)
    return tuple(tuple(jnp.zeros((len(g), pages[g[0]], page, *shape), dtype) for shape in cfg.kv_entry_shapes()) for g in groups)


def cache_bytes(cfg: MoEModelConfig, ecfg: EngineConfig, itemsize: int) -> int:
    per_token = sum(math.prod(s) for s in cfg.kv_entry_shapes())
    return sum(pool_pages(cfg, ecfg)) * ecfg.page_size * per_token * itemsize


def ring_groups(cfg: MoEModelConfig, ecfg: EngineConfig, cache: KVCache) -> tuple[bool, ...]:
    """Which groups of `cache` hold ring pools."""
    rings = ring_layers(cfg, ecfg)
    return tuple(rings[g[0]] for g in layer_groups(rings, cache))


def copy_pages(cache: KVCache, groups: tuple[bool, ...], src: jax.Array, dst: jax.Array) -> KVCache:
    """`cache` with pages `src` of the chosen groups' pools copied to pages `dst`."""
    return tuple(tuple(a.at[:, dst].set(a[:, src]) for a in kv) if chosen else kv for kv, chosen in zip(cache, groups))


def layer_pools(cache: KVCache, rings: tuple[bool, ...]) -> tuple[tuple[jax.Array, ...], ...]:
    """Each layer's pools `[N, page, *entry]` (one per stored tensor), taken out of their groups."""
    where = layer_places(rings, cache)
    return tuple(tuple(a[where[i][1]] for a in cache[where[i][0]]) for i in range(len(rings)))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _grown(cache: KVCache, rings: tuple[bool, ...], pages: int) -> KVCache:
    pad = lambda a: jnp.pad(a, ((0, pages - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731
    pools = [p if ring else tuple(pad(a) for a in p) for p, ring in zip(layer_pools(cache, rings), rings)]
    groups = kv_groups(rings, _layout_of(rings, cache)[0], max(math.prod(a.shape) for p in pools for a in p))
    return tuple(tuple(jnp.stack([pools[i][t] for i in g]) for t in range(len(cache[0]))) for g in groups)


def grown_cache(cache: KVCache, cfg: MoEModelConfig, ecfg: EngineConfig) -> KVCache:
    """`cache` with its shared pool grown to `ecfg.total_kv_pages` (the new pages empty; the
    rings as they were), in the groups its layout gives pools of that size: a new cache, the old
    one left as it is."""
    return _grown(cache, ring_layers(cfg, ecfg), ecfg.total_kv_pages)
