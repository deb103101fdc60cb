"""Host-side KV-cache page allocator: reference counts, a free list and the prefix cache (no jax).

Page 0 is never handed out: padding tokens of a step write their K/V there, so a padded batch can
never clobber a live sequence. Every other page is in exactly one of three states:

    in use    reference count > 0: held by that many sequences (more than one: a shared prefix)
    cached    count 0 but its K/V is registered under a page hash (`jaxcpp.core.prefix_cache`): a later
              request with the same prefix can take it back (`lookup` + `acquire`)
    free      count 0 and nothing worth keeping

A page whose last holder frees it becomes cached if it is registered, free otherwise. `allocate`
takes free pages first and only then evicts cached ones, least recently used first; an evicted page
loses its hash. `register` names a full page's content once the step that writes it has been
submitted (the scheduler's rule, see `jaxcpp.core.scheduler`). Page ids are the same on every pipeline
stage, so this one allocator serves every layout. With prefix caching off nothing is ever registered
and the allocator is a plain free list.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from jaxcpp.core.prefix_cache import PageHash

RESERVED_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised by `allocate` when free and cached pages together are too few; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._ref_counts = [0] * num_pages
        self._cached: OrderedDict[int, None] = OrderedDict()  # count-0 registered pages, oldest use first
        self._hash_of: dict[int, PageHash] = {}               # every registered page (in use or cached)
        self._page_of: dict[PageHash, int] = {}
        self.num_evictions = 0

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: free ones and cached ones it may evict."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered pages nobody holds: prefix K/V kept for later requests, evicted when needed."""
        return len(self._cached)

    @property
    def num_registered(self) -> int:
        """Pages whose K/V a later request could reuse, held or not."""
        return len(self._hash_of)

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    # ---- allocation ----------------------------------------------------------------------------
    def can_allocate(self, n: int, reusing: Sequence[int] = ()) -> bool:
        """Whether `n` new pages fit after `acquire(reusing)` (cached pages it would take back)."""
        taken_back = sum(1 for p in reusing if self._ref_counts[p] == 0)
        return n <= self.num_free - taken_back

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free and {len(self._cached)} cached")
        pages = [self._free.popleft() if self._free else self._evict_oldest() for _ in range(n)]
        for p in pages:
            self._ref_counts[p] = 1
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page. Given a sequence's pages in order, the last ones are
        released first, so they are evicted first: a page is useless without the pages before it."""
        for p in reversed(pages):
            assert self._ref_counts[p] > 0, f"page {p} freed twice: more often than it was taken"
            self._ref_counts[p] -= 1
            if self._ref_counts[p] == 0:
                if p in self._hash_of:
                    self._cached[p] = None
                else:
                    self._free.append(p)

    def _evict_oldest(self) -> int:
        page, _ = self._cached.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        self.num_evictions += 1
        return page

    # ---- the prefix cache ----------------------------------------------------------------------
    def lookup(self, hashes: Iterable[PageHash]) -> list[int]:
        """The registered pages of the longest prefix of `hashes` (stops at the first unknown hash)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Sequence[int]) -> None:
        """Take a reference to registered pages found by `lookup` (cached ones leave the LRU)."""
        for p in pages:
            assert p in self._hash_of, f"page {p} is not registered: only cached prefixes are shared"
            if self._ref_counts[p] == 0:
                del self._cached[p]
            self._ref_counts[p] += 1

    def register(self, page: int, page_hash: PageHash) -> bool:
        """Name a full, held page's K/V. False (and nothing changes) when another page already holds
        that hash (two requests computed the same prefix at once): the first keeps it, this one stays
        private and is freed as usual."""
        assert self._ref_counts[page] > 0, f"page {page} is registered while nobody holds it"
        if page_hash in self._page_of or page in self._hash_of:
            return False
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        return True

    def clear_cache(self) -> None:
        """Forget every registered hash (after a failed step, whose K/V may be unwritten): cached pages
        become free; pages in use stay with their holders, private from now on."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._hash_of.clear()
        self._page_of.clear()

    # ---- checks --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every usable page in exactly one state, the hash maps mutually inverse (for tests)."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert RESERVED_PAGE not in free | cached and self._ref_counts[RESERVED_PAGE] == 0
        for p in range(1, self.num_pages):
            count = self._ref_counts[p]
            assert count >= 0, f"page {p} has reference count {count}"
            states = (count > 0) + (p in free) + (p in cached)
            assert states == 1, f"page {p}: count {count}, free {p in free}, cached {p in cached}"
            assert p not in free or p not in self._hash_of, f"free page {p} is still registered"
            assert p not in cached or p in self._hash_of, f"cached page {p} is not registered"
        assert {self._page_of[h]: h for h in self._page_of} == self._hash_of, "hash maps disagree"
