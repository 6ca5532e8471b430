"""End to end on the vLLM engine backend: ``minedraft up --engine vllm`` as real processes.

The engine services run in ``.venv-vllm`` (vLLM's CPU build; a missing venv fails these tests,
``minedraft.engine_backend.engine_python``), the coordinator and gateway in this Python. Tiny
random Llamas of head_dim 64 (vLLM's CPU attention needs >= 32), vocab 49152, with the SmolLM2
tokenizer; the draft is the target with a little noise on its weights, so drafts are partly
accepted. Two stack starts: ``ar`` (a plain vLLM decoding verifier, the reference) and ``psd``;
``sd`` is a coordinator and gateway in front of the psd stack's engines (the engines are
mode-agnostic, as ``bench/gpu/gpu_stack.py`` uses them). Checked: greedy psd and sd outputs equal
ar's with more than 2m concurrent requests of different lengths; an abort mid-stream frees the
slots of both engines; a stop token id inside an accepted block; seeded sampled requests repeat
whatever shares the batch; the drafter killed mid-run falls back to ar and every stream completes
with the ar output (last: it leaves the psd stack without a drafter); and psd with the drafter's
resident draft sessions (``--draft-sessions``, a third stack start; a fifth with the drafter's
engine as two processes, ``--draft-processes 2``) and with drafts from vLLM's draft-model
proposer (``--draft-proposer``, a fourth; its step log shows the verifier's engine-core time per
call) equals ar too.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.gpu.gpu_stack import start_front
from minedraft.client import GenerationError, GenerationResult, MineDraftClient, build_request
from minedraft.engine_backend import engine_python
from minedraft.launcher import Stack
from test_e2e_faults import _generate
from test_e2e_stack import M, MAX_MODEL_LEN, NUM_REQUESTS, _config, _engine_infos, _generate_all, _status, _wait_slots_free

K = 3
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
PROMPT_IDS = [[1, 500, 600, 700], [1, 42, 43], [1, 9000, 12, 13, 14], [1, 77], [1, 31, 32, 33, 34, 35]]
KILL_TOKENS = 120


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(target_dir, draft_dir): tiny head_dim-64 Llamas + the SmolLM2 tokenizer in each."""
    import torch
    from transformers import AutoTokenizer

    from conftest import _build_tiny_llama
    from specdec.models.gguf import packaged_gguf_path

    assert os.path.isfile(engine_python("vllm"))  # ValueError (a failure, not a skip) without .venv-vllm
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(packaged_gguf_path()),
                                              gguf_file=os.path.basename(packaged_gguf_path()))
    dirs = []
    for name, noise in (("target", 0.0), ("draft", 0.01)):
        model = _build_tiny_llama(num_layers=2, vocab_size=49152, seed=0, max_position_embeddings=MAX_MODEL_LEN,
                                  **SHAPE)
        torch.manual_seed(7)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * torch.randn_like(param))
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    return tuple(dirs)


def _vllm_config(mode: str, model_dirs, runs_dir: str):
    return dataclasses.replace(_config(mode, *model_dirs, runs_dir), engine="vllm", enforce_eager=True,
                               num_speculative_tokens=K)


def _greedy_batch(stack: Stack, max_tokens: int) -> list[GenerationResult]:
    """Six greedy requests at once (> 2m), prompt ids, ignore_eos."""
    def one(i: int) -> GenerationResult:
        return _generate(stack, PROMPT_IDS[i % len(PROMPT_IDS)], max_tokens=max_tokens, temperature=0,
                         ignore_eos=True, request_id=f"batch-{i}")

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(one, range(6)))


@pytest.fixture(scope="module")
def ar_reference(model_dirs, tmp_path_factory):
    """Outputs of a vLLM ``ar`` stack (verifier with no speculative config): the chat batch of
    ``_generate_all`` and the batch of ``_greedy_batch(KILL_TOKENS)``."""
    with Stack(_vllm_config("ar", model_dirs, str(tmp_path_factory.mktemp("runs")))) as stack:
        stack.start(model_dirs[0], log=lambda line: None)
        assert _status(stack.cfg).mode == "ar"
        return {"chat": [r.token_ids for r in _generate_all(stack.cfg)],
                "kill": [r.token_ids for r in _greedy_batch(stack, KILL_TOKENS)]}


@pytest.fixture(scope="module")
def psd_stack(model_dirs, tmp_path_factory):
    with Stack(_vllm_config("psd", model_dirs, str(tmp_path_factory.mktemp("runs")))) as stack:
        stack.start(model_dirs[0], log=lambda line: None)
        yield stack


def test_psd_output_equals_ar_at_temperature_0(ar_reference, psd_stack):  # ar's stack stops first
    results, status = _generate_all(psd_stack.cfg), _status(psd_stack.cfg)
    assert status.effective_mode == "psd" and status.num_parallel_steps > 0
    assert 0 < status.num_accepted_tokens < status.num_draft_tokens   # drafts partly accepted
    assert len(results) == NUM_REQUESTS > 2 * M and len({len(o) for o in ar_reference["chat"]}) > 1
    assert [r.token_ids for r in results] == ar_reference["chat"]


@pytest.mark.parametrize("processes", [1, 2])
def test_psd_with_resident_draft_sessions_equals_ar_at_temperature_0(processes, ar_reference, model_dirs, tmp_path):
    """``--draft-sessions``: the drafter keeps one resumable vLLM request per request; greedy
    outputs still equal ar's, drafts are partly accepted, and every slot of both engines is free
    afterwards (the sessions released with their requests). With ``--draft-processes 2`` the
    drafter's engine is two processes (GPU hosts' configuration for psd at high concurrency)."""
    cfg = dataclasses.replace(_vllm_config("psd", model_dirs, str(tmp_path)), draft_sessions=True,
                              draft_processes=processes)
    with Stack(cfg) as stack:
        stack.start(model_dirs[0], log=lambda line: None)
        results, status = _generate_all(stack.cfg), _status(stack.cfg)
        assert status.effective_mode == "psd" and 0 < status.num_accepted_tokens < status.num_draft_tokens
        assert [r.token_ids for r in results] == ar_reference["chat"]
        drafter = _wait_slots_free(stack.cfg)[0]
        assert drafter.max_num_seqs == cfg.num_engine_slots and not drafter.request_ids
        with open(os.path.join(stack.run_dir, "drafter.log")) as f:
            assert ("draft engine in 2 processes" in f.read()) == (processes == 2)


def test_psd_drafting_with_vllms_proposer_equals_ar_at_temperature_0(ar_reference, model_dirs, tmp_path):
    """``--draft-proposer``: the drafter's engine proposes tokens 2..k inside one engine step per
    draft call; greedy outputs still equal ar's, drafts are partly accepted, every slot is free after."""
    step_log = str(tmp_path / "steps.jsonl")
    cfg = dataclasses.replace(_vllm_config("psd", model_dirs, str(tmp_path)), draft_proposer=True, step_log=step_log)
    with Stack(cfg) as stack:
        stack.start(model_dirs[0], log=lambda line: None)
        assert "--draft-proposer-tokens" in stack.service("drafter").spec.argv
        results, status = _generate_all(stack.cfg), _status(stack.cfg)
        assert status.effective_mode == "psd" and 0 < status.num_accepted_tokens < status.num_draft_tokens
        assert [r.token_ids for r in results] == ar_reference["chat"]
        _wait_slots_free(stack.cfg)
    # the vLLM verifier reports each call's time in vLLM's engine core (VerifyResponse.engine_core_ms)
    with open(step_log, encoding="utf-8") as f:
        verifies = [p for line in f for p in json.loads(line)["phases"] if p["engine"] == "verifier"]
    assert verifies and all(p["core_steps"] >= 1 and 0 < p["core_ms"] <= p["compute_ms"] for p in verifies)


def test_sd_output_equals_ar_at_temperature_0(psd_stack, model_dirs, ar_reference, tmp_path):
    front, cfg = start_front(psd_stack.cfg, "sd", model_dirs[0], str(tmp_path), log=lambda line: None)
    try:
        results, status = _generate_all(cfg), _status(cfg)
    finally:
        front.stop()
    assert status.effective_mode == "sd" and status.num_draft_tokens > 0
    assert sum(r.usage.num_drafts for r in results) > 0
    assert [r.token_ids for r in results] == ar_reference["chat"]
    _wait_slots_free(psd_stack.cfg)


def test_ar_decode_steps_with_arrivals_during_calls_equals_one_token_per_call(psd_stack, model_dirs, ar_reference,
                                                                               tmp_path):
    """``ar --decode-steps 8`` in front of the psd stack's engines: requests arriving while a
    multi-step Verify call runs are admitted at once (the vLLM verifier prefills them between two
    of the call's steps); greedy outputs equal the one-token-per-call ``ar`` stack's."""
    front, cfg = start_front(dataclasses.replace(psd_stack.cfg, num_decode_steps=8), "ar", model_dirs[0],
                             str(tmp_path), log=lambda line: None)

    def one(i: int) -> GenerationResult:
        time.sleep(0.07 * i)   # staggered: each arrives while the others' calls run
        return _generate(front, PROMPT_IDS[i % len(PROMPT_IDS)], max_tokens=KILL_TOKENS, temperature=0,
                         ignore_eos=True, request_id=f"batch-{i}")

    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, range(6)))
        status = _status(cfg)
    finally:
        front.stop()
    assert status.effective_mode == "ar" and status.num_draft_tokens == 0
    assert status.num_steps < 6 * KILL_TOKENS / 4      # 8 tokens per request and step, less at the ends
    assert [r.token_ids for r in results] == ar_reference["kill"]
    for info in _wait_slots_free(psd_stack.cfg):
        assert info.num_free_slots == info.max_num_seqs and not info.request_ids


def test_abort_mid_stream_frees_the_slots_of_both_engines(psd_stack):
    cfg = psd_stack.cfg
    with MineDraftClient(f"{cfg.host}:{cfg.gateway_port}", timeout_s=120) as client:
        stream = client.stream(build_request(prompt_token_ids=PROMPT_IDS[0], request_id="abort-me",
                                             max_tokens=MAX_MODEL_LEN - 40, temperature=0, ignore_eos=True))
        assert next(stream).WhichOneof("response") == "chunk"
        assert all("abort-me" in info.request_ids for info in _engine_infos(cfg))
        assert client.abort("abort-me") is True
        final = [r for r in stream if r.WhichOneof("response") == "complete"]
    assert final and final[0].complete.finish_reason == "abort"
    for info in _wait_slots_free(cfg):
        assert info.num_free_slots == info.max_num_seqs and list(info.request_ids) == [], info


def _chunks(stack: Stack, prompt_ids: list[int], **sampling) -> tuple[list[list[int]], str]:
    """Token ids of each streamed chunk (one engine step each) and the finish reason."""
    with MineDraftClient(f"{stack.cfg.host}:{stack.cfg.gateway_port}", timeout_s=120) as client:
        chunks, reason = [], ""
        for response in client.stream(build_request(prompt_token_ids=prompt_ids, **sampling)):
            if response.WhichOneof("response") == "chunk" and response.chunk.token_ids:
                chunks.append(list(response.chunk.token_ids))
            elif response.WhichOneof("response") == "complete":
                reason = response.complete.finish_reason
    return chunks, reason


def test_stop_token_id_inside_an_accepted_block_ends_the_request_there(psd_stack):
    chunks, _ = _chunks(psd_stack, PROMPT_IDS[2], max_tokens=60, temperature=0, ignore_eos=True)
    tokens = [t for chunk in chunks for t in chunk]
    starts = [sum(map(len, chunks[:i])) for i in range(len(chunks))]
    stop_at = next(start + j for start, chunk in zip(starts, chunks) for j in range(len(chunk) - 1)
                   if start > 0 and tokens[start + j] not in tokens[:start + j])   # not a block's last token
    stopped = _generate(psd_stack, PROMPT_IDS[2], max_tokens=60, temperature=0, ignore_eos=True,
                        stop_token_ids=[tokens[stop_at]])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == tokens[:stop_at + 1] and stopped.usage.completion_tokens == stop_at + 1
    for info in _wait_slots_free(psd_stack.cfg):
        assert info.num_free_slots == info.max_num_seqs and not info.request_ids


def test_seeded_sampled_requests_repeat_whatever_shares_the_batch(psd_stack):
    sampled = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    alone = _generate(psd_stack, PROMPT_IDS[3], seed=1234, **sampled).token_ids

    def one(i: int) -> list[int]:
        extra = {"seed": 1234} if i % 2 == 0 else {"seed": 7 + i, "top_k": 5 + i}
        return _generate(psd_stack, PROMPT_IDS[3] if i % 2 == 0 else PROMPT_IDS[i % 3], **extra, **sampled).token_ids

    with ThreadPoolExecutor(6) as pool:  # 6 requests > 2m = 4: the batches change while they run
        outputs = list(pool.map(one, range(6)))
    assert outputs[0] == outputs[2] == outputs[4] == alone and len(alone) == 24
    other = _generate(psd_stack, PROMPT_IDS[3], seed=99, **sampled).token_ids
    assert other != alone


def test_a_parameter_vllm_refuses_is_invalid_argument_for_that_request_only(psd_stack):
    """temperature > 2 (vLLM's range) and min_p (vLLM: not with speculative decoding) are refused
    with INVALID_ARGUMENT naming the parameter; the drafter stays available, others run on."""
    for sampling, name in (({"temperature": 2.5}, "temperature"), ({"temperature": 1.0, "min_p": 0.1}, "min_p")):
        with pytest.raises(GenerationError) as exc:
            _generate(psd_stack, PROMPT_IDS[0], max_tokens=8, ignore_eos=True, **sampling)
        assert exc.value.code_name == "INVALID_ARGUMENT" and name in exc.value.message
    status = _status(psd_stack.cfg)
    assert status.is_drafter_available and status.effective_mode == "psd"
    ok = _generate(psd_stack, PROMPT_IDS[1], max_tokens=8, temperature=0, ignore_eos=True)
    assert len(ok.token_ids) == 8 and ok.usage.num_drafts > 0
    for info in _wait_slots_free(psd_stack.cfg):
        assert info.num_free_slots == info.max_num_seqs and not info.request_ids


def test_drafter_killed_mid_run_falls_back_to_ar_and_streams_complete(psd_stack, ar_reference):
    """Kills the psd stack's drafter: runs last."""
    before = _greedy_batch(psd_stack, KILL_TOKENS)
    assert [r.token_ids for r in before] == ar_reference["kill"]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_greedy_batch, psd_stack, KILL_TOKENS)
        deadline = time.monotonic() + 120
        while _status(psd_stack.cfg).num_running < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        psd_stack.kill("drafter")
        results = running.result(timeout=300)
    assert all((r.finish_reason, len(r.token_ids)) == ("length", KILL_TOKENS) for r in results)
    assert [r.token_ids for r in results] == ar_reference["kill"]
    status = _status(psd_stack.cfg)
    assert not status.is_drafter_available and status.effective_mode == "ar"
    assert 0 < sum(r.usage.num_drafts for r in results) < sum(r.usage.num_drafts for r in before)  # then ar
    assert _generate(psd_stack, PROMPT_IDS[1], max_tokens=8, temperature=0, ignore_eos=True).usage.num_drafts == 0
