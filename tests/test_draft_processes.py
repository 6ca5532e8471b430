"""``drafter_svc.processes.DraftProcesses``: the draft engine split over processes (native tiny
model on CPU) keeps ``DraftEngine``'s contract: the drafts of one engine, homing that balances the
batch drafted next, refusals that change no state in any process, all-or-none adds, and a dead
process that fails calls at once instead of hanging them."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from drafter_svc.__main__ import parse_args
from drafter_svc.processes import DraftProcesses, DraftProcessError
from drafter_svc.worker import load_worker, process_builds
from specdec.engine.worker_base import DraftCapacityError
from specdec.errors import CapacityError
from specdec.sample.sampling import SamplingParams

MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0.0)


def _args(draft_dir: str, *extra: str):
    return parse_args(["--draft", draft_dir, "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "4",
                       "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "2", "--seed", "7", *extra])


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from conftest import _build_tiny_llama

    path = tmp_path_factory.mktemp("draft")
    _build_tiny_llama(num_layers=1, seed=5).save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def pair(draft_dir):
    """(two processes, one in-process engine of the same model)."""
    processes = DraftProcesses(process_builds(_args(draft_dir, "--draft-processes", "2")), log_level="WARNING")
    yield processes, load_worker(_args(draft_dir))
    processes.close()


def _prompts(n: int) -> list[list[int]]:
    return [[3 + (7 * i + j) % 120 for j in range(5 + i)] for i in range(n)]


def test_child_args_split_the_slots_memory_and_threads_and_the_seed(draft_dir):
    builds = process_builds(_args(draft_dir, "--draft-processes", "3", "--gpu-memory-utilization", "0.3"))
    children = [b.args[0] for b in builds]
    assert [c.max_num_seqs for c in children] == [2, 1, 1]   # the drafter's 4 slots, no more
    assert all(c.draft_processes == 1 and c.num_threads == 1 for c in children)
    assert [c.seed for c in children] == [7, 8, 9]
    assert children[0].gpu_memory_utilization == pytest.approx(0.1)


def test_drafts_and_probs_equal_one_engines_over_calls(pair):
    processes, single = pair
    ids = [f"r{i}" for i in range(4)]
    prompts = _prompts(4)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=11), GREEDY, SamplingParams(temperature=0.8, seed=12)]
    for engine in pair:
        engine.add_requests(list(zip(ids, prompts, params)))
    assert sorted(processes._home.values()) == [0, 0, 1, 1]
    assert processes.facts().num_free_slots == 0 and processes.facts().max_num_seqs == 4
    for n, k in ((MAX_MODEL_LEN, 1), (MAX_MODEL_LEN, 2), (MAX_MODEL_LEN - 3, 4)):   # the engine's own rule
        assert processes.can_draft(n, k) == single.can_draft(n, k)
    sequences = [list(p) for p in prompts]
    committed = [(0, list(p)) for p in prompts]
    try:
        for call in range(3):
            ks = [3, 1, 0, 2] if call == 1 else 3
            got, got_probs = processes.draft(ids, committed, ks)
            want, want_probs = single.draft(ids, committed, ks)
            assert got == want and [len(row) for row in got] == ([3, 1, 0, 2] if call == 1 else [3] * 4)
            assert got_probs.shape == want_probs.shape and torch.allclose(got_probs, want_probs, rtol=1e-4, atol=1e-6)  # batch shapes differ
            # the verifier keeps each row's first draft token and adds one of its own
            committed = [(len(s), [row[0] if row else 5, 9]) for s, row in zip(sequences, got)]
            sequences = [s + tokens for s, (_, tokens) in zip(sequences, committed)]
    finally:
        for engine in pair:
            for rid in ids:
                engine.release(rid)
    assert processes.num_active == 0 and processes.facts().num_free_slots == 4


def test_newcomers_go_where_the_batch_drafted_next_has_fewest_rows(pair):
    processes, _ = pair
    a, b = ["a0", "a1", "a2", "a3"][:2], ["b0", "b1"]
    processes.add_requests([(rid, p, GREEDY) for rid, p in zip(a + b, _prompts(4))])
    try:
        homes = dict(processes._home)
        processes.draft(a, [(0, _prompts(4)[i]) for i in range(2)], 1)   # batch A, then batch B
        processes.draft(b, [(0, _prompts(4)[i + 2]) for i in range(2)], 1)
        gone = next(rid for rid in a if homes[rid] == 0)
        processes.release(gone)                              # batch A lost its row on process 0
        processes.add_requests([("new", _prompts(1)[0], GREEDY)])
        assert processes._home["new"] == 0                   # A is drafted next: it rebalances A
    finally:
        for rid in list(processes._home):
            processes.release(rid)


def test_refusals_change_no_state_in_any_process(pair):
    processes, _ = pair
    ids, prompts = ["x0", "x1"], _prompts(2)
    processes.add_requests([(rid, p, GREEDY) for rid, p in zip(ids, prompts)])
    try:
        first, _ = processes.draft(ids, [(0, p) for p in prompts], 2)
        with pytest.raises(KeyError, match="nope"):
            processes.draft(["x0", "nope"], [(0, prompts[0]), (0, [1])], 2)
        with pytest.raises(ValueError, match="token ids of 'x1'"):
            processes.draft(ids, [(0, prompts[0]), (0, [1, 500])], 2)
        with pytest.raises(ValueError, match="start_position"):
            processes.draft(ids, [(0, prompts[0]), (99, [1])], 2)
        with pytest.raises(DraftCapacityError, match="x1"):
            processes.draft(ids, [(0, prompts[0]), (0, list(range(3, 3 + MAX_MODEL_LEN)))], 2)
        again, _ = processes.draft(ids, [(0, p) for p in prompts], 2)
        assert again == first
        with pytest.raises(ValueError, match="new and distinct"):
            processes.add_requests([("y", [3], GREEDY), ("y", [4], GREEDY)])
        with pytest.raises(CapacityError, match="no free slot"):
            processes.add_requests([(f"z{i}", [3], GREEDY) for i in range(3)])
        # one process refuses its part (a prompt past max_model_len): the other's part is rolled back
        with pytest.raises(CapacityError, match="max_model_len"):
            processes.add_requests([("ok", [3, 4], GREEDY), ("long", [3] * (MAX_MODEL_LEN + 8), GREEDY)])
        assert processes.num_active == 2 and sorted(processes._home) == ids
        processes.add_requests([("ok", [3, 4], GREEDY), ("ok2", [5, 6], GREEDY)])   # their slots are free again
        processes.release("ok")
        processes.release("ok2")
    finally:
        for rid in ids:
            processes.release(rid)


def test_a_dead_process_is_reported_at_once_and_fails_calls(draft_dir):
    lost = threading.Event()
    processes = DraftProcesses(process_builds(_args(draft_dir, "--draft-processes", "2")), log_level="WARNING",
                               on_lost=lost.set)
    try:
        processes.add_requests([("a", [3, 4, 5], GREEDY), ("b", [6, 7, 8], GREEDY)])
        assert not processes.is_lost
        victim = processes._procs[processes._home["b"]]
        os.kill(victim.pid, signal.SIGKILL)
        assert lost.wait(30) and processes.is_lost   # the watcher, before any call
        with pytest.raises(DraftProcessError, match="exit code -9"):
            processes.draft(["a", "b"], [(0, [3, 4, 5]), (0, [6, 7, 8])], 2)
        with pytest.raises(DraftProcessError):
            processes.facts()
    finally:
        processes.close()
    assert not any(proc.is_alive() for proc in processes._procs)


def test_close_is_not_a_loss(draft_dir):
    lost = threading.Event()
    processes = DraftProcesses(process_builds(_args(draft_dir, "--draft-processes", "2")), log_level="WARNING",
                               on_lost=lost.set)
    processes.close()
    assert not any(proc.is_alive() for proc in processes._procs)
    assert not lost.wait(1) and not processes.is_lost


def test_a_process_that_cannot_build_its_engine_fails_the_start(tmp_path):
    args = _args(str(tmp_path / "missing"), "--draft-processes", "2")
    with pytest.raises(DraftProcessError, match="draft process 0 failed to start"):
        DraftProcesses(process_builds(args), log_level="WARNING")


def test_fan_out_stats_log_the_busiest_process_and_the_fan_out_cost(caplog):
    from drafter_svc.fan_out import FanOutStats

    stats = FanOutStats(2, log_every=2)
    with caplog.at_level("INFO", logger="drafter_svc.processes"):
        stats.add(32, 17, 25.0, 24.0)
        assert stats.last == {}
        stats.add(32, 19, 27.0, 26.0)
    assert stats.last == {"calls": 2, "rows": 32.0, "busiest_rows": 18.0, "call_ms": 26.0, "slowest_process_ms": 25.0}
    assert "18.0 in the busiest of 2 (16.0 if even)" in caplog.text and "fan-out and merge 1.0" in caplog.text


def test_a_stuck_process_is_lost_after_the_call_timeout(draft_dir):
    lost = threading.Event()
    processes = DraftProcesses(process_builds(_args(draft_dir, "--draft-processes", "2")), log_level="WARNING",
                               call_timeout_s=2.0, on_lost=lost.set)
    try:
        processes.add_requests([("a", [3, 4, 5], GREEDY), ("b", [6, 7, 8], GREEDY)])
        os.kill(processes._procs[processes._home["b"]].pid, signal.SIGSTOP)
        with pytest.raises(DraftProcessError, match="no answer in 2 s"):
            processes.draft(["a", "b"], [(0, [3, 4, 5]), (0, [6, 7, 8])], 2)
        assert lost.is_set() and processes.is_lost
    finally:
        processes.close()   # kills the stopped process
    assert not any(proc.is_alive() for proc in processes._procs)


def test_a_drafter_whose_warm_up_fails_exits_instead_of_hanging_on_its_processes(draft_dir, tmp_path):
    """The warm-up drafts past ``--max-model-len 4``: the drafter must stop its draft processes and exit 1."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "drafter_svc", "--draft", draft_dir, "--device", "cpu", "--max-num-seqs", "2",
            "--max-model-len", "4", "--port", "0", "--draft-processes", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 1, done.stderr[-2000:]
    assert "draft engine in 2 processes" in done.stderr


def spawned_children(pid: int) -> list[int]:
    """The processes multiprocessing spawned below process ``pid`` (at any depth: a service may
    run under a wrapper process), not multiprocessing's helpers."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = []
        for task in os.listdir(f"/proc/{parent}/task"):   # a child is listed under the thread that started it
            with open(f"/proc/{parent}/task/{task}/children") as f:
                children += [int(child) for child in f.read().split()]
        todo += children
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(child)
    return found


def _is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"   # a zombie nobody reaped yet
    except FileNotFoundError:
        return True


def test_a_draft_process_exits_when_the_drafter_dies_even_mid_build():
    """SIGKILL of the drafter while its draft process builds its engine (here: a 300-s build)."""
    import subprocess
    import sys
    import time

    code = ("import functools, time; from drafter_svc.processes import DraftProcesses; "
            "DraftProcesses([functools.partial(time.sleep, 300)])")
    drafter = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        deadline = time.monotonic() + 60
        while not (children := spawned_children(drafter.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(children) == 1
    finally:
        drafter.kill()
        drafter.wait()
    deadline = time.monotonic() + 15
    while not _is_gone(children[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _is_gone(children[0])



def test_a_draft_process_whose_drafter_died_before_it_started_exits():
    """The drafter died between spawning the process and the process's start (it was re-parented
    before it could look): it exits instead of building its engine (here: a 300-s build)."""
    import subprocess
    import sys

    code = ("import functools, time; from drafter_svc.process_main import serve_engine; "
            "serve_engine(functools.partial(time.sleep, 300), None, 'WARNING', parent_pid=-1)")
    done = subprocess.run([sys.executable, "-c", code], timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 1
