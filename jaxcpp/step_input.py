"""A scheduled step (`SchedulerOutput`) -> padded host arrays: one bucket-shaped batch, one transfer (no jax).

Tokens are laid out flat, decodes first, each sequence's chunk contiguous. The batch is padded to the
token bucket T and the sequence count S = min(T, max_num_seqs); padding tokens write their K/V into
the reserved page 0 and padding sequences have zero-length queries and KV. A *padding step* is all
padding: what an empty schedule pads to, so warm-up compiles exactly the programs real steps use.
A decode whose input token is still on the device (async scheduling) is sent as token 0 with
`feedback_rows` naming the row of the fed-back step's tokens that the first stage reads instead.

`pack` is the host half of moving a step: every field viewed as int32 and concatenated into one
buffer, so each stage receives one transfer, not 15 (`device_put` costs tens of microseconds per array
whatever its size). `jaxcpp.runtime.packing.unpack` cuts it apart inside the jitted program; the
layout (names, shapes, dtypes) follows from the bucket, so it adds no programs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from jaxcpp.buckets import pad_to_bucket, seq_bucket
from jaxcpp.page_allocator import RESERVED_PAGE
from jaxcpp.sequence import Sequence


# ---- what the scheduler decided for one step (plain data; `jaxcpp.scheduler` makes it) -------------
@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int           # first token position of the chunk (the cached prefix length)
    num_tokens: int
    samples: bool        # the chunk reaches the sequence's last token, so the step samples one
    feedback_row: int = -1  # >= 0: a decode whose input token is still on the device, sampled in
                            # this row of the step it feeds back from (`SchedulerOutput.feedback_from`)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    ack: bool = False    # the chunk sizer needs this step's timing: the head waits for the last stage
    step_id: int = 0     # the scheduler's count of steps
    feedback_from: int | None = None  # the step whose tokens this one's placeholder decodes take

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def feeds_back(self) -> bool:
        return any(c.feedback_row >= 0 for c in self.chunks)

    @property
    def samples(self) -> bool:
        """Some chunk reaches its sequence's end, so the step's tokens are needed."""
        return any(c.samples for c in self.chunks)


# ---- the step's padded arrays ------------------------------------------------------------------------


@dataclass(frozen=True)
class StepInput:
    token_ids: np.ndarray       # [T] int32
    positions: np.ndarray       # [T] int32
    slot_mapping: np.ndarray    # [T] int32
    cu_q_lens: np.ndarray       # [S + 1] int32
    kv_lens: np.ndarray         # [S] int32
    page_indices: np.ndarray    # [S, P] int32
    num_seqs: np.ndarray        # [] int32
    num_decodes: np.ndarray     # [] int32
    logits_indices: np.ndarray  # [S] int32: each sequence's last token in the batch
    temperature: np.ndarray     # [S] float32
    top_k: np.ndarray           # [S] int32
    top_p: np.ndarray           # [S] float32
    seeds: np.ndarray           # [S] uint32
    steps: np.ndarray           # [S] int32: tokens the request has generated so far
    feedback_rows: np.ndarray   # [T] int32: -1, or the row of the fed-back step's tokens to read this
                                # token from (a decode whose input the host does not have yet)

    @property
    def num_tokens_padded(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class StepShape:
    token_buckets: list[int]
    max_num_seqs: int
    pages_per_seq: int
    page_size: int


def padding_step(num_tokens: int, shape: StepShape) -> StepInput:
    """An all-padding step of one token bucket (warm-up compiles, attention-free forwards)."""
    return _padding(num_tokens, seq_bucket(num_tokens, shape.max_num_seqs), shape.pages_per_seq)


def build_step_input(sched: SchedulerOutput, shape: StepShape) -> StepInput:
    num_tokens = pad_to_bucket(sched.num_tokens, shape.token_buckets)
    step = _padding(num_tokens, seq_bucket(num_tokens, shape.max_num_seqs), shape.pages_per_seq)
    step.cu_q_lens[:] = sched.num_tokens
    step.num_seqs[...] = len(sched.chunks)
    step.num_decodes[...] = sched.num_decodes
    ps = shape.page_size
    offset = 0
    for i, chunk in enumerate(sched.chunks):
        seq, end = chunk.seq, offset + chunk.num_tokens
        pos = np.arange(chunk.start, chunk.start + chunk.num_tokens, dtype=np.int32)
        pages = np.asarray(seq.pages, np.int32)
        if chunk.feedback_row >= 0:
            step.feedback_rows[offset] = chunk.feedback_row  # its token id stays 0 on the host
        else:
            step.token_ids[offset:end] = seq.token_ids(chunk.start, chunk.start + chunk.num_tokens)
        step.positions[offset:end] = pos
        step.slot_mapping[offset:end] = pages[pos // ps] * ps + pos % ps
        step.cu_q_lens[i] = offset
        step.kv_lens[i] = chunk.start + chunk.num_tokens
        step.page_indices[i, : len(pages)] = pages
        step.logits_indices[i] = end - 1
        p = seq.params
        step.temperature[i], step.top_k[i], step.top_p[i] = p.temperature, p.top_k, p.top_p
        step.seeds[i] = seq.seed & 0xFFFFFFFF
        step.steps[i] = len(seq.output_token_ids) + (chunk.feedback_row >= 0)  # + the pending token
        offset = end
    return step


def _padding(num_tokens: int, num_seqs: int, pages_per_seq: int) -> StepInput:
    """Every token writes the reserved page, every sequence has zero-length queries and KV."""
    return StepInput(
        token_ids=np.zeros(num_tokens, np.int32), positions=np.zeros(num_tokens, np.int32),
        slot_mapping=np.zeros(num_tokens, np.int32),  # slot 0 is in RESERVED_PAGE (page 0)
        cu_q_lens=np.zeros(num_seqs + 1, np.int32), kv_lens=np.zeros(num_seqs, np.int32),
        page_indices=np.full((num_seqs, pages_per_seq), RESERVED_PAGE, np.int32),
        num_seqs=np.zeros((), np.int32), num_decodes=np.zeros((), np.int32),
        logits_indices=np.zeros(num_seqs, np.int32), temperature=np.zeros(num_seqs, np.float32),
        top_k=np.zeros(num_seqs, np.int32), top_p=np.ones(num_seqs, np.float32),
        seeds=np.zeros(num_seqs, np.uint32), steps=np.zeros(num_seqs, np.int32),
        feedback_rows=np.full(num_tokens, -1, np.int32))


# ---- packing: the host half ------------------------------------------------------------------------
class Field(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype  # hashable, so a layout can be a static jit argument


Layout = tuple[Field, ...]

_FIELDS = tuple(f.name for f in dataclasses.fields(StepInput))


def pack(step: StepInput) -> tuple[np.ndarray, Layout]:
    """All fields of `step` as one flat int32 array ([sum of sizes]) and how to cut it apart."""
    arrays = [np.asarray(getattr(step, k)) for k in _FIELDS]
    for k, a in zip(_FIELDS, arrays, strict=True):
        if a.dtype.itemsize != 4:
            raise TypeError(f"StepInput.{k} is {a.dtype}; packing needs 4-byte fields")
    buf = np.concatenate([a.reshape(-1).view(np.int32) for a in arrays])
    return buf, tuple(Field(k, a.shape, a.dtype) for k, a in zip(_FIELDS, arrays, strict=True))
