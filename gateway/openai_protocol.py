"""OpenAI-compatible request bodies and their translation to ``minedraft.v1.GenerateRequest``.

Only the translation lives here; validation of values (ranges, model name, context length)
stays in ``gateway.validation`` and is shared with the gRPC API. Differences from the OpenAI
API, following vLLM's OpenAI server (https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html):

- ``temperature`` unset = 1.0 (sampling), as in OpenAI and vLLM; 0 = greedy.
- ``max_tokens`` / ``max_completion_tokens`` unset = the free context, capped by the gateway's
  ``--max-default-tokens``.
- ``top_k`` and ``min_p`` are extensions (vLLM names).
- ``n`` choices (1 to the gateway's ``--max-n``, 16), each its own request; with ``seed``, choice i
  samples with ``seed + i``. Completions' ``best_of`` (>= n, not with ``stream``) generates best_of
  and returns the n with the highest cumulative logprob. ``usage`` counts the prompt once and the
  completion tokens of the returned choices.
- ``prompt`` is a string, one token-id list, or a one-element list of either; batched prompts
  (several in one request) are refused with 400.
- Unknown fields are refused (400 naming the field) rather than silently ignored, so a sampling
  option this server does not implement never changes results unnoticed.
- Values valid JSON can carry but the protobuf wire cannot are refused with 400 naming the field
  (pydantic, before any translation): integers outside the int32 (int64 for ``seed``) proto
  field, and text holding a lone UTF-16 surrogate (e.g. the JSON escape ``"\ud800"``).
- JSON ``true`` / ``false`` and strings are refused where a number is expected (pydantic's lax
  mode would read them as 1 / 0 and ``"3"`` as 3): ``"max_tokens": true``, ``"n": "2"`` and
  ``"prompt": [true, false]`` are 400 naming the field.
- JSON ``null`` in an optional field means "not given" (its default), as in vLLM: ``"n": null``
  is ``n`` 1, ``"stream": null`` is false.
- Options this server does not implement are accepted at their no-op value and refused (400 naming
  them) otherwise: ``response_format`` ``{"type": "text"}``, ``logit_bias`` ``{}``,
  ``tool_choice`` ``"none"`` (or ``"auto"`` without ``tools``; non-empty ``tools`` are refused).
  ``user``, ``parallel_tool_calls``, ``service_tier``, ``metadata`` and ``store`` are ignored.
"""
from __future__ import annotations

import ctypes
import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from minedraft.v1 import common_pb2, generate_pb2

from gateway.validation import MAX_TOP_LOGPROBS, NO_LOGPROBS, InvalidRequestError

DEFAULT_TEMPERATURE = 1.0
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # proto int32 fields (token ids, max_tokens, top_k, ...)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # proto int64 (seed)


def _utf8_text(text: str) -> str:
    """``text`` unchanged; ValueError when it holds a lone surrogate (proto strings are UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text: lone surrogate at index {exc.start}") from None
    return text


def _not_bool(value):
    """``value`` unchanged; ValueError for a bool or a string (JSON ``true`` or ``"1"`` would pass
    pydantic's lax int / float as 1)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    if isinstance(value, str):  # pydantic's lax mode would read "3" as 3; OpenAI's API refuses it
        raise ValueError(f"expected a number, got the string {value[:32]!r}")
    return value


Text = Annotated[str, AfterValidator(_utf8_text)]
Int32 = Annotated[int, BeforeValidator(_not_bool), Field(ge=INT32_MIN, le=INT32_MAX)]
Int64 = Annotated[int, BeforeValidator(_not_bool), Field(ge=INT64_MIN, le=INT64_MAX)]
Number = Annotated[float, BeforeValidator(_not_bool)]


class _Strict(BaseModel):
    """Unknown fields are refused; ``null`` in a field with a default reads as the default."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class ResponseFormat(BaseModel):
    """``response_format``: only ``{"type": "text"}`` is served; schema fields are not read."""

    model_config = ConfigDict(extra="allow")
    type: Text


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: Text | None = None
    max_tokens: Int32 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int32 | None = None
    min_p: Number | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int32 = 1
    user: str | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number | None = None   # vLLM extension; unset = 1
    logit_bias: dict[str, Number] | None = None
    response_format: ResponseFormat | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One chat message; the role is checked by ``gateway.validation`` (``CHAT_ROLES``)."""

    model_config = ConfigDict(extra="ignore")  # e.g. "name"; tool fields are not served
    role: Text
    content: Text | list[TextPart] | None = None
    tool_calls: list | None = None  # only read to allow null content, as OpenAI does; not rendered

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``; ``logprobs`` is the number of top logprobs (0-20)."""

    prompt: Text | list[Text] | list[Int32] | list[list[Int32]]
    logprobs: Int32 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int32 | None = None


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list | None = None
    tool_choice: Text | dict | None = None
    parallel_tool_calls: bool | None = None  # ignored, as are the three below
    service_tier: Text | None = None
    metadata: dict[str, Text] | None = None
    store: bool | None = None


def _check_unserved(body: _SamplingFields) -> None:
    """Refuses an option this server does not implement unless it has its no-op value."""
    if body.logit_bias:
        raise InvalidRequestError("logit_bias", "logit bias is not served; omit it or send {}")
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequestError("response_format", "structured output is not served; only type 'text' is, "
                                  f"got {body.response_format.type!r}")


def _sampling(body: _SamplingFields, max_tokens: int | None, num_top: int) -> common_pb2.SamplingParams:
    _check_unserved(body)
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError("max_tokens", f"must be >= 1, got {max_tokens}")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling = common_pb2.SamplingParams(
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=body.top_p or 0.0, top_k=body.top_k or 0, min_p=body.min_p or 0.0,
        max_tokens=max_tokens or 0, stop=stops, stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=num_top)
    if body.n < 1:
        raise InvalidRequestError("n", f"must be >= 1, got {body.n}")
    if body.top_p is not None and body.top_p <= 0:
        raise InvalidRequestError("top_p", f"must be in (0, 1], got {body.top_p}")
    _set_penalties(body, sampling)
    if body.seed is not None:
        sampling.seed = body.seed
    return sampling


def _set_penalties(body: _SamplingFields, sampling: common_pb2.SamplingParams) -> None:
    """presence / frequency / repetition penalties (vLLM's ranges, checked here under their HTTP
    names; the wire's 0 = unset repetition_penalty cannot carry an explicit 0)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if not -2.0 <= value <= 2.0:
            raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        setattr(sampling, name, value)
    if body.repetition_penalty is not None:
        as_float32 = ctypes.c_float(body.repetition_penalty).value   # the wire's type
        if not (math.isfinite(as_float32) and as_float32 > 0):
            raise InvalidRequestError("repetition_penalty", "must be finite and > 0 as a 32-bit float (about "
                                      f"1.4e-45 to 3.4e38), got {body.repetition_penalty}")
        sampling.repetition_penalty = body.repetition_penalty


def _one_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return prompt
    if len(prompt) != 1:
        raise InvalidRequestError("prompt", f"one prompt per request is served, got {len(prompt)}; "
                                  "send one request per prompt")
    return prompt[0]


def _completion_logprobs(body: CompletionRequest) -> int:
    """``sampling.logprobs`` of a completions body: its ``logprobs`` when set; else none at all
    (``NO_LOGPROBS``: the engines skip computing them, as vLLM does for such a request), unless
    ``best_of`` > n ranks the samples by their cumulative logprob."""
    if body.logprobs is not None:
        _check_num_top("logprobs", body.logprobs)
        return body.logprobs
    return 0 if (body.best_of or 0) > max(body.n, 1) else NO_LOGPROBS


def _check_num_top(name: str, value: int | None) -> None:
    """The HTTP API's top-logprob counts are in [0, MAX_TOP_LOGPROBS] (OpenAI's range; the gRPC
    API's -1 = none is what a body without them maps to, not a value it may send)."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(name, f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")


def completion_to_generate(body: CompletionRequest, request_id: str) -> generate_pb2.GenerateRequest:
    """The public GenerateRequest of a completions body.

    Raises:
        InvalidRequestError: a field this server does not serve (batched prompt, echo, suffix),
            or ``best_of`` < 1 or with ``stream``; value ranges are checked later by
            ``gateway.validation``.
    """
    if body.echo:
        raise InvalidRequestError("echo", "echo is not served")
    if body.suffix:
        raise InvalidRequestError("suffix", "suffix is not served")
    if body.best_of is not None and body.best_of < 1:
        raise InvalidRequestError("best_of", f"must be >= 1, got {body.best_of}")
    if body.best_of is not None and body.best_of > 1 and body.stream:
        raise InvalidRequestError("best_of", "cannot be used with stream (the best choices are known only at the end)")
    request = generate_pb2.GenerateRequest(
        request_id=request_id, model=body.model or "", n=body.n, best_of=body.best_of or 0,
        sampling=_sampling(body, body.max_tokens, _completion_logprobs(body)))
    prompt = _one_prompt(body.prompt)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.CopyFrom(common_pb2.TokenIds(ids=prompt))
    return request


def _check_contents(messages: list[ChatMessage]) -> None:
    """Null content is valid in OpenAI only for an assistant message with tool calls."""
    for i, message in enumerate(messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise InvalidRequestError(f"messages[{i}].content",
                                      "must not be null (null only in an assistant message with tool_calls)")


def _check_tools(body: ChatCompletionRequest) -> None:
    """Tools are not served: ``tool_choice`` may only say so ("none", or "auto" without tools)."""
    choice = body.tool_choice
    if choice not in (None, "none") and not (choice == "auto" and not body.tools):
        shown = repr(choice) if isinstance(choice, str) else "an object"
        raise InvalidRequestError("tool_choice", "tools are not served; only 'none' (or 'auto' without tools), "
                                  f"got {shown}")
    if body.tools:
        raise InvalidRequestError("tools", "tools are not served")


def chat_to_generate(body: ChatCompletionRequest, request_id: str) -> generate_pb2.GenerateRequest:
    """The public GenerateRequest of a chat completions body (messages rendered by the gateway's
    chat template). ``max_completion_tokens`` wins over the deprecated ``max_tokens``.

    Raises:
        InvalidRequestError: ``top_logprobs`` without ``logprobs``, null message content (but in an
            assistant message with tool calls), tools, or an unserved field.
    """
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError("top_logprobs", "requires logprobs: true")
    _check_num_top("top_logprobs", body.top_logprobs)
    _check_tools(body)
    _check_contents(body.messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    messages = generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role=m.role, content=m.text()) for m in body.messages])
    return generate_pb2.GenerateRequest(
        request_id=request_id, model=body.model or "", n=body.n, messages=messages,
        sampling=_sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else NO_LOGPROBS))


def openai_param(field: str, body: _SamplingFields) -> str:
    """The OpenAI parameter name for a ``gateway.validation`` field name
    (``sampling.top_p`` -> ``top_p``; ``sampling.logprobs`` -> ``top_logprobs`` for chat;
    ``prompt_token_ids[2]`` -> ``prompt[2]``; ``sampling.stop[0]`` -> ``stop`` when the body's
    ``stop`` is one string)."""
    name = field.removeprefix("sampling.")
    if name.startswith("prompt_token_ids"):  # prompt_token_ids[i] -> prompt[i] (or prompt[0][i])
        index = name.removeprefix("prompt_token_ids")
        is_nested = isinstance(getattr(body, "prompt", None), list) and bool(body.prompt) \
            and isinstance(body.prompt[0], list)
        return "prompt" + ("[0]" if is_nested and index else "") + index
    if name.startswith("stop[") and isinstance(getattr(body, "stop", None), str):
        return "stop"  # one stop string, sent as a string
    if name == "logprobs" and isinstance(body, ChatCompletionRequest):
        return "top_logprobs"
    if name == "max_tokens" and isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return name
