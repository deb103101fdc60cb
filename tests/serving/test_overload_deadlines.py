"""Overload at 10x the queue limit, and deadlines that expire while a request is queued, in prefill and
in decode. The fake engine is enough here: what is tested is the server's admission and abort path;
its page accounting and chunked prefill are what the real engine's contract promises."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from jaxcpp.core.engine import LLMEngine
from jaxcpp.serving import AsyncClient, Client
from tests.serving.conftest import wait_until
from tests.serving.fakes import expected_tokens, fake_engine

QUEUE = 8


def test_ten_times_the_queue_limit_excess_refused_at_once_accepted_all_complete(serve) -> None:
    engine = fake_engine(step_delay_s=0.005)
    admitted: list[str] = []
    add = engine.add_request
    engine.add_request = lambda rid, *a: admitted.append(rid) or add(rid, *a)  # type: ignore[method-assign]
    server = serve(engine, max_queue_size=QUEUE)

    async def one(client: AsyncClient, i: int) -> tuple[str, float, object]:
        start = time.monotonic()
        try:
            out = await client.generate([i % 200 + 1], max_tokens=40)
        except grpc.RpcError as err:  # jaxcpp.serving.ClientError
            return err.code().name, time.monotonic() - start, err.details()
        return "OK", time.monotonic() - start, out

    async def main() -> list[tuple[str, float, object]]:
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(10 * QUEUE)))

    results = asyncio.run(main())
    accepted = [(i, r) for i, r in enumerate(results) if r[0] == "OK"]
    refused = [r for r in results if r[0] != "OK"]
    assert {r[0] for r in refused} == {"RESOURCE_EXHAUSTED"}
    assert all("request queue is full" in str(r[2]) for r in refused)
    assert QUEUE <= len(accepted) < 10 * QUEUE and len(accepted) + len(refused) == 10 * QUEUE
    for i, (_, _, out) in accepted:  # every accepted request completes with all its tokens
        assert out.finish_reason == "length" and out.token_ids == expected_tokens([i % 200 + 1], 40)
    # "at once": a refused call is answered by the handler and never reaches the engine thread
    assert len(admitted) == len(accepted)
    print(f"{len(accepted)} accepted, {len(refused)} refused; slowest refusal "
          f"{max(r[1] for r in refused) * 1e3:.0f} ms, fastest completion "
          f"{min(r[1] for _, r in accepted) * 1e3:.0f} ms")
    stats = engine.stats()
    assert (stats.num_pages_used, stats.num_running, stats.num_waiting) == (0, 0, 0)


class _StepLog:
    """Counts the steps the engine starts, and when each request was aborted (engine thread)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps = 0
        self.aborted_at_step: dict[str, int] = {}
        step, abort = engine.step, engine.abort_request

        def counted_step() -> list:
            self.steps += 1
            return step()

        def logged_abort(request_id: str) -> None:
            self.aborted_at_step.setdefault(request_id, self.steps)
            abort(request_id)

        engine.step = counted_step  # type: ignore[method-assign]
        engine.abort_request = logged_abort  # type: ignore[method-assign]


@pytest.mark.parametrize("phase", ["queued", "prefill", "decode"])
def test_deadline_expiring_ends_the_call_and_frees_pages_within_a_step(serve, phase) -> None:
    # 20 ms steps; 64-token budget, so the 1000-token prompt takes ~16 steps of prefill (~0.3 s)
    # queued: one sequence a step (max_num_seqs=1), so while the blocker decodes the victim cannot start
    engine = fake_engine(step_delay_s=0.02, max_model_len=2048, num_pages=150,
                         max_num_seqs=1 if phase == "queued" else 32)
    log = _StepLog(engine)
    server = serve(engine)
    with Client(f"127.0.0.1:{server.port}", timeout=30) as client:
        blockers = []
        if phase == "queued":  # fill every page so the next request waits in the engine's queue
            blocker = client.stream("b", max_tokens=1900)
            next(blocker)  # admitted and running
            blockers = [blocker]
            prompt, timeout = "q", 0.3
        elif phase == "prefill":
            prompt, timeout = "p" * 1000, 0.15
        else:
            prompt, timeout = "d", 0.4
        received: list = []
        with pytest.raises(grpc.RpcError) as err:
            for delta in client.stream(prompt, max_tokens=1000, request_id="victim", timeout=timeout):
                received.append(delta)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        steps_at_deadline = log.steps
        prompt_tokens = engine.stats().num_prompt_tokens_total - (1 if blockers else 0)
        if phase == "queued":
            assert received == [] and prompt_tokens == 0  # never admitted: none of its prompt read
        elif phase == "prefill":
            assert received == [] and 0 < prompt_tokens < 1000  # the deadline hit mid-prompt
        else:
            assert len(received) > 3  # decoding
        wait_until(lambda: "victim" in log.aborted_at_step, timeout=5)
        # the abort ran before the engine thread's next step (+1: a step may be in progress)
        assert log.aborted_at_step["victim"] - steps_at_deadline <= 1
        for s in blockers:
            s.close()
        wait_until(lambda: engine.stats().num_pages_used == 0)
        stats = client.stats()
        assert (stats.engine.num_running, stats.engine.num_waiting, stats.num_in_flight) == (0, 0, 0)
