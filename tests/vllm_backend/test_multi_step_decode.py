"""Multi-step decoding on the vLLM backend (run in ``.venv-vllm``): ``VllmTargetWorker.decode``
runs N sampling steps of the named requests in one call, under ``PsdAsyncScheduler`` (the ``ar``
engine; vLLM's CPU build runs it synchronously, the scheduler's bookkeeping is the same) and
``PsdScheduler`` (an engine with speculation). Checked: exactly N tokens per row, equal to the
greedy reference and to N single steps (seeded sampling too); requests outside the call stay
untouched; a row stops at ``max_model_len`` while the others go on; ``PsdStep`` refuses N < 1
and N > 1 with drafts.
"""
from __future__ import annotations

import pytest
import torch

from conftest import _build_tiny_llama
from specdec.sample.sampling import SamplingParams
from specdec.vllm_backend.engine import VllmEngineConfig
from specdec.vllm_backend.scheduler import PsdAsyncScheduler, PsdScheduler, PsdStep
from specdec.vllm_backend.target import VllmTargetWorker

SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
VOCAB, MAX_LEN = 128, 96
GREEDY = SamplingParams(temperature=0.0, seed=0, ignore_eos=True)   # EOS would end a row early (test_row_ends.py)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    net = _build_tiny_llama(num_layers=2, seed=0, **SHAPE)
    path = str(tmp_path_factory.mktemp("target"))
    net.save_pretrained(path, safe_serialization=True)
    return path, net


def _worker(path: str, **kwargs) -> VllmTargetWorker:
    return VllmTargetWorker(VllmEngineConfig(model=path, max_num_seqs=4, max_model_len=MAX_LEN, enforce_eager=True,
                                             kv_cache_space_gib=0.05, **kwargs))


@pytest.fixture(scope="module")
def ar_target(model):
    return _worker(model[0], async_scheduling=True)


@pytest.fixture(scope="module")
def sd_target(model):
    return _worker(model[0], num_speculative_tokens=3)


@torch.no_grad()
def _hf_greedy(net, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(net(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_the_ar_engine_runs_the_async_scheduler(ar_target, sd_target) -> None:
    assert isinstance(ar_target.scheduler, PsdAsyncScheduler)
    assert type(sd_target.scheduler) is PsdScheduler


@pytest.mark.parametrize("engine", ["ar_target", "sd_target"])
def test_decode_n_steps_equals_the_greedy_reference(engine, model, request) -> None:
    worker = request.getfixturevalue(engine)
    prompts = {"x": _prompt(1, 20), "y": _prompt(2, 33), "paused": _prompt(3, 9)}
    refs = {rid: _hf_greedy(model[1], p, 16) for rid, p in prompts.items()}
    out = {o.request_id: list(o.token_ids) for o in worker.add_requests([(r, p, GREEDY) for r, p in prompts.items()])}
    try:
        paused = worker.scheduler.requests[worker._requests["paused"].vllm_id]
        before = (paused.num_computed_tokens, list(paused.output_token_ids))
        for n in (5, 1, 7):
            steps = worker.decode(["x", "y"], n)
            assert [len(s.token_ids) for s in steps] == [n, n] and all(len(s.logprobs) == n for s in steps)
            for s in steps:
                out[s.request_id] += s.token_ids
        assert out["x"] == refs["x"][:14] and out["y"] == refs["y"][:14]
        assert (paused.num_computed_tokens, list(paused.output_token_ids)) == before
        out["paused"] += worker.decode(["paused"], 3)[0].token_ids
        assert out["paused"] == refs["paused"][:4]
    finally:
        for rid in prompts:
            worker.release(rid)


def test_seeded_multi_step_equals_single_steps(ar_target) -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    runs = []
    for schedule in ([1] * 12, [4, 8]):
        out = list(ar_target.add_requests([("s", _prompt(4, 15), params)])[0].token_ids)
        for n in schedule:
            out += ar_target.decode(["s"], n)[0].token_ids
        ar_target.release("s")
        runs.append(out)
    assert runs[0] == runs[1] and len(runs[0]) == 13


def test_a_row_stops_at_max_model_len_and_the_others_go_on(ar_target) -> None:
    ar_target.add_requests([("long", _prompt(5, MAX_LEN - 4), GREEDY), ("short", _prompt(6, 10), GREEDY)])
    try:
        steps = {s.request_id: s for s in ar_target.decode(["long", "short"], 8)}
        assert len(steps["long"].token_ids) == 3          # prompt + first token + 3 = max_model_len
        assert len(steps["short"].token_ids) == 8
        assert ar_target._requests["long"].is_finished
    finally:
        ar_target.release("long"), ar_target.release("short")


def test_psd_step_refuses_bad_num_steps() -> None:
    with pytest.raises(ValueError, match="num_steps"):
        PsdStep(frozenset({"a"}), num_steps=0)
    with pytest.raises(ValueError, match="num_steps"):
        PsdStep(frozenset({"a"}), {"a": [1, 2]}, num_steps=2)
    with pytest.raises(ValueError, match="async_scheduling"):
        VllmEngineConfig(model="m", num_speculative_tokens=2, async_scheduling=True)


@pytest.mark.parametrize("engine", ["ar_target", "sd_target"])
def test_a_request_without_logprobs_decodes_the_same_tokens_and_gets_none(engine, request) -> None:
    from specdec.sample.sampling import NO_LOGPROBS

    worker = request.getfixturevalue(engine)
    runs = {}
    for logprobs in (0, NO_LOGPROBS):
        params = SamplingParams(temperature=0.0, seed=0, logprobs=logprobs)
        outs = [worker.add_requests([("q", _prompt(6, 17), params)])[0]]
        outs += worker.decode(["q"], 4) + worker.verify(["q"], [[]], None)
        worker.release("q")
        runs[logprobs] = outs
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[NO_LOGPROBS]]
    assert all(len(o.logprobs) == len(o.token_ids) for o in runs[0])
    assert all(o.logprobs == [] and o.top_logprobs == [] for o in runs[NO_LOGPROBS])


def test_on_step_streams_each_engine_step_and_adds_up_to_the_call(ar_target) -> None:
    """``decode(..., on_step)`` (streamed multi-step decoding): one hook call per engine step
    that gave the named rows tokens, each with only that step's new tokens; their concatenation
    is the call's return value; a row that stops early (max_model_len) leaves later steps' lists."""
    ar_target.add_requests([("long", _prompt(7, MAX_LEN - 4), GREEDY), ("short", _prompt(8, 10), GREEDY)])
    try:
        calls = []
        steps = {s.request_id: s for s in ar_target.decode(["long", "short"], 6, on_step=calls.append)}
        streamed = {"long": [], "short": []}
        for outputs in calls:
            assert all(len(o.token_ids) == len(o.logprobs) >= 1 for o in outputs)
            for o in outputs:
                streamed[o.request_id] += o.token_ids
        assert streamed == {rid: list(s.token_ids) for rid, s in steps.items()}
        assert len(streamed["long"]) == 3 and len(streamed["short"]) == 6
        assert len(calls) >= 6 and all(o.request_id == "short" for o in calls[-1])
    finally:
        ar_target.release("long"), ar_target.release("short")


def test_seeded_sampled_prompts_that_do_not_fit_one_step_prefill_whole_on_cpu(model) -> None:
    """Three seeded, sampled 60-token prompts admitted at once with a 96-token step budget: on
    CPU the engine runs without chunked prefill (``VllmEngineConfig.chunked_prefill``: vLLM's CPU
    build crashed on a split seeded prompt, "CPU Generator does not use offset"), so the prompts
    that do not fit wait for a later step, whole; each request's tokens equal those it gets
    when admitted alone."""
    worker = _worker(model[0])
    assert worker.cfg.batched_tokens == MAX_LEN and not worker.cfg.chunked_prefill
    sampled = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(3)]
    items = [(f"s{i}", _prompt(40 + i, 60), params) for i, params in enumerate(sampled)]

    def tokens(batch) -> dict[str, list[int]]:
        out = {s.request_id: list(s.token_ids) for s in worker.add_requests(batch)}
        for s in worker.decode([rid for rid, _, _ in batch], 5):
            out[s.request_id] += s.token_ids
        for rid, _, _ in batch:
            worker.release(rid)
        return out

    together = tokens(items)
    alone = {rid: toks for item in items for rid, toks in tokens([item]).items()}
    assert together == alone and all(len(t) == 6 for t in together.values())
    assert VllmEngineConfig(model="m", device="cuda").chunked_prefill
    assert VllmEngineConfig(model="m", max_model_len=96, max_num_batched_tokens=64).chunked_prefill
