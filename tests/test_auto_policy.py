"""``--mode auto`` in a closed loop on synthetic timing traces (``coordinator.auto_mode``): each
step auto picks a mode, a synthetic drafter/verifier runs it with known costs and acceptance, and
auto learns from the engine times (cost model) and the step's real tokens per ms (calibration).
Checks: ar when drafts are always rejected, with probes that get rarer while they keep losing;
psd when drafting and verification are level; sd when too few requests fill two batches; a cost
the engines' times do not show (overhead outside them) moves auto off the mode that pays it."""

from __future__ import annotations

import collections
import random
from collections.abc import Callable

import pytest

from coordinator.adaptive import KChooser, SpeculationStats
from coordinator.auto_mode import REASON_PROBE, AutoConfig, AutoMode
from coordinator.config import Mode

CostFn = Callable[[int, int], float]  # (rows n, k) -> ms
M, K_MAX = 4, 4


def _accepted(rng: random.Random, alpha: float, k: int) -> int:
    num = 0
    while num < k and rng.random() < alpha:
        num += 1
    return num


class SyntheticEngines:
    """Runs one step of a mode with known draft/verify costs (ms), acceptance ``alpha`` and a
    wall-time factor per mode (``overhead``: costs outside the engines' own timings)."""

    def __init__(self, auto: AutoMode, draft: CostFn, verify: CostFn, alpha: float,
                 overhead: dict[str, float] | None = None, seed: int = 0) -> None:
        self.auto, self.draft, self.verify, self.alpha = auto, draft, verify, alpha
        self.overhead, self.rng, self._verify_first = overhead or {}, random.Random(seed), True
        self.stats: SpeculationStats = auto.chooser.stats

    def step(self, mode: Mode, sizes: tuple[int, int]) -> None:
        n = sum(sizes)
        if mode == Mode.AR:
            wall, tokens = self._verify(n, 0), n
        elif mode == Mode.SD:
            k = self.auto.chooser.batch_k(n, is_parallel=False)
            wall = self._draft(n, k)
            tokens = self._verified(n, k)
            wall += self._verify(n, k)
        else:
            n_verify, n_draft = sizes if self._verify_first else sizes[::-1]
            self._verify_first = not self._verify_first
            k_verify, k_draft = (self.auto.chooser.batch_k(size, is_parallel=True) for size in (n_verify, n_draft))
            wall = max(self._draft(n_draft, k_draft), self._verify(n_verify, k_verify))
            tokens = self._verified(n_verify, k_verify)
        self.auto.observe_step(str(mode), tokens, wall * self.overhead.get(str(mode), 1.0))

    def _draft(self, n: int, k: int) -> float:
        ms = self.draft(n, k)
        self.stats.cost.observe_draft(n, k, ms)
        return ms

    def _verify(self, n: int, k: int) -> float:
        ms = self.verify(n, k)
        self.stats.cost.observe_verify(n, k, ms)
        return ms

    def _verified(self, n: int, k: int) -> int:
        tokens = 0
        for i in range(n):
            num_accepted = _accepted(self.rng, self.alpha, k)
            self.stats.observe_verified(f"r{i}", k, num_accepted)
            tokens += num_accepted + 1
        return tokens


def _run(draft: CostFn, verify: CostFn, alpha: float, sizes: tuple[int, int], num_waiting: int = 0,
         num_steps: int = 300, overhead: dict[str, float] | None = None, policy: str = "adaptive",
         **cfg) -> tuple[AutoMode, list[tuple[Mode, str]]]:
    auto = AutoMode(KChooser(policy, K_MAX, SpeculationStats()), M, AutoConfig(**cfg))
    engines, decisions = SyntheticEngines(auto, draft, verify, alpha, overhead), []
    for _ in range(num_steps):
        decision = auto.choose(sizes, num_waiting, True)
        engines.step(decision.mode, sizes)
        decisions.append((decision.mode, decision.reason))
    return auto, decisions


def _late_modes(decisions: list[tuple[Mode, str]]) -> collections.Counter:
    return collections.Counter(str(mode) for mode, _ in decisions[len(decisions) // 2:])


def test_drafts_always_rejected_settle_on_ar_with_ever_rarer_probes() -> None:
    auto, decisions = _run(lambda n, k: 10.0 * k, lambda n, k: 100.0 + 10.0 * n, alpha=0.0, sizes=(4, 4),
                           num_steps=400, probe_every_steps=8, max_probe_every_steps=128)
    late = _late_modes(decisions)
    assert late["ar"] >= 0.97 * sum(late.values()), late
    probes = [i for i, (_, reason) in enumerate(decisions) if reason == REASON_PROBE]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert 2 <= len(probes) <= 6 and gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0], probes
    assert {decisions[i][0] for i in probes} == {Mode.SD, Mode.PSD}  # both speculative modes refreshed
    assert auto.probe_every_steps > 8


def test_level_draft_and_verify_settle_on_psd() -> None:
    """t_draft(4 rows, k = 4) = 4 * 20 = 80 ms = t_verify (flat): psd hides drafting entirely."""
    _, decisions = _run(lambda n, k: 20.0 * k, lambda n, k: 50.0 + 7.5 * n, alpha=0.7, sizes=(4, 4))
    late = _late_modes(decisions)
    assert late["psd"] >= 0.9 * sum(late.values()), late


def test_too_few_requests_for_two_batches_settle_on_sd() -> None:
    _, decisions = _run(lambda n, k: 5.0 * k, lambda n, k: 100.0 + 5.0 * n, alpha=0.7, sizes=(3, 0))
    assert {str(mode) for mode, _ in decisions} <= {"sd", "ar"}
    late = _late_modes(decisions)
    assert late["sd"] >= 0.95 * sum(late.values()), late


def test_a_cost_outside_the_engine_timings_moves_auto_off_the_mode_paying_it() -> None:
    """The model sees psd ahead of sd by about 15% (drafting 40 ms a token, verify 100 ms + 25 ms a
    row); if psd steps really take 60% longer than their engine times (e.g. a serial data
    plane), the measured calibration hands the load to sd, and only then."""
    draft, verify = (lambda n, k: 40.0 * k), (lambda n, k: 100.0 + 25.0 * n)
    honest, honest_decisions = _run(draft, verify, alpha=0.7, sizes=(4, 4))
    late = _late_modes(honest_decisions)
    assert late["psd"] >= 0.9 * sum(late.values()), late
    slow, slow_decisions = _run(draft, verify, alpha=0.7, sizes=(4, 4), overhead={"psd": 1.6})
    late = _late_modes(slow_decisions)
    assert late["sd"] >= 0.9 * sum(late.values()), late
    assert slow.calibration["psd"].ratio == pytest.approx(1 / 1.6, rel=0.1)
    assert honest.calibration["psd"].ratio == pytest.approx(1.0, rel=0.1)


def test_auto_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_probe_every_steps"):
        AutoConfig(probe_every_steps=16, max_probe_every_steps=8)
    with pytest.raises(ValueError, match="calibration_decay"):
        AutoConfig(calibration_decay=1.0)
