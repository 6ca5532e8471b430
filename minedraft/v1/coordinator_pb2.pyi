from minedraft.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CoordinatorGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "has_stop_strings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HAS_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    has_stop_strings: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., has_stop_strings: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "num_draft_tokens", "num_accepted_tokens", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_draft_tokens: int
    num_accepted_tokens: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "usage")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: _common_pb2.Usage
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class CoordinatorGenerateResponse(_message.Message):
    __slots__ = ("chunk", "finished", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    finished: Finished
    error: _common_pb2.GenerateError
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.GenerateError, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("mode", "num_running", "num_waiting", "batch_sizes", "balance", "skip_batch", "num_steps", "num_parallel_steps", "is_drafter_available", "num_speculative_tokens", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "draft_ms", "verify_ms", "data_plane_ms", "idle_ms", "step_wall_ms", "max_num_running", "effective_mode", "num_verifier_slots", "num_drafter_slots", "k_policy", "balancer")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    BALANCE_FIELD_NUMBER: _ClassVar[int]
    SKIP_BATCH_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARALLEL_STEPS_FIELD_NUMBER: _ClassVar[int]
    IS_DRAFTER_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_WALL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    K_POLICY_FIELD_NUMBER: _ClassVar[int]
    BALANCER_FIELD_NUMBER: _ClassVar[int]
    mode: str
    num_running: int
    num_waiting: int
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    balance: int
    skip_batch: int
    num_steps: int
    num_parallel_steps: int
    is_drafter_available: bool
    num_speculative_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    draft_ms: float
    verify_ms: float
    data_plane_ms: float
    idle_ms: float
    step_wall_ms: float
    max_num_running: int
    effective_mode: str
    num_verifier_slots: int
    num_drafter_slots: int
    k_policy: str
    balancer: str
    def __init__(self, mode: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., balance: _Optional[int] = ..., skip_batch: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_parallel_steps: _Optional[int] = ..., is_drafter_available: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_emitted_tokens: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., data_plane_ms: _Optional[float] = ..., idle_ms: _Optional[float] = ..., step_wall_ms: _Optional[float] = ..., max_num_running: _Optional[int] = ..., effective_mode: _Optional[str] = ..., num_verifier_slots: _Optional[int] = ..., num_drafter_slots: _Optional[int] = ..., k_policy: _Optional[str] = ..., balancer: _Optional[str] = ...) -> None: ...
