"""Prometheus metrics of the coordinator, named like vLLM's speculative-decoding metrics.

vLLM (V1) exports ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos``; the same counters are
exported here under the ``minedraft:`` prefix, plus PSD's own (DESIGN.md §6): steps by mode and
whether both batches were busy (parallel-step ratio = parallel / all), draft vs verify vs
data-plane time per step, batch sizes and balance (MineDraft paper §5.1). Mean acceptance length
= 1 + num_accepted_tokens / num_drafts.

Each :class:`CoordinatorMetrics` has its own registry, so several coordinators (tests) can live
in one process; ``serve_metrics`` exposes it over HTTP (``/metrics``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from coordinator.emitted import Block
from coordinator.stats import StepStats, StepTotals

_PREFIX = "minedraft:"
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's request-latency buckets (seconds), stretched for CPU serving
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_BATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


class CoordinatorMetrics:
    """Counters, histograms and gauges updated once per step."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter(f"{_PREFIX}spec_decode_num_drafts", "Verified drafts (one per request and verify step with k > 0).", registry=r)
        self.num_draft_tokens = Counter(f"{_PREFIX}spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.num_accepted_tokens = Counter(f"{_PREFIX}spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.num_accepted_per_pos = Counter(f"{_PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                            "Accepted draft tokens by position (0-based).", ["position"], registry=r)
        self.num_generation_tokens = Counter(f"{_PREFIX}generation_tokens",
                                             "Output tokens streamed (prefill's first token and steps).", registry=r)
        self.num_prompt_tokens = Counter(f"{_PREFIX}prompt_tokens", "Prompt tokens of received requests.", registry=r)
        self.num_steps = Counter(f"{_PREFIX}coordinator_steps", "Coordinator steps.", ["mode", "parallel"], registry=r)
        self.step_seconds = Histogram(f"{_PREFIX}coordinator_step_seconds", "Time per step by phase (s).", ["phase"],
                                      buckets=_STEP_BUCKETS_S, registry=r)
        self.batch_size = Gauge(f"{_PREFIX}psd_batch_size", "Requests per PSD batch.", ["batch"], registry=r)
        self.batch_balance = Gauge(f"{_PREFIX}psd_batch_balance", "|batch 1| - |batch 0|.", registry=r)
        self.num_running = Gauge(f"{_PREFIX}num_requests_running", "Running requests.", registry=r)
        self.num_waiting = Gauge(f"{_PREFIX}num_requests_waiting", "Waiting requests.", registry=r)
        self.is_drafter_available = Gauge(f"{_PREFIX}drafter_available", "1 if the drafter is in use.", registry=r)
        self._init_request_metrics(r)
        self._init_psd_metrics(r)

    def _init_request_metrics(self, r: CollectorRegistry) -> None:
        """Latency histograms (seconds from the coordinator's receipt; ``coordinator.tracing``)."""
        self.ttft_seconds = Histogram(f"{_PREFIX}time_to_first_token_seconds", "Time to first token (s).",
                                      buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inter_token_seconds = Histogram(f"{_PREFIX}inter_token_latency_seconds",
                                             "Time per output token after the first (s), per token.",
                                             buckets=_STEP_BUCKETS_S, registry=r)
        self.e2e_seconds = Histogram(f"{_PREFIX}e2e_request_latency_seconds", "End-to-end request latency (s).",
                                     buckets=_LATENCY_BUCKETS_S, registry=r)
        self.num_requests_finished = Counter(f"{_PREFIX}request_success", "Finished requests by finish_reason.",
                                             ["finish_reason"], registry=r)

    def _init_psd_metrics(self, r: CollectorRegistry) -> None:
        """PSD figures of the paper: parallel-step ratio (Table 2), data-plane share (Table 1), batches."""
        self.parallel_step_ratio = Gauge(f"{_PREFIX}psd_parallel_step_ratio",
                                         "Steps where both batches were busy / all steps.", registry=r)
        self.data_plane_time_share = Gauge(f"{_PREFIX}data_plane_time_share",
                                           "Data-plane ms / step wall ms, over all steps.", registry=r)
        self.num_migrations = Counter(f"{_PREFIX}psd_batch_migrations",
                                      "Requests moved between PSD batches by the feedback balancer.", registry=r)
        self.num_lazy_drafter_adds = Counter(f"{_PREFIX}auto_lazy_drafter_adds",
                                             "Requests admitted while auto ran ar, added to the drafter on their first draft.",
                                             registry=r)
        self.auto_decisions = Counter(f"{_PREFIX}auto_mode_decisions", "Steps by the mode --mode auto chose, and why.",
                                      ["mode", "reason"], registry=r)
        self.step_batch_size = Histogram(f"{_PREFIX}step_batch_size", "Requests per step by role.", ["role"],
                                         buckets=_BATCH_BUCKETS, registry=r)

    def observe_step(self, stats: StepStats) -> None:
        """Record one step's count, batch sizes and phase times (its tokens: ``observe_block``)."""
        self.num_steps.labels(mode=stats.mode, parallel=str(stats.is_parallel).lower()).inc()
        self.step_batch_size.labels(role="verify").observe(stats.num_verify)
        self.step_batch_size.labels(role="draft").observe(stats.num_draft)
        for phase, ms in (("draft", stats.draft_ms), ("verify", stats.verify_ms),
                          ("data_plane", stats.data_plane_ms), ("idle", stats.idle_ms), ("wall", stats.wall_ms)):
            self.step_seconds.labels(phase=phase).observe(ms / 1e3)

    def observe_block(self, block: Block) -> None:
        """Count one request's emitted block (``coordinator.emitted``: only tokens that reached the
        client count, after truncation at a stop string, stop id, EOS or max_tokens)."""
        self.num_generation_tokens.inc(block.num_tokens)
        if block.num_draft_tokens == 0:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(block.num_draft_tokens)
        self.num_accepted_tokens.inc(block.num_accepted_tokens)
        for position in range(block.num_draft_tokens):
            self.num_accepted_per_pos.labels(position=str(position)).inc(int(position < block.num_accepted_tokens))

    def observe_totals(self, totals: StepTotals) -> None:
        """Set the ratio gauges from the running totals."""
        self.parallel_step_ratio.set(totals.parallel_step_ratio)
        self.data_plane_time_share.set(totals.data_plane_ms / totals.wall_ms if totals.wall_ms else 0.0)

    def observe_state(self, batch_sizes: tuple[int, int], balance: int, num_running: int, num_waiting: int,
                      is_drafter_available: bool) -> None:
        """Set the gauges of the queue and Batch Manager state."""
        for index, size in enumerate(batch_sizes):
            self.batch_size.labels(batch=str(index)).set(size)
        self.batch_balance.set(balance)
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.is_drafter_available.set(int(is_drafter_available))


def serve_metrics(metrics: CoordinatorMetrics, port: int, host: str = "127.0.0.1") -> None:
    """Expose ``metrics`` at http://host:port/metrics (prometheus_client's HTTP server thread)."""
    start_http_server(port, addr=host, registry=metrics.registry)
