"""Prefill-decode disaggregation, the host's side: what a producer offers and a consumer pulls. No jax.

    producer                                         consumer (the entry for clients)
    --------                                         --------
                                                     reserve the prompt's pages (its prefix cache first)
    Generate(prompt, max_tokens=1, kv_transfer) <--- pick the least-loaded producer, send it the request
    prefill, sample the first token
    every stage: gather its layers' pages into
    one array per layer (a page-count bucket),
    offer them under transfer_id (await_pull)
    last response: first token + KVOffer ----------> the engine, on its thread: pull each stage's arrays
                                                     straight onto its devices (jax.experimental.transfer;
                                                     returns at once), poll their arrival each step,
                                                     scatter them into its own pages, then decode from
                                                     the first token (`jaxcpp.core.disaggregation`)

The arrays go stage to device over jax's transfer servers, never through a Python head; the gRPC
messages carry ids, addresses and the first token. The offer is a gathered copy: the producer's pages
are freed (into its prefix cache) as soon as the offer exists, so a slow consumer never holds prefill
capacity; an offer no one pulls is dropped after the transfer timeout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from jaxcpp.core.outputs import TokenLogprobs
from jaxcpp.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVLayout:
    """What one KV page holds: a producer and a consumer must agree on every field. A latent (MLA) page
    holds one shared "head" of kv_lora_rank + qk_rope_head_dim values a token a layer, and no V; an MHA
    page K and V of num_kv_heads heads of head_dim, and 0 for the latent fields."""

    model: str
    num_layers: int
    page_size: int
    kv_cache_dtype: str
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def mismatch(self, other: KVLayout, me: str, them: str) -> str | None:
        """None when the two agree, else a message naming every field that differs, and both sides."""
        diffs = [f"{f.name} {getattr(self, f.name)!r} ({me}) vs {getattr(other, f.name)!r} ({them})"
                 for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        return f"KV layouts differ: {'; '.join(diffs)}" if diffs else None


@dataclass(frozen=True)
class KVTransferRequest:
    """A consumer's ask, carried by the producer's request: offer the prompt's pages from `skip_pages` on."""

    transfer_id: int
    skip_pages: int = 0


@dataclass(frozen=True)
class KVSource:
    """One producer stage: its transfer server and its layers [first, end)."""

    address: str
    first_layer: int
    end_layer: int


@dataclass(frozen=True)
class KVOffer:
    """Where a request's pages wait: per stage, one [num_pages_padded, page_size, kv heads, head dim] array
    per layer, K of its layers then V, under the request's transfer id; for a latent (MLA) cache one
    [num_pages_padded, page_size, 1, kv_lora_rank + qk_rope_head_dim] array per layer, nothing else."""

    sources: tuple[KVSource, ...]
    num_pages: int

    @property
    def num_pages_padded(self) -> int:
        return page_bucket(self.num_pages)


def page_bucket(num_pages: int) -> int:
    """The page count a transfer of `num_pages` pages is padded to: the next power of two. Powers of two on
    both sides, so a producer's bucket is one its consumer has, whatever either's --max-model-len."""
    return 1 << max(0, num_pages - 1).bit_length()


def page_buckets(pages_per_seq: int) -> list[int]:
    """Page counts the gather and scatter programs are compiled for: up to a whole sequence's bucket."""
    return [1 << i for i in range(page_bucket(pages_per_seq).bit_length())]


def padded_pages(pages: list[int]) -> list[int]:
    """`pages` padded with the reserved page 0 to their bucket: padding reads and writes only page 0."""
    return pages + [0] * (page_bucket(len(pages)) - len(pages))


@dataclass(frozen=True, eq=False)
class RemoteJob:
    """A consumer's request for a producer: its prompt, its sampling (the seed drawn here, so a producer
    samples the first token as this engine would have) and the pages it already holds. Compared by
    identity: a request aborted and sent again under its id is a new job, which the old one's end
    (`RemoteDone.job`) is never taken for."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    skip_pages: int


@dataclass(frozen=True)
class RemoteDone:
    """A remote prefill's end: the producer's first token and its offer of the pages (the engine then pulls
    them, `jaxcpp.core.disaggregation`), or why no producer could prefill it. `tried` and `errors` are the
    remote side's own: a pull that fails hands them back (`RemotePrefill.retry`)."""

    job: RemoteJob
    first_token: int = -1
    logprobs: TokenLogprobs | None = None
    offer: KVOffer | None = None
    transfer_id: int = 0
    producer: str = ""        # the producer that offered, as --prefill-servers names it
    error: str | None = None
    unavailable: bool = False  # the error is no producer being able to take it now: a retry may succeed
    prefill_s: float = 0.0    # the producer's call: queue, prefill, first token
    tried: tuple[str, ...] = ()   # producers tried before this one
    errors: tuple[str, ...] = ()  # and how each failed


class KVPull(Protocol):
    """An executor's pull of one offer (`KVConsumerExecutor.pull_kv`), arriving while the engine steps."""

    @property
    def nbytes(self) -> int: ...


@dataclass
class TransferCounts:
    """A consumer's totals of the pulls it imported (EngineStats' num_kv_transfer* counts)."""

    transfers: int = 0
    bytes: int = 0
    tokens: int = 0
    microseconds: int = 0
    prefill_microseconds: int = 0

    def add(self, nbytes: int, tokens: int, transfer_s: float, prefill_s: float) -> None:
        self.transfers += 1
        self.bytes += nbytes
        self.tokens += tokens
        self.microseconds += round(transfer_s * 1e6)
        self.prefill_microseconds += round(prefill_s * 1e6)


class RemotePrefill(Protocol):
    """How a consumer's engine has its prompts prefilled elsewhere (`jaxcpp.serving.disaggregation`: over
    gRPC, with the least-loaded producer). Its end is the producer's offer, which the engine pulls itself
    on its own thread (`jaxcpp.core.disaggregation`). `start`, `retry` and `cancel` return at once; the
    calls to producers run in threads."""

    def start(self, job: RemoteJob) -> None: ...

    def retry(self, done: RemoteDone, error: str) -> None:
        """The pull of `done`'s offer failed (`error`): pass its producer over for a while and prefill the
        job on the next one; its end comes from `done` again, a failure naming every producer's error."""
        ...

    def cancel(self, job: RemoteJob) -> None: ...

    def done(self, wait_s: float) -> list[RemoteDone]:
        """Jobs ended since the last call, waiting up to `wait_s` for one when there are none."""
        ...

    def unready_reason(self) -> str | None:
        """None while some producer can take prompts; else why none can now (the server then answers
        NOT_SERVING and refuses requests UNAVAILABLE, a client's cue to retry)."""
        ...

    def close(self) -> None: ...
