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
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from freetoken_jax.config import EngineConfig, MoEModelConfig

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


def write_pages(pages, view: KVView, new_BT):
    """Stores this step's entries `[B, T, *entry]` into their pages."""
    return pages.at[view.write_page_BT, view.write_off_BT].set(new_BT.astype(pages.dtype))


def gather_pages(pages, view: KVView):
    """Every sequence's cached entries in the view's order: `[B, P * page_size, *entry]`."""
    g = pages[view.page_table_BP]  # [B, P, page, *entry]
    B, P, page = g.shape[:3]
    return g.reshape(B, P * page, *g.shape[3:])


KVCache = tuple[tuple[jax.Array, ...], ...]  # per layer, the stored tensors


def pool_pages(cfg: MoEModelConfig, ecfg: EngineConfig) -> tuple[int, ...]:
    """Pages of each layer's pool: the shared pool's, or the rings' (`ring_pool_pages`)."""
    rings = ring_pool_pages(cfg, ecfg)
    return tuple(rings if ring else ecfg.total_kv_pages for ring in ring_layers(cfg, ecfg))


def gathered_pages(cfg: MoEModelConfig, ecfg: EngineConfig) -> int:
    """Pages a row's attention gathers in one step, summed over the layers."""
    R = ring_pages(cfg, ecfg)
    return sum(R if ring else ecfg.pages_per_sequence for ring in ring_layers(cfg, ecfg))


def init_cache(cfg: MoEModelConfig, ecfg: EngineConfig, dtype) -> KVCache:
    page = ecfg.page_size
    return tuple(tuple(jnp.zeros((n, page, *shape), dtype) for shape in cfg.kv_entry_shapes()) for n in pool_pages(cfg, ecfg))


def cache_bytes(cfg: MoEModelConfig, ecfg: EngineConfig, itemsize: int) -> int:
    per_token = sum(math.prod(s) for s in cfg.kv_entry_shapes())
    return sum(pool_pages(cfg, ecfg)) * ecfg.page_size * per_token * itemsize


def copy_pages(cache: KVCache, layers: tuple[bool, ...], src: jax.Array, dst: jax.Array) -> KVCache:
    """`cache` with pages `src` of the chosen layers' pools copied to pages `dst`."""
    return tuple(tuple(a.at[dst].set(a[src]) for a in kv) if chosen else kv for kv, chosen in zip(cache, layers))
