"""The drafter and verifier engines over the IPC data plane (CPU twin of CUDA IPC) give the
same tokens as inline draft probs: DrafterServicer publishes, VerifierEngine fetches (in process)."""

from __future__ import annotations

import uuid

import pytest
import torch
from conftest import _build_tiny_llama

from drafter_svc.servicer import DrafterServicer
from minedraft.v1 import common_pb2, engine_pb2
from specdec.config import CacheConfig, ModelConfig
from specdec.dataplane.ipc import IpcPlaneConfig, IpcProbsClient, IpcProbsServer
from specdec.engine.runner import ModelRunner
from specdec.sample.sampling import SamplingParams
from specdec.engine.worker import DraftWorker, TargetWorker
from verifier_svc.engine import VerifierEngine

K, NUM_STEPS = 3, 4
PROMPTS = {"s1": [5, 6, 7, 8], "s2": [9, 10, 11], "g": [12, 13, 14, 15, 16]}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target, draft = str(root / "target"), str(root / "draft")
    _build_tiny_llama(seed=0).save_pretrained(target)
    model = _build_tiny_llama(seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for param in model.model.layers[-1].parameters():  # close to the target: some drafts accepted
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(draft)
    return target, draft


def _sampling(rid: str) -> common_pb2.SamplingParams:
    if rid == "g":
        return common_pb2.SamplingParams(temperature=0.0, max_tokens=64)
    return common_pb2.SamplingParams(temperature=1.0, seed=len(rid) + ord(rid[-1]), max_tokens=64)


def _run(model_dirs, plane: int, server=None, client=None) -> list[list[tuple[list[int], int]]]:
    target, draft = model_dirs
    cache = CacheConfig(max_num_seqs=4, max_model_len=128)
    drafter = DrafterServicer("draft", plane, server)
    drafter.attach(DraftWorker(ModelRunner(ModelConfig(model=draft), cache), seed=0))
    engine = VerifierEngine(TargetWorker(ModelRunner(ModelConfig(model=target), cache), seed=0), None, client, seed=0)
    ids = list(PROMPTS)
    first = engine.add(engine_pb2.AddRequestsRequest(seqs=[
        engine_pb2.SeqInit(request_id=r, prompt_token_ids=PROMPTS[r], sampling=_sampling(r)) for r in ids]))
    drafter._add_all([(r, PROMPTS[r], SamplingParams(temperature=_sampling(r).temperature,
                                                     seed=_sampling(r).seed if r != "g" else None)) for r in ids])
    committed = {r: PROMPTS[r] + list(o.token_ids) for r, o in zip(ids, first.outputs)}
    known = {r: 0 for r in ids}
    steps = []
    for step in range(NUM_STEPS):
        draft_response = drafter._draft(engine_pb2.DraftRequest(
            step_id=step, num_speculative_tokens=K, data_plane=plane,
            seqs=[engine_pb2.DraftSeq(request_id=r, start_position=known[r], token_ids=committed[r][known[r]:])
                  for r in ids]), plane)
        assert draft_response.has_draft_probs
        assert (len(draft_response.draft_probs.data) > 0) == (plane == engine_pb2.DATA_PLANE_INLINE)
        verify = engine.verify(engine_pb2.VerifyRequest(
            step_id=step, request_ids=ids, draft_token_ids=draft_response.draft_token_ids,
            draft_probs=draft_response.draft_probs, has_draft_probs=True, data_plane=plane, draft_step_id=step), plane)
        for r, out in zip(ids, verify.outputs):
            known[r] = len(committed[r])
            committed[r] += list(out.token_ids)
        steps.append([(list(o.token_ids), o.num_accepted) for o in verify.outputs])
    return steps


def test_ipc_plane_gives_the_tokens_of_inline_probs(model_dirs):
    torch.set_num_threads(1)
    inline = _run(model_dirs, engine_pb2.DATA_PLANE_INLINE)
    name = f"test-{uuid.uuid4().hex[:12]}"
    server = IpcProbsServer(IpcPlaneConfig(name=name, num_slots=2, max_batch_size=4))
    try:
        via_ipc = _run(model_dirs, engine_pb2.DATA_PLANE_DIST, server, IpcProbsClient(IpcPlaneConfig(name=name)))
    finally:
        server.stop()
    assert via_ipc == inline
    assert sum(acc for step in inline for _, acc in step) > 0  # drafts were accepted somewhere
