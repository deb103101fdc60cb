from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "n", "min_p", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "logprobs", "prompt_logprobs", "include_stop_str_in_output", "structured_outputs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    n: int
    min_p: float
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    prompt_logprobs: int
    include_stop_str_in_output: bool
    structured_outputs: StructuredOutputs
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "kv_transfer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParameters
    kv_transfer: KvTransferRequest
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., kv_transfer: _Optional[_Union[KvTransferRequest, _Mapping]] = ...) -> None: ...

class KvTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "skip_pages", "layout")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    skip_pages: int
    layout: KvLayout
    def __init__(self, transfer_id: _Optional[int] = ..., skip_pages: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model", "num_layers", "page_size", "kv_cache_dtype", "num_kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    page_size: int
    kv_cache_dtype: str
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("address", "first_layer", "end_layer")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    address: str
    first_layer: int
    end_layer: int
    def __init__(self, address: _Optional[str] = ..., first_layer: _Optional[int] = ..., end_layer: _Optional[int] = ...) -> None: ...

class KvOffer(_message.Message):
    __slots__ = ("sources", "num_pages")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[KvSource]
    num_pages: int
    def __init__(self, sources: _Optional[_Iterable[_Union[KvSource, _Mapping]]] = ..., num_pages: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "ttft_s", "e2e_s", "logprobs", "index", "prompt_logprobs", "stop_string", "num_cached_tokens", "kv_offer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    ttft_s: float
    e2e_s: float
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_string: str
    num_cached_tokens: int
    kv_offer: KvOffer
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_string: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., kv_offer: _Optional[_Union[KvOffer, _Mapping]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "max_model_len", "num_layers", "hidden_size", "dtype", "max_num_batched_tokens", "pipeline_parallel_size", "tensor_parallel_size", "eos_token_ids", "server_version", "page_size", "kv_cache_dtype", "kv_role", "kv_layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    hidden_size: int
    dtype: str
    max_num_batched_tokens: int
    pipeline_parallel_size: int
    tensor_parallel_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    server_version: str
    page_size: int
    kv_cache_dtype: str
    kv_role: str
    kv_layout: KvLayout
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., max_num_batched_tokens: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., server_version: _Optional[str] = ..., page_size: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_role: _Optional[str] = ..., kv_layout: _Optional[_Union[KvLayout, _Mapping]] = ...) -> None: ...

class GetServerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DynamicChunkingStats(_message.Message):
    __slots__ = ("values", "labels")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetServerStatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_pages_used", "num_pages_free", "num_pages_total", "num_compilations_since_warmup", "num_prompt_tokens_total", "num_generation_tokens_total", "num_preemptions_total", "num_in_flight", "max_queue_size", "dynamic_chunking", "uptime_s", "num_prefix_cache_queried_tokens_total", "num_prefix_cache_hit_tokens_total", "num_pages_cached", "num_prefix_cache_evictions_total", "num_kv_transfers_total", "num_kv_transfer_bytes_total", "num_kv_transfer_tokens_total", "num_kv_transfer_microseconds_total", "num_remote_prefill_microseconds_total")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPILATIONS_SINCE_WARMUP_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_CHUNKING_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_QUERIED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_EVICTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFER_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFER_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFER_MICROSECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_PREFILL_MICROSECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_pages_used: int
    num_pages_free: int
    num_pages_total: int
    num_compilations_since_warmup: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int
    num_in_flight: int
    max_queue_size: int
    dynamic_chunking: DynamicChunkingStats
    uptime_s: float
    num_prefix_cache_queried_tokens_total: int
    num_prefix_cache_hit_tokens_total: int
    num_pages_cached: int
    num_prefix_cache_evictions_total: int
    num_kv_transfers_total: int
    num_kv_transfer_bytes_total: int
    num_kv_transfer_tokens_total: int
    num_kv_transfer_microseconds_total: int
    num_remote_prefill_microseconds_total: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_pages_used: _Optional[int] = ..., num_pages_free: _Optional[int] = ..., num_pages_total: _Optional[int] = ..., num_compilations_since_warmup: _Optional[int] = ..., num_prompt_tokens_total: _Optional[int] = ..., num_generation_tokens_total: _Optional[int] = ..., num_preemptions_total: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., max_queue_size: _Optional[int] = ..., dynamic_chunking: _Optional[_Union[DynamicChunkingStats, _Mapping]] = ..., uptime_s: _Optional[float] = ..., num_prefix_cache_queried_tokens_total: _Optional[int] = ..., num_prefix_cache_hit_tokens_total: _Optional[int] = ..., num_pages_cached: _Optional[int] = ..., num_prefix_cache_evictions_total: _Optional[int] = ..., num_kv_transfers_total: _Optional[int] = ..., num_kv_transfer_bytes_total: _Optional[int] = ..., num_kv_transfer_tokens_total: _Optional[int] = ..., num_kv_transfer_microseconds_total: _Optional[int] = ..., num_remote_prefill_microseconds_total: _Optional[int] = ...) -> None: ...
