from minedraft.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataPlane(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_PLANE_UNSPECIFIED: _ClassVar[DataPlane]
    DATA_PLANE_INLINE: _ClassVar[DataPlane]
    DATA_PLANE_DIST: _ClassVar[DataPlane]
DATA_PLANE_UNSPECIFIED: DataPlane
DATA_PLANE_INLINE: DataPlane
DATA_PLANE_DIST: DataPlane

class SeqInit(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class AddRequestsRequest(_message.Message):
    __slots__ = ("seqs",)
    SEQS_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedCompositeFieldContainer[SeqInit]
    def __init__(self, seqs: _Optional[_Iterable[_Union[SeqInit, _Mapping]]] = ...) -> None: ...

class SeqOutput(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_accepted", "logprobs", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class AddRequestsResponse(_message.Message):
    __slots__ = ("outputs", "forward_ms")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[SeqOutput]
    forward_ms: float
    def __init__(self, outputs: _Optional[_Iterable[_Union[SeqOutput, _Mapping]]] = ..., forward_ms: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class EngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_num_seqs", "max_model_len", "num_free_slots", "eos_token_ids", "tensor_parallel_size", "device", "dtype", "request_ids", "weight_bytes", "kv_cache_bytes", "sends_draft_probs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENDS_DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_num_seqs: int
    max_model_len: int
    num_free_slots: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tensor_parallel_size: int
    device: str
    dtype: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    weight_bytes: int
    kv_cache_bytes: int
    sends_draft_probs: bool
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_free_slots: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tensor_parallel_size: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., weight_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., sends_draft_probs: _Optional[bool] = ...) -> None: ...

class DraftSeq(_message.Message):
    __slots__ = ("request_id", "start_position", "token_ids", "num_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("step_id", "num_speculative_tokens", "seqs", "data_plane")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    num_speculative_tokens: int
    seqs: _containers.RepeatedCompositeFieldContainer[DraftSeq]
    data_plane: DataPlane
    def __init__(self, step_id: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[DraftSeq, _Mapping]]] = ..., data_plane: _Optional[_Union[DataPlane, str]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("step_id", "draft_token_ids", "draft_probs", "has_draft_probs", "draft_ms", "data_plane_ms", "num_draft_tokens", "service_ms", "service_start_s")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_START_S_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    draft_token_ids: _common_pb2.Tensor
    draft_probs: _common_pb2.Tensor
    has_draft_probs: bool
    draft_ms: float
    data_plane_ms: float
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    service_ms: float
    service_start_s: float
    def __init__(self, step_id: _Optional[int] = ..., draft_token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., draft_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., has_draft_probs: _Optional[bool] = ..., draft_ms: _Optional[float] = ..., data_plane_ms: _Optional[float] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., service_ms: _Optional[float] = ..., service_start_s: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("step_id", "request_ids", "draft_token_ids", "draft_probs", "has_draft_probs", "data_plane", "draft_step_id", "num_draft_tokens", "num_decode_steps", "stream_interval", "max_decode_steps", "stream_interval_ms", "stream_joined")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_JOINED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    draft_token_ids: _common_pb2.Tensor
    draft_probs: _common_pb2.Tensor
    has_draft_probs: bool
    data_plane: DataPlane
    draft_step_id: int
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_decode_steps: int
    stream_interval: int
    max_decode_steps: _containers.RepeatedScalarFieldContainer[int]
    stream_interval_ms: int
    stream_joined: bool
    def __init__(self, step_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., draft_token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., draft_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., has_draft_probs: _Optional[bool] = ..., data_plane: _Optional[_Union[DataPlane, str]] = ..., draft_step_id: _Optional[int] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., num_decode_steps: _Optional[int] = ..., stream_interval: _Optional[int] = ..., max_decode_steps: _Optional[_Iterable[int]] = ..., stream_interval_ms: _Optional[int] = ..., stream_joined: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("step_id", "outputs", "verify_ms", "data_plane_ms", "is_partial", "service_ms", "service_start_s", "engine_core_ms", "num_engine_steps")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_MS_FIELD_NUMBER: _ClassVar[int]
    IS_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_START_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CORE_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    outputs: _containers.RepeatedCompositeFieldContainer[SeqOutput]
    verify_ms: float
    data_plane_ms: float
    is_partial: bool
    service_ms: float
    service_start_s: float
    engine_core_ms: float
    num_engine_steps: int
    def __init__(self, step_id: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[SeqOutput, _Mapping]]] = ..., verify_ms: _Optional[float] = ..., data_plane_ms: _Optional[float] = ..., is_partial: _Optional[bool] = ..., service_ms: _Optional[float] = ..., service_start_s: _Optional[float] = ..., engine_core_ms: _Optional[float] = ..., num_engine_steps: _Optional[int] = ...) -> None: ...
