"""The coordinator's command line in docker-compose.yml is one the coordinator accepts: its
``${VAR:-default}`` settings expanded as compose does (defaults, or a user's values), then parsed
by ``coordinator.__main__.parse_args`` into a valid ``CoordinatorConfig``. Runs without Docker."""
from __future__ import annotations

import os
import re
import shlex

import yaml

from coordinator.__main__ import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _coordinator_argv(env: dict[str, str]) -> list[str]:
    with open(os.path.join(ROOT, "docker-compose.yml"), encoding="utf-8") as f:
        command = yaml.safe_load(f)["services"]["coordinator"]["command"][-1]
    script = command.split("exec python -m coordinator", 1)[1]
    script = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), script)
    return shlex.split(script.replace('"$$PLANE"', "inline"))


def test_compose_coordinator_flags_parse_with_their_defaults():
    cfg = parse_args(_coordinator_argv({}))
    assert (cfg.mode, cfg.num_speculative_tokens, cfg.max_num_seqs) == ("psd", 4, 16)
    assert (cfg.num_decode_steps, cfg.stream_interval) == (1, 8)


def test_compose_coordinator_takes_the_users_settings():
    cfg = parse_args(_coordinator_argv({"MINEDRAFT_DECODE_STEPS": "16", "MINEDRAFT_STREAM_INTERVAL": "4",
                                        "MINEDRAFT_K": "3"}))
    assert (cfg.num_decode_steps, cfg.stream_interval, cfg.num_speculative_tokens) == (16, 4, 3)
