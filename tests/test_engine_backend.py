"""``--engine vllm`` in the launcher (torch-free): the engines' command lines, the Python that runs
them, the vLLM sizing flags, and the configurations refused before anything starts."""
from __future__ import annotations

import os
import sys

import pytest

from minedraft import engine_backend
from minedraft.engine_backend import SHARED_GPU_UTILIZATION, engine_python, kv_cache_gib
from minedraft.stack import StackConfig, build_service_specs, default_data_plane


def _fake_python() -> str:
    """An executable file standing for the Python with vLLM (nothing runs it here)."""
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="vllm-python-"), "python")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(path, 0o755)
    return path


FAKE_PYTHON = _fake_python()


def _specs(**kwargs):
    cfg = StackConfig(engine="vllm", draft="/draft", engine_python=FAKE_PYTHON, **kwargs)
    return {s.name: s for s in build_service_specs(cfg, "/target")}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_engines_run_in_the_engine_python_with_the_engine_flag():
    specs = _specs(mode="psd", num_speculative_tokens=3, max_num_seqs=2)
    for name in ("verifier", "drafter"):
        argv = specs[name].argv
        assert argv[0] == FAKE_PYTHON and _flag(argv, "--engine") == "vllm"
        assert _flag(argv, "--data-plane") == "inline" and "--kv-cache-space-gib" in argv
    assert _flag(specs["verifier"].argv, "--num-speculative-tokens") == "3"
    for name in ("coordinator", "gateway"):   # torch-free services stay in this Python
        assert specs[name].argv[0] == sys.executable and "--engine" not in specs[name].argv


def test_ar_verifier_is_a_plain_decoding_engine_and_tp_is_vllms_own():
    argv = _specs(mode="ar", tensor_parallel_size=2, device="cuda")["verifier"].argv
    assert _flag(argv, "--num-speculative-tokens") == "0"
    assert _flag(argv, "--tensor-parallel-size") == "2" and "torch.distributed.run" not in argv
    assert "--kv-cache-space-gib" not in argv and _flag(argv, "--gpu-memory-utilization") == "0.85"
    native = build_service_specs(StackConfig(mode="ar", tensor_parallel_size=2), "/target")[0].argv
    assert "torch.distributed.run" in native and "--engine" not in native


def test_a_drafter_sharing_the_gpu_gets_its_share_and_the_verifier_the_rest():
    specs = _specs(device="cuda", drafter_gpu=0)
    assert float(_flag(specs["verifier"].argv, "--gpu-memory-utilization")) == SHARED_GPU_UTILIZATION["verifier"]
    assert float(_flag(specs["drafter"].argv, "--gpu-memory-utilization")) == SHARED_GPU_UTILIZATION["drafter"]
    explicit = _specs(device="cuda", drafter_gpu=0, gpu_memory_utilization=0.6)
    assert _flag(explicit["verifier"].argv, "--gpu-memory-utilization") == "0.6"


def test_cpu_kv_cache_fits_every_slot_at_full_length(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,'
                                          ' "num_hidden_layers": 3, "vocab_size": 100}')
    from safetensors.numpy import save_file
    import numpy as np

    save_file({"w": np.zeros((4, 4), dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    cfg = StackConfig(max_num_seqs=16, max_model_len=8192, num_speculative_tokens=4, dtype="float32")
    tokens = (-(-(8192 + 4) // 128) + 1) * 128   # whole vLLM CPU blocks, plus one
    need = 2 * 3 * 2 * 64 * 4 * tokens * cfg.num_engine_slots / 2**30   # K+V, layers, kv heads, head dim, fp32
    assert need > engine_backend.MIN_KV_GIB and kv_cache_gib(cfg, "verifier", str(tmp_path)) == pytest.approx(need)
    assert kv_cache_gib(cfg, "verifier", str(tmp_path / "missing")) == engine_backend.MIN_KV_GIB


@pytest.mark.parametrize("kwargs, field", [
    ({"data_plane": "dist"}, "data_plane"), ({"data_plane": "ipc"}, "data_plane"),
    ({"max_prefill_tokens": 0}, "max_prefill_tokens"), ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"engine": "tensorrt"}, "engine"), ({"bench_fixed_acceptance": 0.7}, "bench_fixed_acceptance"),
])
def test_vllm_stack_refuses_what_the_vllm_engines_cannot_do(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StackConfig(**{"engine": "vllm", **kwargs})


def test_engine_python_names_the_fix_when_no_python_has_vllm(monkeypatch, tmp_path):
    monkeypatch.setattr(engine_backend.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(engine_backend, "repo_root", lambda: str(tmp_path))
    with pytest.raises(ValueError, match="setup_vllm.sh"):
        engine_python("vllm")
    assert engine_python("native") == sys.executable and engine_python("vllm", sys.executable) == sys.executable
    with pytest.raises(ValueError, match="--engine-python"):
        engine_python("vllm", str(tmp_path / "no-such-python"))
    venv_python = tmp_path / ".venv-vllm" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("")
    assert engine_python("vllm") == str(venv_python)


def test_default_data_plane_is_inline_for_vllm_engines_on_any_device():
    assert default_data_plane("cuda", "native") == "ipc"
    assert default_data_plane("cuda", "vllm") == "inline" == default_data_plane("cpu", "vllm")


def test_vllm_services_refuse_native_tp_flags_before_serving(capsys):
    from verifier_svc.__main__ import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--engine", "native", "--tensor-parallel-size", "2"])
    assert exc.value.code == 2 and "--tensor-parallel-size" in capsys.readouterr().err
    os.environ.pop("WORLD_SIZE", None)
    args = parse_args(["--engine", "vllm", "--tensor-parallel-size", "2", "--num-speculative-tokens", "0"])
    assert args.engine == "vllm" and args.num_speculative_tokens == 0


def test_draft_processes_reach_only_the_drafter_on_either_engine(capsys):
    from drafter_svc.__main__ import parse_args
    from minedraft.cli import build_parser, stack_config

    specs = _specs(mode="psd", draft_processes=2)
    assert _flag(specs["drafter"].argv, "--draft-processes") == "2"
    assert "--draft-processes" not in specs["verifier"].argv and "--draft-processes" not in _specs()["drafter"].argv
    native = {s.name: s for s in build_service_specs(StackConfig(draft="/draft", draft_processes=3), "/target")}
    assert _flag(native["drafter"].argv, "--draft-processes") == "3"
    assert stack_config(build_parser().parse_args(["up", "--draft-processes", "2"]), "psd").draft_processes == 2
    for bad in (0, 1000):
        with pytest.raises(ValueError, match="draft_processes"):
            StackConfig(draft_processes=bad)
    assert parse_args(["--draft", "/d", "--draft-processes", "4"]).draft_processes == 4
    for bad in ("0", "17"):   # 16 slots by default
        with pytest.raises(SystemExit):
            parse_args(["--draft", "/d", "--draft-processes", bad])
        assert f"--draft-processes: must be in [1, --max-num-seqs 16], got {bad}" in capsys.readouterr().err


def test_draft_sessions_reach_only_the_vllm_drafter_and_need_the_vllm_engine(capsys):
    from drafter_svc.__main__ import parse_args
    from minedraft.cli import build_parser, stack_config

    specs = _specs(mode="psd", draft_sessions=True)
    assert "--draft-sessions" in specs["drafter"].argv and "--draft-sessions" not in specs["verifier"].argv
    assert "--draft-sessions" not in _specs(mode="psd")["drafter"].argv
    up = build_parser().parse_args(["up", "--engine", "vllm", "--draft-sessions"])
    assert stack_config(up, "psd").draft_sessions
    with pytest.raises(ValueError, match="draft_sessions"):
        StackConfig(draft_sessions=True)   # the native engine keeps its drafts resident anyway
    assert parse_args(["--draft", "/d", "--engine", "vllm", "--draft-sessions"]).draft_sessions
    with pytest.raises(SystemExit):
        parse_args(["--draft", "/d", "--draft-sessions"])
    assert "--draft-sessions: only with --engine vllm" in capsys.readouterr().err


def test_the_draft_proposer_reaches_the_vllm_drafter_as_k_minus_1_proposer_tokens(capsys):
    from drafter_svc.__main__ import parse_args
    from minedraft.cli import build_parser, stack_config

    drafter = _specs(mode="psd", draft_proposer=True, num_speculative_tokens=5)["drafter"].argv
    at = drafter.index("--draft-proposer-tokens")
    assert drafter[at + 1] == "4" and "--draft-sessions" not in drafter
    assert "--draft-proposer-tokens" not in _specs(mode="psd")["drafter"].argv
    assert "--draft-proposer-tokens" not in _specs(mode="psd", draft_proposer=True)["verifier"].argv
    up = build_parser().parse_args(["up", "--engine", "vllm", "--draft-proposer"])
    assert stack_config(up, "psd").draft_proposer
    for bad in (dict(draft_proposer=True), dict(engine="vllm", draft_proposer=True, num_speculative_tokens=1),
                dict(engine="vllm", draft_proposer=True, draft_sessions=True)):
        with pytest.raises(ValueError, match="draft_proposer"):
            StackConfig(**bad)
    assert parse_args(["--draft", "/d", "--engine", "vllm", "--draft-proposer-tokens", "3"]).draft_proposer_tokens == 3
    for argv in (["--draft-proposer-tokens", "3"], ["--engine", "vllm", "--draft-sessions", "--draft-proposer-tokens", "3"],
                 ["--engine", "vllm", "--draft-proposer-tokens", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(["--draft", "/d", *argv])
        assert "--draft-proposer-tokens" in capsys.readouterr().err
