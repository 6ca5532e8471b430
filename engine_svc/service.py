"""Pieces shared by the two engine services (drafter_svc and verifier_svc).

- ``EngineExecutor``: one worker thread for all model compute, so the grpc.aio event loop
  stays responsive (health checks, GetInfo) while a forward runs; one thread also keeps the
  workers' state single-threaded (they are not thread-safe).
- ``engine_call``: runs a function there and maps engine errors to gRPC status codes:
  unknown request id (KeyError) -> NOT_FOUND, ``CapacityError`` -> RESOURCE_EXHAUSTED,
  ``ValueError`` (bad shapes, ids, params) -> INVALID_ARGUMENT.
- proto <-> engine conversions of sampling params and step outputs; ``EngineInfo``.
- the command-line flags common to both services.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextvars
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from minedraft.serving import DEFAULT_GRACE_S, DEFAULT_HOST, DEFAULT_MAX_MESSAGE_BYTES
from minedraft.v1 import common_pb2, engine_pb2
from specdec.dataplane.common import (
    DEFAULT_DIST_ADDR,
    DEFAULT_DIST_PORT,
    DataPlaneUnavailableError,
    DraftProbsMissingError,
)
from specdec.errors import CapacityError
from specdec.sample.sampling import TOP_K_OFF, SamplingParams
from engine_svc.tensor_proto import TensorDecodeError

T = TypeVar("T")
# "dist" and "ipc" are both out of band on the wire (DATA_PLANE_DIST: the coordinator passes step
# ids only); the services pick the transport: torch.distributed (NCCL/gloo) or same-host IPC
DATA_PLANE_NAMES = {"inline": engine_pb2.DATA_PLANE_INLINE, "dist": engine_pb2.DATA_PLANE_DIST,
                    "ipc": engine_pb2.DATA_PLANE_DIST}
_WIRE_TOP_P_UNSET = 0.0  # proto3 default: "unset" -> 1 (off)


class EngineExecutor:
    """A single-thread executor for model compute (see module docstring)."""

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` in the engine thread and await its result (exceptions propagate).
        It runs in a copy of the caller's context, so its spans are children of the RPC's span."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._pool, context.run, fn, *args)

    def shutdown(self) -> None:
        """Finish the queued calls, then stop the thread."""
        self._pool.shutdown(wait=True)


def grpc_code_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status code an engine exception maps to, or None for an internal error."""
    if isinstance(exc, (KeyError, DraftProbsMissingError)):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, DataPlaneUnavailableError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (ValueError, TensorDecodeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return None


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the mapped code (INTERNAL for unexpected errors); never returns."""
    code = grpc_code_of(exc) or grpc.StatusCode.INTERNAL
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    await context.abort(code, f"{type(exc).__name__}: {message}")


def to_sampling_params(message: common_pb2.SamplingParams) -> SamplingParams:
    """Engine ``SamplingParams`` from the wire message (top_p 0 = unset -> 1; top_k 0 = off;
    repetition_penalty 0 = unset -> 1).

    Raises:
        ValueError: a field is out of range (message from ``SamplingParams.__post_init__``).
    """
    return SamplingParams(
        temperature=float(message.temperature),
        top_k=TOP_K_OFF if message.top_k == 0 else int(message.top_k),
        top_p=1.0 if message.top_p == _WIRE_TOP_P_UNSET else float(message.top_p),
        min_p=float(message.min_p),
        seed=int(message.seed) if message.HasField("seed") else None,
        max_tokens=max(int(message.max_tokens), 1),
        stop_token_ids=tuple(int(t) for t in message.stop_token_ids),
        ignore_eos=bool(message.ignore_eos),
        logprobs=int(message.logprobs),
        presence_penalty=float(message.presence_penalty),
        frequency_penalty=float(message.frequency_penalty),
        repetition_penalty=1.0 if message.repetition_penalty == 0.0 else float(message.repetition_penalty),
    )


def to_seq_output(step) -> engine_pb2.SeqOutput:
    """``minedraft.v1.SeqOutput`` from a ``specdec.engine.worker.StepOutput``."""
    return engine_pb2.SeqOutput(
        request_id=step.request_id,
        token_ids=step.token_ids,
        num_accepted=step.num_accepted,
        logprobs=step.logprobs,
        top_logprobs=[common_pb2.TopLogprobs(token_ids=ids, logprobs=values) for ids, values in step.top_logprobs],
    )


def check_unique_ids(request_ids: list[str]) -> None:
    """Raises ValueError if ``request_ids`` is empty, has an empty id, or repeats one."""
    if not request_ids:
        raise ValueError("the batch must hold at least one request")
    if any(not rid for rid in request_ids):
        raise ValueError("request_id must not be empty")
    if len(set(request_ids)) != len(request_ids):
        raise ValueError(f"request ids must be distinct, got {request_ids}")


def engine_info(facts, model_name: str, request_ids, tensor_parallel_size: int = 1) -> engine_pb2.EngineInfo:
    """``EngineInfo`` from an engine's ``specdec.engine_api.EngineFacts`` and the requests it holds."""
    return engine_pb2.EngineInfo(
        model=model_name,
        vocab_size=facts.vocab_size,
        max_num_seqs=facts.max_num_seqs,
        max_model_len=facts.max_model_len,
        num_free_slots=facts.num_free_slots,
        eos_token_ids=list(facts.eos_token_ids),
        tensor_parallel_size=tensor_parallel_size,
        device=facts.device,
        dtype=facts.dtype,
        request_ids=sorted(request_ids),
        weight_bytes=facts.weight_bytes,
        kv_cache_bytes=facts.kv_cache_bytes,
        sends_draft_probs=facts.sends_draft_probs,
    )


def elapsed_ms(start: float) -> float:
    """Milliseconds since ``start`` (a ``time.perf_counter()`` value)."""
    return (time.perf_counter() - start) * 1000.0


def check_common_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``parser.error``, exit 2, naming the field) what the engine's ``ModelConfig`` would
    refuse only after the server started: device, dtype and the prefill settings."""
    from specdec.config import ModelConfig

    try:
        ModelConfig(device=args.device, dtype=args.dtype, max_prefill_tokens=args.max_prefill_tokens,
                    max_graph_prefill_tokens=args.max_graph_prefill_tokens)
    except ValueError as exc:
        parser.error(str(exc))


def vllm_engine_config(args: argparse.Namespace, model_dir: str, load_format: str, **overrides):
    """``specdec.vllm_backend.engine.VllmEngineConfig`` of an engine service started with
    ``--engine vllm`` (device ``cuda:N`` -> ``cuda``: vLLM uses the GPUs ``CUDA_VISIBLE_DEVICES``
    shows). Raises ValueError naming a bad field."""
    from specdec.vllm_backend.engine import VllmEngineConfig

    device = "cuda" if args.device.startswith("cuda") else args.device
    is_async = args.async_scheduling == "on" or (args.async_scheduling == "auto" and device == "cuda"
                                                 and overrides.get("num_speculative_tokens") == 0)
    return VllmEngineConfig(
        model=model_dir, device=device, dtype=args.dtype,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, load_format=load_format,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_space_gib=args.kv_cache_space_gib,
        enforce_eager=args.enforce_eager, seed=args.seed or 0, async_scheduling=is_async, **overrides)


def add_common_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Flags both engine services take (engine backend, model dtype/device, capacity, serving, data plane)."""
    from specdec.engine_api import ENGINES

    parser.add_argument("--engine", choices=ENGINES, default="native",
                        help="what runs the model: native (transformers + our slot KV cache and CUDA graphs) "
                             "or vllm (vLLM's engine, paged KV cache and kernels; specdec.vllm_backend)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                        help="--engine vllm on cuda: fraction of the GPU this engine may use")
    parser.add_argument("--kv-cache-space-gib", type=float, default=1.0,
                        help="--engine vllm on cpu: KV cache size in GiB")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="--engine vllm: no torch.compile / CUDA graphs (faster start, slower steps)")
    parser.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                        help="--engine vllm: vLLM's async scheduling (the next step scheduled while one runs) "
                             "for an engine without speculation; auto: on for the ar verifier on cuda, off for the "
                             "drafter (its short draft calls ran slower with it on the H200); vLLM's CPU build has none")
    parser.add_argument("--dtype", default="float32", help="parameter and KV-cache dtype")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="KV-cache slots")
    parser.add_argument("--max-model-len", type=int, default=2048, help="tokens per slot")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="prefill prompts added together in one forward up to this many padded tokens "
                             "(0: one prompt per forward; default: 8192 on CUDA, 0 on CPU)")
    parser.add_argument("--max-graph-prefill-tokens", type=int, default=None,
                        help="one-prompt prefills up to this many tokens replay a CUDA graph per power-of-two "
                             "length bucket (0: off; default: 1024 while CUDA graphs are on, else 0)")
    parser.add_argument("--host", default=DEFAULT_HOST, help="gRPC bind address")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port (0 = any)")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S, help="drain time on SIGTERM")
    parser.add_argument("--data-plane", choices=sorted(DATA_PLANE_NAMES), default="inline",
                        help="how draft probs travel: inline gRPC, torch.distributed (NCCL between "
                             "GPUs, else gloo) or ipc (same host: CUDA IPC / shared memory)")
    parser.add_argument("--ipc-name", default="minedraft", help="ipc data plane: shared file name stem")
    parser.add_argument("--dist-addr", default=DEFAULT_DIST_ADDR, help="dist data plane TCPStore host")
    parser.add_argument("--dist-port", type=int, default=DEFAULT_DIST_PORT, help="dist data plane TCPStore port")
    parser.add_argument("--dist-timeout-s", type=float, default=300.0, help="dist data plane connect timeout")
    parser.add_argument("--seed", type=int, default=None, help="seed of per-request seeds for unseeded requests")
    parser.add_argument("--log-level", default="INFO")
