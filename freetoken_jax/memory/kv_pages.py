"""Host-side allocator of KV pages. Page 0 is reserved (padding writes land there)."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """The KV page pool cannot hold what was asked for."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, tokens: int) -> list[int]:
        n = self.pages_for(tokens)
        if n > len(self._free):
            raise OutOfPages(f"{tokens} tokens need {n} KV pages; {len(self._free)} of {self.num_pages - 1} are free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        if any(p <= 0 or p >= self.num_pages for p in pages):
            raise ValueError(f"not pages of this pool: {pages}")
        self._free.extend(reversed(pages))

    def grown(self, num_pages: int) -> PageAllocator:
        """An allocator of a larger pool whose pages held here are held there too."""
        if num_pages < self.num_pages:
            raise ValueError(f"cannot grow {self.num_pages} pages to {num_pages}")
        new = PageAllocator(num_pages, self.page_size)
        free = set(self._free)
        new._free = [p for p in new._free if p >= self.num_pages or p in free]
        return new
