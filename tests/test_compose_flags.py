"""The coordinator's command line in docker-compose.yml is one the coordinator accepts: its
``${VAR:-default}`` settings expanded as compose does (defaults, or a user's values), its shell
script then run by ``sh`` in the container's environment (``MINEDRAFT_ENGINE``) with the ``exec``
printing the argv instead, which ``coordinator.__main__.parse_args`` turns into a valid
``CoordinatorConfig``. Runs without Docker."""
from __future__ import annotations

import os
import re
import subprocess

import yaml

from coordinator.__main__ import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _coordinator_argv(env: dict[str, str]) -> list[str]:
    with open(os.path.join(ROOT, "docker-compose.yml"), encoding="utf-8") as f:
        compose = yaml.safe_load(f)
    command = compose["services"]["coordinator"]["command"][-1]
    expand = lambda text: re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), text)  # noqa: E731
    script = expand(command).replace("$$", "$").replace("exec python -m coordinator", "printf '%s\\n'")
    engine = expand(compose["services"]["coordinator"]["environment"]["MINEDRAFT_ENGINE"])   # the container's
    out = subprocess.run(["sh", "-c", script], env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                                    "MINEDRAFT_ENGINE": engine}, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_compose_coordinator_flags_parse_with_their_defaults():
    cfg = parse_args(_coordinator_argv({}))
    assert (cfg.mode, cfg.num_speculative_tokens, cfg.max_num_seqs) == ("psd", 4, 16)
    assert (cfg.num_decode_steps, cfg.stream_interval, cfg.stream_interval_ms) == (1, 8, 50)


def test_compose_coordinator_decodes_32_tokens_per_ar_call_on_vllm_unless_told():
    assert parse_args(_coordinator_argv({"MINEDRAFT_ENGINE": "vllm"})).num_decode_steps == 32
    assert parse_args(_coordinator_argv({"MINEDRAFT_ENGINE": "vllm", "MINEDRAFT_DECODE_STEPS": "4"})).num_decode_steps == 4


def test_compose_coordinator_takes_the_users_settings():
    cfg = parse_args(_coordinator_argv({"MINEDRAFT_DECODE_STEPS": "16", "MINEDRAFT_STREAM_INTERVAL": "4",
                                        "MINEDRAFT_STREAM_INTERVAL_MS": "0", "MINEDRAFT_K": "3"}))
    assert (cfg.num_decode_steps, cfg.stream_interval, cfg.num_speculative_tokens) == (16, 4, 3)
    assert cfg.stream_interval_ms == 0
