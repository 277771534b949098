"""A radix tree of KV pages keyed by token ids, at page granularity.

Each node below the root stands for one full page of tokens and the KV page that holds them;
its path from the root is the token prefix. A request whose prompt starts with a cached prefix
reuses those pages (read-only: only full pages are shared, and a request writes only past them).
Nodes in use by running requests are locked (reference counts); unlocked leaves are evicted
least recently used first when the page pool runs short. Pages in the tree belong to the tree:
they return to the allocator only when evicted.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class Node:
    __slots__ = ("key", "page", "parent", "children", "refs", "last_use")

    def __init__(self, key: tuple[int, ...], page: int, parent: Node | None):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.refs = 0
        self.last_use = 0


class RadixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = Node((), -1, None)
        self._clock = itertools.count(1)
        self.cached_pages = 0

    def _keys(self, tokens: Sequence[int], max_pages: int) -> list[tuple[int, ...]]:
        P = self.page_size
        return [tuple(tokens[i * P : (i + 1) * P]) for i in range(min(max_pages, len(tokens) // P))]

    def match(self, tokens: Sequence[int], max_pages: int | None = None) -> list[Node]:
        """The nodes of the longest cached prefix of `tokens` (whole pages, at most `max_pages`),
        locked for the caller; release them with `unlock`."""
        node, path = self.root, []
        now = next(self._clock)
        for key in self._keys(tokens, len(tokens) if max_pages is None else max_pages):
            child = node.children.get(key)
            if child is None:
                break
            child.last_use = now
            path.append(child)
            node = child
        for n in path:
            n.refs += 1
        return path

    def unlock(self, nodes: Sequence[Node]) -> None:
        for n in nodes:
            if n.refs <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            n.refs -= 1

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Records the full pages of a finished sequence. Returns the pages the tree did not take
        (already cached under the same prefix, or not full): the caller frees those."""
        keys = self._keys(tokens, len(pages))
        node, leftover = self.root, []
        now = next(self._clock)
        for key, page in zip(keys, pages):
            child = node.children.get(key)
            if child is None:
                child = Node(key, page, node)
                node.children[key] = child
                self.cached_pages += 1
            elif child.page != page:
                leftover.append(page)
            child.last_use = now
            node = child
        leftover.extend(pages[len(keys) :])
        return leftover

    def evict(self, pages_wanted: int) -> list[int]:
        """Removes up to `pages_wanted` unlocked leaves, least recently used first; returns their pages."""
        freed: list[int] = []
        while len(freed) < pages_wanted:
            leaves = [n for n in self._nodes() if not n.children and n.refs == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_use)
            del victim.parent.children[victim.key]
            freed.append(victim.page)
            self.cached_pages -= 1
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
