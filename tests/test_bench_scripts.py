"""Bench scripts documented as ``python bench/<group>/<name>.py`` start from any working directory
(they put the repository root on ``sys.path`` themselves; ``bench`` is not an installed package)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("draft/draft_acceptance.py", "draft/draft_generalization.py", "gpu/gpu_step.py", "cpu/prefill.py")


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help_runs_outside_the_repository(name, tmp_path):
    path = os.path.join(ROOT, "bench", name)
    with open(path) as f:
        assert f"python bench/{name}" in f.read()          # the documented way to run it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, path, "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")
