"""A fake executor that keeps a KV cache: each sampled token depends on the whole context *as read from
its pages*, so a wrong page, a stale one or one read before it was written changes the tokens.

Every slot holds a 64-bit "K/V" chained like a transformer's: content(pos) = mix(content(pos - 1),
token, pos), read from the cache for positions before the chunk and computed within it. The sampled
token is a digest of every context position's content. Reads of positions before a chunk see the
cache as it was before the step (no step may read what a step writes in the same batch), and with
`allocator` set every written slot must be in a page with exactly one holder that the prefix cache
does not know yet: a shared or published page is never written again. `expected_tokens` replays the
rule on plain token lists. Host only, no jax.
"""

from __future__ import annotations

import numpy as np

from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.core.page_allocator import RESERVED_PAGE, PageAllocator
from jaxcpp.core.step_input import StepInput, StepShape

MASK = (1 << 64) - 1
UNWRITTEN = 0xDEAD_BEEF_DEAD_BEEF  # what an unwritten slot reads as: it derails the chain


def mix(prev: int, token: int, position: int) -> int:
    x = (prev * 0x9E3779B97F4A7C15 + token * 0xBF58476D1CE4E5B9 + position + 1) & MASK
    return x ^ (x >> 31)


def fold(digest: int, content: int) -> int:
    return (digest * 0x94D049BB133111EB + content) & MASK


def sample(digest: int) -> int:
    return 32 + (digest >> 17) % 95  # printable ASCII: fits any vocabulary of 127 ids or more


class KVFakeExecutor(FakeExecutor):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kv: dict[int, int] = {}
        self.page_size = 0
        self.allocator: PageAllocator | None = None  # set it to check that no shared page is written

    @staticmethod
    def expected_tokens(prompt: list[int], n: int, next_token=None) -> list[int]:  # type: ignore[override]
        tokens, content, digest, out = list(prompt), 0, 0, []
        for pos, token in enumerate(tokens):
            content = mix(content, token, pos)
            digest = fold(digest, content)
        for _ in range(n):
            token = sample(digest)
            out.append(token)
            content = mix(content, token, len(tokens))
            digest = fold(digest, content)
            tokens.append(token)
        return out

    def warmup(self, shape: StepShape) -> float:
        self.page_size = shape.page_size
        return super().warmup(shape)

    def _tokens(self, step: StepInput) -> np.ndarray:
        tokens = np.zeros(step.kv_lens.shape, np.int32)
        writes: dict[int, int] = {}
        for i in range(int(step.num_seqs)):
            tokens[i], seq_writes = self._run_sequence(step, i)
            writes.update(seq_writes)
        self.kv.update(writes)
        return tokens

    def _run_sequence(self, step: StepInput, i: int) -> tuple[int, dict[int, int]]:
        ps = self.page_size
        q0, q1 = int(step.cu_q_lens[i]), int(step.cu_q_lens[i + 1])
        start = int(step.kv_lens[i]) - (q1 - q0)
        pages = step.page_indices[i]

        def slot(pos: int) -> int:
            return int(pages[pos // ps]) * ps + pos % ps

        content = digest = 0
        for pos in range(start):
            content = self.kv.get(slot(pos), UNWRITTEN)
            digest = fold(digest, content)
        writes = {}
        for j in range(q0, q1):
            pos = start + j - q0
            assert int(step.positions[j]) == pos and int(step.slot_mapping[j]) == slot(pos), "bad slot mapping"
            self._check_writable(int(pages[pos // ps]))
            content = mix(content, int(step.token_ids[j]), pos)
            digest = fold(digest, content)
            writes[slot(pos)] = content
        return sample(digest), writes

    def _check_writable(self, page: int) -> None:
        a = self.allocator
        if a is None or page == RESERVED_PAGE:
            return
        assert a.ref_count(page) == 1, f"a step writes page {page}, held by {a.ref_count(page)} sequences"
        assert page not in a._hash_of, f"a step writes page {page}, which the prefix cache already serves"
