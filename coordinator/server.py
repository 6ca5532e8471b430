"""grpc.aio ``minedraft.v1.Coordinator`` service: Generate (stream), Abort, GetStatus.

``serve(cfg)`` builds the server (health NOT_SERVING + reflection, ``minedraft.serving``), waits
until the verifier (and, in ``sd``/``psd``, the drafter) report SERVING and answer ``GetInfo``,
starts the step loop (``coordinator.scheduler``), reports SERVING (and from then on NOT_SERVING
whenever the verifier is not SERVING: ``minedraft.serving.mirror_health``), and on SIGTERM/SIGINT drains:
new requests are refused (UNAVAILABLE) and running ones get ``grace_s`` seconds to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from minedraft.serving import (DEFAULT_MAX_MESSAGE_BYTES, ServerOptions, build_server, mirror_health, serve_until_signal,
                               wait_for_serving)
from minedraft.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, engine_pb2

from coordinator.admission import NO_DRAFTER, EngineSlots
from coordinator.config import CoordinatorConfig, DataPlaneKind
from coordinator.context_window import ContextLimits
from coordinator.engines import EngineClients
from coordinator.finish import FinishParams
from coordinator.metrics import serve_metrics
from coordinator.request import RequestState
from coordinator.scheduler import QueueFullError, Scheduler
from coordinator.tracing import RequestTrace

logger = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


def _error(code: grpc.StatusCode, message: str) -> coordinator_pb2.CoordinatorGenerateResponse:
    return coordinator_pb2.CoordinatorGenerateResponse(error=common_pb2.GenerateError(code=code.value[0], message=message))


def _validate(request: coordinator_pb2.CoordinatorGenerateRequest) -> str | None:
    """The reason a Generate request is invalid, or None."""
    if not request.request_id:
        return "request_id: must not be empty"
    if not request.prompt_token_ids:
        return "prompt_token_ids: must not be empty"
    if any(t < 0 for t in request.prompt_token_ids):
        return "prompt_token_ids: token ids must be >= 0"
    if request.sampling.max_tokens < 1:
        return f"sampling.max_tokens: must be >= 1, got {request.sampling.max_tokens}"
    if any(t < 0 for t in request.sampling.stop_token_ids):
        return "sampling.stop_token_ids: token ids must be >= 0"
    if request.sampling.temperature < 0:
        return f"sampling.temperature: must be >= 0, got {request.sampling.temperature}"
    return None


def _check_context(request: coordinator_pb2.CoordinatorGenerateRequest, limits: ContextLimits) -> str | None:
    """Why the request cannot fit the verifier's context window (``prompt + max_tokens <=
    max_model_len``, the gateway's rule in ``gateway.validation``), or None; no check while the
    limit is unknown (0). Without it such a request streamed until the verifier's KV was full and
    then failed with RESOURCE_EXHAUSTED (CapacityError)."""
    max_model_len = limits.verifier_max_model_len
    num_prompt, max_tokens = len(request.prompt_token_ids), request.sampling.max_tokens
    if max_model_len and num_prompt + max_tokens > max_model_len:
        return (f"sampling.max_tokens: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"verifier's max_model_len {max_model_len}")
    return None


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """The Coordinator RPCs over one :class:`Scheduler` (None until the engines are ready)."""

    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.scheduler: Scheduler | None = None
        self.is_draining = False

    async def Generate(self, request, context) -> AsyncIterator[coordinator_pb2.CoordinatorGenerateResponse]:
        """Stream ``TokenChunk``s, then one ``Finished`` (or one ``GenerateError``). A cancelled
        stream aborts the request (its KV is released in both engines)."""
        scheduler = self.scheduler
        if scheduler is None or self.is_draining:
            yield _error(grpc.StatusCode.UNAVAILABLE, "coordinator is not serving (warming up or draining)")
            return
        problem = _validate(request) or _check_context(request, scheduler.limits)
        if problem is not None:
            yield _error(grpc.StatusCode.INVALID_ARGUMENT, problem)
            return
        state = RequestState(request.request_id, list(request.prompt_token_ids), request.sampling,
                             FinishParams.from_params(request.sampling), has_stop_strings=request.has_stop_strings)
        try:
            scheduler.submit(state)
        except QueueFullError as exc:
            yield _error(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return
        except ValueError as exc:
            yield _error(grpc.StatusCode.ALREADY_EXISTS, str(exc))
            return
        # set before the next await, so the step loop sees it from admission on
        state.trace = RequestTrace(request.request_id, len(request.prompt_token_ids), scheduler.metrics)
        is_done = False
        try:
            while not is_done:
                message = await state.outbox.get()
                is_done = message.WhichOneof("response") != "chunk"
                yield message
        finally:
            if not is_done:  # client went away (cancel) before the finish: abort it (not a reuse of its id)
                scheduler.abort(state.request_id, state)

    async def Abort(self, request, context) -> common_pb2.AbortResponse:
        """Abort a waiting or running request; ``found`` is False for unknown ids. With
        ``num_output_tokens`` (the gateway's stop-string cut) its counters count only those."""
        cut = request.num_output_tokens if request.HasField("num_output_tokens") else None
        found = self.scheduler is not None and self.scheduler.abort(request.request_id, num_output_tokens=cut)
        return common_pb2.AbortResponse(found=found)

    async def GetStatus(self, request, context) -> coordinator_pb2.StatusResponse:
        """Queue and batch state plus step totals (see ``coordinator.stats``)."""
        response = coordinator_pb2.StatusResponse(mode=str(self.cfg.mode),
                                                  num_speculative_tokens=self.cfg.num_speculative_tokens)
        scheduler = self.scheduler
        if scheduler is None:
            return response
        totals, batches = scheduler.totals, scheduler.batches
        response.MergeFrom(coordinator_pb2.StatusResponse(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            batch_sizes=list(batches.batch_sizes()), balance=batches.balance, skip_batch=batches.skip_batch,
            num_steps=totals.num_steps, num_parallel_steps=totals.num_parallel_steps,
            is_drafter_available=scheduler.is_drafter_available, num_draft_tokens=totals.num_draft_tokens,
            num_accepted_tokens=totals.num_accepted_tokens, num_emitted_tokens=totals.num_emitted_tokens,
            draft_ms=totals.draft_ms, verify_ms=totals.verify_ms, data_plane_ms=totals.data_plane_ms,
            idle_ms=totals.idle_ms, step_wall_ms=totals.wall_ms, max_num_running=scheduler.max_num_running,
            effective_mode=str(scheduler.effective_mode), num_verifier_slots=scheduler.slots.num_verifier_slots,
            num_drafter_slots=scheduler.slots.num_drafter_slots, k_policy=str(self.cfg.k_policy),
            balancer=str(self.cfg.balancer),
        ))
        return response

    async def drain(self) -> None:
        """Refuse new requests and wait for the running ones (bounded by the caller's grace)."""
        self.is_draining = True
        if self.scheduler is not None:
            await self.scheduler.wait_idle()


async def connect_engines(cfg: CoordinatorConfig) -> tuple[EngineClients, tuple[int, ...], EngineSlots, ContextLimits]:
    """Wait for the engines to serve; return (clients, EOS token ids, each engine's free KV slots,
    their context windows).

    Raises:
        TimeoutError: an engine is not SERVING within ``engine_wait_s``.
        RuntimeError: an engine reports no free slot.
    """
    addresses = [cfg.verifier] + ([cfg.drafter] if cfg.uses_drafter else [])
    await asyncio.gather(*(wait_for_serving(a, cfg.engine_wait_s) for a in addresses))
    engines = EngineClients(cfg.drafter, cfg.verifier, cfg.rpc_timeout_s)
    stubs = [engines.verifier] + ([engines.drafter] if cfg.uses_drafter else [])
    infos = await _release_stale_requests(engines, stubs, addresses, cfg.rpc_timeout_s)
    if min(info.num_free_slots for info in infos) < 1:
        raise RuntimeError(f"engines report no free KV slot: {[info.num_free_slots for info in infos]}")
    slots = EngineSlots(infos[0].num_free_slots, infos[1].num_free_slots if cfg.uses_drafter else NO_DRAFTER)
    for address, info in zip(addresses, infos):
        logger.info("engine %s: model %s, %d free slots, max_model_len %d", address, info.model,
                    info.num_free_slots, info.max_model_len)
    if cfg.uses_drafter:
        check_inline_draft_probs_fit(cfg, infos[1])
    limits = ContextLimits(infos[0].max_model_len, infos[1].max_model_len if cfg.uses_drafter else 0)
    logger.info("admission: at most %d running requests (limited by %s)", slots.max_num_running(cfg),
                slots.limited_by(cfg))
    return engines, tuple(infos[0].eos_token_ids), slots, limits


PROBS_ITEMSIZE = 4          # the drafter's float32 draft probabilities
MESSAGE_OVERHEAD_BYTES = 1 << 20   # ids, k_i, field headers: far below this


def check_inline_draft_probs_fit(cfg: CoordinatorConfig, drafter: engine_pb2.EngineInfo,
                                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
    """Refuse at start-up (never mid-traffic) a configuration whose largest inline Draft reply
    / Verify request cannot pass gRPC: ``max_num_seqs x k x vocab`` float32 draft probabilities
    of a sampled batch, when the drafter sends probabilities and the plane is inline.

    Raises:
        RuntimeError: naming the sizes and the flags that fix it.
    """
    if cfg.data_plane != DataPlaneKind.INLINE or not drafter.sends_draft_probs:
        return
    num_bytes = cfg.max_num_seqs * cfg.num_speculative_tokens * drafter.vocab_size * PROBS_ITEMSIZE
    if num_bytes + MESSAGE_OVERHEAD_BYTES > max_message_bytes:
        raise RuntimeError(
            f"draft probabilities of a batch of max_num_seqs={cfg.max_num_seqs} x k={cfg.num_speculative_tokens} x "
            f"vocab {drafter.vocab_size} are {num_bytes / 2**20:.1f} MiB, over the {max_message_bytes / 2**20:.0f} MiB "
            "gRPC message limit: lower --k or --max-num-seqs, or use --data-plane dist or ipc")


async def _release_stale_requests(engines: EngineClients, stubs: list, addresses: list[str],
                                  timeout_s: float) -> list[engine_pb2.EngineInfo]:
    """Free slots still held from an earlier coordinator run (this coordinator owns every request
    in its engines); returns the engines' ``EngineInfo`` afterwards."""
    infos = await asyncio.gather(*(s.GetInfo(engine_pb2.EngineInfoRequest(), timeout=timeout_s) for s in stubs))
    stale = [(stub, address, list(info.request_ids)) for stub, address, info in zip(stubs, addresses, infos)
             if info.request_ids]
    for stub, address, request_ids in stale:
        logger.warning("engine %s holds %d stale requests; releasing them", address, len(request_ids))
        await engines.release(stub, request_ids)
    if not stale:
        return list(infos)
    return list(await asyncio.gather(*(s.GetInfo(engine_pb2.EngineInfoRequest(), timeout=timeout_s) for s in stubs)))


async def start(cfg: CoordinatorConfig, servicer: CoordinatorServicer) -> tuple[Scheduler, asyncio.Task]:
    """Connect to the engines and start the step loop for ``servicer``."""
    engines, eos_token_ids, slots, limits = await connect_engines(cfg)
    scheduler = Scheduler(cfg, engines, eos_token_ids, slots)
    scheduler.limits = limits
    task = asyncio.create_task(scheduler.run(), name="coordinator-step-loop")
    servicer.scheduler = scheduler
    return scheduler, task


async def serve(cfg: CoordinatorConfig) -> None:
    """Run the coordinator until SIGTERM/SIGINT (see module docstring)."""
    server, health, port = await build_server([SERVICE_NAME], ServerOptions(host=cfg.host, port=cfg.port))
    servicer = CoordinatorServicer(cfg)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    await server.start()
    logger.info("coordinator listening on %s:%d (mode %s, k %d, m %d)", cfg.host, port, cfg.mode,
                cfg.num_speculative_tokens, cfg.max_num_seqs)
    try:
        scheduler, task = await start(cfg, servicer)
    except BaseException:
        await server.stop(None)
        raise
    if cfg.metrics_port:
        serve_metrics(scheduler.metrics, cfg.metrics_port, cfg.host)
        logger.info("metrics on http://%s:%d/metrics", cfg.host, cfg.metrics_port)
    await health.set_serving()
    # readiness follows the verifier: without it no request can run (the drafter only speeds up)
    watch = asyncio.create_task(mirror_health(cfg.verifier, health), name="verifier-health")
    try:
        await serve_until_signal(server, health, grace_s=cfg.grace_s, on_drain=servicer.drain)
    finally:
        for background in (watch, task):
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background
        await scheduler.engines.close()
    logger.info("coordinator stopped after %d steps", scheduler.totals.num_steps)
