"""``--cuda-mps``: flags, the private daemon's lifecycle and which children join it.

CI has no NVIDIA driver, so ``nvidia-cuda-mps-control`` is a stand-in shell script on ``PATH`` that
records how it was called (and, at ``quit``, which engine pids were still alive); the real daemon
ran on an H200 (bench/results/HISTORY.md, runs 17-18).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import replace

import pytest

from bench.load.load_sweep_cli import parse_args as parse_sweep_args
from minedraft import cuda_mps
from minedraft.banner import banner_lines
from minedraft.cli import build_parser, stack_config
from minedraft.cuda_mps import LOG_ENV, MPS_CONTROL, PIPE_DIR_FILE, PIPE_ENV, CudaMpsDaemon, CudaMpsError
from minedraft.launcher import Stack
from minedraft.placement import CUDA_ENV, MPS_SM_ENV, Placement
from minedraft.stack import ServiceSpec, StackConfig, coordinator_spec, drafter_spec, verifier_spec

CONTROL_SCRIPT = """#!/bin/sh
[ -z "${HANG_S:-}" ] || sleep "$HANG_S"
input="$(cat)"
alive=""
if [ -f "${CHILD_PIDS:-/nonexistent}" ]; then
  for pid in $(cat "$CHILD_PIDS"); do kill -0 "$pid" 2>/dev/null && alive="$alive $pid"; done
fi
printf '%s|%s|%s|%s|%s\\n' "$*" "${CUDA_MPS_PIPE_DIRECTORY:-}" "${CUDA_MPS_LOG_DIRECTORY:-}" "$input" "$alive" >> "$CALLS"
exit "${EXIT_CODE:-0}"
"""
SLEEP_CODE = "import time; time.sleep(120)"


@pytest.fixture
def temp_root(monkeypatch):
    """A short, private system temp dir (``tempfile.tempdir``): what it holds afterwards leaked."""
    root = tempfile.mkdtemp(prefix="mdt-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def control(tmp_path, monkeypatch, temp_root):
    """A stand-in ``nvidia-cuda-mps-control`` first on PATH; returns the file its calls go to."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    script = bin_dir / MPS_CONTROL
    script.write_text(CONTROL_SCRIPT)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CALLS", str(calls))
    return calls


def _calls(path) -> list[list[str]]:
    return [line.split("|") for line in path.read_text().splitlines()] if path.exists() else []


def test_daemon_starts_with_its_own_pipe_dir_and_quits(control, tmp_path, temp_root, monkeypatch):
    monkeypatch.chdir(tmp_path)
    daemon = CudaMpsDaemon.started("run")  # a relative run dir: the daemon gets an absolute log dir
    log_dir = str(tmp_path / "run" / "mps")
    assert daemon.is_running and os.path.dirname(daemon.pipe_dir) == temp_root and os.path.isdir(log_dir)
    assert daemon.env == {PIPE_ENV: daemon.pipe_dir, LOG_ENV: log_dir}
    assert open(os.path.join(log_dir, PIPE_DIR_FILE)).read().strip() == daemon.pipe_dir
    daemon.stop()
    daemon.stop()  # idempotent
    assert _calls(control) == [["-d", daemon.pipe_dir, log_dir, "", ""], ["", daemon.pipe_dir, log_dir, "quit", ""]]
    assert not daemon.is_running and os.listdir(temp_root) == []


def test_a_failing_missing_or_hanging_control_program_names_the_flag(control, tmp_path, temp_root, monkeypatch):
    monkeypatch.setenv("EXIT_CODE", "3")
    with pytest.raises(CudaMpsError, match="--cuda-mps: .* exited with code 3"):
        CudaMpsDaemon.started(str(tmp_path / "run"))
    with pytest.raises(CudaMpsError, match="--cuda-mps: no-such-mps-control not found on PATH"):
        CudaMpsDaemon.started(str(tmp_path / "run"), control="no-such-mps-control")
    monkeypatch.setenv("HANG_S", "5")
    monkeypatch.setattr(cuda_mps, "CONTROL_TIMEOUT_S", 0.3)
    with pytest.raises(CudaMpsError, match="--cuda-mps: .* -d: .*timed out"):
        CudaMpsDaemon.started(str(tmp_path / "run"))
    assert os.listdir(temp_root) == []  # no failed start leaves its pipe dir


def test_a_temp_dir_too_long_for_the_control_socket(control, tmp_path, temp_root, monkeypatch):
    long_dir = os.path.join(temp_root, "x" * 100)
    os.makedirs(long_dir)
    monkeypatch.setattr(tempfile, "tempdir", long_dir)
    monkeypatch.setattr(cuda_mps, "FALLBACK_TEMP_DIR", temp_root)
    daemon = CudaMpsDaemon.started(str(tmp_path / "run"))
    assert os.path.dirname(daemon.pipe_dir) == temp_root and len(daemon.pipe_dir) + len("/control") <= 107
    daemon.stop()
    monkeypatch.setattr(cuda_mps, "FALLBACK_TEMP_DIR", long_dir)
    with pytest.raises(CudaMpsError, match="--cuda-mps: no temp dir short enough"):
        CudaMpsDaemon.started(str(tmp_path / "run"))
    assert os.listdir(long_dir) == [] and os.listdir(temp_root) == ["x" * 100]


def _spawn_env_dump(stack: Stack, spec: ServiceSpec, out) -> dict[str, str]:
    """Spawn ``spec``'s name, env and MPS flag with a command that writes its environment to ``out``."""
    code = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    service = stack._spawn(replace(spec, argv=[sys.executable, "-c", code]))
    assert service.process.wait(timeout=60) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("is_mps", [True, False])
def test_the_engines_join_one_daemon_which_stop_quits(control, tmp_path, is_mps):
    cfg = StackConfig(device="cuda", verifier_gpus=(0,), drafter_gpu=0, cuda_mps=is_mps, runs_dir=str(tmp_path))
    specs = [verifier_spec(cfg, "/m"), drafter_spec(cfg, "/m", "/d"), coordinator_spec(cfg)]
    # a Stack whose own config knows nothing of MPS, as bench's Engines: the specs decide
    stack = Stack(StackConfig(runs_dir=str(tmp_path)), run_dir=str(tmp_path / "run"))
    os.makedirs(stack.run_dir)
    envs = {spec.name: _spawn_env_dump(stack, spec, tmp_path / f"{spec.name}.json") for spec in specs}
    assert PIPE_ENV not in envs["coordinator"] and envs["coordinator"][CUDA_ENV] == ""  # torch-free: no GPU
    if is_mps:
        pipe_dir = stack.mps.pipe_dir
        assert envs["verifier"][PIPE_ENV] == envs["drafter"][PIPE_ENV] == pipe_dir
        assert envs["verifier"][CUDA_ENV] == envs["drafter"][CUDA_ENV] == "0"
        assert [call[0] for call in _calls(control)] == ["-d"]  # one daemon for both engines
    else:
        assert stack.mps is None and PIPE_ENV not in envs["verifier"] and _calls(control) == []
    stack.stop()
    assert stack.mps is None
    assert [call[3] for call in _calls(control)] == (["", "quit"] if is_mps else [])


def test_stop_quits_the_daemon_only_after_the_engines_exited(control, tmp_path, monkeypatch):
    cfg = StackConfig(device="cuda", verifier_gpus=(0,), drafter_gpu=0, cuda_mps=True, runs_dir=str(tmp_path))
    stack = Stack(cfg, run_dir=str(tmp_path / "run"))
    os.makedirs(stack.run_dir)
    pids = tmp_path / "pids.txt"
    monkeypatch.setenv("CHILD_PIDS", str(pids))
    for spec in (verifier_spec(cfg, "/m"), drafter_spec(cfg, "/m", "/d")):
        stack.services.append(stack._spawn(replace(spec, argv=[sys.executable, "-c", SLEEP_CODE])))
    pids.write_text(" ".join(str(s.process.pid) for s in stack.services))
    assert all(s.process.poll() is None for s in stack.services)
    stack.stop()
    calls = _calls(control)
    assert [call[3] for call in calls] == ["", "quit"] and calls[1][4] == ""  # no engine alive at quit


def test_a_tensor_parallel_verifier_joins_too():
    cfg = StackConfig(device="cuda", tensor_parallel_size=2, verifier_gpus=(0, 1), drafter_gpu=1, cuda_mps=True)
    spec = verifier_spec(cfg, "/m")
    assert "torch.distributed.run" in spec.argv and spec.is_cuda_mps and spec.env[CUDA_ENV] == "0,1"
    assert not verifier_spec(replace(cfg, cuda_mps=False), "/m").is_cuda_mps


def test_ar_runs_its_verifier_outside_mps(tmp_path):
    cfg = StackConfig(mode="ar", device="cuda", verifier_gpus=(0,), drafter_gpu=0, cuda_mps=True)
    assert not cfg.uses_cuda_mps and not verifier_spec(cfg, "/m").is_cuda_mps
    assert verifier_spec(replace(cfg, mode="psd"), "/m").is_cuda_mps
    assert any("CUDA MPS: not used" in line for line in banner_lines(cfg, "runs/x"))
    stack = Stack(cfg, run_dir=str(tmp_path / "run"))
    assert stack._mps_env(verifier_spec(cfg, "/m")) == {} and stack.mps is None


def test_flags_and_validation():
    parser = build_parser()
    up = parser.parse_args(["up", "--device", "cuda", "--verifier-gpus", "0", "--drafter-gpu", "0", "--cuda-mps"])
    cfg = stack_config(up, up.mode)
    assert cfg.cuda_mps and cfg.placement.cuda_mps and cfg.placement.is_shared_gpu
    assert not stack_config(parser.parse_args(["up"]), "psd").cuda_mps
    with pytest.raises(ValueError, match="--cuda-mps: only with --device cuda"):
        StackConfig(device="cpu", cuda_mps=True)
    assert not Placement("cuda", (0,), 1).is_shared_gpu and not Placement("cpu").is_shared_gpu
    base = ["--out-dir", "x", "--configs", "psd-k4-m16"]
    assert parse_sweep_args(base + ["--cuda-mps"]).cuda_mps and not parse_sweep_args(base).cuda_mps
    with pytest.raises(SystemExit):
        parse_sweep_args(base + ["--device", "cpu", "--cuda-mps"])


def test_banner_says_whether_the_shared_gpu_runs_under_mps():
    shared = StackConfig(device="cuda", verifier_gpus=(0,), drafter_gpu=0)
    assert any("--cuda-mps lets them run at the same time" in line for line in banner_lines(shared, "runs/x"))
    with_mps = StackConfig(device="cuda", verifier_gpus=(0,), drafter_gpu=0, cuda_mps=True)
    assert any("CUDA MPS: on" in line for line in banner_lines(with_mps, "runs/x"))
    for cfg in (StackConfig(device="cuda", verifier_gpus=(0,), drafter_gpu=1), StackConfig(),
                StackConfig(mode="ar", device="cuda", verifier_gpus=(0,), drafter_gpu=0)):
        assert not any("mps" in line.lower() for line in banner_lines(cfg, "runs/x"))


def test_verifier_sm_share_reaches_only_an_mps_verifier():
    parser = build_parser()
    up = parser.parse_args(["up", "--device", "cuda", "--verifier-gpus", "0", "--drafter-gpu", "0", "--cuda-mps",
                            "--cuda-mps-verifier-sm-percent", "70"])
    cfg = stack_config(up, "psd")
    assert cfg.verifier_sm_percent == 70 and cfg.placement.verifier_sm_percent == 70
    assert verifier_spec(cfg, "/m").env[MPS_SM_ENV] == "70"
    assert MPS_SM_ENV not in drafter_spec(cfg, "/m", "/d").env   # the drafter keeps every SM
    assert any("at most 70% of the SMs" in line for line in banner_lines(cfg, "runs/x"))
    assert MPS_SM_ENV not in verifier_spec(replace(cfg, mode="ar"), "/m").env   # ar: not an MPS client
    assert MPS_SM_ENV not in verifier_spec(replace(cfg, verifier_sm_percent=100), "/m").env


@pytest.mark.parametrize("percent, mps", [(0, True), (101, True), (-5, True), (70, False)])
def test_verifier_sm_share_out_of_range_or_without_mps_is_refused_naming_the_flag(percent, mps):
    with pytest.raises(ValueError, match="--cuda-mps-verifier-sm-percent"):
        StackConfig(device="cuda", verifier_gpus=(0,), drafter_gpu=0, cuda_mps=mps, verifier_sm_percent=percent)
