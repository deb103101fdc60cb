"""A scheduled step (`SchedulerOutput`) -> padded host arrays: one bucket-shaped batch, one transfer (no jax).

Tokens are laid out flat, decodes first, each sequence's chunk contiguous. The batch is padded to the
token bucket T (a step of few tokens scoring no prompt token: possibly a rung below the others,
`jaxcpp.core.buckets`) and the sequence count S = min(T, max_num_seqs); padding tokens write their K/V into
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
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from jaxcpp.core.buckets import seq_bucket, step_bucket
from jaxcpp.core.page_allocator import RESERVED_PAGE
from jaxcpp.sampling_params import MAX_BANNED_IDS

if TYPE_CHECKING:  # the scheduler's output is read here, never made: no import at run time
    from jaxcpp.core.scheduler_output import SchedulerOutput


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
    num_generated: np.ndarray   # [S] int32: tokens the request has generated so far
    feedback_rows: np.ndarray   # [T] int32: -1, or the row of the fed-back step's tokens to read this
                                # token from (a decode whose input the host does not have yet)
    min_p: np.ndarray           # [S] float32
    presence_penalty: np.ndarray    # [S] float32
    frequency_penalty: np.ndarray   # [S] float32
    repetition_penalty: np.ndarray  # [S] float32
    history_slot: np.ndarray    # [S] int32: the sampling row's device history slot (penalties), -1 = none
    clear_slot: np.ndarray      # [S] int32: a slot to empty first (a request's first chunk), -1 = none
    banned_ids: np.ndarray      # [S, MAX_BANNED_IDS] int32: stop ids min_tokens bans for now, -1 = none
    wants_logprobs: np.ndarray  # [S] int32: 1 where the sampled token's logprobs are asked for
    prompt_slot: np.ndarray     # [T] int32: the history slot this prompt token joins, -1 = none
    prompt_targets: np.ndarray  # [T] int32: the next prompt token, whose log-probability is asked, or -1

    @property
    def num_tokens_padded(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def needs_full_sampler(self) -> bool:
        """Some row samples with a penalty history or banned ids, or some prompt token joins a history:
        the last stage then runs the sampler program that has them (`jaxcpp.runtime.sampler.sample_step`)."""
        return bool((self.history_slot >= 0).any() or (self.prompt_slot >= 0).any() or (self.banned_ids >= 0).any())


@dataclass(frozen=True)
class StepShape:
    token_buckets: list[int]    # multiples of max(64, page size), for any step
    max_num_seqs: int
    pages_per_seq: int
    page_size: int
    decode_buckets: list[int] = field(default_factory=list)  # below those: steps that score no prompt token

    @property
    def buckets(self) -> list[int]:
        """Every token count a program is compiled for, ascending."""
        return [*self.decode_buckets, *self.token_buckets]

    def scores_prompt_tokens(self, num_tokens: int) -> bool:
        """Whether a step of this bucket may score prompt tokens (`prompt_logprobs`): every bucket but the
        rungs below the token buckets."""
        return num_tokens in self.token_buckets


def padding_step(num_tokens: int, shape: StepShape) -> StepInput:
    """An all-padding step of one token bucket (warm-up compiles, attention-free forwards)."""
    return _padding(num_tokens, seq_bucket(num_tokens, shape.max_num_seqs), shape.pages_per_seq)


def build_step_input(sched: SchedulerOutput, shape: StepShape) -> StepInput:
    """Per-sequence values gathered into lists and written once per field, but for the page table
    rows and the fed-back rows, one per chunk (a decode step of 64 sequences is 64 one-token chunks:
    per-chunk numpy calls for every field would dominate the host's step)."""
    num_tokens = step_bucket(sched.num_tokens, sched.fits_rungs, shape.token_buckets, shape.decode_buckets)
    step = _padding(num_tokens, seq_bucket(num_tokens, shape.max_num_seqs), shape.pages_per_seq)
    chunks, n, total = sched.chunks, len(sched.chunks), sched.num_tokens
    step.num_seqs[...] = n
    step.num_decodes[...] = sched.num_decodes
    lens = np.array([c.num_tokens for c in chunks], np.int32)
    starts = np.array([c.start for c in chunks], np.int32)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    step.cu_q_lens[:] = total
    step.cu_q_lens[:n] = offsets[:-1]
    step.kv_lens[:n] = starts + lens
    step.logits_indices[:n] = offsets[1:] - 1
    token_ids: list[int] = []
    for i, c in enumerate(chunks):
        step.page_indices[i, : len(c.seq.pages)] = c.seq.pages
        if c.feedback_row >= 0:
            token_ids.append(0)  # read on the device from the fed-back step's tokens
            step.feedback_rows[offsets[i]] = c.feedback_row
        else:
            token_ids += c.seq.token_ids(c.start, c.start + c.num_tokens)
    params = [c.seq.params for c in chunks]
    step.temperature[:n] = [p.temperature for p in params]
    step.top_k[:n] = [p.top_k for p in params]
    step.top_p[:n] = [p.top_p for p in params]
    step.seeds[:n] = [c.seq.seed & 0xFFFFFFFF for c in chunks]
    step.num_generated[:n] = [len(c.seq.output_token_ids) + (c.feedback_row >= 0) for c in chunks]  # + the pending one
    row = np.repeat(np.arange(n), lens)
    pos = np.repeat(starts - offsets[:-1], lens) + np.arange(total, dtype=np.int32)
    ps = shape.page_size
    step.token_ids[:total] = token_ids
    step.positions[:total] = pos
    step.slot_mapping[:total] = step.page_indices[row, pos // ps] * ps + pos % ps
    if any(not p.is_plain for p in params):
        _write_extras(step, sched, offsets)
    return step


def failing_chunks(sched: SchedulerOutput, shape: StepShape) -> list[tuple[int, Exception]]:
    """The chunks (by index) whose own values cannot be laid out: each built alone, as a step of one.
    `build_step_input` raised for the whole step; a chunk that fails alone is its request's error
    (a value validation let through), and if none does, the error is the engine's."""
    failed = []
    for i, chunk in enumerate(sched.chunks):
        alone = dataclasses.replace(sched, chunks=[chunk], num_decodes=int(i < sched.num_decodes))
        try:
            build_step_input(alone, shape)
        except Exception as error:  # noqa: BLE001 - whatever it is, it is this request's
            failed.append((i, error))
    return failed


def _write_extras(step: StepInput, sched: SchedulerOutput, offsets: np.ndarray) -> None:
    """Penalties, min_p, min_tokens' bans, history slots, logprobs and prompt-logprob targets: only
    steps that carry a request asking for one of them pay for writing them."""
    chunks, n = sched.chunks, len(sched.chunks)
    params = [c.seq.params for c in chunks]
    step.min_p[:n] = [p.min_p for p in params]
    step.presence_penalty[:n] = [p.presence_penalty for p in params]
    step.frequency_penalty[:n] = [p.frequency_penalty for p in params]
    step.repetition_penalty[:n] = [p.repetition_penalty for p in params]
    for i, c in enumerate(chunks):
        seq, row = c.seq, int(offsets[i]) - c.start  # position p of the chunk is token row + p
        prompt_len = len(seq.prompt_token_ids)
        if c.samples:
            step.history_slot[i] = seq.history_slot
            step.wants_logprobs[i] = seq.params.logprobs is not None
            if int(step.num_generated[i]) < seq.params.min_tokens:
                step.banned_ids[i, :len(seq.banned_ids)] = seq.banned_ids
        if c.history_start >= 0:
            if c.history_start == 0:
                step.clear_slot[i] = seq.history_slot
            step.prompt_slot[row + c.history_start:row + min(c.start + c.num_tokens, prompt_len)] = seq.history_slot
        if seq.params.prompt_logprobs is not None and c.start < prompt_len - 1:
            last = min(c.start + c.num_tokens, prompt_len - 1)  # positions with a next prompt token
            step.prompt_targets[row + c.start:row + last] = seq.prompt_token_ids[c.start + 1:last + 1]


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
        seeds=np.zeros(num_seqs, np.uint32), num_generated=np.zeros(num_seqs, np.int32),
        feedback_rows=np.full(num_tokens, -1, np.int32), min_p=np.zeros(num_seqs, np.float32),
        presence_penalty=np.zeros(num_seqs, np.float32), frequency_penalty=np.zeros(num_seqs, np.float32),
        repetition_penalty=np.ones(num_seqs, np.float32), history_slot=np.full(num_seqs, -1, np.int32),
        clear_slot=np.full(num_seqs, -1, np.int32), banned_ids=np.full((num_seqs, MAX_BANNED_IDS), -1, np.int32),
        wants_logprobs=np.zeros(num_seqs, np.int32),
        prompt_slot=np.full(num_tokens, -1, np.int32), prompt_targets=np.full(num_tokens, -1, np.int32))


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


def unpack(buf: np.ndarray, layout: Layout) -> StepInput:
    """`pack`'s inverse on the host (a stand-in stage reads the step it was sent)."""
    fields, offset = {}, 0
    for f in layout:
        size = int(np.prod(f.shape, dtype=np.int64))
        fields[f.name] = buf[offset:offset + size].view(f.dtype).reshape(f.shape)
        offset += size
    return StepInput(**fields)
