"""drafter_svc + verifier_svc as real processes on loopback, against the in-process workers.

One drafter and one verifier (both with the dist data plane configured, so each request can pick
INLINE or DIST) are started once for the module on tiny models saved to a tmp dir. The in-process
minedraft.serving lifecycle tests are in test_serving_lifecycle.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from conftest import _build_tiny_llama
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from minedraft.probes import free_loopback_ports
from minedraft.serving import wait_for_serving_sync
from minedraft.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from engine_svc.tensor_proto import tensor_to_proto

MAX_NUM_SEQS = 4
K = 3
NUM_STEPS = 4
START_TIMEOUT_S = 180
SEQS = [  # (id suffix, prompt, sampling)
    ("greedy", [5, 6, 7, 8], common_pb2.SamplingParams(temperature=0.0, max_tokens=64)),
    ("sampled", [9, 10, 11], common_pb2.SamplingParams(temperature=0.8, top_k=40, seed=1234, max_tokens=64)),
]


def free_port() -> int:
    return free_loopback_ports(1)[0]   # below the ephemeral range (minedraft.probes)


def first_health_status(target: str, timeout_s: float) -> int:
    """Poll health Check until the server answers; return that first status."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
            except grpc.RpcError:
                time.sleep(0.05)
    raise TimeoutError(target)


def _perturbed(model, scale: float = 0.1):
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.model.layers[-1].parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    return model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target, draft = str(root / "target"), str(root / "draft")
    _build_tiny_llama(seed=0).save_pretrained(target)
    _perturbed(_build_tiny_llama(seed=0)).save_pretrained(draft)  # close to the target: some drafts accepted
    return target, draft


@pytest.fixture(scope="module")
def services(model_dirs, tmp_path_factory):
    target, draft = model_dirs
    logs = tmp_path_factory.mktemp("logs")
    common = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "128", "--num-threads", "1",
              "--data-plane", "dist", "--dist-port", str(free_port()), "--grace-s", "2",
              "--max-prefill-tokens", "4096"]   # batched prefill, as on CUDA (CPU default: one per forward)
    ports = {"drafter": free_port(), "verifier": free_port()}
    argv = {
        "verifier": ["-m", "verifier_svc", "--model", target, "--port", str(ports["verifier"])],
        "drafter": ["-m", "drafter_svc", "--draft", draft, "--model", target, "--port", str(ports["drafter"])],
    }
    procs = {name: subprocess.Popen([sys.executable, *args, *common], stdout=open(logs / f"{name}.log", "w"),
                                    stderr=subprocess.STDOUT) for name, args in argv.items()}
    targets = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    first = {name: first_health_status(t, START_TIMEOUT_S) for name, t in targets.items()}
    for t in targets.values():
        wait_for_serving_sync(t, START_TIMEOUT_S)
    channels = {name: grpc.insecure_channel(t) for name, t in targets.items()}
    yield {
        "first_status": first, "targets": targets, "procs": procs,
        "drafter": engine_pb2_grpc.DrafterStub(channels["drafter"]),
        "verifier": engine_pb2_grpc.VerifierStub(channels["verifier"]),
    }
    for channel in channels.values():
        channel.close()
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes = {name: proc.wait(timeout=30) for name, proc in procs.items()}
    assert codes == {"drafter": 0, "verifier": 0}, [(logs / f"{n}.log").read_text()[-3000:] for n in codes]


def seq_inits(tag: str) -> list[engine_pb2.SeqInit]:
    return [engine_pb2.SeqInit(request_id=f"{tag}-{name}", prompt_token_ids=prompt, sampling=sampling)
            for name, prompt, sampling in SEQS]


def run_grpc(services, tag: str, plane: int) -> list[list[tuple[list[int], int]]]:
    """Add, then NUM_STEPS draft+verify steps through gRPC; returns per-step (tokens, accepted)."""
    drafter, verifier = services["drafter"], services["verifier"]
    seqs = seq_inits(tag)
    ids = [s.request_id for s in seqs]
    first = verifier.AddRequests(engine_pb2.AddRequestsRequest(seqs=seqs))
    drafter.AddRequests(engine_pb2.AddRequestsRequest(seqs=seqs))
    committed = {s.request_id: list(s.prompt_token_ids) + list(o.token_ids) for s, o in zip(seqs, first.outputs)}
    known = {rid: 0 for rid in ids}  # what the drafter has seen of each committed sequence
    steps = [[(list(o.token_ids), o.num_accepted) for o in first.outputs]]
    for step in range(NUM_STEPS):
        draft = drafter.Draft(engine_pb2.DraftRequest(
            step_id=step, num_speculative_tokens=K, data_plane=plane,
            seqs=[engine_pb2.DraftSeq(request_id=r, start_position=known[r], token_ids=committed[r][known[r]:])
                  for r in ids]))
        assert draft.has_draft_probs and (len(draft.draft_probs.data) > 0) == (plane == engine_pb2.DATA_PLANE_INLINE)
        verify = verifier.Verify(engine_pb2.VerifyRequest(
            step_id=step, request_ids=ids, draft_token_ids=draft.draft_token_ids, draft_probs=draft.draft_probs,
            has_draft_probs=draft.has_draft_probs, data_plane=plane, draft_step_id=step))
        assert verify.data_plane_ms > 0 and verify.verify_ms > 0
        # each service's own wall time on the call covers its engine's compute and data plane
        assert verify.service_ms >= verify.verify_ms + verify.data_plane_ms and draft.service_ms >= draft.draft_ms > 0
        assert verify.service_start_s > draft.service_start_s > 0   # the handlers' starts, in call order
        for rid, out in zip(ids, verify.outputs):
            known[rid] = len(committed[rid])
            committed[rid] += list(out.token_ids)
        steps.append([(list(o.token_ids), o.num_accepted) for o in verify.outputs])
    for stub in (drafter, verifier):
        assert stub.ReleaseRequests(engine_pb2.ReleaseRequest(request_ids=ids)).num_released == len(ids)
    return steps


def run_in_process(model_dirs) -> list[list[tuple[list[int], int]]]:
    """The same protocol with specdec workers called directly (the reference)."""
    from engine_svc.service import to_sampling_params
    from specdec.config import CacheConfig, ModelConfig
    from specdec.engine.runner import ModelRunner
    from specdec.engine.worker import DraftWorker, TargetWorker

    cache = CacheConfig(max_num_seqs=MAX_NUM_SEQS, max_model_len=128)
    target = TargetWorker(ModelRunner(ModelConfig(model=model_dirs[0]), cache))
    drafter = DraftWorker(ModelRunner(ModelConfig(model=model_dirs[1]), cache), target.runner.vocab_size)
    ids, committed, steps = [], {}, [[]]
    for seq in seq_inits("ref"):
        params = to_sampling_params(seq.sampling)
        out = target.add_request(seq.request_id, list(seq.prompt_token_ids), params)
        drafter.add_request(seq.request_id, list(seq.prompt_token_ids), params)
        ids.append(seq.request_id)
        committed[seq.request_id] = list(seq.prompt_token_ids) + out.token_ids
        steps[0].append((out.token_ids, out.num_accepted))
    for _ in range(NUM_STEPS):
        tokens, probs = drafter.draft(ids, [(0, committed[r]) for r in ids], K)
        outs = target.verify(ids, tokens, probs)
        for rid, out in zip(ids, outs):
            committed[rid] += out.token_ids
        steps.append([(o.token_ids, o.num_accepted) for o in outs])
    return steps


def test_health_is_not_serving_until_warm_up_then_serving(services):
    assert services["first_status"] == {"drafter": health_pb2.HealthCheckResponse.NOT_SERVING,
                                        "verifier": health_pb2.HealthCheckResponse.NOT_SERVING}
    for name, service in (("drafter", "minedraft.v1.Drafter"), ("verifier", "minedraft.v1.Verifier")):
        with grpc.insecure_channel(services["targets"][name]) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            reply = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            assert service in {s.name for s in reply.list_services_response.service}


def test_grpc_round_trip_equals_in_process_workers(services, model_dirs):
    via_grpc = run_grpc(services, "inline", engine_pb2.DATA_PLANE_INLINE)
    reference = run_in_process(model_dirs)
    assert via_grpc == reference
    assert sum(acc for step in via_grpc for _, acc in step) > 0  # drafts were accepted somewhere


def test_inline_and_dist_data_planes_give_identical_tokens(services):
    inline = run_grpc(services, "plane-inline", engine_pb2.DATA_PLANE_INLINE)
    dist = run_grpc(services, "plane-dist", engine_pb2.DATA_PLANE_DIST)
    assert inline == dist


def test_release_frees_slots_and_info_lists_requests(services):
    verifier, drafter = services["verifier"], services["drafter"]
    before = verifier.GetInfo(engine_pb2.EngineInfoRequest())
    assert before.num_free_slots == MAX_NUM_SEQS and before.vocab_size == 128 and before.eos_token_ids == [2]
    seqs = seq_inits("slots")
    for stub in (verifier, drafter):
        stub.AddRequests(engine_pb2.AddRequestsRequest(seqs=seqs))
        info = stub.GetInfo(engine_pb2.EngineInfoRequest())
        assert info.num_free_slots == MAX_NUM_SEQS - len(seqs)
        assert list(info.request_ids) == sorted(s.request_id for s in seqs)
        ids = [s.request_id for s in seqs] + ["never-added"]
        assert stub.ReleaseRequests(engine_pb2.ReleaseRequest(request_ids=ids)).num_released == len(seqs)
        assert stub.GetInfo(engine_pb2.EngineInfoRequest()).num_free_slots == MAX_NUM_SEQS


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_errors_map_to_status_codes(services):
    verifier, drafter = services["verifier"], services["drafter"]
    assert _code(lambda: drafter.Draft(engine_pb2.DraftRequest(
        num_speculative_tokens=2, seqs=[engine_pb2.DraftSeq(request_id="ghost", token_ids=[1])]))) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: verifier.Verify(engine_pb2.VerifyRequest(request_ids=["ghost"]))) == grpc.StatusCode.NOT_FOUND
    too_many = [engine_pb2.SeqInit(request_id=f"cap-{i}", prompt_token_ids=[3, 4]) for i in range(MAX_NUM_SEQS + 1)]
    for stub in (verifier, drafter):
        assert _code(lambda: stub.AddRequests(engine_pb2.AddRequestsRequest(seqs=too_many))) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.GetInfo(engine_pb2.EngineInfoRequest()).num_free_slots == MAX_NUM_SEQS  # all or none
        one_too_long = [engine_pb2.SeqInit(request_id="ok-1", prompt_token_ids=[3, 4]),
                        engine_pb2.SeqInit(request_id="long-1", prompt_token_ids=[3] * 129)]
        assert _code(lambda: stub.AddRequests(engine_pb2.AddRequestsRequest(seqs=one_too_long))) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        repeated = [engine_pb2.SeqInit(request_id="twice", prompt_token_ids=[3, 4])] * 2
        assert _code(lambda: stub.AddRequests(engine_pb2.AddRequestsRequest(seqs=repeated))) == \
            grpc.StatusCode.INVALID_ARGUMENT
        info = stub.GetInfo(engine_pb2.EngineInfoRequest())
        assert info.num_free_slots == MAX_NUM_SEQS  # a batched prefill that fails adds nothing
    seqs = seq_inits("bad")
    verifier.AddRequests(engine_pb2.AddRequestsRequest(seqs=seqs))
    ids = [s.request_id for s in seqs]
    bad_shape = tensor_to_proto(torch.zeros(len(ids) + 1, 2, dtype=torch.int32))
    assert _code(lambda: verifier.Verify(engine_pb2.VerifyRequest(request_ids=ids, draft_token_ids=bad_shape))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    bad_probs = engine_pb2.VerifyRequest(request_ids=ids, draft_token_ids=tensor_to_proto(torch.zeros(2, 2, dtype=torch.int32)),
                                         draft_probs=tensor_to_proto(torch.zeros(2, 2, 7)), has_draft_probs=True,
                                         data_plane=engine_pb2.DATA_PLANE_INLINE)
    assert _code(lambda: verifier.Verify(bad_probs)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: verifier.Verify(engine_pb2.VerifyRequest(
        request_ids=ids, draft_token_ids=tensor_to_proto(torch.zeros(2, 2, dtype=torch.int32)), has_draft_probs=True,
        data_plane=engine_pb2.DATA_PLANE_DIST, draft_step_id=987654))) == grpc.StatusCode.NOT_FOUND
    decode = verifier.Verify(engine_pb2.VerifyRequest(request_ids=ids))  # k = 0 still works after errors
    assert [len(o.token_ids) for o in decode.outputs] == [1, 1]
    verifier.ReleaseRequests(engine_pb2.ReleaseRequest(request_ids=ids))


def test_ragged_draft_k_must_be_the_largest_k_i_and_verify_k_i_must_match_the_draft(services):
    """A Draft whose num_speculative_tokens exceeds every row's num_draft_tokens is refused
    (the response is padded to k: an unbounded k was an unbounded allocation); a DIST Verify
    whose num_draft_tokens differ from the Draft's is refused; neither leaks a slot."""
    drafter, verifier = services["drafter"], services["verifier"]
    seqs = seq_inits("ragged-bad")
    ids = [s.request_id for s in seqs]
    first = verifier.AddRequests(engine_pb2.AddRequestsRequest(seqs=seqs))
    drafter.AddRequests(engine_pb2.AddRequestsRequest(seqs=seqs))
    committed = [list(s.prompt_token_ids) + list(o.token_ids) for s, o in zip(seqs, first.outputs)]

    def draft_request(step: int, k: int, ks: list[int]) -> engine_pb2.DraftRequest:
        return engine_pb2.DraftRequest(step_id=step, num_speculative_tokens=k, data_plane=engine_pb2.DATA_PLANE_DIST,
                                       seqs=[engine_pb2.DraftSeq(request_id=r, token_ids=c, num_draft_tokens=k_i)
                                             for r, c, k_i in zip(ids, committed, ks)])

    for k in (K + 1, 1 << 30):
        assert _code(lambda: drafter.Draft(draft_request(7000, k, [1, K]))) == grpc.StatusCode.INVALID_ARGUMENT

    def verify(step: int, ks: list[int]) -> engine_pb2.VerifyResponse:
        draft = drafter.Draft(draft_request(step, K, [1, K]))
        assert list(draft.num_draft_tokens) == [1, K]
        return verifier.Verify(engine_pb2.VerifyRequest(
            step_id=step, request_ids=ids, draft_token_ids=draft.draft_token_ids, num_draft_tokens=ks,
            has_draft_probs=True, data_plane=engine_pb2.DATA_PLANE_DIST, draft_step_id=step))

    # row 0 would read padding as drafts (the dist plane hands a step's probs out once: draft again)
    assert _code(lambda: verify(7001, [K, K])) == grpc.StatusCode.INVALID_ARGUMENT
    for row0 in ([-1, 5], [5, 1 << 20]):  # a padding id inside k_i, an id past the vocab: named, nothing changed
        with pytest.raises(grpc.RpcError) as info:
            verifier.Verify(engine_pb2.VerifyRequest(
                step_id=7003, request_ids=ids, num_draft_tokens=[2, 0],
                draft_token_ids=tensor_to_proto(torch.tensor([row0, [-1, -1]], dtype=torch.int32))))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft_token_ids" in info.value.details() and ids[0] in info.value.details()
    outputs = verify(7002, [1, K]).outputs
    assert [o.num_accepted <= k_i for o, k_i in zip(outputs, [1, K])] == [True, True]
    for stub in (drafter, verifier):
        assert stub.ReleaseRequests(engine_pb2.ReleaseRequest(request_ids=ids)).num_released == len(ids)
        assert stub.GetInfo(engine_pb2.EngineInfoRequest()).num_free_slots == MAX_NUM_SEQS


def test_inline_draft_probs_must_be_a_distribution_that_drafted_its_tokens(services):
    """Client-sent draft_probs with NaN, a negative value, or q(draft token) = 0 at a real position
    are INVALID_ARGUMENT naming draft_probs and the request (the sampler would emit garbage or
    always accept); padding past k_i is not checked; the request still verifies afterwards."""
    from conftest import TINY_VOCAB_SIZE

    verifier = services["verifier"]
    seqs = seq_inits("probs-bad")
    ids = [s.request_id for s in seqs]
    verifier.AddRequests(engine_pb2.AddRequestsRequest(seqs=seqs))
    drafts = torch.tensor([[5, 6], [7, -1]], dtype=torch.int32)

    def verify(probs: torch.Tensor) -> engine_pb2.VerifyResponse:
        return verifier.Verify(engine_pb2.VerifyRequest(
            request_ids=ids, draft_token_ids=tensor_to_proto(drafts), num_draft_tokens=[2, 1],
            draft_probs=tensor_to_proto(probs), has_draft_probs=True, data_plane=engine_pb2.DATA_PLANE_INLINE))

    good = torch.full((2, 2, TINY_VOCAB_SIZE), 1.0 / TINY_VOCAB_SIZE)
    good[1, 1] = float("nan")                                  # padding (k_1 = 1): never read
    for row, pos, value in ((0, 1, float("nan")), (1, 0, -0.5)):
        bad = good.clone()
        bad[row, pos, 9] = value
        with pytest.raises(grpc.RpcError) as info:
            verify(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft_probs" in info.value.details() and ids[row] in info.value.details()
    zero_q = good.clone()
    zero_q[0, 1, 6] = 0.0                                      # q(d_2) = 0 for row 0's drafted token 6
    assert _code(lambda: verify(zero_q)) == grpc.StatusCode.INVALID_ARGUMENT
    outputs = verify(good).outputs
    assert [o.num_accepted <= k_i for o, k_i in zip(outputs, [2, 1])] == [True, True]
    verifier.ReleaseRequests(engine_pb2.ReleaseRequest(request_ids=ids))
