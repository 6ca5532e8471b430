"""BENCHMARK-ONLY fixed acceptance (specdec.sample.fixed_acceptance): measured acceptance converges to P,
off by default, flag validation and labels."""
from __future__ import annotations

import math

import pytest
import torch

from specdec.sample.bench_only import check_acceptance_prob, expected_mean_acceptance_length, fixed_acceptance_label
from minedraft.stack import StackConfig, build_service_specs
from specdec.config import CacheConfig, ModelConfig
from specdec.sample.fixed_acceptance import FixedAcceptance, fixed_acceptance_sample
from specdec.sample.rejection import PLACEHOLDER_TOKEN_ID
from specdec.engine.runner import ModelRunner
from specdec.sample.sampling import SamplingParams, make_generator
from specdec.engine.worker import TargetWorker
from verifier_svc.__main__ import _served_name, parse_args

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def _sample(p: float, batch: int, k: int, vocab: int = 11, seed: int = 0, greedy: bool = True):
    torch.manual_seed(1)
    target_probs = torch.softmax(torch.randn(batch, k + 1, vocab), dim=-1)
    drafts = torch.randint(0, vocab, (batch, k))
    gens = [make_generator(i) for i in range(batch)]
    is_greedy = torch.full((batch,), greedy)
    out, num = fixed_acceptance_sample(drafts, target_probs, is_greedy, gens, p, make_generator(seed))
    return drafts, target_probs, out, num


@pytest.mark.parametrize("p", [0.3, 0.7, 0.9])
def test_measured_acceptance_converges_to_p(p):
    k, batch = 4, 20000
    _, _, _, num = _sample(p, batch, k)
    # position i is reached when the i-1 before it were accepted; P(accept | reached) = P
    reached = sum(int((num >= i).sum()) for i in range(k))
    accepted = int(num.sum())
    assert accepted / reached == pytest.approx(p, abs=0.01)
    assert float(num.float().mean() + 1) == pytest.approx(expected_mean_acceptance_length(p, k), rel=0.02)


def test_output_layout_and_target_token():
    drafts, target_probs, out, num = _sample(0.6, 64, 5)
    for row in range(64):
        a = int(num[row])
        assert out[row, :a].tolist() == drafts[row, :a].tolist()           # accepted drafts, whatever p says
        assert int(out[row, a]) == int(target_probs[row, a].argmax())      # then the target's (greedy) token
        assert (out[row, a + 1:] == PLACEHOLDER_TOKEN_ID).all()


def test_extremes_and_seeded():
    _, target_probs, out, num = _sample(1.0, 8, 3)
    assert (num == 3).all() and (out[:, 3] == target_probs[:, 3].argmax(-1)).all()   # bonus token
    assert (_sample(0.0, 8, 3)[3] == 0).all()
    assert torch.equal(_sample(0.5, 32, 4, seed=7)[3], _sample(0.5, 32, 4, seed=7)[3])
    assert not torch.equal(_sample(0.5, 256, 4, seed=7)[3], _sample(0.5, 256, 4, seed=8)[3])


def test_sampled_rows_draw_from_target():
    vocab = 3
    target = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]]).repeat(50, 1, 1)   # p_1 = e_2, p_2 = e_1
    drafts = torch.zeros(50, 1, dtype=torch.int64)                                   # draft 0, p_1(0) = 0
    gens = [make_generator(i) for i in range(50)]
    out, num = fixed_acceptance_sample(drafts, target, torch.zeros(50, dtype=torch.bool), gens, 0.5,
                                       make_generator(3))
    assert 0 < int(num.sum()) < 50                       # accepted regardless of p_1(0) = 0
    assert (out[num == 0, 0] == 2).all() and (out[num == 1, 1] == 1).all()
    assert out.shape == (50, 2) and vocab == target.shape[-1]


def _worker(tiny_llama, fixed=None):
    runner = ModelRunner(ModelConfig(dtype="float64"), CacheConfig(max_num_seqs=4, max_model_len=128),
                         model=tiny_llama(dtype=torch.float64))
    return TargetWorker(runner, seed=0, fixed_acceptance=fixed)


def test_worker_off_by_default_and_on_when_given(tiny_llama):
    default = _worker(tiny_llama)
    assert default.fixed_acceptance is None
    first = default.add_request("a", [1, 5, 9], GREEDY).token_ids[0]
    bad = [(first + 1) % 50] * 3      # drafts that the greedy target never proposes first
    assert default.verify(["a"], [bad], None)[0].num_accepted == 0
    fixed = _worker(tiny_llama, FixedAcceptance(1.0))
    fixed.add_request("a", [1, 5, 9], GREEDY)
    step = fixed.verify(["a"], [bad], None)[0]
    assert step.num_accepted == 3 and step.token_ids[:3] == bad


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf])
def test_flag_validation_names_the_flag(value):
    with pytest.raises(ValueError, match="--bench-fixed-acceptance"):
        StackConfig(bench_fixed_acceptance=value)
    with pytest.raises(ValueError, match="acceptance_prob"):
        FixedAcceptance(value)
    with pytest.raises(SystemExit):
        parse_args(["--bench-fixed-acceptance", str(value)])
    with pytest.raises(ValueError, match="seed"):
        FixedAcceptance(0.5, seed=-1)
    assert check_acceptance_prob("0.25") == 0.25


def test_stack_passes_flag_and_labels(tmp_path):
    assert parse_args([]).bench_fixed_acceptance is None
    assert _served_name(parse_args(["--model", "m"])) == "m"
    assert _served_name(parse_args(["--model", "m", "--bench-fixed-acceptance", "0.7"])) == \
        "m [BENCHMARK-ONLY fixed acceptance 0.7]"
    draft = str(tmp_path)
    plain = {s.name: s for s in build_service_specs(StackConfig(mode="psd", draft=draft), "target")}
    assert "--bench-fixed-acceptance" not in plain["verifier"].argv
    specs = {s.name: s for s in build_service_specs(
        StackConfig(mode="psd", draft=draft, bench_fixed_acceptance=0.7), "target")}
    argv = specs["verifier"].argv
    assert argv[argv.index("--bench-fixed-acceptance") + 1] == "0.7"
    gateway = specs["gateway"].argv
    assert fixed_acceptance_label(0.7) in gateway[gateway.index("--draft-name") + 1]
