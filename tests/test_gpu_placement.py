"""Device placement of the engine services (minedraft.placement): each child's env and args."""
from __future__ import annotations

import pytest

from minedraft.cli import build_parser, stack_config
from minedraft.placement import CUDA_ENV, NO_GPU, Placement, parse_gpu_list
from minedraft.stack import StackConfig, build_service_specs


def _specs(tmp_path, **kwargs) -> dict:
    cfg = StackConfig(mode="psd", draft=str(tmp_path), **kwargs)
    return {s.name: s for s in build_service_specs(cfg, "target")}


def _arg(spec, flag: str) -> str:
    return spec.argv[spec.argv.index(flag) + 1]


def test_cuda_verifier_gpu0_drafter_gpu1(tmp_path):
    specs = _specs(tmp_path, device="cuda", verifier_gpus=(0,), drafter_gpu=1, dtype="bfloat16")
    assert specs["verifier"].env == {CUDA_ENV: "0"} and _arg(specs["verifier"], "--device") == "cuda:0"
    assert specs["drafter"].env == {CUDA_ENV: "1"} and _arg(specs["drafter"], "--device") == "cuda:0"
    assert specs["coordinator"].env == {CUDA_ENV: ""} and specs["gateway"].env == {CUDA_ENV: ""}
    assert specs["verifier"].cpus == () and specs["drafter"].cpus == ()        # no core pinning on GPU
    assert _arg(specs["verifier"], "--dtype") == "bfloat16"


def test_cuda_tp2_under_torchrun_and_shared_gpu(tmp_path):
    specs = _specs(tmp_path, device="cuda", tensor_parallel_size=2, verifier_gpus=(1, 0), drafter_gpu=0)
    assert "torch.distributed.run" in specs["verifier"].argv
    assert specs["verifier"].env == {CUDA_ENV: "1,0"} and _arg(specs["verifier"], "--device") == "cuda"
    assert specs["drafter"].env == {CUDA_ENV: "0"}
    default = Placement("cuda", tensor_parallel_size=2)
    assert default.resolved_verifier_gpus == (0, 1) and default.resolved_drafter_gpu == 2


def test_cpu_is_unchanged(tmp_path):
    specs = _specs(tmp_path)
    assert all(CUDA_ENV not in s.env for s in specs.values())
    assert _arg(specs["verifier"], "--device") == "cpu" and _arg(specs["drafter"], "--device") == "cpu"


@pytest.mark.parametrize("kwargs, flag", [
    (dict(device="tpu"), "--device"),
    (dict(verifier_gpus=(0,)), "--verifier-gpus"),
    (dict(drafter_gpu=1), "--drafter-gpu"),
    (dict(device="cuda", verifier_gpus=(0, 1)), "--verifier-gpus"),                    # tp = 1
    (dict(device="cuda", tensor_parallel_size=2, verifier_gpus=(0, 0)), "--verifier-gpus"),
    (dict(device="cuda", drafter_gpu=-3), "--drafter-gpu"),
])
def test_validation_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        StackConfig(**kwargs)


@pytest.mark.parametrize("text", ["a", "0,-1", "0,,1"])
def test_parse_gpu_list_errors(text):
    with pytest.raises(ValueError, match="--verifier-gpus"):
        parse_gpu_list(text)


def test_cli_flags_and_dtype_default():
    parser = build_parser()
    args = parser.parse_args(["up", "--device", "cuda", "--verifier-gpus", "0", "--drafter-gpu", "1"])
    cfg = stack_config(args, "psd")
    assert (cfg.device, cfg.verifier_gpus, cfg.drafter_gpu, cfg.dtype) == ("cuda", (0,), 1, "bfloat16")
    cpu = stack_config(parser.parse_args(["up"]), "psd")
    assert (cpu.device, cpu.dtype, cpu.drafter_gpu, cpu.bench_fixed_acceptance) == ("cpu", "float32", NO_GPU, None)
    explicit = stack_config(parser.parse_args(["up", "--device", "cuda", "--dtype", "float16"]), "psd")
    assert explicit.dtype == "float16"
