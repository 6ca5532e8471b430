"""A small Python client for MineDraft's public gRPC API (``minedraft.v1.MineDraft``), torch-free.

Sync::

    with MineDraftClient("127.0.0.1:50051") as client:
        for delta in client.stream_text("Hello", max_tokens=32, temperature=0):
            print(delta, end="")
        result = client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=32)

Async: ``AsyncMineDraftClient`` has the same methods as coroutines / async iterators.
Sampling keywords are the fields of ``minedraft.v1.SamplingParams`` (temperature, top_k, top_p,
min_p, seed, max_tokens, stop, stop_token_ids, ignore_eos, include_stop_str_in_output, logprobs:
the number of top logprobs per token, 0-20; 0 = only the sampled token's; -1 = none). ``abort(request_id)`` stops a running request.
Invalid requests raise ``grpc.RpcError`` with INVALID_ARGUMENT; an error reported inside the
stream raises ``GenerationError``. ``api_key=`` sends ``authorization: Bearer KEY`` metadata
(gateways started with ``--api-key``; without it they answer UNAUTHENTICATED).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc

from minedraft.serving import aio_channel, message_size_options, wait_for_serving, wait_for_serving_sync
from minedraft.v1 import common_pb2, generate_pb2, generate_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


class GenerationError(RuntimeError):
    """The gateway reported an error inside the stream (``GenerateResponse.error``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message

    @property
    def code_name(self) -> str:
        """The ``grpc.StatusCode`` name of ``code`` (8: RESOURCE_EXHAUSTED), or the number when unknown."""
        return next((c.name for c in grpc.StatusCode if c.value[0] == self.code), str(self.code))


@dataclass
class GenerationResult:
    """A finished generation with client-side timings.

    Attributes:
        ttft_s: seconds from sending the request to the first chunk with tokens (TTFT).
        latency_s: seconds from sending the request to the ``complete`` message.
        num_chunks: chunks that carried tokens (one per engine step).
        logprobs: the target model's logprob of each output token (natural log).
        top_logprobs: per output token, the ``sampling.logprobs`` most likely tokens and their
            target logprobs (``common_pb2.TopLogprobs``); empty unless ``logprobs=N`` was asked.
    """

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    num_chunks: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)


def build_request(prompt: str | None = None, *, messages: Sequence[dict[str, str]] | None = None,
                  prompt_token_ids: Sequence[int] | None = None, request_id: str = "", model: str = "",
                  n: int = 0, best_of: int = 0, **sampling) -> generate_pb2.GenerateRequest:
    """Builds a GenerateRequest from exactly one of prompt / messages / prompt_token_ids;
    ``n`` / ``best_of`` choices (0 = 1 / n), the other keywords are SamplingParams fields.

    Raises:
        ValueError: not exactly one input given.
    """
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("prompt: give exactly one of prompt, messages, prompt_token_ids")
    request = generate_pb2.GenerateRequest(request_id=request_id, model=model, n=n, best_of=best_of,
                                           sampling=common_pb2.SamplingParams(**sampling))
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.messages.CopyFrom(generate_pb2.ChatMessages(
            messages=[generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]))
    else:
        request.prompt_token_ids.CopyFrom(common_pb2.TokenIds(ids=list(prompt_token_ids)))
    return request


class _Collector:
    """Accumulates a stream into a GenerationResult."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.result = GenerationResult()

    def add(self, response: generate_pb2.GenerateResponse) -> None:
        self.result.request_id = response.request_id
        kind = response.WhichOneof("response")
        if kind == "error":
            raise GenerationError(response.error.code, response.error.message)
        if kind == "chunk" and response.chunk.token_ids:
            if self.result.num_chunks == 0:
                self.result.ttft_s = time.perf_counter() - self.start
            self.result.num_chunks += 1
            self.result.logprobs += list(response.chunk.logprobs)
            self.result.top_logprobs += list(response.chunk.top_logprobs)
        elif kind == "complete":
            done = response.complete
            self.result.text = done.text
            self.result.token_ids = list(done.output_token_ids)
            self.result.finish_reason = done.finish_reason
            self.result.usage.CopyFrom(done.usage)
            self.result.latency_s = time.perf_counter() - self.start


def api_key_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata for a gateway started with ``--api-key`` (``authorization: Bearer KEY``);
    empty without a key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class MineDraftClient:
    """Blocking client over one gRPC channel to the gateway (``host:port``)."""

    def __init__(self, target: str = DEFAULT_TARGET, timeout_s: float | None = None, api_key: str = "") -> None:
        self.target = target
        self._timeout_s = timeout_s
        self._metadata = api_key_metadata(api_key)
        self._channel = grpc.insecure_channel(target, options=message_size_options())
        self._stub = generate_pb2_grpc.MineDraftStub(self._channel)

    def __enter__(self) -> "MineDraftClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_until_serving(self, timeout_s: float = 60.0) -> None:
        """Blocks until the gateway's health is SERVING. Raises TimeoutError."""
        wait_for_serving_sync(self.target, timeout_s)

    def stream(self, request: generate_pb2.GenerateRequest) -> Iterator[generate_pb2.GenerateResponse]:
        """The raw response stream of one request (cancel by closing the iterator)."""
        call = self._stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def stream_text(self, prompt: str | None = None, **kwargs) -> Iterator[str]:
        """Yields the text deltas of one generation (see ``build_request`` for the arguments)."""
        collector = _Collector()
        for response in self.stream(build_request(prompt, **kwargs)):
            collector.add(response)
            if response.WhichOneof("response") == "chunk" and response.chunk.text:
                yield response.chunk.text

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Runs one generation to completion (see ``build_request`` for the arguments)."""
        collector = _Collector()
        for response in self.stream(build_request(prompt, **kwargs)):
            collector.add(response)
        return collector.result

    def generate_choices(self, prompt: str | None = None, **kwargs) -> list[GenerationResult]:
        """Runs one generation with ``n`` (and ``best_of``) choices to completion; one result per
        choice, by index (see ``build_request`` for the arguments)."""
        collectors: dict[int, _Collector] = {}
        for response in self.stream(build_request(prompt, **kwargs)):
            kind = response.WhichOneof("response")
            index = getattr(response, kind).index if kind in ("chunk", "complete") else 0
            collectors.setdefault(index, _Collector()).add(response)
        return [collectors[i].result for i in sorted(collectors)]

    def abort(self, request_id: str) -> bool:
        """Aborts a running request; True when the coordinator knew it."""
        return self._stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=self._timeout_s,
                                metadata=self._metadata).found

    def list_models(self) -> list[generate_pb2.ModelCard]:
        return list(self._stub.ListModels(generate_pb2.ListModelsRequest(), timeout=self._timeout_s,
                                          metadata=self._metadata).models)


class AsyncMineDraftClient:
    """grpc.aio client; create and use it inside one running event loop."""

    def __init__(self, target: str = DEFAULT_TARGET, timeout_s: float | None = None, api_key: str = "") -> None:
        self.target = target
        self._timeout_s = timeout_s
        self._metadata = api_key_metadata(api_key)
        self._channel = aio_channel(target)
        self._stub = generate_pb2_grpc.MineDraftStub(self._channel)

    async def __aenter__(self) -> "AsyncMineDraftClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_until_serving(self, timeout_s: float = 60.0) -> None:
        """Waits until the gateway's health is SERVING. Raises TimeoutError."""
        await wait_for_serving(self.target, timeout_s)

    async def stream(self, request: generate_pb2.GenerateRequest) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The raw response stream of one request."""
        call = self._stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def stream_text(self, prompt: str | None = None, **kwargs) -> AsyncIterator[str]:
        """Yields the text deltas of one generation."""
        collector = _Collector()
        async for response in self.stream(build_request(prompt, **kwargs)):
            collector.add(response)
            if response.WhichOneof("response") == "chunk" and response.chunk.text:
                yield response.chunk.text

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Runs one generation to completion; the result carries TTFT and latency."""
        collector = _Collector()
        async for response in self.stream(build_request(prompt, **kwargs)):
            collector.add(response)
        return collector.result

    async def abort(self, request_id: str) -> bool:
        response = await self._stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=self._timeout_s,
                                          metadata=self._metadata)
        return response.found

    async def list_models(self) -> list[generate_pb2.ModelCard]:
        response = await self._stub.ListModels(generate_pb2.ListModelsRequest(), timeout=self._timeout_s,
                                               metadata=self._metadata)
        return list(response.models)
