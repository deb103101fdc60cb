"""Prefix caching on the host: page hashes, the allocator's cache and LRU, and the real engine and
scheduler on a fake executor that keeps a KV cache (`kv_fake.KVFakeExecutor`): a wrong, stale or
not-yet-written page changes the tokens. Milliseconds each, no jax.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.executor import ExecutorError
from jaxcpp.core.page_allocator import OutOfPagesError, PageAllocator
from jaxcpp.core.prefix_cache import ROOT_HASH, PageHashes, hash_page
from jaxcpp.sampling_params import SamplingParams
from tests.engine.kv_fake import KVFakeExecutor

PS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# ---- hashes ------------------------------------------------------------------------------------
def test_a_page_hash_chains_over_everything_before_it():
    a, b = list(range(PS)), list(range(1, PS + 1))
    assert hash_page(ROOT_HASH, a) == hash_page(ROOT_HASH, list(a))
    assert hash_page(ROOT_HASH, a) != hash_page(ROOT_HASH, b)
    # The same tokens after a different prefix are a different page.
    assert hash_page(hash_page(ROOT_HASH, a), b) != hash_page(hash_page(ROOT_HASH, b), b)
    tokens = a + b + [7] * 5
    chain = PageHashes(PS, lambda s, e: tokens[s:e])
    assert chain.first(2) == [hash_page(ROOT_HASH, a), hash_page(hash_page(ROOT_HASH, a), b)]


# ---- the allocator -----------------------------------------------------------------------------
def test_a_released_registered_page_stays_cached_until_free_pages_run_out():
    alloc = PageAllocator(5)  # 4 usable
    pages = alloc.allocate(2)
    assert alloc.register(pages[0], b"h0") and alloc.register(pages[1], b"h1")
    alloc.free(pages)
    assert (alloc.num_cached, alloc.num_free, alloc.num_used) == (2, 4, 0)
    assert alloc.lookup([b"h0", b"h1", b"h2"]) == pages
    fresh = alloc.allocate(2)  # the two never-used pages go first
    assert set(fresh).isdisjoint(pages) and alloc.num_evictions == 0
    alloc.allocate(1)  # now the least recently used cached page goes: the chain's tail, freed first
    assert alloc.num_evictions == 1 and alloc.lookup([b"h0", b"h1"]) == [pages[0]]
    alloc.check_invariants()


def test_acquire_takes_a_cached_page_back_and_shares_a_held_one():
    alloc = PageAllocator(4)
    [page] = alloc.allocate(1)
    alloc.register(page, b"h")
    alloc.acquire([page])  # a second holder while the first still has it
    assert alloc.ref_count(page) == 2
    alloc.free([page])
    alloc.free([page])
    assert alloc.num_cached == 1 and alloc.can_allocate(3) and not alloc.can_allocate(3, reusing=[page])
    alloc.acquire([page])
    assert alloc.num_cached == 0 and alloc.ref_count(page) == 1
    with pytest.raises(OutOfPagesError):
        alloc.allocate(3)
    alloc.check_invariants()


def test_a_hash_is_served_by_one_page_and_clear_cache_forgets_all():
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    assert alloc.register(a, b"h") and not alloc.register(b, b"h")  # same content computed twice
    alloc.free([a, b])
    assert alloc.num_cached == 1  # b was private: it went back to the free list
    alloc.clear_cache()
    assert (alloc.num_cached, alloc.num_registered, alloc.lookup([b"h"])) == (0, 0, [])
    alloc.check_invariants()


def test_freeing_a_page_more_often_than_taken_fails_loudly():
    alloc = PageAllocator(3)
    [page] = alloc.allocate(1)
    alloc.free([page])
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free([page])


# ---- the engine on a KV-keeping fake -------------------------------------------------------------
def kv_engine(*, num_stages: int = 1, **flags) -> LLMEngine:
    base = dict(model="tiny", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8, page_size=PS,
                log_stats_interval_s=0)
    fake = KVFakeExecutor(num_stages=num_stages)
    engine = LLMEngine(EngineConfig.from_kwargs(**{**base, **flags}), executor=fake)
    fake.allocator = engine.allocator
    return engine


def drive(engine: LLMEngine, check=None) -> dict[str, object]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check is not None:
            check(engine)
    return done


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY):
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return drive(engine, check_state)


def check_state(engine: LLMEngine) -> None:
    """The allocator's own invariants, and every reference count is exactly the live holders."""
    alloc = engine.allocator
    alloc.check_invariants()
    holders = [0] * alloc.num_pages
    for seq in engine.scheduler.requests.values():
        for p in seq.pages:
            holders[p] += 1
    assert holders == [alloc.ref_count(p) for p in range(alloc.num_pages)]


def prompt(prefix_len: int, suffix: int, length: int = 9) -> list[int]:
    return [(5 * j) % 200 + 3 for j in range(prefix_len)] + [(suffix * 11 + j) % 200 + 3 for j in range(length)]


def assert_expected(done, prompts, n=GREEDY.max_tokens):
    for request_id, p in prompts.items():
        assert done[request_id].token_ids == KVFakeExecutor.expected_tokens(p, n), request_id


@pytest.mark.parametrize("num_stages", [1, 2])
def test_a_later_request_starts_from_the_cached_whole_pages(num_stages):
    engine = kv_engine(num_stages=num_stages)
    first = {"a": prompt(40, 1)}  # 49 tokens: pages 0-2 full after the prompt
    assert_expected(run(engine, first), first)
    later = {"b": prompt(40, 2), "c": prompt(5, 3)}
    done = run(engine, later)
    assert_expected(done, later)
    assert done["b"].num_cached_tokens == 32  # pages 0 and 1: the shared 40 tokens cover two whole pages
    assert done["c"].num_cached_tokens == 0   # 5 shared tokens: less than a page is never shared
    s = engine.stats()
    assert (s.num_prefix_cache_queried_tokens_total, s.num_prefix_cache_hit_tokens_total) == (49 + 49 + 14, 32)
    assert s.num_pages_used == 0 and s.num_pages_cached > 0


def test_an_entirely_cached_prompt_still_computes_its_last_token():
    engine = kv_engine()
    p = prompt(48, 0, 0)  # exactly three pages
    done = run(engine, {"a": p})
    done = run(engine, {"b": list(p)})
    assert_expected(done, {"b": p})
    assert done["b"].num_cached_tokens == 32  # the third page holds the last token: recomputed, not shared
    step = engine.executor.steps[-GREEDY.max_tokens]  # the prefill of b: 16 tokens after a 32-token prefix
    assert int(step.cu_q_lens[1]) == 16 and int(step.kv_lens[0]) == 48


def test_the_token_budget_counts_only_uncomputed_tokens():
    engine = kv_engine(enable_chunked_prefill=False, max_num_batched_tokens=64)
    cached = prompt(48, 0, 10)
    run(engine, {"a": cached})
    # 58 + 54 prompt tokens, but 48 of the first are cached: 10 + 54 fit one 64-token step, unchunked.
    work = {"b": list(cached), "c": prompt(0, 9, 54)}
    for request_id, p in work.items():
        engine.add_request(request_id, p, GREEDY)
    engine.step()
    step = engine.executor.steps[-1]
    assert int(step.num_seqs) == 2 and int(step.cu_q_lens[2]) == 64
    done = drive(engine, check_state)
    assert_expected(done, work)
    assert done["b"].num_cached_tokens == 48


def test_two_requests_with_one_prefix_in_the_same_step_compute_it_twice():
    engine = kv_engine(max_num_batched_tokens=256)
    same = {"a": prompt(64, 1), "b": prompt(64, 2)}
    done = run(engine, same)
    assert_expected(done, same)
    assert done["a"].num_cached_tokens == done["b"].num_cached_tokens == 0  # not yet written when admitted
    third = {"c": prompt(64, 3)}
    done = run(engine, third)
    assert_expected(done, third)
    assert done["c"].num_cached_tokens == 64


def test_an_aborted_prefill_leaves_its_submitted_pages_cached_and_only_those():
    engine = kv_engine(max_num_batched_tokens=32)  # the 100-token prompt goes in 32-token chunks
    long = prompt(100, 0, 0)
    engine.add_request("a", long, GREEDY)
    engine.step()
    engine.step()  # two chunks submitted: 64 tokens, four whole pages written
    engine.abort_request("a")
    drive(engine, check_state)
    assert engine.allocator.num_cached == 4
    done = run(engine, {"b": long})
    assert_expected(done, {"b": long})
    assert done["b"].num_cached_tokens == 64


def test_a_preempted_request_finds_its_own_pages_again():
    engine = kv_engine(num_pages=14, max_model_len=128)  # 13 usable pages
    admissions = []
    admit = engine.scheduler._admit

    def recording_admit(seq, *args):
        chunk = admit(seq, *args)
        if chunk:
            admissions.append((seq.request_id, seq.num_preemptions, seq.admission_prefix))
        return chunk

    engine.scheduler._admit = recording_admit  # type: ignore[method-assign]
    # Admitted together (2 pages each), they need 5 pages each by the end: the newest must yield.
    work = {f"r{i}": prompt(0, i, 20) for i in range(3)}
    done = run(engine, work, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    assert_expected(done, work, 60)
    assert engine.scheduler.num_preemptions > 0
    resumed = [a for a in admissions if a[1] > 0]
    assert resumed and all(prefix > 0 for _, _, prefix in resumed)  # its pages were still cached
    assert all(done[r].num_cached_tokens == 0 for r in work)  # what it reports is its first admission


def test_a_failed_step_drops_the_cache():
    engine = kv_engine()
    run(engine, {"a": prompt(48, 0)})
    assert engine.allocator.num_cached > 0
    fail = engine.executor.submit

    def failing(*args, **kwargs):
        raise ExecutorError("boom", stage=1, fatal=False)

    engine.executor.submit = failing  # type: ignore[method-assign]
    engine.add_request("b", prompt(48, 1), GREEDY)
    done = drive(engine)
    assert done["b"].finish_reason == "error"
    assert engine.allocator.num_cached == 0 and engine.allocator.num_registered == 0
    engine.executor.submit = fail  # type: ignore[method-assign]
    done = run(engine, {"c": prompt(48, 2)})
    assert done["c"].num_cached_tokens == 0


def test_with_caching_off_nothing_is_shared():
    engine = kv_engine(enable_prefix_caching=False)
    run(engine, {"a": prompt(48, 0)})
    done = run(engine, {"b": prompt(48, 1)})
    assert done["b"].num_cached_tokens == 0 and engine.allocator.num_registered == 0
    assert engine.stats().num_prefix_cache_hit_tokens_total == 0


# ---- random workloads ----------------------------------------------------------------------------
PREFIXES = [prompt(n, 0, 0) for n in (0, 16, 23, 48, 80)]

# (shared prefix, suffix length, suffix seed, max_tokens, arrives at step, aborted at step or never)
request_st = st.tuples(st.sampled_from(range(len(PREFIXES))), st.integers(1, 40), st.integers(0, 3),
                       st.integers(1, 30), st.integers(0, 12), st.one_of(st.none(), st.integers(0, 40)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request_st, min_size=1, max_size=10), num_stages=st.sampled_from([1, 2]),
       num_pages=st.sampled_from([12, 16, 24]))
def test_random_workloads_keep_pages_consistent_and_outputs_exact(requests, num_stages, num_pages):
    """Shared prefixes, aborts, preemptions and eviction pressure: reference counts are the live
    holders (never negative), no page is both free and held, every page is back at the end, and every
    request that was not aborted gets exactly the tokens of its context."""
    engine = kv_engine(num_stages=num_stages, num_pages=num_pages, max_model_len=160, max_num_batched_tokens=32,
                       max_num_seqs=4)
    prompts, aborted, done, step = {}, set(), {}, 0
    while step <= 40 or engine.has_unfinished_requests():
        for i, (prefix, suffix_len, seed, max_tokens, arrive, abort) in enumerate(requests):
            request_id = f"r{i}"
            if arrive == step:
                prompts[request_id] = (PREFIXES[prefix] + [(seed * 7 + j) % 200 + 3 for j in range(suffix_len)],
                                       max_tokens)
                engine.add_request(request_id, prompts[request_id][0],
                                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            if abort == step and request_id in prompts and request_id not in done:
                aborted.add(request_id)
                engine.abort_request(request_id)
        done.update({o.request_id: o for o in engine.step() if o.finished and o.finish_reason != "abort"})
        check_state(engine)
        step += 1
    alloc, stats = engine.allocator, engine.stats()
    event(f"preempted: {stats.num_preemptions_total > 0}")
    event(f"evicted: {stats.num_prefix_cache_evictions_total > 0}")
    event(f"hit: {stats.num_prefix_cache_hit_tokens_total > 0}")
    event(f"aborted: {bool(aborted)}")
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_usable  # every page free or cached
    for request_id, (p, max_tokens) in prompts.items():
        if request_id not in aborted:
            assert done[request_id].token_ids == KVFakeExecutor.expected_tokens(p, max_tokens), request_id
