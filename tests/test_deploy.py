"""The 5-GPU docker-compose deployment validates (``docker-compose config``; Debian package
``docker-compose``, installed by .ci/run). Skipped where the binary is missing."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPOSE = shutil.which("docker-compose")
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="docker-compose binary not installed")


def _compose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([COMPOSE, "-f", os.path.join(ROOT, "docker-compose.yml"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_compose_file_is_valid():
    result = _compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_has_every_service_and_gpu_split():
    result = _compose("config")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    block = re.search(r"^services:\n(.*?)(?=^\S|\Z)", text, flags=re.M | re.S).group(1)
    services = set(re.findall(r"^  ([a-z]+):$", block, flags=re.M))
    assert services == {"jaeger", "verifier", "drafter", "coordinator", "gateway"}
    assert "--nproc-per-node 4" in text and "condition: service_healthy" in text
    assert "- '4'" in text or '- "4"' in text  # drafter on GPU 4
    # engine backend switch: vLLM runs its own TP (no torchrun) and the inline plane in every service
    flat = " ".join(text.split())  # config re-wraps long commands
    assert "--engine vllm --tensor-parallel-size 4" in flat and 'drafter_svc --engine "$$MINEDRAFT_ENGINE"' in flat
    assert flat.count('[ "$$MINEDRAFT_ENGINE" = vllm ] && PLANE=inline') == 2
