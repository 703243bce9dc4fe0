from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "grammar", "prompt_logprobs", "logit_bias", "min_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    grammar: Grammar
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec", "generated_ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ..., generated_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("rid", "input_ids", "sampling", "bootstrap_room", "prefill_node_id", "room_ticket", "resumed_tokens")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_TICKET_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    bootstrap_room: int
    prefill_node_id: str
    room_ticket: str
    resumed_tokens: int
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., bootstrap_room: _Optional[int] = ..., prefill_node_id: _Optional[str] = ..., room_ticket: _Optional[str] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("rid", "input_ids", "sampling", "bootstrap_room", "decode_node_id", "resumed_tokens")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    bootstrap_room: int
    decode_node_id: str
    resumed_tokens: int
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., bootstrap_room: _Optional[int] = ..., decode_node_id: _Optional[str] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("bootstrap_room", "prompt_tokens", "cached_tokens", "sent_pages", "sent_bytes", "descriptors", "timing", "prompt_logprobs", "page_id_writes")
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SENT_PAGES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PAGE_ID_WRITES_FIELD_NUMBER: _ClassVar[int]
    bootstrap_room: int
    prompt_tokens: int
    cached_tokens: int
    sent_pages: int
    sent_bytes: int
    descriptors: int
    timing: NodeTiming
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    page_id_writes: int
    def __init__(self, bootstrap_room: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., sent_pages: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., descriptors: _Optional[int] = ..., timing: _Optional[_Union[NodeTiming, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., page_id_writes: _Optional[int] = ...) -> None: ...

class NodeTiming(_message.Message):
    __slots__ = ("bootstrap_wait_s", "queue_s", "prefill_s", "transfer_s", "prealloc_s", "kv_wait_s", "admit_s", "first_decode_s", "decode_s", "total_s")
    BOOTSTRAP_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    PREALLOC_S_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ADMIT_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    bootstrap_wait_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    prealloc_s: float
    kv_wait_s: float
    admit_s: float
    first_decode_s: float
    decode_s: float
    total_s: float
    def __init__(self, bootstrap_wait_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., prealloc_s: _Optional[float] = ..., kv_wait_s: _Optional[float] = ..., admit_s: _Optional[float] = ..., first_decode_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "detail", "usage", "timing", "prompt_logprobs")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    detail: str
    usage: Usage
    timing: NodeTiming
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, finish_reason: _Optional[str] = ..., detail: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[NodeTiming, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "finished")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    finished: Finished
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("open", "cancel_rid")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_RID_FIELD_NUMBER: _ClassVar[int]
    open: GenerateRequest
    cancel_rid: str
    def __init__(self, open: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel_rid: _Optional[str] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("rid", "chunk", "finished", "error")
    RID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rid: str
    chunk: TokenChunk
    finished: Finished
    error: RequestError
    def __init__(self, rid: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ...) -> None: ...

class StreamBatch(_message.Message):
    __slots__ = ("deltas",)
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    def __init__(self, deltas: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rid",)
    RID_FIELD_NUMBER: _ClassVar[int]
    rid: str
    def __init__(self, rid: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ok", "role", "model", "node_id")
    OK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    role: str
    model: str
    node_id: str
    def __init__(self, ok: _Optional[bool] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("running_requests", "queued_requests", "free_pages", "total_pages", "token_usage", "cached_pages")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    queued_requests: int
    free_pages: int
    total_pages: int
    token_usage: float
    cached_pages: int
    def __init__(self, running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., token_usage: _Optional[float] = ..., cached_pages: _Optional[int] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("freed_pages",)
    FREED_PAGES_FIELD_NUMBER: _ClassVar[int]
    freed_pages: int
    def __init__(self, freed_pages: _Optional[int] = ...) -> None: ...

class CheckIntegrityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckIntegrityResponse(_message.Message):
    __slots__ = ("ok", "error", "free_pages", "used_pages", "cached_pages", "total_pages")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    free_pages: int
    used_pages: int
    cached_pages: int
    total_pages: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., free_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., total_pages: _Optional[int] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    drain_timeout_s: float
    def __init__(self, role: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("from_role", "role", "node_id", "switched", "aborted", "seconds")
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SWITCHED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    from_role: str
    role: str
    node_id: str
    switched: bool
    aborted: int
    seconds: float
    def __init__(self, from_role: _Optional[str] = ..., role: _Optional[str] = ..., node_id: _Optional[str] = ..., switched: _Optional[bool] = ..., aborted: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ExpertRecordingRequest(_message.Message):
    __slots__ = ("action",)
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DUMP: _ClassVar[ExpertRecordingRequest.Action]
        START: _ClassVar[ExpertRecordingRequest.Action]
        STOP: _ClassVar[ExpertRecordingRequest.Action]
    DUMP: ExpertRecordingRequest.Action
    START: ExpertRecordingRequest.Action
    STOP: ExpertRecordingRequest.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    action: ExpertRecordingRequest.Action
    def __init__(self, action: _Optional[_Union[ExpertRecordingRequest.Action, str]] = ...) -> None: ...

class ExpertRecordingResponse(_message.Message):
    __slots__ = ("recording", "distribution_json", "written_to")
    RECORDING_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTION_JSON_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_TO_FIELD_NUMBER: _ClassVar[int]
    recording: bool
    distribution_json: str
    written_to: str
    def __init__(self, recording: _Optional[bool] = ..., distribution_json: _Optional[str] = ..., written_to: _Optional[str] = ...) -> None: ...
