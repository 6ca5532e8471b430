"""``core_step`` (run in ``.venv-vllm``): ``VllmTargetWorker`` reads each engine step from vLLM's
engine core, without the output processor that ``LLMEngine.step()`` runs. Checked: the logprob
dicts it builds from a hand-made ``LogprobsLists`` (sampled token first with its rank, then
ranks 1..n, the batch's extra columns dropped); the worker's tokens, sampled-token logprobs and
top logprobs equal what vLLM's own output processor gives for the same request on the same
engine, on both schedulers; and no request stays in the output processor once released, also
one that vLLM ended itself (``max_model_len``) or one aborted in the middle.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import _build_tiny_llama
from specdec.sample.sampling import SamplingParams
from specdec.vllm_backend.engine import VllmEngineConfig, drain, to_vllm_sampling
from specdec.vllm_backend.outputs import _logprob_dicts, core_step
from specdec.vllm_backend.scheduler import PsdStep
from specdec.vllm_backend.target import VllmTargetWorker

SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
VOCAB, MAX_LEN = 128, 96


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("target"))
    _build_tiny_llama(num_layers=2, seed=0, **SHAPE).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=["async", "sync"])
def worker(model_dir, request):
    kwargs = {"async_scheduling": True} if request.param == "async" else {"num_speculative_tokens": 2}
    return VllmTargetWorker(VllmEngineConfig(model=model_dir, max_num_seqs=4, max_model_len=MAX_LEN,
                                             enforce_eager=True, kv_cache_space_gib=0.05, **kwargs))


def test_logprob_dicts_put_the_sampled_token_first_with_its_rank_and_drop_extra_columns() -> None:
    from vllm.v1.outputs import LogprobsLists

    lists = LogprobsLists(logprob_token_ids=np.array([[7, 3, 7, 9], [5, 5, 2, 8]]),
                          logprobs=np.array([[-2.0, -0.5, -2.0, -3.0], [-0.1, -0.1, -2.5, -4.0]]),
                          sampled_token_ranks=np.array([2, 1]))
    dicts = _logprob_dicts(lists, 2)   # the batch asked 3; this request 2: the last column is not its
    assert [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in dicts] == [
        {7: (-2.0, 2), 3: (-0.5, 1)}, {5: (-0.1, 1), 2: (-2.5, 2)}]
    assert [list(d) for d in _logprob_dicts(lists, 0)] == [[7], [5]]


def _vllm_own(worker, prompt: list[int], params: SamplingParams, num_tokens: int):
    """The same request through ``LLMEngine.step()`` (vLLM's output processor), the PSD filter off."""
    engine = worker.engine
    worker.scheduler.set_step(None)
    try:
        engine.add_request("own", {"prompt_token_ids": prompt}, to_vllm_sampling(params, num_tokens))
        tokens, logprobs = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.outputs[0].token_ids
                logprobs += out.outputs[0].logprobs or []
        drain(engine)
    finally:
        worker.scheduler.set_step(PsdStep(frozenset()))
    return tokens, logprobs


@pytest.mark.parametrize("num_top", [0, 3])
def test_tokens_and_logprobs_equal_vllms_output_processor(worker, num_top) -> None:
    prompt, params = _prompt(1, 19), SamplingParams(temperature=0.0, seed=0, ignore_eos=True, logprobs=num_top)
    tokens, own = _vllm_own(worker, prompt, params, 9)
    outs = worker.add_requests([("q", prompt, params)]) + worker.decode(["q"], 4) + worker.decode(["q"], 4)
    worker.release("q")
    assert [t for o in outs for t in o.token_ids] == tokens
    assert [lp for o in outs for lp in o.logprobs] == pytest.approx([d[t].logprob for d, t in zip(own, tokens)],
                                                                   abs=1e-5)
    top = [pair for o in outs for pair in o.top_logprobs]
    expected = [sorted((lp.rank, tid) for tid, lp in d.items() if lp.rank <= num_top) for d in own]
    assert [ids for ids, _ in top] == [[tid for _, tid in ranked] for ranked in expected] if num_top else top == []


def test_released_requests_leave_nothing_in_the_output_processor(worker) -> None:
    greedy = SamplingParams(temperature=0.0, seed=0, ignore_eos=True)
    worker.add_requests([("ends", _prompt(2, MAX_LEN - 3), greedy), ("goes", _prompt(3, 10), greedy)])
    worker.decode(["ends", "goes"], 6)
    assert worker._requests["ends"].is_finished            # vLLM ended it at max_model_len
    worker.add_requests([("aborted", _prompt(4, 12), greedy)])
    for rid in ("ends", "goes", "aborted"):
        worker.release(rid)
    assert worker.engine.output_processor.request_states == {}
    assert worker._names == {}


def test_core_step_drops_outputs_of_requests_it_does_not_name(worker) -> None:
    greedy = SamplingParams(temperature=0.0, seed=0, ignore_eos=True)
    worker.add_requests([("a", _prompt(5, 8), greedy)])
    try:
        worker.scheduler.set_step(PsdStep(frozenset({worker._requests["a"].vllm_id})))
        seen = {}
        for _ in range(3):
            seen.update(core_step(worker.engine, {}))
        assert seen == {}
    finally:
        worker.scheduler.set_step(PsdStep(frozenset()))
        drain(worker.engine)
        worker.release("a")
