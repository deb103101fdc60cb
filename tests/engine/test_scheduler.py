"""Scheduler properties, host only: budget, decode-first order, chunking, preemption, no page leaks."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcpp.config import SchedulerConfig
from jaxcpp.core.outputs import RequestMetrics
from jaxcpp.core.page_allocator import PageAllocator
from jaxcpp.core.scheduler import Scheduler, SchedulerOutput
from jaxcpp.core.sequence import Sequence, SequenceStatus
from jaxcpp.sampling_params import SamplingParams


def make_seq(i: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0,
                    RequestMetrics(0.0))


def finish_step(sched: Scheduler, out: SchedulerOutput, rng: random.Random) -> None:
    """Stand-in for the device: every sampling chunk gets a token; finished requests retire."""
    for c in out.chunks:
        if c.samples and not c.seq.is_finished:
            c.seq.receive_token(rng.randrange(100))
            if len(c.seq.output_token_ids) >= c.seq.params.max_tokens:
                sched.finish(c.seq, "length")


def check_step(sched: Scheduler, out: SchedulerOutput, config: SchedulerConfig, eligible_decodes: int) -> None:
    assert out.num_tokens <= config.max_num_batched_tokens
    assert len(out.chunks) <= config.max_num_seqs
    kinds = [c.num_tokens == 1 and c.seq.is_decode for c in out.chunks]
    # Decodes come first; and a prefill token is scheduled only once every eligible decode has its token.
    assert kinds == sorted(kinds, reverse=True)
    if any(not k for k in kinds):
        assert out.num_decodes >= eligible_decodes - len(out.preempted)
    for c in out.chunks:
        assert len(c.seq.pages) * sched.page_size >= c.start + c.num_tokens


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    max_tokens=st.lists(st.integers(1, 40), min_size=12, max_size=12),
    budget=st.sampled_from([16, 64, 100, 256]),
    max_num_seqs=st.integers(1, 16),
    num_pages=st.integers(25, 80),
    chunked=st.booleans(),
    abort_every=st.integers(0, 7),
    seed=st.integers(0, 1000),
)
def test_scheduler_properties(prompt_lens, max_tokens, budget, max_num_seqs, num_pages, chunked,
                              abort_every, seed):
    page_size = 16
    max_num_seqs = min(max_num_seqs, budget)
    if not chunked:
        prompt_lens = [min(p, budget) for p in prompt_lens]
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             enable_chunked_prefill=chunked)
    allocator = PageAllocator(num_pages)
    sched = Scheduler(config, allocator, page_size)
    rng = random.Random(seed)
    seqs = [make_seq(i, p, max_tokens[i]) for i, p in enumerate(prompt_lens)]
    # Every request alone must fit the cache, as the engine's max-model-len check guarantees.
    seqs = [s for s in seqs if -(-(len(s.prompt_token_ids) + s.params.max_tokens) // page_size) < num_pages]
    for s in seqs:
        sched.add(s)
    for step in range(2000):
        if not sched.has_unfinished():
            break
        eligible = sum(1 for s in sched.running if s.is_decode and not s.awaiting_token)
        out = sched.schedule()
        check_step(sched, out, config, min(eligible, max_num_seqs, budget))
        assert out.chunks, "the scheduler must always make progress"
        finish_step(sched, out, rng)
        if abort_every and step % abort_every == 0 and sched.running:
            sched.finish(rng.choice(sched.running), "abort")
    assert not sched.has_unfinished()
    assert allocator.num_free == allocator.num_usable, "pages leaked"
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)


def test_sarathi_budget_split_from_seed_004():
    """A and B decode, C has a 12-token prompt: budget 8 leaves C 6 tokens a step (two steps)."""
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8)
    sched = Scheduler(config, PageAllocator(64), 16)
    a, b, c = make_seq(0, 3, 10), make_seq(1, 3, 10), make_seq(2, 12, 10)
    for s in (a, b):
        sched.add(s)
    finish_step(sched, sched.schedule(), random.Random(0))  # A, B prefill and get their first token
    sched.add(c)
    steps = []
    while not c.output_token_ids:
        out = sched.schedule()
        steps.append([(ch.seq.request_id, ch.num_tokens) for ch in out.chunks])
        finish_step(sched, out, random.Random(0))
    assert steps == [[("r0", 1), ("r1", 1), ("r2", 6)], [("r0", 1), ("r1", 1), ("r2", 6)]]


def test_chunked_prefill_off_takes_whole_prompt():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=False)
    sched = Scheduler(config, PageAllocator(64), 16)
    sched.add(make_seq(0, 40, 4))
    sched.add(make_seq(1, 40, 4))
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("r0", 40)]


def test_preemption_recomputes_newest_and_frees_pages():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
    allocator = PageAllocator(5)  # 4 usable pages of 16 tokens
    sched = Scheduler(config, allocator, 16)
    old, new = make_seq(0, 32, 40), make_seq(1, 31, 40)
    sched.add(old)
    sched.add(new)
    rng = random.Random(0)
    finish_step(sched, sched.schedule(), rng)
    assert allocator.num_free == 0
    out = sched.schedule()  # old needs a third page for its 33rd token: new is preempted
    assert out.preempted == [new] and new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert [c.seq for c in out.chunks] == [old]
