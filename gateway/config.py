"""Gateway configuration (frozen, validated)."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000
DEFAULT_COORDINATOR = "127.0.0.1:50052"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
MAX_PORT = 65535
DEFAULT_MAX_N = 16


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway process.

    Attributes:
        tokenizer: directory of the target model's tokenizer (HF format, with chat template).
        coordinator: ``host:port`` of the coordinator's gRPC server.
        model_name: the served model id; requests naming another model are refused.
        draft_name: the draft model id shown by ListModels ("" when none).
        max_model_len: tokens of prompt + output a request may hold (must match the engines).
        max_default_tokens: output budget (tokens) of a request whose ``max_tokens`` is unset:
            ``min(max_model_len - prompt_len, max_default_tokens)``.
        max_num_stop_strings: most stop strings one request may carry.
        host, port: where the public gRPC server listens.
        grace_s: seconds in-flight streams get to finish on SIGTERM.
        http_port: port of the OpenAI-compatible HTTP API on ``host`` (0 = no HTTP server).
        api_key: when set, HTTP ``/v1/*`` requests need ``Authorization: Bearer <api_key>``, and
            gRPC ``minedraft.v1.MineDraft`` calls the metadata ``authorization: Bearer <api_key>``.
        max_n: most choices one request may ask for (``n``, and ``best_of``), each its own request
            at the coordinator.
    """

    tokenizer: str
    coordinator: str = DEFAULT_COORDINATOR
    model_name: str = DEFAULT_MODEL_NAME
    draft_name: str = ""
    max_model_len: int = 2048
    max_default_tokens: int = 1024
    max_num_stop_strings: int = 16
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    grace_s: float = 5.0
    http_port: int = DEFAULT_HTTP_PORT
    api_key: str = ""
    max_n: int = DEFAULT_MAX_N

    def __post_init__(self) -> None:
        if not self.tokenizer:
            raise ValueError("tokenizer: a tokenizer directory is required")
        if ":" not in self.coordinator:
            raise ValueError(f"coordinator: expected host:port, got {self.coordinator!r}")
        if not self.model_name:
            raise ValueError("model_name: must be non-empty")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len: must be > 0, got {self.max_model_len}")
        if self.max_default_tokens <= 0:
            raise ValueError(f"max_default_tokens: must be > 0, got {self.max_default_tokens}")
        if self.max_num_stop_strings <= 0:
            raise ValueError(f"max_num_stop_strings: must be > 0, got {self.max_num_stop_strings}")
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port: must be in [0, {MAX_PORT}], got {self.port}")
        if not 0 <= self.http_port <= MAX_PORT:
            raise ValueError(f"http_port: must be in [0, {MAX_PORT}] (0 = off), got {self.http_port}")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"http_port: must differ from port {self.port}")
        if self.max_n < 1:
            raise ValueError(f"max_n: must be >= 1, got {self.max_n}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s}")
