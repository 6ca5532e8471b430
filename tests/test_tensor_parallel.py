"""Verifier tensor parallelism: TP=2 under torchrun (gloo) equals TP=1 in process (greedy and
seeded sampled requests, draft probs broadcast to rank 1)."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
import pytest
import torch
from conftest import _build_tiny_llama

from minedraft.probes import free_loopback_ports
from minedraft.serving import wait_for_serving_sync
from minedraft.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from engine_svc.tensor_proto import tensor_to_proto
from verifier_svc.tp import TPContext, check_tp_divides_heads, shard_head_counts

NUM_HEADS, NUM_KV_HEADS = 4, 2
START_TIMEOUT_S = 240
LOGPROB_ATOL = 1e-4  # float32, TP=2 all-reduce order vs TP=1
PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10], "c": [11, 12, 13, 14, 15, 16], "sampled": [17, 18, 19]}
SAMPLED_SEED = 11
DRAFTS = [[[3, 4, 5], [6, 7, 8], [9, 10, 11], [1, 2, 3]], [[12, 13, 14], [15, 16, 17], [18, 19, 20], [4, 5, 6]]]
VOCAB_SIZE = 128


def _draft_probs(step: int) -> torch.Tensor:
    """Fixed draft distributions [4, 3, V] (sent inline; broadcast to rank 1 by the channel)."""
    gen = torch.Generator().manual_seed(step)
    return torch.softmax(torch.randn(len(PROMPTS), 3, VOCAB_SIZE, generator=gen) * 3, dim=-1)


def _sampling(request_id: str) -> dict:
    if request_id == "sampled":
        return {"temperature": 0.9, "seed": SAMPLED_SEED}
    return {"temperature": 0.0}


def _free_port() -> int:
    return free_loopback_ports(1)[0]   # below the ephemeral range (minedraft.probes)


def test_tp_size_must_divide_head_counts():
    model = _build_tiny_llama(num_attention_heads=4, num_key_value_heads=2)
    check_tp_divides_heads(model.config, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tp_divides_heads(model.config, 4)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_tp_divides_heads(model.config, 3)


def test_shard_head_counts_gives_per_rank_heads_and_keeps_head_dim():
    model = _build_tiny_llama(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    head_dim = model.config.head_dim
    shard_head_counts(model, 2)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 1)
    assert model.config.head_dim == head_dim == 16


@pytest.mark.parametrize("fields", [{"rank": 2, "world_size": 2}, {"world_size": 0}])
def test_tp_context_validation(fields):
    with pytest.raises(ValueError, match="rank|world_size"):
        TPContext(**fields)


def _verify_loop(add, verify) -> list[tuple[list[int], list[float]]]:
    """Add three greedy and one seeded sampled request, verify fixed drafts (k = 3) with fixed
    draft probs, then one decode (k = 0)."""
    ids = list(PROMPTS)
    outputs = [(o.token_ids, o.logprobs) for o in add(ids)]
    for step, drafts in enumerate(DRAFTS):
        outputs += [(o.token_ids, o.logprobs) for o in verify(ids, drafts, _draft_probs(step))]
    outputs += [(o.token_ids, o.logprobs) for o in verify(ids, [[] for _ in ids], None)]
    return [(list(tokens), list(logprobs)) for tokens, logprobs in outputs]


def _in_process(model_dir: str):
    from specdec.config import CacheConfig, ModelConfig
    from specdec.engine.runner import ModelRunner
    from specdec.sample.sampling import SamplingParams
    from specdec.engine.worker import TargetWorker

    worker = TargetWorker(ModelRunner(ModelConfig(model=model_dir), CacheConfig(max_num_seqs=4, max_model_len=128)))
    return _verify_loop(
        lambda ids: [worker.add_request(r, PROMPTS[r], SamplingParams(**_sampling(r))) for r in ids],
        lambda ids, drafts, probs: worker.verify(ids, drafts, probs))


def _via_grpc(stub):
    def add(ids):
        seqs = [engine_pb2.SeqInit(request_id=r, prompt_token_ids=PROMPTS[r],
                                   sampling=common_pb2.SamplingParams(**_sampling(r))) for r in ids]
        return stub.AddRequests(engine_pb2.AddRequestsRequest(seqs=seqs)).outputs

    def verify(ids, drafts, probs):
        request = engine_pb2.VerifyRequest(request_ids=ids, data_plane=engine_pb2.DATA_PLANE_INLINE)
        if drafts[0]:
            request.draft_token_ids.CopyFrom(tensor_to_proto(torch.tensor(drafts, dtype=torch.int32)))
        if probs is not None:
            request.draft_probs.CopyFrom(tensor_to_proto(probs))
            request.has_draft_probs = True
        return stub.Verify(request).outputs

    return _verify_loop(add, verify)


def test_torchrun_tp2_verifier_equals_tp1(tmp_path):
    model_dir = str(tmp_path / "target")
    _build_tiny_llama(num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS).save_pretrained(model_dir)
    port = _free_port()
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
         "-m", "verifier_svc", "--model", model_dir, "--port", str(port), "--max-num-seqs", "4",
         "--max-model-len", "128", "--num-threads", "1", "--grace-s", "2"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        target = f"127.0.0.1:{port}"
        wait_for_serving_sync(target, START_TIMEOUT_S)
        with grpc.insecure_channel(target) as channel:
            stub = engine_pb2_grpc.VerifierStub(channel)
            info = stub.GetInfo(engine_pb2.EngineInfoRequest())
            assert info.tensor_parallel_size == 2
            tp2 = _via_grpc(stub)
            stub.ReleaseRequests(engine_pb2.ReleaseRequest(request_ids=list(PROMPTS)))
            assert stub.GetInfo(engine_pb2.EngineInfoRequest()).num_free_slots == len(PROMPTS)
        tp1 = _in_process(model_dir)
        assert [tokens for tokens, _ in tp2] == [tokens for tokens, _ in tp1]
        for (_, lp2), (_, lp1) in zip(tp2, tp1):
            assert torch.allclose(torch.tensor(lp2), torch.tensor(lp1), atol=LOGPROB_ATOL, rtol=0)
        # the per-rank KV cache holds num_kv_heads / 2 heads: half of TP=1's bytes
        assert info.kv_cache_bytes == 2 * 2 * 4 * (NUM_KV_HEADS // 2) * 128 * 16 * 4
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    log.close()
