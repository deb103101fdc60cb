"""Page hashes for automatic prefix caching: what makes two pages of K/V interchangeable (no jax).

A full page's K/V depends on every token before it, not only on its own tokens, so a page is named by
a hash chained over the previous page's hash and this page's token ids:

    h_0 = H(b"" || ids of page 0)        h_i = H(h_{i-1} || ids of page i)

Two pages with the same hash hold the same tokens at the same positions after the same prefix, so (in
one engine: one model, one dtype) the same K/V. Only *full* pages are hashed: the partial last page of
a sequence is still being written and is never shared.

H is SHA-256 over the parent's 32-byte digest and the page's token ids as 4-byte integers (a fixed
length, so the encoding is unambiguous). Not Python's `hash()`: it is 64 bits and not collision
resistant, and a crafted prompt whose page collides with another user's would be served that user's
K/V (vLLM's CVE-2025-25183). SHA-256 costs about a microsecond per page, against the milliseconds a
page's prefill costs.

`PageHashes` is one sequence's chain, extended lazily as its pages fill (tokens are only appended, so a
hash once computed stays right, across preemptions too).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

PageHash = bytes
ROOT_HASH: PageHash = b""   # the parent of a sequence's first page
_TOKEN_CODE = "i"
assert array(_TOKEN_CODE).itemsize == 4, "page hashes encode token ids as 4-byte integers"


def hash_page(parent: PageHash, token_ids: list[int]) -> PageHash:
    """The chained hash of one full page."""
    return hashlib.sha256(parent + array(_TOKEN_CODE, token_ids).tobytes()).digest()


class PageHashes:
    """The hash chain of one sequence's full pages; `token_ids(start, end)` reads its tokens."""

    def __init__(self, page_size: int, token_ids: Callable[[int, int], list[int]]) -> None:
        self.page_size = page_size
        self._token_ids = token_ids
        self.hashes: list[PageHash] = []

    def first(self, num_pages: int) -> list[PageHash]:
        """The hashes of the first `num_pages` pages (they must be full), computing what is missing."""
        ps = self.page_size
        while len(self.hashes) < num_pages:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            self.hashes.append(hash_page(parent, self._token_ids(i * ps, (i + 1) * ps)))
        return self.hashes[:num_pages]
