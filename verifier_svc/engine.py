"""The verifier's engine commands, run identically on every tensor-parallel rank.

``VerifierEngine`` wraps ``specdec.engine.worker.TargetWorker``. On rank 0 (the driver) each command
is validated, completed (seeds of unseeded requests drawn; draft probs decoded from the inline
message or fetched over the dist data plane), broadcast to the other ranks
(``verifier_svc.tp.CommandChannel``) and then applied; ranks > 0 run ``follow()``, applying the
same commands in the same order until SHUTDOWN. Validation happens before the broadcast, so
the ranks only ever see commands that the driver accepted; an engine error after it happens on
every rank alike (same code, same inputs) and leaves their states equal.

Synchronous: call from the single engine thread only.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import Future

import torch
from opentelemetry import trace

from engine_svc.service import check_unique_ids, elapsed_ms, to_sampling_params, to_seq_output
from minedraft.v1 import engine_pb2
from engine_svc.tensor_proto import is_empty_proto, proto_to_tensor
from specdec.engine.worker_base import decode_step_caps
from verifier_svc.streaming import StepCoalescer
from verifier_svc.tp import CMD_ADD, CMD_RELEASE, CMD_SHUTDOWN, CMD_VERIFY, PROBS_DTYPES, CommandChannel

logger = logging.getLogger(__name__)
_SEED_BITS = 63
MAX_DECODE_STEPS = 64   # VerifyRequest.num_decode_steps
_tracer = trace.get_tracer("minedraft.verifier")  # spans: children of the Verify RPC's server span


class VerifierEngine:
    """Target-model commands (see module docstring).

    Args:
        worker: this rank's ``TargetWorker``.
        channel: the TP command channel, or None for TP = 1.
        probs_client: ``specdec.dataplane.dist.DraftProbsClient`` (driver with ``--data-plane dist``).
        seed: seeds the source of per-request seeds for unseeded requests (None: random).
    """

    def __init__(self, worker, channel: CommandChannel | None = None, probs_client=None,
                 seed: int | None = None) -> None:
        self.worker = worker
        self.channel = channel
        self.probs_client = probs_client
        self.request_ids: set[str] = set()
        self._seed_source = random.Random(seed)

    @property
    def vocab_size(self) -> int:
        return self.worker.facts().vocab_size

    def _broadcast(self, kind: int, message=None, probs: torch.Tensor | None = None) -> None:
        if self.channel is not None:
            self.channel.send(kind, b"" if message is None else message.SerializeToString(), probs)

    # ---- driver entry points --------------------------------------------------------------
    def add(self, request: engine_pb2.AddRequestsRequest) -> engine_pb2.AddRequestsResponse:
        """Prefill each prompt and sample its first token (all requests or none).

        Raises: ValueError (duplicate/active id, bad params), CapacityError (no slot, too long).
        """
        return self.add_checked(self._checked_add(request))

    def add_checked(self, request: engine_pb2.AddRequestsRequest) -> engine_pb2.AddRequestsResponse:
        """``add`` of a request ``join_call`` has checked and seeded already."""
        start = time.perf_counter()
        self._broadcast(CMD_ADD, request)
        outputs = self._apply_add(request)
        return engine_pb2.AddRequestsResponse(outputs=outputs, forward_ms=elapsed_ms(start))

    def join_call(self, request: engine_pb2.AddRequestsRequest) -> tuple[engine_pb2.AddRequestsRequest, Future | None]:
        """Any thread: hand ``request`` to the worker's multi-step call now running, which
        prefills it between two of its steps (``specdec.vllm_backend.joining``; vLLM engine, no TP
        channel of ours). Returns (the request checked, with its seeds drawn; the future of its
        ``AddRequestsResponse``, or None when no call takes it: then ``add_checked`` the returned request).

        Raises: ValueError (duplicate/active id, bad params), as ``add``.
        """
        request = self._checked_add(request)
        submit = getattr(self.worker, "join_running_call", None)
        if submit is None or self.channel is not None:
            return request, None
        start = time.perf_counter()
        joined = submit([(seq.request_id, list(seq.prompt_token_ids), to_sampling_params(seq.sampling))
                         for seq in request.seqs])
        if joined is None:
            return request, None
        response: Future = Future()

        def on_prefilled(future: Future) -> None:  # in the engine thread, inside the running call
            if future.exception() is not None:
                response.set_exception(future.exception())
                return
            self.request_ids.update(seq.request_id for seq in request.seqs)
            response.set_result(engine_pb2.AddRequestsResponse(
                outputs=[to_seq_output(step) for step in future.result()], forward_ms=elapsed_ms(start)))

        joined.add_done_callback(on_prefilled)
        return request, response

    def _checked_add(self, request: engine_pb2.AddRequestsRequest) -> engine_pb2.AddRequestsRequest:
        """A copy of ``request`` whose ids and sampling are checked and every request seeded."""
        ids = [seq.request_id for seq in request.seqs]
        check_unique_ids(ids)
        active = [rid for rid in ids if rid in self.request_ids]
        if active:
            raise ValueError(f"request ids already active: {active}")
        request = engine_pb2.AddRequestsRequest.FromString(request.SerializeToString())
        for seq in request.seqs:
            to_sampling_params(seq.sampling)  # validate before any rank sees the command
            if not seq.sampling.HasField("seed"):
                seq.sampling.seed = self._seed_source.getrandbits(_SEED_BITS)
        return request

    def verify(self, request: engine_pb2.VerifyRequest, plane: int, on_step=None) -> engine_pb2.VerifyResponse:
        """One verify step (k = 0: decode) of ``request.request_ids`` with their draft tokens;
        ragged rows (``num_draft_tokens``) are verified with their own k_i, feeding k_i + 1
        tokens each (``TargetWorker.verify``); padding past k_i is never read.

        ``on_step``: for a multi-step call (``num_decode_steps`` > 1), called in this thread
        every ``request.stream_interval`` decode steps (0: every step) with one ``SeqOutput`` per
        named row that decoded since the last call, and with ``request.stream_joined`` per
        request that joined the call: its new tokens (``StepCoalescer``).

        Raises: KeyError (unknown id), ValueError / TensorDecodeError (shapes),
        DraftProbsMissingError / DataPlaneUnavailableError (dist plane), CapacityError.
        """
        ids = list(request.request_ids)
        check_unique_ids(ids)
        unknown = [rid for rid in ids if rid not in self.request_ids]
        if unknown:
            raise KeyError(f"unknown request ids: {unknown}")
        draft_ids = self._draft_token_ids(request, len(ids))
        ks = _row_ks(request, len(ids), draft_ids.shape[1])
        _check_draft_ids(ids, draft_ids, ks, self.worker.facts().input_vocab_size)
        _check_decode_steps(request.num_decode_steps, max(ks, default=0), list(request.max_decode_steps), len(ids))
        start = time.perf_counter()
        with _tracer.start_as_current_span("verifier.data_plane_receive"):  # + broadcast to TP ranks
            probs = self._draft_probs(request, plane, ids, draft_ids, ks)
            command = engine_pb2.VerifyRequest()
            command.CopyFrom(request)
            command.ClearField("draft_probs")
            command.has_draft_probs = probs is not None
            self._broadcast(CMD_VERIFY, command, probs)
        data_plane_ms = elapsed_ms(start)
        start = time.perf_counter()
        with _tracer.start_as_current_span("verifier.verify", attributes={"minedraft.batch_size": len(ids),
                                                                          "minedraft.k": int(draft_ids.shape[1])}):
            outputs = self._apply_verify(command, probs, on_step)
        response = engine_pb2.VerifyResponse(step_id=request.step_id, outputs=outputs,
                                             verify_ms=elapsed_ms(start), data_plane_ms=data_plane_ms)
        core = getattr(self.worker, "last_call", None)   # the vLLM worker's engine-core time (CoreTime)
        if core is not None:
            response.engine_core_ms, response.num_engine_steps = core.ms, core.num_steps
        return response

    def release(self, request: engine_pb2.ReleaseRequest) -> int:
        """Free the slots of the active ids among ``request.request_ids``; returns how many."""
        known = [rid for rid in dict.fromkeys(request.request_ids) if rid in self.request_ids]
        command = engine_pb2.ReleaseRequest(request_ids=known)
        if known:
            self._broadcast(CMD_RELEASE, command)
        return self._apply_release(command)

    def shutdown(self) -> None:
        """Tell the other ranks to leave ``follow()``."""
        self._broadcast(CMD_SHUTDOWN)

    # ---- validation helpers (driver) --------------------------------------------------------
    @staticmethod
    def _draft_token_ids(request: engine_pb2.VerifyRequest, batch_size: int) -> torch.Tensor:
        if is_empty_proto(request.draft_token_ids):
            return torch.zeros(batch_size, 0, dtype=torch.int64)
        ids = proto_to_tensor(request.draft_token_ids)
        if ids.dim() != 2 or ids.shape[0] != batch_size or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"draft_token_ids must be int [b={batch_size}, k], got {ids.dtype} {tuple(ids.shape)}")
        return ids.long()

    def _draft_probs(self, request, plane: int, ids: list[str], draft_ids: torch.Tensor, ks: list[int]) -> torch.Tensor | None:
        """[b, k, V] draft probs: inline, or fetched from the plane (checked against the rows'
        k_i, and cut to k columns when the Draft call drafted wider)."""
        if not request.has_draft_probs:
            return None
        k = draft_ids.shape[1]
        if k == 0:
            raise ValueError("has_draft_probs is set but there are no draft tokens (k = 0)")
        if plane == engine_pb2.DATA_PLANE_DIST:
            probs = self.probs_client.fetch(request.draft_step_id, ids, ks)
            probs = probs[:, :k] if probs.dim() == 3 and probs.shape[1] > k else probs
        else:
            probs = proto_to_tensor(request.draft_probs)
        expected = (len(ids), k, self.vocab_size)
        if tuple(probs.shape) != expected or probs.dtype not in PROBS_DTYPES:
            raise ValueError(f"draft_probs must be float {list(expected)}, got {probs.dtype} {list(probs.shape)}")
        if plane != engine_pb2.DATA_PLANE_DIST:  # client-sent; the dist plane's come from our drafter
            _check_probs_values(ids, probs, draft_ids, ks)
        return probs

    # ---- applied on every rank ------------------------------------------------------------
    def _apply_add(self, request: engine_pb2.AddRequestsRequest) -> list[engine_pb2.SeqOutput]:
        """Prefill every new request (batched, all or nothing: ``TargetWorker.add_requests``)."""
        steps = self.worker.add_requests([(seq.request_id, list(seq.prompt_token_ids), to_sampling_params(seq.sampling))
                                          for seq in request.seqs])
        self.request_ids.update(seq.request_id for seq in request.seqs)
        return [to_seq_output(step) for step in steps]

    def _apply_verify(self, command: engine_pb2.VerifyRequest, probs, on_step=None) -> list[engine_pb2.SeqOutput]:
        ids = list(command.request_ids)
        draft_ids = self._draft_token_ids(command, len(ids))
        ks = _row_ks(command, len(ids), draft_ids.shape[1])
        if command.num_decode_steps > 1:
            hook = None if on_step is None else StepCoalescer(on_step, command.stream_interval, command.num_decode_steps,
                                                              frozenset(ids), command.stream_joined,
                                                              command.stream_interval_ms)
            return [to_seq_output(step) for step in self.worker.decode(ids, command.num_decode_steps, hook,
                                                                         list(command.max_decode_steps) or None)]
        steps = self.worker.verify(ids, [row[:k_i] for row, k_i in zip(draft_ids.tolist(), ks)], probs)
        return [to_seq_output(step) for step in steps]

    def _apply_release(self, command: engine_pb2.ReleaseRequest) -> int:
        for request_id in command.request_ids:
            self.worker.release(request_id)
            self.request_ids.discard(request_id)
        return len(command.request_ids)

    # ---- ranks > 0 ----------------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks > 0: apply the driver's commands until SHUTDOWN."""
        while True:
            kind, payload, probs_code = self.channel.receive()
            if kind == CMD_SHUTDOWN:
                return
            try:
                self._apply_command(kind, payload, probs_code)
            except Exception:  # the driver raised the same error and reported it
                logger.exception("command %d failed on this rank", kind)

    def _apply_command(self, kind: int, payload: bytes, probs_code: int) -> None:
        if kind == CMD_ADD:
            self._apply_add(engine_pb2.AddRequestsRequest.FromString(payload))
        elif kind == CMD_VERIFY:
            command = engine_pb2.VerifyRequest.FromString(payload)
            k = self._draft_token_ids(command, len(command.request_ids)).shape[1]
            probs = self.channel.receive_probs(probs_code, (len(command.request_ids), k, self.vocab_size))
            self._apply_verify(command, probs)
        elif kind == CMD_RELEASE:
            self._apply_release(engine_pb2.ReleaseRequest.FromString(payload))
        else:
            raise ValueError(f"unknown command kind {kind}")


def _row_ks(request: engine_pb2.VerifyRequest, batch_size: int, k: int) -> list[int]:
    """k_i of each row (``num_draft_tokens``; empty: k for all). Raises ValueError unless b values in [0, k]."""
    if not request.num_draft_tokens:
        return [k] * batch_size
    ks = list(request.num_draft_tokens)
    if len(ks) != batch_size or any(not 0 <= k_i <= k for k_i in ks):
        raise ValueError(f"num_draft_tokens must be {batch_size} values in [0, k={k}], got {ks}")
    return ks


def _check_draft_ids(request_ids: list[str], draft_ids: torch.Tensor, ks: list[int], vocab_size: int) -> None:
    """Raise ValueError naming the field and the request unless each row's first k_i draft ids
    (the real drafts; the rest is padding) lie in [0, vocab_size)."""
    for request_id, row, k_i in zip(request_ids, draft_ids.tolist(), ks):
        bad = [t for t in row[:k_i] if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"draft_token_ids of {request_id!r} must lie in [0, {vocab_size}) at positions "
                             f"< num_draft_tokens={k_i}, got {bad}")


def _check_probs_values(request_ids: list[str], probs: torch.Tensor, draft_ids: torch.Tensor, ks: list[int]) -> None:
    """Raise ValueError naming ``draft_probs`` and the request unless each real row (positions
    < k_i) is finite, non-negative and gives its own draft token a positive probability (the
    rejection sampler's q(d) > 0: a draft token was sampled from q). Padding is not read."""
    for row, (request_id, k_i) in enumerate(zip(request_ids, ks)):
        q = probs[row, :k_i].float()                                        # [k_i, V]
        q_draft = q.gather(-1, draft_ids[row, :k_i].unsqueeze(-1).to(q.device))
        if not bool(torch.isfinite(q).all()) or bool((q < 0).any()) or bool((q_draft <= 0).any()):
            raise ValueError(f"draft_probs of {request_id!r} must be finite and >= 0 with q(draft token) > 0 "
                             f"at positions < num_draft_tokens={k_i}")


def _check_decode_steps(num_decode_steps: int, k: int, max_decode_steps: list[int], num_rows: int) -> None:
    """``VerifyRequest.num_decode_steps``: at most ``MAX_DECODE_STEPS``, and > 1 only without
    drafts; ``max_decode_steps``: empty, or with ``num_decode_steps`` > 1 one cap >= 1 per row."""
    if num_decode_steps > MAX_DECODE_STEPS:
        raise ValueError(f"num_decode_steps: must be <= {MAX_DECODE_STEPS}, got {num_decode_steps}")
    if num_decode_steps > 1 and k > 0:
        raise ValueError(f"num_decode_steps: > 1 only for plain decoding (k = 0), got k = {k}")
    if max_decode_steps and num_decode_steps <= 1:
        raise ValueError(f"max_decode_steps: only with num_decode_steps > 1, got {num_decode_steps}")
    decode_step_caps(max(num_decode_steps, 1), max_decode_steps, num_rows)   # ValueError naming max_decode_steps
