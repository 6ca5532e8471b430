"""Issue 25.3: a configuration whose inline draft probabilities cannot pass gRPC is refused when
the coordinator connects to the engines (start-up), not by a drafter dropped mid-traffic; a
drafter that sends token ids only (the vLLM engine) is never refused for it."""
from __future__ import annotations

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.server import check_inline_draft_probs_fit
from minedraft.v1 import engine_pb2
from specdec.engine_api import EngineFacts

VOCAB = 49152


def _drafter(sends_draft_probs: bool = True) -> engine_pb2.EngineInfo:
    return engine_pb2.EngineInfo(vocab_size=VOCAB, sends_draft_probs=sends_draft_probs)


def test_the_issue_configuration_k100_m4_is_refused_with_the_sizes_and_the_fixes():
    cfg = CoordinatorConfig(mode="psd", num_speculative_tokens=100, max_num_seqs=4)   # 75 MiB of probs
    with pytest.raises(RuntimeError, match=r"75\.0 MiB.*64 MiB.*--k or --max-num-seqs.*--data-plane dist or ipc"):
        check_inline_draft_probs_fit(cfg, _drafter())


def test_the_limit_is_exact_to_the_batch_size():
    fits = CoordinatorConfig(mode="sd", num_speculative_tokens=4, max_num_seqs=84)    # 63 MiB + 1 MiB headers
    check_inline_draft_probs_fit(fits, _drafter())
    with pytest.raises(RuntimeError):
        check_inline_draft_probs_fit(CoordinatorConfig(mode="sd", num_speculative_tokens=4, max_num_seqs=85), _drafter())


def test_out_of_band_planes_and_token_id_drafters_are_not_sized():
    big = dict(mode="psd", num_speculative_tokens=100, max_num_seqs=64)
    check_inline_draft_probs_fit(CoordinatorConfig(**big, data_plane="dist"), _drafter())
    check_inline_draft_probs_fit(CoordinatorConfig(**big), _drafter(sends_draft_probs=False))


def test_engines_report_whether_their_drafts_carry_probabilities():
    from engine_svc.service import engine_info

    facts = EngineFacts(VOCAB, VOCAB, 4, 256, 4, (2,), "cpu", "float32", 0, 0)
    assert not engine_info(facts, "m", []).sends_draft_probs
    assert engine_info(facts.__class__(**{**facts.__dict__, "sends_draft_probs": True}), "m", []).sends_draft_probs


def test_the_native_draft_worker_says_it_sends_probabilities(tiny_llama):
    from specdec.config import CacheConfig, ModelConfig
    from specdec.engine.runner import ModelRunner
    from specdec.engine.worker import DraftWorker, TargetWorker

    cache = CacheConfig(max_num_seqs=2, max_model_len=64)
    assert DraftWorker(ModelRunner(ModelConfig(), cache, model=tiny_llama())).facts().sends_draft_probs
    assert not TargetWorker(ModelRunner(ModelConfig(), cache, model=tiny_llama())).facts().sends_draft_probs
