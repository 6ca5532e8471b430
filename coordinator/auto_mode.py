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
exceed m (they cannot fill two batches). The current mode is kept unless another is better by
``margin`` (no flapping on noise). While in ``ar`` an ``sd`` step runs every ``probe_every_steps``
steps so the acceptance estimate (otherwise frozen) can show that drafts pay again. Before any
timing is known: ``psd`` when there are more than m requests, else ``sd``.

Every mode verifies with the exact rejection sampler, so switching never changes outputs'
distribution (greedy outputs stay identical).
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.adaptive import KChooser
from coordinator.config import Mode
from coordinator.cost_model import expected_tokens

REASON_NO_DRAFTER = "drafter_unavailable"
REASON_NO_TIMINGS = "no_timings_yet"
REASON_PROBE = "probe_acceptance"
REASON_GOODPUT = "best_goodput"
REASON_KEPT = "within_margin"


@dataclass(frozen=True)
class AutoConfig:
    """Attributes:
        margin: relative goodput gain needed to leave the current mode, >= 0.
        probe_every_steps: in ``ar``, run one ``sd`` step after this many ``ar`` steps (>= 1).
    """

    margin: float = 0.05
    probe_every_steps: int = 16

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError(f"margin: must be >= 0, got {self.margin}")
        if self.probe_every_steps < 1:
            raise ValueError(f"probe_every_steps: must be >= 1, got {self.probe_every_steps}")


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


class AutoMode:
    """Chooses each step's mode (module docstring). Stateful: the current mode and ar streak."""

    def __init__(self, chooser: KChooser, max_num_seqs: int, cfg: AutoConfig = AutoConfig()) -> None:
        self.chooser, self.max_num_seqs, self.cfg = chooser, max_num_seqs, cfg
        self.current: Mode | None = None
        self._num_ar_steps = 0

    def choose(self, batch_sizes: tuple[int, int], num_waiting: int, is_drafter_available: bool) -> AutoDecision:
        """Mode of the next step for running requests split as ``batch_sizes`` (the Batch
        Manager's two batches) with ``num_waiting`` queued requests."""
        decision = self._decide(batch_sizes, num_waiting, is_drafter_available)
        self._num_ar_steps = self._num_ar_steps + 1 if decision.mode == Mode.AR else 0
        if decision.reason != REASON_PROBE:
            self.current = decision.mode
        return decision

    def goodputs(self, batch_sizes: tuple[int, int], can_fill_two: bool) -> dict[str, float]:
        """Expected committed tokens per ms of each candidate mode."""
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
        if self.current == Mode.AR and self._num_ar_steps >= self.cfg.probe_every_steps:
            return AutoDecision(Mode.SD, REASON_PROBE, goodput)
        best = Mode(max(goodput, key=goodput.get))
        current = str(self.current) if self.current is not None else None
        if current in goodput and goodput[str(best)] <= goodput[current] * (1 + self.cfg.margin):
            return AutoDecision(Mode(current), REASON_KEPT, goodput)
        return AutoDecision(best, REASON_GOODPUT, goodput)
