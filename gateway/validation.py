"""Validation and normalization of public GenerateRequests (torch-free).

Every check raises ``InvalidRequestError`` whose message starts with the offending field's
name (e.g. ``sampling.top_p: ...``); the server answers it with INVALID_ARGUMENT.

Defaults and proto3 conventions (a scalar left unset reads 0 on the wire):
- ``sampling.temperature`` 0 (or unset) = greedy decoding (argmax); > 0 = sampling.
- ``sampling.top_p`` 0 (unset) = 1.0 (off); ``sampling.top_k`` 0 (unset) = -1 (off).
- ``sampling.max_tokens`` 0 (unset) = ``min(max_model_len - prompt_len, max_default_tokens)``,
  like vLLM's OpenAI server, which fills the remaining context, capped by the gateway's
  ``--max-default-tokens`` so an unbounded request cannot hold a slot for the whole context.
- ``n`` 0 (unset) = 1, at most ``cfg.max_n``; ``best_of`` 0 (unset) = n, else in [n, max_n]. Each of
  the best_of samples is its own request at the coordinator (``gateway.choices``).
- a field the schema does not know, or a known field sent with the wrong wire type (protobuf keeps
  both as unknown fields and would run the request on defaults), is refused, naming the message it
  came in; so are a ``request_id`` over ``MAX_REQUEST_ID_CHARS`` and a stop string over
  ``MAX_STOP_STRING_CHARS`` characters.
- ``messages[i].role`` is one of ``CHAT_ROLES``: the chat template renders role and content only,
  so ``developer`` (unknown to most templates), ``tool`` (needs tool_call_id; tools are not
  served) and any other role are refused.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from minedraft.v1 import common_pb2, generate_pb2

from gateway.config import GatewayConfig
from gateway.tokenizer import PromptTokenizer

UNSET = 0
TOP_K_OFF = -1
TOP_P_OFF = 1.0
MAX_TOP_LOGPROBS = 20
NO_LOGPROBS = -1   # sampling.logprobs: no logprobs at all (chunks carry none; specdec.sample.sampling.NO_LOGPROBS)
CHAT_ROLES = ("system", "user", "assistant")
PROMPT_BYTES_SLACK = 2  # a tokenizer's normalizer (e.g. NFC) may shrink text before it is split
MAX_REQUEST_ID_CHARS = 512
MAX_STOP_STRING_CHARS = 1024


class InvalidRequestError(ValueError):
    """A request field is invalid; ``str(err)`` names the field first."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the coordinator.

    Attributes:
        request_id: the client's id or a fresh uuid4 hex.
        prompt_token_ids: the tokenized prompt, ``[prompt_len]``.
        sampling: normalized SamplingParams for the coordinator (stop strings removed).
        stops: the stop strings, handled in the gateway.
        include_stop_str_in_output: keep a matched stop string in the text.
        n: choices to return.
        best_of: samples to generate (>= n); the n with the highest cumulative logprob are returned.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    stops: tuple[str, ...]
    include_stop_str_in_output: bool
    n: int = 1
    best_of: int = 1


def _check_range(field: str, value: float, is_ok: bool, expected: str) -> None:
    if isinstance(value, float) and math.isnan(value):
        raise InvalidRequestError(field, "must be a number, got NaN")
    if not is_ok:
        raise InvalidRequestError(field, f"must be {expected}, got {value}")


def _check_text_size(request: generate_pb2.GenerateRequest, tokenizer: PromptTokenizer, max_model_len: int) -> None:
    """Refuses text that cannot fit before tokenizing it: a token spans at most
    ``tokenizer.max_token_bytes`` bytes, so more than ``max_model_len * max_token_bytes * slack``
    bytes hold more than ``max_model_len`` tokens. Tokenizing runs on the gateway's event loop; a
    10 MB prompt took 13 s there on a busy 2-core CPU, stalling every other stream."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        num_bytes = len(request.prompt.encode("utf-8"))
    elif kind == "messages":
        num_bytes = sum(len(m.content.encode("utf-8")) for m in request.messages.messages)
    else:
        return
    max_bytes = max_model_len * tokenizer.max_token_bytes * PROMPT_BYTES_SLACK
    if num_bytes > max_bytes:
        raise InvalidRequestError(kind, f"{num_bytes} bytes of text cannot fit max_model_len {max_model_len} "
                                  f"tokens (at most {max_bytes} bytes)")


def _tokenize_input(request: generate_pb2.GenerateRequest, tokenizer: PromptTokenizer) -> list[int]:
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("prompt", "one of prompt, messages, prompt_token_ids is required")
    if kind == "prompt":
        if not request.prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        return tokenizer.encode_text(request.prompt)
    if kind == "messages":
        messages = request.messages.messages
        if not messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        for i, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role",
                                          f"must be one of {', '.join(CHAT_ROLES)}; got {message.role!r}")
        try:
            return tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages])
        except Exception as exc:  # jinja template errors (e.g. role order) are the caller's
            raise InvalidRequestError("messages", f"chat template failed: {exc}") from exc
    ids = list(request.prompt_token_ids.ids)
    if not ids:
        raise InvalidRequestError("prompt_token_ids", "must not be empty")
    _check_token_ids("prompt_token_ids", ids, tokenizer.vocab_size)
    return ids


def _check_sampling(s: common_pb2.SamplingParams, vocab_size: int, max_num_stops: int) -> None:
    _check_range("sampling.temperature", s.temperature, s.temperature >= 0, ">= 0")
    if math.isinf(s.temperature):
        raise InvalidRequestError("sampling.temperature", "must be finite")
    _check_range("sampling.top_p", s.top_p, 0 <= s.top_p <= 1, "in (0, 1] (0 = unset)")
    _check_range("sampling.top_k", s.top_k, s.top_k >= TOP_K_OFF, ">= -1 (-1 or 0 = off)")
    _check_range("sampling.min_p", s.min_p, 0 <= s.min_p <= 1, "in [0, 1]")
    _check_penalties(s)
    if s.HasField("seed") and s.seed < 0:
        raise InvalidRequestError("sampling.seed", f"must be >= 0, got {s.seed}")
    if s.max_tokens < 0:
        raise InvalidRequestError("sampling.max_tokens", f"must be > 0, got {s.max_tokens}")
    if s.logprobs < NO_LOGPROBS:
        raise InvalidRequestError("sampling.logprobs", f"must be >= 0, or -1 (none), got {s.logprobs}")
    if s.logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError("sampling.logprobs", f"must be <= {MAX_TOP_LOGPROBS}, got {s.logprobs}")
    if len(s.stop) > max_num_stops:
        raise InvalidRequestError("sampling.stop", f"at most {max_num_stops} stop strings, got {len(s.stop)}")
    for i, stop in enumerate(s.stop):
        if not stop:
            raise InvalidRequestError(f"sampling.stop[{i}]", "stop strings must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"sampling.stop[{i}]", f"stop strings of at most {MAX_STOP_STRING_CHARS} "
                                                             f"characters, got {len(stop)}")
    _check_token_ids("sampling.stop_token_ids", list(s.stop_token_ids), vocab_size)


def _check_token_ids(field: str, ids: list[int], vocab_size: int) -> None:
    """Token ids in [0, vocab_size); the error names the first bad one's index (``field[i]``)."""
    bad = [i for i, t in enumerate(ids) if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{field}[{bad[0]}]", f"ids out of [0, {vocab_size}): "
                                                        f"{[ids[i] for i in bad[:5]]}")


def _check_penalties(s: common_pb2.SamplingParams) -> None:
    """vLLM's ranges: presence and frequency in [-2, 2], repetition > 0 (0 on the wire = unset)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        _check_range(f"sampling.{name}", value, -2 <= value <= 2, "in [-2, 2]")
    _check_range("sampling.repetition_penalty", s.repetition_penalty,
                 math.isfinite(s.repetition_penalty) and s.repetition_penalty >= 0, "finite and > 0 (0 = unset)")


def _resolve_max_tokens(requested: int, prompt_len: int, cfg: GatewayConfig) -> int:
    room = cfg.max_model_len - prompt_len
    if room <= 0:
        raise InvalidRequestError(
            "prompt", f"prompt has {prompt_len} tokens; max_model_len is {cfg.max_model_len}")
    if requested == UNSET:
        return min(room, cfg.max_default_tokens)
    if requested > cfg.max_model_len:
        raise InvalidRequestError(
            "sampling.max_tokens", f"must be <= max_model_len {cfg.max_model_len}, got {requested}")
    if requested > room:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({requested}) exceeds max_model_len {cfg.max_model_len}")
    return requested


def check_wire(message, path: str = "") -> None:
    """Refuse unknown fields (or known ones with the wrong wire type) in ``message`` and in every
    sub-message it holds, naming where they came. Raises InvalidRequestError."""
    from google.protobuf import unknown_fields

    unknown = unknown_fields.UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({field.field_number for field in unknown})
        raise InvalidRequestError(path or "request", f"unknown field number(s) {numbers}, or a field sent with "
                                                     "the wrong wire type (see protos/minedraft/v1)")
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None:
            continue
        name = f"{path}.{descriptor.name}" if path else descriptor.name
        if descriptor.is_repeated:
            for index, item in enumerate(value):
                check_wire(item, f"{name}[{index}]")
        else:
            check_wire(value, name)


def _check_request_fields(request: generate_pb2.GenerateRequest, cfg: GatewayConfig) -> None:
    check_wire(request, "")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got "
                                                f"{len(request.request_id)}")
    if request.model and request.model != cfg.model_name:
        raise InvalidRequestError("model", f"unknown model {request.model!r}; served: {cfg.model_name!r}")
    n, best_of = _num_choices(request, cfg.max_n)
    if best_of > n and request.sampling.logprobs == NO_LOGPROBS:
        raise InvalidRequestError("sampling.logprobs", f"-1 (none) cannot rank best_of={best_of} > n={n} samples "
                                                       "(by their cumulative logprob); send 0 or more")


def _num_choices(request: generate_pb2.GenerateRequest, max_n: int) -> tuple[int, int]:
    """(n, best_of) of ``request`` (0 = unset: n 1, best_of n), both in [1, max_n], best_of >= n."""
    n = request.n or 1
    if not 1 <= n <= max_n:
        raise InvalidRequestError("n", f"must be in [1, {max_n}], got {request.n}")
    best_of = request.best_of or n
    if not n <= best_of <= max_n:
        raise InvalidRequestError("best_of", f"must be in [n, {max_n}] (n = {n}), got {request.best_of}")
    return n, best_of


def prepare_request(request: generate_pb2.GenerateRequest, tokenizer: PromptTokenizer,
                    cfg: GatewayConfig) -> PreparedRequest:
    """Validates ``request``, tokenizes its input and fills defaults (see module docstring).

    Raises:
        InvalidRequestError: a field is invalid; the message names it.
    """
    _check_request_fields(request, cfg)
    s = request.sampling
    _check_sampling(s, tokenizer.vocab_size, cfg.max_num_stop_strings)
    if s.max_tokens > cfg.max_model_len:
        raise InvalidRequestError(
            "sampling.max_tokens", f"must be <= max_model_len {cfg.max_model_len}, got {s.max_tokens}")
    _check_text_size(request, tokenizer, cfg.max_model_len)
    prompt_token_ids = _tokenize_input(request, tokenizer)
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(s)
    del sampling.stop[:]
    sampling.include_stop_str_in_output = False
    sampling.top_p = s.top_p if s.top_p > 0 else TOP_P_OFF
    sampling.top_k = s.top_k if s.top_k != UNSET else TOP_K_OFF
    sampling.max_tokens = _resolve_max_tokens(s.max_tokens, len(prompt_token_ids), cfg)
    return PreparedRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        stops=tuple(s.stop),
        include_stop_str_in_output=s.include_stop_str_in_output,
        n=request.n or 1,
        best_of=request.best_of or request.n or 1,
    )
