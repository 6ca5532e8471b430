"""End to end: a psd stack whose drafter runs its engine as two processes (``--draft-processes 2``).

One of the draft processes is killed mid-run: the requests in flight finish with the greedy output
they had before (the coordinator falls back to ``ar``), the drafter notices at once, drains and
exits non-zero, and a restart (what ``minedraft up`` does) brings speculation back.
"""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from minedraft.launcher import restart_exited
from test_draft_processes import spawned_children as _draft_processes
from test_e2e_faults import PROMPT_IDS, _generate, _greedy_batch, self_drafting_stack
from test_e2e_stack import _status


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A psd stack (k = 3, m = 2, the target as its own draft) with a two-process drafter."""
    yield from self_drafting_stack(tmp_path_factory, draft_processes=2)


def test_a_killed_draft_process_restarts_the_drafter_and_output_stays_greedy(stack):
    drafter = stack.service("drafter").process
    assert len(_draft_processes(drafter.pid)) == 2
    max_tokens = 200
    before = _greedy_batch(stack, max_tokens)
    assert sum(r.usage.num_drafts for r in before) > 0
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_greedy_batch, stack, max_tokens)
        deadline = time.monotonic() + 60
        while _status(stack.cfg).num_running < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(_draft_processes(drafter.pid)[0], signal.SIGKILL)
        results = running.result(timeout=240)
    assert [r.token_ids for r in results] == [r.token_ids for r in before]   # greedy output unchanged
    assert drafter.wait(timeout=60) == 1        # it drained and exited non-zero, its other process with it
    assert not _status(stack.cfg).is_drafter_available
    assert restart_exited(stack, {}, log=lambda line: None) == ["drafter"]   # what `minedraft up` does
    assert len(_draft_processes(stack.service("drafter").process.pid)) == 2
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:   # the coordinator probes the drafter every 2 s while requests run
        result = _generate(stack, PROMPT_IDS[0], max_tokens=40, temperature=0, ignore_eos=True)
        if result.usage.num_drafts > 0:
            break
    assert result.usage.num_drafts > 0 and _status(stack.cfg).effective_mode == "psd"
