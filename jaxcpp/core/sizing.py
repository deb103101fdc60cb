"""The sizes that follow from a model and the flags, decided once, on the host, without the weights.

    sizing = EngineSizing.plan(config, spec)   # max model length, pages, buckets, the layer split
    sizing.shape                               # the StepShape every step is padded to

The head computes this once it knows the backend (`--dtype auto` depends on it) and hands the same
object to its executor; a multi-process head sends it to every stage (`to_message` / `from_message`),
so the engine and every stage agree on dtype, page counts and buckets by construction. No jax here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxcpp.config import ConfigError, EngineConfig
from jaxcpp.core.buckets import decode_buckets, token_buckets
from jaxcpp.core.kv_transfer import KVLayout
from jaxcpp.core.step_input import StepShape
from jaxcpp.models.config import LlamaConfig
from jaxcpp.models.spec import ModelSpec

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_on_backend(requested: str, backend: str) -> str:
    """`--dtype auto` means the checkpoint's, except on the CPU backend: float32 there, since bfloat16
    matmuls on CPU are emulated and run several times slower. An explicit dtype is always honoured.
    The caller names the backend: the head of a multi-process pipeline asks its stages."""
    return "float32" if requested == "auto" and backend == "cpu" else requested


def stage_layers(num_layers: int, pp: int, partition: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of the decoder layers of each stage.

    `partition` (`--pp-partition`) gives the layers per stage; by default the split is as even as it
    can be, with the extra layers on the *later* stages (the last stage also runs the LM head and the
    sampler, yet later stages wait less in a filling pipe, which measured better in ATOM, e.g. 15,15,15,16).
    """
    if num_layers < pp:
        raise ConfigError(f"--pipeline-parallel-size: {pp} stages need at least {pp} decoder layers, "
                          f"the model has {num_layers}")
    if partition is None:
        base, extra = divmod(num_layers, pp)
        partition = [base + (1 if s >= pp - extra else 0) for s in range(pp)]
    if len(partition) != pp:
        raise ConfigError(f"--pp-partition: gives {len(partition)} stages but --pipeline-parallel-size "
                          f"is {pp}")
    if sum(partition) != num_layers or min(partition) < 1:
        raise ConfigError(f"--pp-partition: {','.join(map(str, partition))} must be positive and sum to "
                          f"the model's {num_layers} decoder layers")
    bounds = np.cumsum([0, *partition]).tolist()
    return [(int(bounds[s]), int(bounds[s + 1])) for s in range(pp)]


@dataclass(frozen=True)
class EngineSizing:
    spec: ModelSpec
    max_model_len: int
    page_size: int
    pages_per_seq: int
    num_pages: int                  # per stage, page 0 (reserved for padding writes) included
    token_buckets: list[int]        # multiples of max(64, page size); dynamic chunking snaps chunks to them
    max_num_seqs: int
    layers: list[tuple[int, int]]   # [start, end) of each pipeline stage
    decode_buckets: list[int]       # below the token buckets, for steps that score no prompt token
    kv_cache_dtype: str = "float32"  # what the pages hold: the model's dtype, or float8_e4m3fn / float8_e5m2

    @property
    def shape(self) -> StepShape:
        return StepShape(self.token_buckets, self.max_num_seqs, self.pages_per_seq, self.page_size,
                         self.decode_buckets)

    def kv_layout(self) -> KVLayout:
        """What each KV page holds, which a disaggregated producer and consumer must agree on."""
        m = self.spec.config
        rank = int(getattr(m, "kv_lora_rank", 0) or 0)
        if rank:  # one latent row a token a layer: one shared head of rank + rope values (make_kv_cache)
            rope = int(m.qk_rope_head_dim)
            return KVLayout(self.spec.name, m.num_hidden_layers, self.page_size, self.kv_cache_dtype, 1,
                            rank + rope, rank, rope)
        return KVLayout(self.spec.name, m.num_hidden_layers, self.page_size, self.kv_cache_dtype,
                        m.num_key_value_heads, m.head_dim)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """config.json's, and generation_config.json's (a chat model's end-of-turn ids are often only there)."""
        return tuple(dict.fromkeys((*self.spec.config.eos_token_ids, *generation_eos_token_ids(self.spec.folder))))

    def to_message(self) -> dict[str, Any]:
        """What a stage process needs to size itself as the head did (JSON): every field, the spec as
        the dtype it resolved to (the stage reads the same model folder)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "spec"}
        return {**fields, "layers": [list(layer) for layer in self.layers], "dtype": self.spec.config.dtype}

    @staticmethod
    def from_message(message: dict[str, Any], spec: ModelSpec) -> EngineSizing:
        """The head's sizing, in a stage: `spec` is the model folder's, read with the head's dtype."""
        fields = {k: v for k, v in message.items() if k != "dtype"}
        fields["layers"] = [tuple(layer) for layer in fields["layers"]]
        return EngineSizing(spec.with_dtype(message["dtype"]), **fields)

    @staticmethod
    def plan(config: EngineConfig, spec: ModelSpec) -> EngineSizing:
        model = spec.config
        max_model_len = config.model.max_model_len or model.max_position_embeddings
        if max_model_len > model.max_position_embeddings:
            raise ConfigError(f"--max-model-len: {max_model_len} exceeds the model's max_position_embeddings "
                              f"{model.max_position_embeddings}")
        p = config.parallel
        layers = stage_layers(model.num_hidden_layers, p.pipeline_parallel_size,
                              p.partition_list() if p.pp_partition is not None else None)
        page_size = config.cache.page_size
        pages_per_seq = -(-max_model_len // page_size)
        largest_stage = max(end - start for start, end in layers)
        kv_cache_dtype = config.cache.resolved_kv_cache_dtype(model.dtype)
        num_pages = _num_pages(config, model, largest_stage, pages_per_seq, kv_cache_dtype)
        max_num_seqs = config.scheduler.max_num_seqs
        return EngineSizing(spec, max_model_len, page_size, pages_per_seq, num_pages,
                            token_buckets(config.scheduler.max_num_batched_tokens, page_size), max_num_seqs,
                            layers, decode_buckets(max_num_seqs, page_size), kv_cache_dtype)


def kv_values_per_token(model: LlamaConfig) -> int:
    """Values one token keeps in one layer's pages: K and V of every KV head, or, for an MLA model (a
    config with `kv_lora_rank`, as DeepSeek-V2/V3 and Kimi-K2 have), one latent row of kv_lora_rank +
    qk_rope_head_dim values shared by all heads (`jaxcpp.kernels.mla_attention`)."""
    rank = getattr(model, "kv_lora_rank", None)
    if rank:
        return int(rank) + int(model.qk_rope_head_dim)
    return 2 * model.num_key_value_heads * model.head_dim


def page_bytes(model: LlamaConfig, num_layers: int, page_size: int, kv_cache_dtype: str) -> int:
    """Bytes of one page over `num_layers` layers (the per-layer fp8 scales are negligible)."""
    return num_layers * page_size * kv_values_per_token(model) * _ITEMSIZE[kv_cache_dtype]


def pages_in_memory(model: LlamaConfig, num_layers: int, page_size: int, kv_cache_dtype: str,
                    memory_gb: float) -> int:
    """Pages of `num_layers` layers that `memory_gb` (--kv-cache-memory-gb) holds, page 0 included."""
    return int(memory_gb * 2**30) // max(1, page_bytes(model, num_layers, page_size, kv_cache_dtype))


def _num_pages(config: EngineConfig, model: LlamaConfig, largest_stage_layers: int, pages_per_seq: int,
               kv_cache_dtype: str) -> int:
    """Every stage holds the same number of pages, so the stage with the most layers sizes them."""
    page_size = config.cache.page_size
    if config.cache.num_pages is not None:
        num_pages = config.cache.num_pages
    else:
        budget = pages_in_memory(model, largest_stage_layers, page_size, kv_cache_dtype,
                                 config.cache.kv_cache_memory_gb)
        # More pages than every sequence at full length can use would only waste memory.
        num_pages = min(budget, config.scheduler.max_num_seqs * pages_per_seq + 1)
    if num_pages < pages_per_seq + 1:
        raise ConfigError(f"--num-pages: {num_pages} pages cannot hold one sequence of --max-model-len "
                          f"({pages_per_seq} pages of {page_size} tokens, plus the reserved page)")
    return num_pages


def parameter_summary(model: LlamaConfig) -> str:
    """"30.53B parameters, 3.35B active per token" (an MoE model runs only its chosen experts), or
    "8.03B parameters" for a dense one: for the start-up log."""
    total, active = model.param_counts()
    text = f"{_count(total)} parameters"
    return text if active == total else f"{text}, {_count(active)} active per token"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def generation_eos_token_ids(folder: Path) -> tuple[int, ...]:
    """`eos_token_id` of the folder's generation_config.json (an id or a list), or () without one."""
    try:
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))
