"""``minedraft.launcher.start_groups``: which services ``Stack.start`` starts beside each other."""
from __future__ import annotations

import pytest

from minedraft import launcher
from minedraft.launcher import Stack, start_groups
from minedraft.stack import ServiceSpec, StackConfig

ALL = ("verifier", "drafter", "coordinator", "gateway")
AR = ("verifier", "coordinator", "gateway")


def _specs(names) -> list[ServiceSpec]:
    return [ServiceSpec(name, [], f"127.0.0.1:{port}") for port, name in enumerate(names, start=50051)]


def _names(groups) -> list[list[str]]:
    return [[spec.name for spec in group] for group in groups]


def test_vllm_engines_sharing_a_gpu_start_one_at_a_time():
    # vLLM sizes its KV cache from the free GPU memory: the drafter must see the verifier's taken
    cfg = StackConfig(engine="vllm", device="cuda", verifier_gpus=(0,), drafter_gpu=0)
    assert _names(start_groups(cfg, _specs(ALL))) == [["verifier"], ["drafter"], ["coordinator", "gateway"]]
    tp = StackConfig(engine="vllm", device="cuda", tensor_parallel_size=2, verifier_gpus=(0, 1), drafter_gpu=1)
    assert _names(start_groups(tp, _specs(ALL))) == [["verifier"], ["drafter"], ["coordinator", "gateway"]]


@pytest.mark.parametrize("cfg", [
    StackConfig(engine="vllm", device="cuda", verifier_gpus=(0,), drafter_gpu=1),
    StackConfig(engine="vllm", device="cuda", tensor_parallel_size=4, verifier_gpus=(0, 1, 2, 3), drafter_gpu=4),
    StackConfig(engine="vllm", device="cpu"),
], ids=["own-gpu", "tp4-5gpu-host", "cpu"])
def test_vllm_engines_on_their_own_memory_start_together_before_the_front(cfg):
    assert _names(start_groups(cfg, _specs(ALL))) == [["verifier", "drafter"], ["coordinator", "gateway"]]


def test_ar_has_no_drafter_to_wait_for():
    for cfg in (StackConfig(engine="vllm", device="cuda", verifier_gpus=(0,), drafter_gpu=0),
                StackConfig(engine="vllm", device="cpu")):
        assert _names(start_groups(cfg, _specs(AR))) == [["verifier"], ["coordinator", "gateway"]]


def test_the_native_engine_starts_everything_at_once():
    cfg = StackConfig(engine="native", device="cuda", verifier_gpus=(0,), drafter_gpu=0)
    assert _names(start_groups(cfg, _specs(ALL))) == [list(ALL)]


def test_stack_start_waits_for_each_group_in_turn(monkeypatch, tmp_path):
    started: list[list[str]] = []
    monkeypatch.setattr(launcher, "check_memory", lambda cfg, model_dir, log: None)
    monkeypatch.setattr(launcher, "build_service_specs", lambda cfg, model_dir: _specs(ALL))
    monkeypatch.setattr(Stack, "add_services", lambda self, specs, log=print, deadline=None: started.append([s.name for s in specs]))
    Stack(StackConfig(engine="vllm", device="cpu", runs_dir=str(tmp_path))).start("/m")
    assert started == [["verifier", "drafter"], ["coordinator", "gateway"]]
