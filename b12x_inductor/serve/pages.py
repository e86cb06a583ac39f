"""The page allocator: a free list over the KV page pool.

The pool holds `num_pages` pages of `page_size` token slots in every layer (one [num_pages, page_size, Hkv, D]
key and value tensor per layer, owned by the runner; for an MLA model one latent tensor [num_pages, page_size,
kv_lora_rank + qk_rope_head_dim] per layer instead); page p is page p of every layer, so one free list serves
them all. A request owns a page table (its list of page ids, in position order): token position i lives in
page `pages[i // page_size]` at offset `i % page_size`, i.e. slot `pages[i // page_size] * page_size + i %
page_size`. Pages return to the free list when a request finishes or is preempted (its KV is recomputed later).

A model whose sliding-window layers recycle their pages (`ServeConfig.recycle_window_pages`) has a second pool
for those layers, with its own allocator: there a request holds only the pages its window can still see
(`Request.window_pages` from column `window_base`), and the scheduler frees the ones before it.
"""

from __future__ import annotations


class PageAllocator:
    """A LIFO free list of page ids 0 .. num_pages - 1 (recently freed pages are reused first)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages must be >= 1; got {num_pages}")
        if page_size < 1:
            raise ValueError(f"PageAllocator: page_size must be >= 1; got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._used = set()
        self.peak_used = 0  # the most pages allocated at once since construction

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` token slots."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        """n page ids, or None (and nothing taken) when fewer than n are free."""
        if n < 0:
            raise ValueError(f"PageAllocator.allocate: n must be >= 0; got {n}")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        self.peak_used = max(self.peak_used, len(self._used))
        return pages

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Extends a page table in place to hold `num_tokens` slots; False (and no change) if pages ran out."""
        extra = self.allocate(max(0, self.pages_for(num_tokens) - len(pages)))
        if extra is None:
            return False
        pages.extend(extra)
        return True

    def free(self, pages: list[int]) -> None:
        """Returns pages to the free list (and empties the given page table)."""
        for p in pages:
            if p not in self._used:
                raise ValueError(f"PageAllocator.free: page {p} is not allocated")
            self._used.remove(p)
            self._free.append(p)
        pages.clear()
