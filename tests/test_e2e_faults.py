"""Finishing, seeds, deadlines and process failures on a real stack (issue 5, points 2, 3, 5, 6).

One ``psd`` stack of real processes whose draft model *is* the target (a tiny random Llama), so
at temperature 0 every draft token is accepted: each step commits a block of k + 1 tokens and
finishing rules are exercised inside accepted blocks. The failure tests run last in the module
(they kill processes): the coordinator killed mid-stream (the gateway ends the stream with
UNAVAILABLE; a restarted coordinator frees the orphaned KV slots), SIGTERM to the coordinator
(in-flight requests finish within the grace period), the drafter killed mid-run (``ar`` fallback, identical greedy output, then
a restart on the same port by ``minedraft up``'s supervisor resumes speculation), and the verifier killed (in-flight and new
requests fail fast with UNAVAILABLE; coordinator and gateway readiness go NOT_SERVING).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from minedraft.client import GenerationError, MineDraftClient, build_request
from minedraft.launcher import Stack, StackError, health_status, restart_exited
from test_e2e_stack import _config, _status, _wait_slots_free

K = 3
MAX_MODEL_LEN = 512
SERVING = health_pb2.HealthCheckResponse.SERVING
PROMPT_IDS = [[1, 500, 600, 700], [1, 42, 43], [1, 9000, 12, 13, 14], [1, 77]]


def self_drafting_stack(tmp_path_factory, **overrides):
    """A started psd stack (k = 3, m = 2) whose draft is the target itself (a tiny Llama with the
    SmolLM2 tokenizer): every greedy draft is accepted. A generator: yields the stack, then stops it."""
    from specdec.models.gguf import packaged_gguf_path
    from transformers import AutoTokenizer

    from conftest import _build_tiny_llama

    target = str(tmp_path_factory.mktemp("target"))
    _build_tiny_llama(num_layers=2, vocab_size=49152, seed=0,
                      max_position_embeddings=MAX_MODEL_LEN).save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(os.path.dirname(packaged_gguf_path()),
                                  gguf_file=os.path.basename(packaged_gguf_path())).save_pretrained(target)
    cfg = _config("psd", target, target, str(tmp_path_factory.mktemp("runs")), **overrides)
    cfg = dataclasses.replace(cfg, num_speculative_tokens=K, max_model_len=MAX_MODEL_LEN)
    with Stack(cfg) as running:
        running.start(target, log=lambda line: None)
        yield running


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A psd stack (k = 3, m = 2) whose draft is the target itself: every greedy draft is accepted."""
    yield from self_drafting_stack(tmp_path_factory)


def _client(stack: Stack, timeout_s: float | None = 120) -> MineDraftClient:
    return MineDraftClient(f"{stack.cfg.host}:{stack.cfg.gateway_port}", timeout_s=timeout_s)


def _generate(stack: Stack, prompt_ids: list[int], **sampling):
    with _client(stack) as client:
        return client.generate(prompt_token_ids=prompt_ids, **sampling)


def _first_new_token(token_ids: list[int], lo: int) -> int:
    """Index >= lo of a token that does not occur earlier and sits inside a k+1 block (not its end)."""
    for i in range(lo, len(token_ids)):
        if token_ids[i] not in token_ids[:i] and i % (K + 1) not in (0, K):
            return i
    raise AssertionError(f"no fresh token after {lo} in {token_ids}")


def test_stop_id_inside_an_accepted_block_and_length_at_the_budget(stack):
    base = _generate(stack, PROMPT_IDS[0], max_tokens=40, temperature=0, ignore_eos=True)
    assert base.usage.num_accepted_tokens >= base.usage.num_drafts * (K - 1) > 0  # blocks of accepted tokens
    stop_at = _first_new_token(base.token_ids, 5)
    stop_id = base.token_ids[stop_at]
    stopped = _generate(stack, PROMPT_IDS[0], max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == base.token_ids[: stop_at + 1]  # the stop id is kept, nothing after it
    assert stopped.usage.completion_tokens == len(stopped.token_ids)
    budget = stop_at  # the stop id lies just beyond the budget
    capped = _generate(stack, PROMPT_IDS[0], max_tokens=budget, temperature=0, ignore_eos=True,
                       stop_token_ids=[stop_id])
    assert capped.finish_reason == "length"
    assert capped.token_ids == base.token_ids[:budget] and capped.usage.completion_tokens == budget
    for max_tokens in (1, K, K + 2):  # budgets that end inside and at the end of a block
        short = _generate(stack, PROMPT_IDS[1], max_tokens=max_tokens, temperature=0, ignore_eos=True)
        assert (short.finish_reason, len(short.token_ids), short.usage.completion_tokens) == \
            ("length", max_tokens, max_tokens)


def test_stop_string_inside_an_accepted_block_cuts_the_text_and_frees_the_slots(stack):
    base = _generate(stack, PROMPT_IDS[2], max_tokens=40, temperature=0, ignore_eos=True)
    text = base.text
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3]
                and text.find(text[i:i + 3]) == i)
    result = _generate(stack, PROMPT_IDS[2], max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == text[: text.find(stop)]
    assert result.usage.completion_tokens == len(result.token_ids) < len(base.token_ids)
    assert result.token_ids == base.token_ids[: len(result.token_ids)]
    for info in _wait_slots_free(stack.cfg):
        assert info.num_free_slots == info.max_num_seqs and not info.request_ids


def test_seeded_requests_repeat_whatever_shares_the_batch(stack):
    sampled = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    alone = _generate(stack, PROMPT_IDS[3], seed=1234, **sampled).token_ids

    def one(i: int) -> list[int]:
        seed = {"seed": 1234} if i % 2 == 0 else {}
        return _generate(stack, PROMPT_IDS[3] if i % 2 == 0 else PROMPT_IDS[i % 3], **seed, **sampled).token_ids

    with ThreadPoolExecutor(6) as pool:  # 6 requests > 2m = 4: the batches change while they run
        outputs = list(pool.map(one, range(6)))
    assert outputs[0] == outputs[2] == outputs[4] == alone
    unseeded = [_generate(stack, PROMPT_IDS[3], **sampled).token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1] and alone not in unseeded


def test_a_request_filling_the_context_window_finishes_without_pushing_others_to_ar(stack):
    """Near the end of max_model_len there is no room for k draft tokens: that request runs on
    without speculation, the others keep speculating, and the output equals the greedy target's."""
    prompt = PROMPT_IDS[2]
    long_tokens = MAX_MODEL_LEN - len(prompt)
    drafted_before = _status(stack.cfg).num_draft_tokens
    with ThreadPoolExecutor(2) as pool:
        full = pool.submit(_generate, stack, prompt, max_tokens=long_tokens, temperature=0, ignore_eos=True)
        time.sleep(0.5)
        other = pool.submit(_generate, stack, PROMPT_IDS[1], max_tokens=24, temperature=0, ignore_eos=True)
        full, other = full.result(timeout=240), other.result(timeout=240)
    assert (full.finish_reason, full.usage.completion_tokens) == ("length", long_tokens)
    assert other.usage.num_drafts > 0
    status = _status(stack.cfg)
    assert status.is_drafter_available and status.num_draft_tokens > drafted_before
    base = _generate(stack, prompt, max_tokens=40, temperature=0, ignore_eos=True)
    assert full.token_ids[:40] == base.token_ids


def test_abort_mid_stream_then_the_same_request_id_at_once_is_unaffected(stack):
    """Issue 5 point 4: an aborted request frees its slots and batch place (balance back to the
    size difference), its in-flight drafts are dropped, and a new request reusing its id right
    after gets exactly the output it would have had on an idle stack."""
    expected = _generate(stack, PROMPT_IDS[2], max_tokens=32, temperature=0, ignore_eos=True).token_ids
    request = build_request(prompt_token_ids=PROMPT_IDS[0], max_tokens=MAX_MODEL_LEN - 10, temperature=0,
                            ignore_eos=True, request_id="reused-id")
    with _client(stack) as client:
        responses = client.stream(request)
        next(responses)  # the first chunk: the request is running in both batches' rotation
        next(responses)
        assert client.abort("reused-id")
        responses.close()
        again = client.generate(prompt_token_ids=PROMPT_IDS[2], max_tokens=32, temperature=0, ignore_eos=True,
                                request_id="reused-id")
    assert again.token_ids == expected and again.finish_reason == "length"
    for info in _wait_slots_free(stack.cfg):
        assert info.num_free_slots == info.max_num_seqs and not info.request_ids
    status = _status(stack.cfg)
    assert list(status.batch_sizes) in ([0, 0], []) and status.balance == 0 and status.num_running == 0


def test_client_deadline_gives_deadline_exceeded_and_frees_the_slots(stack):
    with _client(stack, timeout_s=0.5) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt_token_ids=PROMPT_IDS[0], max_tokens=MAX_MODEL_LEN - 10, temperature=0,
                            ignore_eos=True, request_id="deadline")
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for info in _wait_slots_free(stack.cfg):
        assert info.num_free_slots == info.max_num_seqs and "deadline" not in info.request_ids
    assert _generate(stack, PROMPT_IDS[1], max_tokens=4, temperature=0).finish_reason in ("stop", "length")


def test_coordinator_killed_mid_stream_ends_the_stream_with_unavailable_and_a_restart_recovers(stack):
    cfg = stack.cfg
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(_generate, stack, PROMPT_IDS[0], max_tokens=MAX_MODEL_LEN - 10, temperature=0,
                           ignore_eos=True, request_id="orphan")
        deadline = time.monotonic() + 60
        while _status(cfg).num_running < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        stack.kill("coordinator")
        with pytest.raises(GenerationError) as info:
            call.result(timeout=15)  # no hang: the gateway ends the stream
    assert info.value.code == grpc.StatusCode.UNAVAILABLE.value[0]
    deadline = time.monotonic() + 15
    while health_status(f"{cfg.host}:{cfg.gateway_port}") == SERVING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health_status(f"{cfg.host}:{cfg.gateway_port}") != SERVING
    stack.restart("coordinator", log=lambda line: None)  # waits for every service, the gateway included
    for info in _wait_slots_free(cfg):  # the new coordinator released the orphan's KV slots
        assert info.num_free_slots == info.max_num_seqs and not info.request_ids
    assert _generate(stack, PROMPT_IDS[1], max_tokens=8, temperature=0, ignore_eos=True).finish_reason == "length"


def test_sigterm_drains_in_flight_requests_within_the_grace_period(stack):
    cfg = stack.cfg
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(_generate, stack, PROMPT_IDS[i], max_tokens=60, temperature=0, ignore_eos=True)
                 for i in range(2)]
        deadline = time.monotonic() + 60
        while _status(cfg).num_running < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        stack.kill("coordinator", signal.SIGTERM)
        results = [call.result(timeout=30) for call in calls]
    assert [(r.finish_reason, len(r.token_ids)) for r in results] == [("length", 60)] * 2  # finished, not cut
    assert stack.service("coordinator").process.wait(timeout=15) == 0  # grace 5 s + exit
    stack.restart("coordinator", log=lambda line: None)
    assert _generate(stack, PROMPT_IDS[1], max_tokens=4, temperature=0, ignore_eos=True).finish_reason == "length"


def _greedy_batch(stack: Stack, max_tokens: int) -> list:
    def one(i: int):
        return _generate(stack, PROMPT_IDS[i % len(PROMPT_IDS)], max_tokens=max_tokens, temperature=0,
                         ignore_eos=True, request_id=f"greedy-{i}")

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(one, range(6)))


def test_drafter_killed_mid_run_falls_back_to_ar_and_a_restart_resumes_speculation(stack):
    max_tokens = 200
    before = _greedy_batch(stack, max_tokens)
    expected = [r.token_ids for r in before]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_greedy_batch, stack, max_tokens)
        deadline = time.monotonic() + 60
        while _status(stack.cfg).num_running < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        stack.kill("drafter")
        results = running.result(timeout=240)
    assert [r.token_ids for r in results] == expected  # greedy output unchanged by the fallback
    assert all(r.finish_reason == "length" for r in results)
    num_drafts = sum(r.usage.num_drafts for r in results)
    assert 0 < num_drafts < sum(r.usage.num_drafts for r in before)  # speculated, then ar after the kill
    status = _status(stack.cfg)
    assert not status.is_drafter_available and status.effective_mode == "ar"
    restarts: dict[str, int] = {}
    assert restart_exited(stack, restarts, log=lambda line: None) == ["drafter"]  # what `minedraft up` does
    assert restarts == {"drafter": 1} and restart_exited(stack, restarts, log=lambda line: None) == []
    drafted_before = status.num_draft_tokens
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the coordinator probes the drafter every 2 s while requests run
        _generate(stack, PROMPT_IDS[0], max_tokens=40, temperature=0, ignore_eos=True)
        status = _status(stack.cfg)
        if status.is_drafter_available and status.num_draft_tokens > drafted_before:
            break
    assert status.is_drafter_available and status.effective_mode == "psd"
    assert status.num_draft_tokens > drafted_before
    assert _generate(stack, PROMPT_IDS[0], max_tokens=40, temperature=0, ignore_eos=True).usage.num_drafts > 0


def test_verifier_killed_fails_fast_with_unavailable_and_readiness_drops(stack):
    cfg = stack.cfg
    with ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(_generate, stack, PROMPT_IDS[i], max_tokens=MAX_MODEL_LEN - 10, temperature=0,
                             ignore_eos=True) for i in range(3)]
        deadline = time.monotonic() + 60
        while _status(cfg).num_running < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        stack.kill("verifier")
        killed_at = time.monotonic()
        with pytest.raises(StackError, match="verifier exited"):  # `minedraft up` stops: not restartable
            restart_exited(stack, {}, log=lambda line: None)
        for call in calls:
            with pytest.raises(GenerationError) as info:
                call.result(timeout=30)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert time.monotonic() - killed_at < 15
    started = time.monotonic()
    with pytest.raises((GenerationError, grpc.RpcError)) as info:
        _generate(stack, PROMPT_IDS[1], max_tokens=4)
    code = info.value.code if isinstance(info.value, GenerationError) else info.value.code().value[0]
    assert code == grpc.StatusCode.UNAVAILABLE.value[0] and time.monotonic() - started < 15
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and SERVING in (health_status(f"{cfg.host}:{cfg.coordinator_port}"),
                                                      health_status(f"{cfg.host}:{cfg.gateway_port}")):
        time.sleep(0.1)
    assert health_status(f"{cfg.host}:{cfg.coordinator_port}") != SERVING
    assert health_status(f"{cfg.host}:{cfg.gateway_port}") != SERVING
    [info] = _wait_slots_free(cfg, timeout_s=15, verifier=False)   # the drafter released them
    assert info.num_free_slots == info.max_num_seqs and not info.request_ids
