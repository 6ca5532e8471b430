"""End to end: verifier, drafter, coordinator and gateway as real processes on loopback.

Tiny random Llama models (vocab 49152 with the real SmolLM2 tokenizer next to them) stand in for
target and draft, so the whole stack starts in seconds. Checked: greedy ``psd`` (and ``sd``)
output equals ``ar`` output with more than 2m concurrent requests of different lengths (both
batches fill, requests finish and waiting ones take their slots); aborts mid-stream (Abort RPC
and client cancel) free the KV slots in drafter and verifier; the gateway reports SERVING only
after every service is warm; a service dying at start-up fails the launch with its log tail
and leaves no process behind.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from minedraft.client import GenerationResult, MineDraftClient, build_request
from minedraft.launcher import Stack, StackError, health_status
from minedraft.stack import StackConfig, free_loopback_ports as _free_ports
from minedraft.v1 import coordinator_pb2, coordinator_pb2_grpc, engine_pb2, engine_pb2_grpc

M = 2  # max_num_seqs: requests per batch; psd runs 2m
NUM_REQUESTS = 3 * M + 1
MAX_MODEL_LEN = 256
SERVING = health_pb2.HealthCheckResponse.SERVING
PROMPTS = ["Tell me a story.", "What is 2+2?", "Name three colors.", "Hi", "Explain gravity briefly.",
           "Write a haiku about rain.", "List prime numbers.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(target_dir, draft_dir): tiny random Llamas + the SmolLM2 tokenizer in each."""
    from specdec.models.gguf import packaged_gguf_path
    from transformers import AutoTokenizer

    from conftest import _build_tiny_llama

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(packaged_gguf_path()),
                                              gguf_file=os.path.basename(packaged_gguf_path()))
    dirs = []
    for name, seed, num_layers in (("target", 0, 2), ("draft", 1, 1)):
        path = str(tmp_path_factory.mktemp(name))
        model = _build_tiny_llama(num_layers=num_layers, vocab_size=49152, seed=seed,
                                  max_position_embeddings=MAX_MODEL_LEN)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    return tuple(dirs)


def _config(mode: str, target: str, draft: str, runs_dir: str, **overrides) -> StackConfig:
    gateway, coordinator, drafter, verifier, dist = _free_ports(5)
    return StackConfig(mode=mode, num_speculative_tokens=3, max_num_seqs=M, target=target, draft=draft,
                       max_model_len=MAX_MODEL_LEN, gateway_port=gateway, coordinator_port=coordinator,
                       drafter_port=drafter, verifier_port=verifier, dist_port=dist, runs_dir=runs_dir,
                       startup_timeout_s=300, **overrides)


def _generate_all(cfg: StackConfig) -> list[GenerationResult]:
    """NUM_REQUESTS greedy chat requests at once, with different max_tokens."""
    def one(i: int) -> GenerationResult:
        with MineDraftClient(f"{cfg.host}:{cfg.gateway_port}", timeout_s=240) as client:
            result = client.generate(messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     max_tokens=6 + 5 * i, temperature=0, request_id=f"e2e-{i}")
            assert result.finish_reason in ("stop", "length")
            return result

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, range(NUM_REQUESTS)))


@pytest.fixture(scope="module")
def ar_outputs(model_dirs, tmp_path_factory):
    target, draft = model_dirs
    with Stack(_config("ar", target, draft, str(tmp_path_factory.mktemp("runs")))) as stack:
        stack.start(target, log=lambda line: None)
        return [r.token_ids for r in _generate_all(stack.cfg)]


def _status(cfg: StackConfig) -> coordinator_pb2.StatusResponse:
    with grpc.insecure_channel(f"{cfg.host}:{cfg.coordinator_port}") as channel:
        return coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(coordinator_pb2.StatusRequest(), timeout=30)


def _engine_infos(cfg: StackConfig, verifier: bool = True) -> list[engine_pb2.EngineInfo]:
    """[drafter's, verifier's] ``EngineInfo`` (without ``verifier``: the drafter's alone)."""
    infos = []
    engines = ((engine_pb2_grpc.DrafterStub, cfg.drafter_port), (engine_pb2_grpc.VerifierStub, cfg.verifier_port))
    for stub_cls, port in engines[:2 if verifier else 1]:
        with grpc.insecure_channel(f"{cfg.host}:{port}") as channel:
            infos.append(stub_cls(channel).GetInfo(engine_pb2.EngineInfoRequest(), timeout=30))
    return infos


def _wait_slots_free(cfg: StackConfig, timeout_s: float = 30.0, verifier: bool = True) -> list[engine_pb2.EngineInfo]:
    """``_engine_infos`` once every slot is free (or at ``timeout_s``: releases run at the step
    loop's next sync, after the request's end reached its caller)."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = _engine_infos(cfg, verifier)
        if all(i.num_free_slots == i.max_num_seqs and not i.request_ids for i in infos) or time.monotonic() > deadline:
            return infos
        time.sleep(0.2)


@pytest.fixture(scope="module")
def psd_stack(model_dirs, tmp_path_factory):
    """A running psd stack; records every gateway health transition seen during start-up."""
    target, draft = model_dirs
    # a long drain grace: its last test's in-flight streams finish within it on a loaded machine
    cfg = _config("psd", target, draft, str(tmp_path_factory.mktemp("runs")), grace_s=30.0, stop_timeout_s=60.0)
    violations: list[str] = []
    is_starting = threading.Event()
    is_starting.set()

    def watch_gateway() -> None:  # whenever the gateway says SERVING, every service must be warm
        while is_starting.is_set():
            if health_status(f"{cfg.host}:{cfg.gateway_port}", timeout_s=1) == SERVING:
                for port in (cfg.verifier_port, cfg.drafter_port, cfg.coordinator_port):
                    if health_status(f"{cfg.host}:{port}", timeout_s=1) != SERVING:
                        violations.append(f"gateway SERVING while port {port} is not")
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_gateway)
    watcher.start()
    with Stack(cfg) as stack:
        try:
            stack.start(target, log=lambda line: None)
        finally:
            is_starting.clear()
            watcher.join()
        yield stack, violations


def test_gateway_serving_only_after_all_services_are_warm(psd_stack):
    stack, violations = psd_stack
    assert violations == []
    assert health_status(f"{stack.cfg.host}:{stack.cfg.gateway_port}") == SERVING


@pytest.mark.parametrize("mode", ["psd", "sd", "psd-dp2"])
def test_speculative_output_equals_autoregressive_at_temperature_0(mode, psd_stack, model_dirs, ar_outputs,
                                                                   tmp_path_factory):
    """``psd-dp2``: the drafter's engine as two processes (``--draft-processes 2``)."""
    if mode == "psd":
        results, status = _generate_all(psd_stack[0].cfg), _status(psd_stack[0].cfg)
        assert status.num_parallel_steps > 0  # drafting one batch while verifying the other
    else:
        target, draft = model_dirs
        mode, _, processes = mode.partition("-dp")
        cfg = _config(mode, target, draft, str(tmp_path_factory.mktemp("runs")), draft_processes=int(processes or 1))
        with Stack(cfg) as stack:
            stack.start(target, log=lambda line: None)
            results, status = _generate_all(stack.cfg), _status(stack.cfg)
            drafter = _wait_slots_free(stack.cfg)[0]
            with open(os.path.join(stack.run_dir, "drafter.log")) as f:
                is_split = f"draft engine in {processes} processes" in f.read()
        assert drafter.max_num_seqs == cfg.num_engine_slots and not drafter.request_ids
        assert is_split == bool(processes)
    assert status.effective_mode == mode and status.num_draft_tokens > 0
    assert sum(r.usage.num_drafts for r in results) > 0
    assert len({len(o) for o in ar_outputs}) > 1  # requests finished at different steps
    assert [r.token_ids for r in results] == ar_outputs


@pytest.mark.parametrize("how", ["abort_rpc", "client_cancel"])
def test_abort_mid_stream_frees_kv_slots(psd_stack, how):
    stack, _ = psd_stack
    cfg = stack.cfg
    with MineDraftClient(f"{cfg.host}:{cfg.gateway_port}", timeout_s=120) as client:
        request_id = f"abort-{how}"
        stream = client.stream(build_request("Count to one hundred.", request_id=request_id,
                                             max_tokens=MAX_MODEL_LEN - 40, temperature=0, ignore_eos=True))
        first = next(stream)
        assert first.WhichOneof("response") == "chunk"
        busy = _engine_infos(cfg)
        assert all(request_id in info.request_ids for info in busy)
        if how == "abort_rpc":
            assert client.abort(request_id) is True
            final = [r for r in stream if r.WhichOneof("response") == "complete"]
            assert final and final[0].complete.finish_reason == "abort"
        else:
            stream.close()
    infos = _wait_slots_free(cfg)
    for info in infos:
        assert info.num_free_slots == info.max_num_seqs, info
        assert list(info.request_ids) == []


def test_service_dying_at_start_fails_launch_without_orphans(model_dirs, tmp_path):
    _, draft = model_dirs
    cfg = _config("ar", str(tmp_path / "missing-model"), draft, str(tmp_path / "runs"))
    stack = Stack(cfg)
    with pytest.raises(StackError, match="exited with code") as info:
        stack.start(str(tmp_path / "missing-model"), log=lambda line: None)
    processes = [s.process for s in stack.services]
    stack.stop()
    assert "last lines of" in str(info.value)
    assert all(p.poll() is not None for p in processes)
    assert os.path.isfile(os.path.join(stack.run_dir, "verifier.log"))


def test_stop_drains_in_flight_requests_front_to_back(psd_stack):
    """``Stack.stop`` (``minedraft up`` on SIGTERM) lets streams running at the signal finish: the
    gateway drains first while the coordinator and engines still serve (before: every engine got
    SIGTERM at once and in-flight requests failed with UNAVAILABLE). Stops the module's stack: last."""
    stack, _ = psd_stack
    cfg = stack.cfg
    num_tokens = 48

    def one(i: int) -> GenerationResult:
        with MineDraftClient(f"{cfg.host}:{cfg.gateway_port}", timeout_s=120) as client:
            return client.generate(prompt=PROMPTS[i], max_tokens=num_tokens, temperature=0, ignore_eos=True)

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(one, i) for i in range(2)]
        deadline = time.monotonic() + 60
        while _status(cfg).num_running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        stack.stop()
        results = [r.result(timeout=60) for r in running]
    assert [(r.finish_reason, len(r.token_ids)) for r in results] == [("length", num_tokens)] * 2
