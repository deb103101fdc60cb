"""Disaggregation's engine side, one seam: what the engine does as a kv_producer and as a kv_consumer. No jax.

    engine.step()                 consumer.step(idle)      start remote prefills pages allow; pull each
                                                           offer that came back; import the pulls that
                                                           arrived and admit their requests to decode
    engine postprocess            producer.offer(sched)    offer the pages of prefills that sampled
    engine.add_request            check_kv_transfer(...)   a consumer's ask, refused naming the field

Every KV call (`offer_kv`, `pull_kv`, `kv_arrived`, `import_kv`: the executor's KV sub-protocols) is made
here, on the engine's thread, the one that drives the executor. The remote side
(`RemotePrefill`, over gRPC in `jaxcpp.serving.disaggregation`) only calls producers: its end is an offer
and the first token. A pull that fails, or has not arrived within the transfer timeout, goes back to it
(`RemotePrefill.retry`) to be prefilled on the next producer; the flow is drawn in
`jaxcpp.core.kv_transfer`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from jaxcpp.core.executor import Executor, KVConsumerExecutor, KVProducerExecutor
from jaxcpp.core.kv_transfer import KVPull, KVTransferRequest, RemoteDone, RemoteJob, RemotePrefill, TransferCounts
from jaxcpp.core.outputs import RequestOutput
from jaxcpp.core.scheduler import Scheduler, SchedulerOutput
from jaxcpp.core.sequence import Sequence
from jaxcpp.errors import InvalidRequestError
from jaxcpp.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Output = Callable[[Sequence, list[int]], RequestOutput]  # the engine's output of a request


# ---- a producer ------------------------------------------------------------------------------------
class KVProducer:
    """A kv_producer's engine side: a consumer's prefill is checked at admission and its prompt's pages
    offered once it has sampled its one token."""

    def __init__(self, executor: Executor, page_size: int) -> None:
        self.executor = cast(KVProducerExecutor, executor)
        self.page_size = page_size

    def offer(self, sched: SchedulerOutput) -> None:
        """The step's prefills that sampled their token: offer their pages before postprocess frees them.
        The gathers go to the executor before any later step, which may then reuse the pages."""
        for chunk in sched.chunks:
            seq, ask = chunk.seq, chunk.seq.kv_transfer
            if chunk.samples and ask is not None and not seq.is_finished:
                seq.kv_offer = self.executor.offer_kv(
                    ask.transfer_id, seq.pages[ask.skip_pages:seq.num_prompt_pages(self.page_size)])


def check_kv_transfer(producer: KVProducer | None, ask: KVTransferRequest, token_ids: list[int],
                      params: SamplingParams) -> None:
    """A consumer's ask, refused naming the field (`InvalidRequestError`) unless this engine can serve it."""
    if producer is None:
        raise InvalidRequestError("kv_transfer", "this instance is not a kv_producer (--kv-transfer-config)")
    if params.max_tokens != 1 or params.n != 1:
        raise InvalidRequestError("max_tokens", "a prefill for a consumer samples one token (max_tokens 1, n 1)")
    if ask.skip_pages > (len(token_ids) - 1) // producer.page_size:
        raise InvalidRequestError("kv_transfer.skip_pages", f"{ask.skip_pages} is more than the "
                                  "prompt's whole pages before its last token")


# ---- a consumer ------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Pulling:
    """An offer being pulled: polled each step until it arrives or `deadline` (time.monotonic()) passes."""

    done: RemoteDone
    pull: KVPull
    started: float
    deadline: float


class KVConsumer:
    """A kv_consumer's engine side: its requests' remote prefills, from reserving their pages to admitting
    them to decode. A request is either waiting for pages (in `Scheduler.remote`, no job yet), with the
    remote side (a job, no pull), or pulling (a job and a pull)."""

    def __init__(self, remote: RemotePrefill, executor: Executor, scheduler: Scheduler, page_size: int,
                 transfer_timeout_s: float, output: Output) -> None:
        self.remote = remote
        self.executor = cast(KVConsumerExecutor, executor)
        self.scheduler = scheduler
        self.page_size = page_size
        self.timeout_s = transfer_timeout_s
        self._output = output
        self.jobs: dict[str, RemoteJob] = {}       # requests with a remote prefill running, by id
        self._pulling: dict[str, _Pulling] = {}    # those whose offer is being pulled
        self.transfers = TransferCounts()

    def step(self, idle: bool) -> list[RequestOutput]:
        """Start the remote prefills pages allow, pull what producers offered, admit what arrived. When the
        engine is otherwise `idle`, wait a little for a producer (the loop would spin otherwise)."""
        self._start_jobs()
        wait_s = 0.0 if not idle else 0.001 if self._pulling else 0.005
        outputs = [out for done in self.remote.done(wait_s=wait_s) for out in self._on_done(done)]
        return outputs + [out for pulling in list(self._pulling.values()) for out in self._poll(pulling)]

    def abort(self, request_id: str) -> None:
        """Forget a request's job: a call still running is cancelled, a pull still landing is dropped unwritten."""
        self._pulling.pop(request_id, None)
        job = self.jobs.pop(request_id, None)
        if job is not None:
            self.remote.cancel(job)

    def close(self) -> None:
        self.remote.close()

    def _start_jobs(self) -> None:
        for seq in [s for s in self.scheduler.remote if s.request_id not in self.jobs]:
            skip = self.scheduler.reserve_remote(seq)
            if skip is None:
                break  # first come, first served: later ones wait for pages too
            job = self.jobs[seq.request_id] = RemoteJob(seq.request_id, seq.prompt_token_ids, seq.params, seq.seed,
                                                        skip)
            self.remote.start(job)

    def _on_done(self, done: RemoteDone) -> list[RequestOutput]:
        """A producer offered the pages (start pulling them), or no producer could prefill the request."""
        if self.jobs.get(done.job.request_id) is not done.job:
            return []  # aborted meanwhile (maybe sent again under its id): its pages are free already
        if done.error is None and done.offer is not None:
            now = time.monotonic()  # the transfer timeout runs from the offer's arrival
            try:
                pull = self.executor.pull_kv(done.offer, done.transfer_id)
            except Exception as e:  # noqa: BLE001 - jax's transfer errors (a closed connection) have no one type
                return self._retry(done, f"pulling its pages failed: {e}")
            self._pulling[done.job.request_id] = _Pulling(done, pull, now, now + self.timeout_s)
            return []
        del self.jobs[done.job.request_id]
        seq = self.scheduler.requests[done.job.request_id]
        self.scheduler.finish(seq, "error", time.monotonic())
        return [dataclasses.replace(self._output(seq, []), error=done.error or "the producer offered no pages",
                                    unavailable=done.unavailable)]

    def _poll(self, pulling: _Pulling) -> list[RequestOutput]:
        """Import a pull that arrived; hand one that failed or timed out back to the remote side."""
        try:
            arrived = self.executor.kv_arrived(pulling.pull)
        except Exception as e:  # noqa: BLE001 - as above: the transfer failed
            return self._retry(pulling.done, f"pulling its pages failed: {e}")
        if not arrived:
            if time.monotonic() > pulling.deadline:  # jax cannot cancel a pull: if it ever lands, it is dropped
                return self._retry(pulling.done, f"its pages did not arrive within the transfer timeout "
                                                 f"({self.timeout_s:g}s)")
            return []
        done = pulling.done
        del self._pulling[done.job.request_id], self.jobs[done.job.request_id]
        seq, skip = self.scheduler.requests[done.job.request_id], done.job.skip_pages
        self.executor.import_kv(pulling.pull, seq.pages[skip:])
        self.transfers.add(pulling.pull.nbytes, len(seq.prompt_token_ids) - skip * self.page_size,
                           time.monotonic() - pulling.started, done.prefill_s)
        if done.logprobs is not None and seq.params.logprobs is not None:
            seq.logprobs.append(done.logprobs)
        self.scheduler.admit_remote(seq, done.first_token, time.monotonic())
        return [self._output(seq, [done.first_token])]

    def _retry(self, done: RemoteDone, error: str) -> list[RequestOutput]:
        self._pulling.pop(done.job.request_id, None)
        self.remote.retry(done, error)  # the job stays: its next end comes from the remote side
        return []
