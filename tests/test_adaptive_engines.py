"""Adaptive k against the real engines: drafter_svc and verifier_svc as processes on tiny Llamas
(draft = target with a perturbed last layer, so some drafts are accepted and some rejected), the
coordinator's step loop in-process. Greedy output with k changing between steps (a k schedule
forced through the production KChooser interface, with rows of different k_i in one Draft and
one Verify call, some requests left undrafted (k = 0) next to drafted ones, and the adaptive
policy itself) must equal the target alone (``ar``) token for
token, in ``sd`` and ``psd``."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys

import pytest
from conftest import _build_tiny_llama
from test_services import _perturbed, free_port

from coordinator.adaptive import NO_DRAFT, KChooser
from coordinator.config import CoordinatorConfig
from coordinator.finish import FinishParams
from coordinator.request import RequestState
from coordinator.server import CoordinatorServicer, start
from minedraft.serving import wait_for_serving_sync
from minedraft.v1 import common_pb2

MAX_NUM_SEQS = 4
K_MAX = 4
START_TIMEOUT_S = 180
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 3, 40, 41, 42], [7, 7, 7], [100, 101], [13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(drafter address, verifier address) of real engine processes on tiny models."""
    root = tmp_path_factory.mktemp("models")
    target, draft = str(root / "target"), str(root / "draft")
    _build_tiny_llama(seed=0).save_pretrained(target)
    _perturbed(_build_tiny_llama(seed=0), scale=0.05).save_pretrained(draft)
    ports = {"drafter": free_port(), "verifier": free_port()}
    common = ["--max-num-seqs", str(2 * MAX_NUM_SEQS), "--max-model-len", "128", "--num-threads", "1", "--grace-s", "1"]
    argv = {"verifier": ["-m", "verifier_svc", "--model", target],
            "drafter": ["-m", "drafter_svc", "--draft", draft, "--model", target]}
    logs = tmp_path_factory.mktemp("logs")
    procs = [subprocess.Popen([sys.executable, *args, "--port", str(ports[name]), *common],
                              stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT)
             for name, args in argv.items()]
    addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    for address in addresses.values():
        wait_for_serving_sync(address, START_TIMEOUT_S)
    yield addresses["drafter"], addresses["verifier"]
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(timeout=30)


class ScheduledK(KChooser):
    """Batch k from a fixed cycle (1, 3, 2, 4, ...), one value per draft decision; per request,
    every third request of a plan (rotating) is left undrafted (k = 0, verified in its own call)
    and every second drafted one drafts one token fewer than the batch (ragged rows, at least 1)."""

    def __init__(self, stats) -> None:
        super().__init__("adaptive", K_MAX, stats)
        self._cycle = itertools.cycle([1, 3, 2, 4, 1, 1, 4])
        self._num_plans = 0

    def batch_k(self, num_requests: int, is_parallel: bool) -> int:
        return next(self._cycle)

    def draft_ks(self, request_ids: list[str], is_parallel: bool) -> dict[str, int]:
        ks = super().draft_ks(request_ids, is_parallel)
        self._num_plans += 1
        drafted = [rid for i, rid in enumerate(ks) if (i + self._num_plans) % 3]
        return {rid: max(1, ks[rid] - drafted.index(rid) % 2) if rid in drafted else NO_DRAFT for rid in ks}


async def _run(engines, mode: str, tag: str, k_policy: str = "fixed", forced: bool = False) -> tuple[list, set]:
    drafter, verifier = engines
    cfg = CoordinatorConfig(mode=mode, num_speculative_tokens=K_MAX, max_num_seqs=MAX_NUM_SEQS, drafter=drafter,
                            verifier=verifier, engine_wait_s=30, k_policy=k_policy)
    servicer = CoordinatorServicer(cfg)
    scheduler, task = await start(cfg, servicer)
    widths, verify = [], scheduler.engines.verify

    async def recording_verify(step_id, request_ids, drafts, *args):
        widths.append(sorted({len(d.token_ids) for d in drafts or ()}))
        return await verify(step_id, request_ids, drafts, *args)

    scheduler.engines.verify = recording_verify
    if forced:
        scheduler.chooser = ScheduledK(scheduler.spec_stats)
    try:
        requests = []
        for i, prompt in enumerate(PROMPTS):
            sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
            request = RequestState(f"{tag}-{i}", prompt, sampling, FinishParams.from_params(sampling))
            scheduler.submit(request)
            requests.append(request)
        await asyncio.wait_for(scheduler.wait_idle(), 120)
        ks = {s.k for s in scheduler.totals.recent if s.num_draft_tokens}
        if forced:  # some steps verified drafted and undrafted requests side by side, some Verify
            assert any(0 < s.num_draft_tokens < s.k * s.num_verify for s in scheduler.totals.recent)
            assert any(len(w) > 1 for w in widths), widths  # calls held rows of different k_i
        return [r.output_token_ids for r in requests], ks
    finally:
        task.cancel()
        await scheduler.engines.close()


@pytest.mark.parametrize("mode", ["sd", "psd"])
def test_greedy_output_with_changing_k_equals_target_alone(engines, mode: str) -> None:
    async def main():
        reference, _ = await _run(engines, "ar", f"ar-{mode}")
        forced, forced_ks = await _run(engines, mode, f"forced-{mode}", "adaptive", forced=True)
        adaptive, _ = await _run(engines, mode, f"adaptive-{mode}", "adaptive")
        assert forced_ks == {1, 2, 3, 4}
        assert forced == reference and adaptive == reference
        assert all(len(out) == 10 + 3 * i for i, out in enumerate(reference))

    asyncio.run(main())
