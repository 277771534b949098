"""A radix tree of KV pages keyed by token ids, at page granularity.

Each node below the root stands for one full page of tokens and the KV page that holds them;
its path from the root is the token prefix. A request whose prompt starts with a cached prefix
reuses those pages (read-only: only full pages are shared, and a request writes only past them).
Nodes in use by running requests are locked (reference counts); unlocked leaves are evicted
least recently used first when the page pool runs short. Pages in the tree belong to the tree:
they return to the allocator only when evicted.

Models whose sliding-window layers keep their KV in rings (`kv_cache.ring_pages`) cache a second
page per node, `wpage`: the page's entries of those layers, in the ring pool. Only the last
pages before a point are kept there (what the window reads), and they are evicted on their own,
leaving tombstones (`wpage` None). A prefix can be continued only where the `lookback` pages
before its end still have theirs: `match` stops at the longest such prefix, and everything
after it is computed again.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class Node:
    __slots__ = ("key", "page", "wpage", "parent", "children", "refs", "last_use")

    def __init__(self, key: tuple[int, ...], page: int, parent: Node | None, wpage: int | None = None):
        self.key, self.page, self.parent, self.wpage = key, page, parent, wpage
        self.children: dict[tuple[int, ...], Node] = {}
        self.refs = 0
        self.last_use = 0


class RadixCache:
    def __init__(self, page_size: int, lookback: int = 0):
        """`lookback`: pages before a prefix's end whose ring-pool page it needs (0: the model
        keeps no rings)."""
        self.page_size, self.lookback = page_size, lookback
        self.root = Node((), -1, None)
        self._clock = itertools.count(1)
        self.cached_pages = 0
        self.cached_wpages = 0

    def _keys(self, tokens: Sequence[int], max_pages: int) -> list[tuple[int, ...]]:
        P = self.page_size
        return [tuple(tokens[i * P : (i + 1) * P]) for i in range(min(max_pages, len(tokens) // P))]

    def continuable(self, path: Sequence[Node]) -> int:
        """The longest prefix of `path` (in pages) that can be continued: with rings, one whose
        last `lookback` pages still hold their ring-pool page."""
        if not self.lookback:
            return len(path)
        k = len(path)
        while k > 0 and any(n.wpage is None for n in path[max(0, k - self.lookback) : k]):
            k -= 1
        return k

    def match(self, tokens: Sequence[int], max_pages: int | None = None, *, whole: bool = False) -> list[Node]:
        """The nodes of the longest cached prefix of `tokens` that can be continued (whole
        pages, at most `max_pages`; `whole`: continuable or not), locked for the caller; release
        them with `unlock`."""
        node, path = self.root, []
        now = next(self._clock)
        for key in self._keys(tokens, len(tokens) if max_pages is None else max_pages):
            child = node.children.get(key)
            if child is None:
                break
            child.last_use = now
            path.append(child)
            node = child
        path = path if whole else path[: self.continuable(path)]
        for n in path:
            n.refs += 1
        return path

    def unlock(self, nodes: Sequence[Node]) -> None:
        for n in nodes:
            if n.refs <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            n.refs -= 1

    def insert(self, tokens: Sequence[int], pages: Sequence[int], wpages: Sequence[int | None] = ()) -> tuple[list[int], list[int]]:
        """Records the full pages of a sequence, and `wpages[i]` (None: none) as the ring-pool
        page of page i. Returns the pages and ring-pool pages the tree did not take (already
        cached under the same prefix, or not full): the caller frees those."""
        keys = self._keys(tokens, len(pages))
        wpages = list(wpages) + [None] * (len(pages) - len(wpages))
        node, leftover, wleftover = self.root, [], []
        now = next(self._clock)
        for key, page, wpage in zip(keys, pages, wpages):
            child = node.children.get(key)
            if child is None:
                child = Node(key, page, node)
                node.children[key] = child
                self.cached_pages += 1
            elif child.page != page:
                leftover.append(page)
            if wpage is not None:
                if child.wpage is None:
                    child.wpage = wpage
                    self.cached_wpages += 1
                elif child.wpage != wpage:
                    wleftover.append(wpage)
            child.last_use = now
            node = child
        leftover.extend(pages[len(keys) :])
        wleftover.extend(w for w in wpages[len(keys) :] if w is not None)
        return leftover, wleftover

    def evict(self, pages_wanted: int) -> tuple[list[int], list[int]]:
        """Removes up to `pages_wanted` unlocked leaves, least recently used first; returns their
        pages and their ring-pool pages."""
        freed: list[int] = []
        wfreed: list[int] = []
        while len(freed) < pages_wanted:
            leaves = [n for n in self._nodes() if not n.children and n.refs == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_use)
            del victim.parent.children[victim.key]
            freed.append(victim.page)
            self.cached_pages -= 1
            if victim.wpage is not None:
                wfreed.append(victim.wpage)
                self.cached_wpages -= 1
        return freed, wfreed

    def evict_wpages(self, wanted: int) -> list[int]:
        """Frees up to `wanted` ring-pool pages of unlocked nodes, least recently used first,
        leaving tombstones."""
        held = sorted((n for n in self._nodes() if n.wpage is not None and n.refs == 0), key=lambda n: n.last_use)[:wanted]
        out = []
        for n in held:
            out.append(n.wpage)
            n.wpage = None
        self.cached_wpages -= len(out)
        return out

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
