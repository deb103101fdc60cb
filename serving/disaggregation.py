"""Prefill-decode disaggregation over gRPC: a consumer's producers (`jaxcpp.core.kv_transfer` has the flow).

The consumer is the entry for clients (as llm-d's decode-side sidecar and NVIDIA Dynamo's decode workers
are): it reserves a request's pages first, so it knows which prefix it already holds and asks only for
the rest, and it streams every token itself, without a proxy hop. For each request it picks the
least-loaded compatible producer (fewest prefills this consumer has running there), sends it the
prompt with max_tokens 1 and a `KvTransferRequest`, and hands the first token and the `KvOffer` to the
engine, which pulls the pages on its own thread and writes them into its pages in order with its steps
(`jaxcpp.core.disaggregation`). This side calls producers only; it never touches the executor.

Failures: a producer that cannot be reached, dies during the call or whose pages do not arrive within
the transfer timeout (the engine hands the job back: `retry`) is skipped for `PRODUCER_DOWN_S` and the
request goes to the next producer (nothing
has been streamed yet, and the seed travels with the request, so the retry samples the same first
token); with none left the request fails naming each producer's error. A producer whose KV layout
differs from the consumer's is refused at its first contact, with both sides named, and never used.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxcpp.config import produces
from jaxcpp.core.kv_transfer import KVLayout, KVOffer, KVSource, KVTransferRequest, RemoteDone, RemoteJob
from jaxcpp.core.outputs import ModelInfo, TokenLogprobs
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PRODUCER_DOWN_S = 5.0       # a producer that failed a request is passed over this long, while others are up
CHECK_TIMEOUT_S = 10.0      # its model info, at first contact
RESOLVE_EVERY_S = 10.0      # --prefill-servers' names are resolved again this often (pods come and go)
HEALTH_EVERY_S = 1.0        # each producer's gRPC health is asked this often: the consumer serves while one is
HEALTH_TIMEOUT_S = 2.0      # SERVING (its own health follows: NOT_SERVING / 503 while none is)


def connect_producers(engine: Any, api_key: str | None) -> GrpcRemotePrefill | None:
    """A kv_consumer engine with --prefill-servers gets its remote prefill (returned); any other engine is left
    as is (None)."""
    kv = getattr(engine, "kv", None)
    servers = engine.config.kv_transfer.prefill_server_list() if kv is not None else []
    if not (kv is not None and kv.consumes and servers):
        return None
    remote = GrpcRemotePrefill(servers, engine.kv_layout, api_key)
    engine.attach_remote_prefill(remote)
    return remote


# ---- the protocol's messages -------------------------------------------------------------------
def layout_to_proto(layout: KVLayout) -> pb.KvLayout:
    return pb.KvLayout(**dataclasses.asdict(layout))


def layout_from_proto(msg: pb.KvLayout) -> KVLayout:
    """A peer's layout; one from before the latent fields reads 0 for them: an MHA layout, as it was."""
    return KVLayout(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(KVLayout)})


def offer_to_proto(offer: KVOffer) -> pb.KvOffer:
    return pb.KvOffer(sources=[pb.KvSource(address=s.address, first_layer=s.first_layer, end_layer=s.end_layer)
                               for s in offer.sources],
                      num_pages=offer.num_pages)


def offer_from_proto(msg: pb.KvOffer) -> KVOffer:
    return KVOffer(tuple(KVSource(s.address, s.first_layer, s.end_layer) for s in msg.sources), msg.num_pages)


def kv_transfer_from_proto(msg: pb.KvTransferRequest, info: ModelInfo, peer: str
                           ) -> tuple[KVTransferRequest | None, str | None]:
    """A producer's side of a consumer's request: the ask, or why it is refused (naming both sides)."""
    if not produces(info.kv_role):
        return None, (f"kv_transfer: this server is not a kv_producer (its --kv-transfer-config kv_role is "
                      f"{info.kv_role or 'unset'})")
    mismatch = info.kv_layout.mismatch(layout_from_proto(msg.layout), "this producer", f"consumer {peer}")
    if mismatch is not None:
        return None, f"kv_transfer.layout: {mismatch}"
    return KVTransferRequest(msg.transfer_id, msg.skip_pages), None


def producer_sampling(job: RemoteJob) -> pb.SamplingParameters:
    """What the producer needs to sample the first token as this engine would: the draw's parameters and
    seed, the ids min_tokens holds back. Stop strings are the consumer's (it sees the text); requests
    with penalties or prompt logprobs never come here (their prompt passes the consumer's device)."""
    p = job.params
    return pb.SamplingParameters(max_tokens=1, n=1, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                 min_p=p.min_p, seed=job.seed, min_tokens=min(p.min_tokens, 1),
                                 stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
                                 logprobs=p.logprobs)


def _token_logprobs(msg: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


# ---- the consumer's side ---------------------------------------------------------------------
class _Retry(Exception):
    """This producer failed the request in a way another producer may not: try the next one."""


class _Fatal(Exception):
    """The producer refused the request itself: another would too."""


@dataclass
class _Producer:
    target: str
    channel: grpc.Channel
    stub: pb_grpc.JaxcppServiceStub
    in_flight: int = 0
    checked: bool = False
    health: Any = None           # its grpc.health.v1 stub
    refused: str | None = None   # its KV layout differs: never used
    down_until: float = 0.0
    serving: bool = False        # its health answered SERVING at the last check
    status: str = "not asked yet"  # what its health said (or why it could not be asked), for the consumer's reason


class GrpcRemotePrefill:
    """`jaxcpp.core.kv_transfer.RemotePrefill` over the producers' gRPC APIs."""

    def __init__(self, targets: list[str], layout: KVLayout, api_key: str | None = None,
                 max_workers: int = 64) -> None:
        self._layout = layout
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._targets = targets
        self._producers = [self._producer(t) for t in expand_targets(targets)]
        self._resolved_at = time.monotonic()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="jaxcpp-remote-prefill")
        self._done: queue.SimpleQueue[RemoteDone] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._calls: dict[RemoteJob, Any] = {}   # each job's running Generate call
        self._running: set[RemoteJob] = set()    # jobs with a worker (started or retried, not ended)
        self._cancelled: set[RemoteJob] = set()  # of those, the ones the engine gave up
        self._transfer_ids = itertools.count(secrets.randbits(62))  # unique per consumer; a restart starts afresh
        self._readiness_listeners: list[Callable[[bool], None]] = []
        self._closed = threading.Event()
        log.info("kv_consumer: %d producer(s): %s", len(self._producers), ", ".join(p.target for p in self._producers))

    @staticmethod
    def _producer(target: str) -> _Producer:
        channel = grpc.insecure_channel(target)
        return _Producer(target, channel, pb_grpc.JaxcppServiceStub(channel),
                         health=health_pb2_grpc.HealthStub(channel))

    # ---- readiness: the consumer serves while a producer can prefill -------------------------------
    def unready_reason(self) -> str | None:
        """None while some compatible producer answers SERVING; else why no prompt can be prefilled now."""
        with self._lock:
            producers = list(self._producers)
        if any(p.serving and p.checked and p.refused is None for p in producers):
            return None
        states = "; ".join(f"producer {p.target}: {p.refused or p.status}" for p in producers)
        return f"no prefill server (kv_producer) is ready: {states}; retry when health is SERVING"

    def watch_readiness(self, listener: Callable[[bool], None]) -> None:
        """Ask every producer's health now (this blocks up to HEALTH_TIMEOUT_S), call `listener(ready)`, then
        again every HEALTH_EVERY_S in a thread, calling it whenever readiness changes."""
        self._readiness_listeners.append(listener)
        ready = self._check_readiness(None)
        threading.Thread(target=self._watch_health, args=(ready,), name="jaxcpp-producer-health", daemon=True).start()

    def _watch_health(self, ready: bool) -> None:
        while not self._closed.wait(HEALTH_EVERY_S):
            try:
                ready = self._check_readiness(ready)
            except Exception:  # a bug here must not freeze the consumer's health
                log.exception("kv_consumer: checking the producers' health failed")

    def _check_readiness(self, was_ready: bool | None) -> bool:
        """Every producer's health asked once; the listeners told when readiness changed."""
        self._resolve_again()
        with self._lock:
            producers = list(self._producers)
        for p in producers:
            self._ask_health(p)
        ready = (reason := self.unready_reason()) is None
        if ready != was_ready:
            log.info("kv_consumer: %s", "a producer is ready: serving" if ready else f"not serving: {reason}")
            for listener in list(self._readiness_listeners):
                listener(ready)
        return ready

    def _ask_health(self, producer: _Producer) -> None:
        try:
            reply = producer.health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError as e:
            producer.serving, producer.status = False, _describe(e)
            return
        producer.serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        producer.status = "SERVING" if producer.serving else \
            f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)} (warming up or stopping)"
        if producer.serving and not producer.checked:
            self._check(producer)  # its role and KV layout, once

    # ---- RemotePrefill -------------------------------------------------------------------------
    def start(self, job: RemoteJob) -> None:
        self._submit(job, (), ())

    def retry(self, done: RemoteDone, error: str) -> None:
        """The engine could not pull `done`'s offer: its producer is passed over, the next one prefills it."""
        log.warning("producer %s failed request %r (%s); trying another", done.producer, done.job.request_id, error)
        with self._lock:
            producer = next((p for p in self._producers if p.target == done.producer), None)
        if producer is not None:
            producer.down_until = time.monotonic() + PRODUCER_DOWN_S
        self._submit(done.job, (*done.tried, done.producer), (*done.errors, f"producer {done.producer}: {error}"))

    def _submit(self, job: RemoteJob, tried: tuple[str, ...], errors: tuple[str, ...]) -> None:
        with self._lock:
            self._running.add(job)
        self._pool.submit(self._run, job, tried, errors)

    def cancel(self, job: RemoteJob) -> None:
        with self._lock:
            if job not in self._running:
                return  # its offer is the engine's now (being pulled), or it ended
            self._cancelled.add(job)
            call = self._calls.get(job)
        if call is not None:
            call.cancel()  # the producer aborts it and frees its pages

    def done(self, wait_s: float) -> list[RemoteDone]:
        ended = []
        try:
            ended.append(self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait())
            while True:
                ended.append(self._done.get_nowait())
        except queue.Empty:
            return ended

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for p in self._producers:
                p.channel.close()

    # ---- one job, in a worker thread -------------------------------------------------------------
    def _run(self, job: RemoteJob, tried: tuple[str, ...], errors: tuple[str, ...]) -> None:
        try:
            done = self._prefill(job, list(tried), list(errors))
        except Exception as e:  # noqa: BLE001 - a bug here must end the request, not hang it
            log.exception("remote prefill of %r failed", job.request_id)
            done = RemoteDone(job, error=f"remote prefill failed: {e!r}")
        with self._lock:
            self._running.discard(job)
            self._cancelled.discard(job)
        self._done.put(done)

    def _prefill(self, job: RemoteJob, tried: list[str], errors: list[str]) -> RemoteDone:
        """The first producer's offer, trying each in turn (`tried`, `errors`: a retried job's earlier ones)."""
        while not self._is_cancelled(job) and (producer := self._pick(set(tried))) is not None:
            try:
                return self._prefill_on(producer, job, tuple(tried), tuple(errors))
            except _Fatal as e:
                return RemoteDone(job, error=str(e))
            except _Retry as e:
                log.warning("producer %s failed request %r (%s); trying another", producer.target, job.request_id, e)
                errors.append(f"producer {producer.target}: {e}")
                producer.down_until = time.monotonic() + PRODUCER_DOWN_S
            tried.append(producer.target)
        if self._is_cancelled(job):
            return RemoteDone(job, error="aborted")
        refused = [p.refused for p in self._producers if p.refused is not None]
        reasons = errors + refused or [self.unready_reason() or "no producer"]
        # retryable unless every producer was refused for good (a KV layout that differs)
        return RemoteDone(job, error="no producer could prefill it: " + "; ".join(reasons),
                          unavailable=bool(errors) or not refused)

    def _pick(self, tried: set[str]) -> _Producer | None:
        """The least-loaded compatible producer not tried yet, preferring those not recently failed."""
        self._resolve_again()
        with self._lock:
            fresh = [p for p in self._producers if p.target not in tried and p.refused is None]
        for p in fresh:
            if not p.checked:
                self._check(p)
        fresh = [p for p in fresh if p.refused is None]
        now = time.monotonic()
        up = [p for p in fresh if p.down_until <= now] or fresh
        with self._lock:
            return min(up, key=lambda p: p.in_flight) if up else None

    def _resolve_again(self) -> None:
        """Every RESOLVE_EVERY_S, the --prefill-servers names again: producers that came up (or came back
        with new addresses, as restarted pods do) join, those gone leave once nothing runs there."""
        now = time.monotonic()
        with self._lock:
            if now - self._resolved_at < RESOLVE_EVERY_S:
                return
            self._resolved_at = now
        targets = expand_targets(self._targets)
        with self._lock:
            known = {p.target: p for p in self._producers}
            kept = [p for p in self._producers if p.target in targets or p.in_flight]
            added = [self._producer(t) for t in targets if t not in known]
            self._producers = kept + added
        if added or len(kept) < len(known):
            log.info("kv_consumer: producers now %s", ", ".join(p.target for p in self._producers))

    def _check(self, producer: _Producer) -> None:
        """At first contact: is it a producer, with our KV layout? A mismatch is refused for good."""
        try:
            info = producer.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata,
                                              timeout=CHECK_TIMEOUT_S)
        except grpc.RpcError as e:
            producer.down_until = time.monotonic() + PRODUCER_DOWN_S
            log.warning("producer %s: %s", producer.target, _describe(e))
            return  # unreachable now: tried like the others, checked on a later contact
        producer.checked = True
        if not produces(info.kv_role):
            producer.refused = (f"producer {producer.target}: not a kv_producer (kv_role "
                                f"{info.kv_role or 'unset'})")
        else:
            mismatch = self._layout.mismatch(layout_from_proto(info.kv_layout), "this consumer",
                                             f"producer {producer.target}")
            producer.refused = f"refused at connect: {mismatch}" if mismatch is not None else None
        if producer.refused is not None:
            log.error("%s", producer.refused)

    def _prefill_on(self, producer: _Producer, job: RemoteJob, tried: tuple[str, ...], errors: tuple[str, ...]
                    ) -> RemoteDone:
        transfer_id = next(self._transfer_ids)
        request = pb.GenerateRequest(
            request_id=f"kv-{transfer_id:x}", token_ids=pb.TokenIds(ids=job.prompt_token_ids),
            sampling=producer_sampling(job),
            kv_transfer=pb.KvTransferRequest(transfer_id=transfer_id, skip_pages=job.skip_pages,
                                             layout=layout_to_proto(self._layout)))
        started = time.perf_counter()
        responses = self._call(producer, job, request)
        offered = time.perf_counter()
        tokens = [t for r in responses for t in r.token_ids]
        last = responses[-1] if responses else None
        if last is None or not last.HasField("kv_offer") or not tokens:
            raise _Retry("it finished without offering the pages")
        logprobs = [lp for r in responses for lp in r.logprobs]
        return RemoteDone(job, tokens[0], _token_logprobs(logprobs[0]) if logprobs else None,
                          offer_from_proto(last.kv_offer), transfer_id, producer.target,
                          prefill_s=offered - started, tried=tried, errors=errors)

    def _call(self, producer: _Producer, job: RemoteJob, request: pb.GenerateRequest) -> list[Any]:
        with self._lock:
            if job in self._cancelled:
                return []
            call = producer.stub.Generate(request, metadata=self._metadata)
            self._calls[job] = call
            producer.in_flight += 1
        try:
            return list(call)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise _Fatal(f"producer {producer.target}: {_describe(e)}") from e
            raise _Retry(_describe(e)) from e
        finally:
            with self._lock:
                self._calls.pop(job, None)
                producer.in_flight -= 1

    def _is_cancelled(self, job: RemoteJob) -> bool:
        with self._lock:
            return job in self._cancelled


def _describe(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


def expand_targets(targets: list[str]) -> list[str]:
    """host:port entries, a host name that resolves to several addresses (a headless Service) counted as
    that many producers; a name that does not resolve yet is kept (gRPC resolves it when called)."""
    expanded: list[str] = []
    for target in targets:
        host, _, port = target.rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, ValueError):
            infos = []
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        expanded += [f"{a}:{port}" if ":" not in a else f"[{a}]:{port}" for a in addresses] if len(addresses) > 1 \
            else [target]
    return list(dict.fromkeys(expanded))
