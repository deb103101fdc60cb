"""Turn a scheduled step into padded host arrays: one bucket-shaped batch, moved in one transfer (no jax).

Tokens are laid out flat, decodes first, each sequence's chunk contiguous. The batch is padded to the
token bucket T and the sequence count S = min(T, max_num_seqs); padding tokens write their K/V into
the reserved page 0 and padding sequences have zero-length queries and KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxcpp.buckets import pad_to_bucket, seq_bucket
from jaxcpp.page_allocator import RESERVED_PAGE
from jaxcpp.scheduler import SchedulerOutput


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

    @property
    def num_tokens_padded(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class StepShape:
    token_buckets: list[int]
    max_num_seqs: int
    pages_per_seq: int
    page_size: int


def build_step_input(sched: SchedulerOutput, shape: StepShape) -> StepInput:
    num_tokens = pad_to_bucket(sched.num_tokens, shape.token_buckets)
    num_seqs = seq_bucket(num_tokens, shape.max_num_seqs)
    ps = shape.page_size
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, RESERVED_PAGE * ps, np.int32)
    cu_q_lens = np.full(num_seqs + 1, sched.num_tokens, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    page_indices = np.full((num_seqs, shape.pages_per_seq), RESERVED_PAGE, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    temperature = np.zeros(num_seqs, np.float32)
    top_k = np.zeros(num_seqs, np.int32)
    top_p = np.ones(num_seqs, np.float32)
    seeds = np.zeros(num_seqs, np.uint32)
    steps = np.zeros(num_seqs, np.int32)

    offset = 0
    for i, chunk in enumerate(sched.chunks):
        seq, end = chunk.seq, offset + chunk.num_tokens
        pos = np.arange(chunk.start, chunk.start + chunk.num_tokens, dtype=np.int32)
        pages = np.asarray(seq.pages, np.int32)
        token_ids[offset:end] = seq.token_ids(chunk.start, chunk.start + chunk.num_tokens)
        positions[offset:end] = pos
        slot_mapping[offset:end] = pages[pos // ps] * ps + pos % ps
        cu_q_lens[i] = offset
        kv_lens[i] = chunk.start + chunk.num_tokens
        page_indices[i, : len(pages)] = pages
        logits_indices[i] = end - 1
        p = seq.params
        temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
        seeds[i] = seq.seed & 0xFFFFFFFF
        steps[i] = len(seq.output_token_ids)
        offset = end
    return StepInput(token_ids, positions, slot_mapping, cu_q_lens, kv_lens, page_indices,
                     np.int32(len(sched.chunks)), np.int32(sched.num_decodes), logits_indices,
                     temperature, top_k, top_p, seeds, steps)
