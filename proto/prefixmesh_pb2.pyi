from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "logprobs", "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "fit_context")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FIT_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    n: int
    logprobs: int
    min_tokens: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    fit_context: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., fit_context: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "priority", "cache_salt", "resume_token_ids", "resume_text_chars", "fetch_hint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    FETCH_HINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    priority: int
    cache_salt: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_text_chars: int
    fetch_hint: FetchHint
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., resume_text_chars: _Optional[int] = ..., fetch_hint: _Optional[_Union[FetchHint, _Mapping]] = ...) -> None: ...

class FetchHint(_message.Message):
    __slots__ = ("replica_id", "address", "num_blocks")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    num_blocks: int
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "fetched_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    fetched_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., fetched_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "finish_reason", "usage", "replica_id", "logprobs", "stop_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    replica_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    stop_reason: str
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., replica_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "cache_salt", "model", "dtype", "block_size", "hash_scheme", "start", "any_order")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ANY_ORDER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    cache_salt: str
    model: str
    dtype: str
    block_size: int
    hash_scheme: str
    start: int
    any_order: bool
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., cache_salt: _Optional[str] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_scheme: _Optional[str] = ..., start: _Optional[int] = ..., any_order: _Optional[bool] = ...) -> None: ...

class KVBlock(_message.Message):
    __slots__ = ("block_hash", "token_ids", "keys", "values", "parent_hash")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    def __init__(self, block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[bytes]] = ..., values: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("replica_id", "running", "waiting", "kv_usage", "queued_tokens", "num_blocks", "free_blocks")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    running: int
    waiting: int
    kv_usage: float
    queued_tokens: int
    num_blocks: int
    free_blocks: int
    def __init__(self, replica_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., queued_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("load", "prefix_cache_queries", "prefix_cache_hits", "preemptions", "prompt_tokens", "generation_tokens", "finished_by_reason", "model", "block_size", "hash_scheme", "epoch", "cached_blocks", "fetched_tokens", "blocks_served", "recompute_preemptions", "swap_preemptions", "recomputed_tokens", "swapped_out_blocks", "swapped_in_blocks", "queue_time_s", "admissions")
    class FinishedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SERVED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SWAP_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_OUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_IN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    load: ReplicaLoad
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    finished_by_reason: _containers.ScalarMap[str, int]
    model: str
    block_size: int
    hash_scheme: str
    epoch: str
    cached_blocks: int
    fetched_tokens: int
    blocks_served: int
    recompute_preemptions: int
    swap_preemptions: int
    recomputed_tokens: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    queue_time_s: float
    admissions: int
    def __init__(self, load: _Optional[_Union[ReplicaLoad, _Mapping]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., preemptions: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., finished_by_reason: _Optional[_Mapping[str, int]] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_scheme: _Optional[str] = ..., epoch: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., fetched_tokens: _Optional[int] = ..., blocks_served: _Optional[int] = ..., recompute_preemptions: _Optional[int] = ..., swap_preemptions: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., swapped_out_blocks: _Optional[int] = ..., swapped_in_blocks: _Optional[int] = ..., queue_time_s: _Optional[float] = ..., admissions: _Optional[int] = ...) -> None: ...

class CacheState(_message.Message):
    __slots__ = ("replica_id", "block_hashes", "integrity_ok", "integrity_error", "num_blocks", "free_blocks", "used_blocks", "inflight_requests")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_OK_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    integrity_ok: bool
    integrity_error: str
    num_blocks: int
    free_blocks: int
    used_blocks: int
    inflight_requests: int
    def __init__(self, replica_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., integrity_ok: _Optional[bool] = ..., integrity_error: _Optional[str] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., inflight_requests: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "block_size", "hash_scheme", "max_model_len", "tokenizer_json", "tokenizer_config_json", "replica_id", "kernel_build", "dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BUILD_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    hash_scheme: str
    max_model_len: int
    tokenizer_json: bytes
    tokenizer_config_json: bytes
    replica_id: str
    kernel_build: str
    dtype: str
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_scheme: _Optional[str] = ..., max_model_len: _Optional[int] = ..., tokenizer_json: _Optional[bytes] = ..., tokenizer_config_json: _Optional[bytes] = ..., replica_id: _Optional[str] = ..., kernel_build: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("replica_id", "address", "model", "block_size", "load", "requests", "prompt_tokens", "cached_tokens", "hit_rate", "inflight_tokens", "http_address", "cached_blocks", "epoch")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    model: str
    block_size: int
    load: ReplicaLoad
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    inflight_tokens: int
    http_address: str
    cached_blocks: int
    epoch: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., load: _Optional[_Union[ReplicaLoad, _Mapping]] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., hit_rate: _Optional[float] = ..., inflight_tokens: _Optional[int] = ..., http_address: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., epoch: _Optional[str] = ...) -> None: ...

class RoutingStats(_message.Message):
    __slots__ = ("decisions", "requests", "predicted_cached_tokens", "actual_cached_tokens", "prompt_tokens", "retries", "failovers", "errors", "hit_rate", "misses")
    class DecisionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MissesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.ScalarMap[str, int]
    requests: int
    predicted_cached_tokens: int
    actual_cached_tokens: int
    prompt_tokens: int
    retries: int
    failovers: int
    errors: int
    hit_rate: float
    misses: _containers.ScalarMap[str, int]
    def __init__(self, decisions: _Optional[_Mapping[str, int]] = ..., requests: _Optional[int] = ..., predicted_cached_tokens: _Optional[int] = ..., actual_cached_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., retries: _Optional[int] = ..., failovers: _Optional[int] = ..., errors: _Optional[int] = ..., hit_rate: _Optional[float] = ..., misses: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("policy", "replicas", "routing", "redis_connected", "router_id")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    REDIS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    policy: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    routing: RoutingStats
    redis_connected: bool
    router_id: str
    def __init__(self, policy: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., routing: _Optional[_Union[RoutingStats, _Mapping]] = ..., redis_connected: _Optional[bool] = ..., router_id: _Optional[str] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...
