"""Host-side KV-cache page allocator: a free list and reference counts (no jax).

Page 0 is never handed out: padding tokens of a step write their K/V there, so a padded batch can
never clobber a live sequence. Reference counts let several sequences share a page (prefix sharing);
a page returns to the free list when its last holder frees it.
"""

from __future__ import annotations

from collections import deque

RESERVED_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised by `allocate` when the free list is too short; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._ref_counts = [0] * num_pages

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._ref_counts[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self._ref_counts[p] > 0, f"page {p} freed twice"
            self._ref_counts[p] -= 1
            if self._ref_counts[p] == 0:
                self._free.append(p)
