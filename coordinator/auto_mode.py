"""Automatic choice of ``ar`` / ``sd`` / ``psd`` per step (``--mode auto``; torch-free).

The MineDraft paper runs one fixed mode and names the cases where PSD or SD hurts as limits
(§7): speculation costs more than it gains when verification is compute-bound at a large batch
or when drafts keep being rejected, and two batches cannot both be filled at low load. Here each
step picks the mode with the highest expected committed tokens per ms, from the online
estimates of ``coordinator.cost_model`` (measured Draft/Verify times, acceptance):

    ar:  n / t_verify(n, 0)
    sd:  n * E(alpha, k) / (t_draft(n, k) + t_verify(n, k))           all n requests in one batch
    psd: (n_0 + n_1) * E / (max(t_draft(n_0, k), t_verify(n_1, k)) + max(t_draft(n_1, k), t_verify(n_0, k)))

(two steps, one per batch; E = ``expected_tokens``; k from ``coordinator.adaptive.KChooser``, so
fixed or adaptive). ``psd`` is not considered while the running and waiting requests do not
exceed m (they cannot fill two batches).

Live measurements correct the model: after each step the committed tokens per ms of wall time
it really reached are compared with what the model predicted for the mode it ran; each mode's
estimate is multiplied by its decayed ratio measured / predicted (``calibration``, clamped to
[``MIN_CALIBRATION``, ``MAX_CALIBRATION``]; 1 before ``MIN_CALIBRATION_STEPS`` steps of it), so
costs the model misses (RPC overhead, idle time, serial parts) count against the mode that pays
them. The current mode is kept unless another is better by ``margin`` (hysteresis). While in
``ar`` one ``sd`` step runs every ``probe_every_steps`` steps so the acceptance estimate (otherwise
frozen) can show that drafts pay again (a ``psd`` step every other probe when the requests can
fill two batches, so its timings do not stay stale either); each probe after which ``ar`` still wins doubles that
interval (up to ``max_probe_every_steps``), so a mode that keeps losing costs ever less to probe;
a switch back to speculation resets it. Before any timing is known: ``psd`` when there are more
than m requests, else ``sd``.

Every mode verifies with the exact rejection sampler, so switching never changes outputs'
distribution (greedy outputs stay identical).
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.adaptive import KChooser
from coordinator.config import Mode
from coordinator.cost_model import DEFAULT_DECAY, expected_tokens

REASON_NO_DRAFTER = "drafter_unavailable"
REASON_NO_TIMINGS = "no_timings_yet"
REASON_PROBE = "probe_acceptance"
REASON_GOODPUT = "best_goodput"
REASON_KEPT = "within_margin"
MIN_CALIBRATION, MAX_CALIBRATION = 0.25, 4.0  # bounds of a mode's measured / predicted goodput
MIN_CALIBRATION_STEPS = 3.0  # decayed steps of a mode before its calibration is used


@dataclass(frozen=True)
class AutoConfig:
    """Attributes:
        margin: relative goodput gain needed to leave the current mode, >= 0.
        probe_every_steps: in ``ar``, run one ``sd`` or ``psd`` probe step after this many ``ar`` steps (>= 1).
        max_probe_every_steps: the probe interval's bound while probes keep losing (>= probe_every_steps).
        calibration_decay: weight of the past per step in the measured / predicted ratios, in (0, 1).
    """

    margin: float = 0.05
    probe_every_steps: int = 16
    max_probe_every_steps: int = 256
    calibration_decay: float = DEFAULT_DECAY

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError(f"margin: must be >= 0, got {self.margin}")
        if self.probe_every_steps < 1:
            raise ValueError(f"probe_every_steps: must be >= 1, got {self.probe_every_steps}")
        if self.max_probe_every_steps < self.probe_every_steps:
            raise ValueError(f"max_probe_every_steps: must be >= probe_every_steps, got {self.max_probe_every_steps}")
        if not 0.0 < self.calibration_decay < 1.0:
            raise ValueError(f"calibration_decay: must be in (0, 1), got {self.calibration_decay}")


@dataclass(frozen=True)
class AutoDecision:
    """One step's choice: the mode, why, and the expected goodput (tokens/ms) of each candidate."""

    mode: Mode
    reason: str
    goodput: dict[str, float]

    def attributes(self) -> dict[str, object]:
        """Span attributes (``minedraft.auto.*``)."""
        attrs: dict[str, object] = {"minedraft.auto.mode": str(self.mode), "minedraft.auto.reason": self.reason}
        attrs.update({f"minedraft.auto.goodput_{mode}": value for mode, value in self.goodput.items()})
        return attrs


@dataclass
class _Calibration:
    """Decayed sums of one mode's committed tokens and of the tokens the model predicted over
    the same wall time; their ratio is the mode's measured / predicted goodput."""

    num_tokens: float = 0.0
    num_predicted: float = 0.0
    num_steps: float = 0.0

    def observe(self, num_tokens: int, predicted: float, decay: float) -> None:
        self.num_tokens = decay * self.num_tokens + num_tokens
        self.num_predicted = decay * self.num_predicted + predicted
        self.num_steps = decay * self.num_steps + 1.0

    @property
    def ratio(self) -> float:
        if self.num_steps < MIN_CALIBRATION_STEPS or self.num_predicted <= 0:
            return 1.0
        return min(max(self.num_tokens / self.num_predicted, MIN_CALIBRATION), MAX_CALIBRATION)


class AutoMode:
    """Chooses each step's mode (module docstring). Stateful: the current mode, the ar streak,
    the probe interval and each mode's calibration."""

    def __init__(self, chooser: KChooser, max_num_seqs: int, cfg: AutoConfig = AutoConfig()) -> None:
        self.chooser, self.max_num_seqs, self.cfg = chooser, max_num_seqs, cfg
        self.current: Mode | None = None
        self.probe_every_steps = cfg.probe_every_steps
        self.calibration: dict[str, _Calibration] = {str(m): _Calibration() for m in (Mode.AR, Mode.SD, Mode.PSD)}
        self._num_ar_steps = self._num_probes = 0
        self._last: AutoDecision | None = None
        self._last_inputs: tuple[tuple[int, int], bool] = ((0, 0), False)  # of the last model estimate

    def choose(self, batch_sizes: tuple[int, int], num_waiting: int, is_drafter_available: bool) -> AutoDecision:
        """Mode of the next step for running requests split as ``batch_sizes`` (the Batch
        Manager's two batches) with ``num_waiting`` queued requests."""
        decision = self._decide(batch_sizes, num_waiting, is_drafter_available)
        if self._last is not None and self._last.reason == REASON_PROBE:
            is_losing = decision.mode == Mode.AR
            self.probe_every_steps = (min(2 * self.probe_every_steps, self.cfg.max_probe_every_steps) if is_losing
                                      else self.cfg.probe_every_steps)
        self._num_ar_steps = self._num_ar_steps + 1 if decision.mode == Mode.AR else 0
        if decision.reason != REASON_PROBE:
            self.current = decision.mode
        self._last = decision
        return decision

    def observe_step(self, mode: str, num_emitted: int, wall_ms: float) -> None:
        """The step just run in ``mode`` committed ``num_emitted`` tokens in ``wall_ms`` ms:
        update that mode's calibration against the goodput predicted when it was chosen."""
        last = self._last
        if last is None or str(last.mode) != mode or mode not in last.goodput or wall_ms <= 0:
            return
        # the model after this step's engine times: the ratio keeps only what the model cannot see
        predicted = self.model_goodputs(*self._last_inputs).get(mode, 0.0)
        self.calibration[mode].observe(num_emitted, predicted * wall_ms, self.cfg.calibration_decay)

    def goodputs(self, batch_sizes: tuple[int, int], can_fill_two: bool) -> dict[str, float]:
        """Expected committed tokens per ms of each candidate mode: the model's, times the
        mode's calibration (module docstring)."""
        return {mode: value * self.calibration[mode].ratio
                for mode, value in self.model_goodputs(batch_sizes, can_fill_two).items()}

    def model_goodputs(self, batch_sizes: tuple[int, int], can_fill_two: bool) -> dict[str, float]:
        """Expected committed tokens per ms of each candidate mode from the cost model alone."""
        n0, n1 = batch_sizes
        n = n0 + n1
        cost, alpha = self.chooser.stats.cost, self.chooser.stats.acceptance.alpha
        t_ar = cost.verify_ms(n, 0)
        out = {str(Mode.AR): n / t_ar if t_ar > 0 else 0.0}
        k = self.chooser.batch_k(n, is_parallel=False)
        out[str(Mode.SD)] = self.chooser.goodput(n, k, is_parallel=False)
        if can_fill_two:
            if not (n0 and n1):
                n0, n1 = (n + 1) // 2, n // 2
            k0, k1 = (self.chooser.batch_k(size, is_parallel=True) for size in (n0, n1))
            step_ms = (max(cost.draft_ms(n0, k0), cost.verify_ms(n1, k1))
                       + max(cost.draft_ms(n1, k1), cost.verify_ms(n0, k0)))
            tokens = n0 * expected_tokens(alpha, k0) + n1 * expected_tokens(alpha, k1)
            out[str(Mode.PSD)] = tokens / step_ms if step_ms > 0 else 0.0
        return out

    def _decide(self, batch_sizes: tuple[int, int], num_waiting: int, is_drafter_available: bool) -> AutoDecision:
        if not is_drafter_available:
            return AutoDecision(Mode.AR, REASON_NO_DRAFTER, {})
        can_fill_two = sum(batch_sizes) + num_waiting > self.max_num_seqs
        if not self.chooser.stats.cost.is_known:
            return AutoDecision(Mode.PSD if can_fill_two else Mode.SD, REASON_NO_TIMINGS, {})
        goodput = self.goodputs(batch_sizes, can_fill_two)
        self._last_inputs = (batch_sizes, can_fill_two)
        if self.current == Mode.AR and self._num_ar_steps >= self.probe_every_steps:
            self._num_probes += 1  # sd and psd take turns, so neither keeps a stale estimate
            is_psd = can_fill_two and self._num_probes % 2 == 0
            return AutoDecision(Mode.PSD if is_psd else Mode.SD, REASON_PROBE, goodput)
        best = Mode(max(goodput, key=goodput.get))
        current = str(self.current) if self.current is not None else None
        if current in goodput and goodput[str(best)] <= goodput[current] * (1 + self.cfg.margin):
            return AutoDecision(Mode(current), REASON_KEPT, goodput)
        return AutoDecision(best, REASON_GOODPUT, goodput)
