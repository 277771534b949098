"""The paged KV cache as device state.

Every layer owns a pool of pages `[num_pages, page_size, *entry]` per stored tensor (K and V for
grouped-query attention; the latent and the rope key for MLA). A sequence's page table row lists
its pages in order, so the gathered page run is the sequence's KV in position order. Page 0 is
never handed to a sequence: writes of padding tokens go there and are never read unmasked.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from freetoken_jax.config import EngineConfig, MoEModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVView:
    """Where this step's tokens are written and which cached positions each may read."""

    write_page_BT: jax.Array  # int32 page of each new token (0 for padding)
    write_off_BT: jax.Array  # int32 offset inside that page
    page_table_BP: jax.Array  # int32 pages of each sequence, in position order
    mask_BTS: jax.Array  # bool: token t of sequence b may attend to cached position s
    positions_BT: jax.Array  # int32 position of each new token

    @classmethod
    def build(cls, positions_BT: jax.Array, valid_BT: jax.Array, page_table_BP: jax.Array, page_size: int) -> KVView:
        B, P = page_table_BP.shape
        slot = positions_BT // page_size
        in_table = valid_BT & (slot < P)
        page = jnp.take_along_axis(page_table_BP, jnp.clip(slot, 0, P - 1), axis=1)
        page = jnp.where(in_table, page, 0)
        s = jnp.arange(P * page_size, dtype=positions_BT.dtype)
        mask = (s[None, None, :] <= positions_BT[:, :, None]) & valid_BT[:, :, None]
        return cls(page, positions_BT % page_size, page_table_BP, mask, positions_BT)

    def mask(self, window: int = 0) -> jax.Array:
        """`mask_BTS`, limited to the `window` positions ending at each token's own (0: all)."""
        if not window:
            return self.mask_BTS
        s = jnp.arange(self.mask_BTS.shape[-1], dtype=self.positions_BT.dtype)
        return self.mask_BTS & (s[None, None, :] > self.positions_BT[:, :, None] - window)


def write_pages(pages, view: KVView, new_BT):
    """Stores this step's entries `[B, T, *entry]` into their pages."""
    return pages.at[view.write_page_BT, view.write_off_BT].set(new_BT.astype(pages.dtype))


def gather_pages(pages, view: KVView):
    """Every sequence's cached entries in position order: `[B, P * page_size, *entry]`."""
    g = pages[view.page_table_BP]  # [B, P, page, *entry]
    B, P, page = g.shape[:3]
    return g.reshape(B, P * page, *g.shape[3:])


KVCache = tuple[tuple[jax.Array, ...], ...]  # per layer, the stored tensors


def init_cache(cfg: MoEModelConfig, ecfg: EngineConfig, dtype) -> KVCache:
    n, page = ecfg.total_kv_pages, ecfg.page_size
    return tuple(tuple(jnp.zeros((n, page, *shape), dtype) for shape in cfg.kv_entry_shapes()) for _ in range(cfg.num_layers))


def cache_bytes(cfg: MoEModelConfig, ecfg: EngineConfig, itemsize: int) -> int:
    per_token = sum(math.prod(s) for s in cfg.kv_entry_shapes())
    return cfg.num_layers * ecfg.total_kv_pages * ecfg.page_size * per_token * itemsize
