"""Load sweep (issue 10): every fixed (mode, k, m), psd with adaptive k and ``--mode auto`` under
closed-loop concurrency 1..64 and one seeded bursty open-loop trace.

``python -m bench.load.load_sweep --out-dir DIR [--device cuda|cpu] [--configs ...] [--concurrencies 1,4,16,64]``

The engines (verifier on GPU 0, drafter on GPU ``--drafter-gpu``, default 1, on ``cuda``; both on this machine's cores on
``cpu``) start once with enough KV slots for the largest configuration; each configuration
(``bench.load.load_sweep_cli``: name syntax, default grid) then gets its own coordinator and gateway
in front of them, a few unmeasured warm-up requests, and its load points
(``bench.load.load_sweep_run``) in order: closed loop at each concurrency, then the bursty trace
(``bench.common.loadgen.bursty_arrivals``, the same arrival times for every configuration). Results
(``bench.load.load_sweep_report``: per point metrics, best fixed configuration, auto/best,
psd-adaptive/sd, goals, greedy outputs vs ``ar`` at temperature 0) are rewritten after every
point to ``results.json``, ``results.md`` and ``load_sweep.png`` in ``--out-dir``; no point starts
once ``--time-budget-s`` is nearly spent (skips are recorded). ``--device cpu`` with tiny
models and limits is the CPU twin that CI runs (tests/test_load_sweep.py).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace

from tqdm import tqdm

from bench.gpu.gpu_stack import Budget, Engines
from bench.gpu.gpu_stack_cli import gpu_names
from bench.load.load_sweep_cli import SweepConfig, parse_args
from bench.load.load_sweep_report import SweepReport
from bench.load.load_sweep_run import PointSpec, closed_point, open_point, prompt_pool, run_point
from bench.common.loadgen import bursty_arrivals
from minedraft.launcher import Stack, resolve_model_dir
from minedraft.placement import default_dtype
from minedraft.stack import (StackConfig, coordinator_spec, drafter_spec, free_loopback_ports, gateway_spec,
                             resolve_draft_dir, verifier_spec)

BURST_LABEL = "bursty"
AR_K = 1  # StackConfig needs k >= 1; an ar coordinator never drafts


def engine_config(args, configs: tuple[SweepConfig, ...]) -> StackConfig:
    """Engines with 2 * ceil(max running / 2) KV slots and the largest k (fresh loopback ports)."""
    max_running = max(c.max_num_running for c in configs)
    gpu_kwargs = (dict(verifier_gpus=(0,), drafter_gpu=args.drafter_gpu, cuda_mps=args.cuda_mps)
                  if args.device == "cuda" else {})
    verifier_port, drafter_port, dist_port = free_loopback_ports(3)
    return StackConfig(mode="psd", num_speculative_tokens=max(max(c.k for c in configs), AR_K),
                       max_num_seqs=(max_running + 1) // 2, target=args.target, draft=args.draft,
                       max_model_len=args.max_model_len, dtype=args.dtype or default_dtype(args.device),
                       device=args.device, verifier_port=verifier_port, drafter_port=drafter_port,
                       dist_port=dist_port, runs_dir=args.logs_dir, startup_timeout_s=args.startup_timeout_s,
                       max_prefill_tokens=args.max_prefill_tokens,
                       max_graph_prefill_tokens=args.max_graph_prefill_tokens, **gpu_kwargs)


class Front:
    """A configuration's coordinator (``sweep``'s mode, k, m, k policy, balancer; step log;
    /metrics) and gateway in front of the shared engines. ``prestart`` spawns the gateway early
    (it loads its tokenizer while the previous configuration still runs, and turns SERVING once
    the coordinator does); ``up`` starts the coordinator, which reads the engines' free KV slots,
    so only after the previous configuration's coordinator is gone."""

    def __init__(self, cfg: StackConfig, sweep: SweepConfig, names: tuple[str, str], run_dir: str,
                 gateway_wait_s: float, log=print) -> None:
        gateway_port, coordinator_port, metrics_port = free_loopback_ports(3)
        self.cfg = replace(cfg, mode=sweep.mode, num_speculative_tokens=max(sweep.k, AR_K), max_num_seqs=sweep.m,
                           k_policy=sweep.k_policy, balancer=sweep.balancer, gateway_port=gateway_port,
                           max_num_batched_tokens=sweep.max_num_batched_tokens,
                           coordinator_port=coordinator_port, metrics_port=metrics_port,
                           step_log=os.path.join(run_dir, "steps.jsonl"))
        self.sweep, self.names, self.log = sweep, names, log
        self.gateway = Stack(replace(self.cfg, startup_timeout_s=gateway_wait_s), run_dir=run_dir)
        self.coordinator = Stack(self.cfg, run_dir=run_dir)
        self._thread: threading.Thread | None = None
        self._is_ready, self._is_stopped = threading.Event(), threading.Event()
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.cfg.gateway_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.metrics_port}/metrics"

    def prestart(self) -> None:
        def gateway_up() -> None:
            try:
                self.gateway.add_services([gateway_spec(self.cfg, *self.names)], self.log)
            except BaseException as exc:  # re-raised by up()
                self._error = exc
            self._is_ready.set()
            self._is_stopped.wait()  # children get PR_SET_PDEATHSIG: the spawning thread outlives the gateway
        self._thread = threading.Thread(target=gateway_up, name=f"gateway-{self.sweep.name}", daemon=True)
        self._thread.start()

    def up(self) -> None:
        """Coordinator started, both SERVING on return. Raises StackError."""
        if self._thread is None:
            self.prestart()
        self.coordinator.add_services([coordinator_spec(self.cfg)], self.log)
        self._is_ready.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self.gateway.stop()
        self.coordinator.stop()
        self._is_stopped.set()
        if self._thread is not None:
            self._thread.join()


def load_points(args) -> list[PointSpec]:
    points = [closed_point(c, args.requests_per_client, args.min_requests, args.max_requests) for c in args.concurrencies]
    if not args.no_burst:
        points.append(open_point(BURST_LABEL, bursty_arrivals(args.burst, args.seed)))
    return points


def run_config(args, front: Front, pool, points, budget: Budget, report: SweepReport, progress) -> None:
    """One configuration: its front up, warm-up, then its load points (each written when it ends)."""
    sweep, start = front.sweep, time.monotonic()
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
                    seed=args.seed)
    front.up()
    if args.num_warmup:
        warmup = closed_point(min(args.num_warmup, sweep.max_num_running), 1, args.num_warmup, args.num_warmup)
        run_point(front.address, pool, warmup, sampling, args.startup_timeout_s, request_prefix="warmup")
    report.note(f"{sweep.name}: front up + warm-up {time.monotonic() - start:.1f} s")
    for point in points:
        progress.set_postfix_str(f"{sweep.name} {point.label}")
        if not budget.allows(f"{sweep.name} {point.label}", progress.write):
            report.note(f"SKIPPED {sweep.name} {point.label}: time budget")
        else:
            metrics, results = run_point(front.address, pool, point, sampling, args.startup_timeout_s,
                                         front.cfg.step_log, front.metrics_url, request_prefix=point.label)
            report.add(sweep, point.label, metrics, results)
            progress.write(f"{sweep.name} {point.label}: {metrics['output_tokens_per_s']:.1f} tok/s, "
                           f"latency p50 {metrics['latency_ms_p50']:.0f} ms, "
                           f"MAL {metrics['mean_acceptance_length']:.2f}")
        progress.update(1)


def schedule(args) -> list[tuple[SweepConfig, str]]:
    """(configuration, log dir) in run order: the configuration list once per ``--rounds``."""
    if args.rounds == 1:
        return [(c, os.path.join(args.logs_dir, c.name)) for c in args.configs]
    return [(c, os.path.join(args.logs_dir, c.name, f"round{r}")) for r in range(args.rounds) for c in args.configs]


def run_configs(args, cfg: StackConfig, names: tuple[str, str], pool, points, budget: Budget, report: SweepReport,
                progress) -> int:
    """Every scheduled configuration in turn, the next one's gateway prestarted; 1 if one failed, else 0."""
    status, fronts, plan = 0, [], schedule(args)
    gateway_wait_s = args.time_budget_s + args.startup_timeout_s
    try:
        for index, (sweep, run_dir) in enumerate(plan):
            if index == 0:
                fronts.append(Front(cfg, sweep, names, run_dir, gateway_wait_s, progress.write))
            front = fronts[-1]
            if index + 1 < len(plan) and budget.left_s() > args.min_point_s:
                fronts.append(Front(cfg, plan[index + 1][0], names, plan[index + 1][1], gateway_wait_s, progress.write))
                fronts[-1].prestart()
            try:
                run_config(args, front, pool, points, budget, report, progress)
            except Exception as exc:  # one failed configuration must not lose the others' results
                report.note(f"FAILED {sweep.name}: {type(exc).__name__}: {str(exc)[-2000:]}")
                status = 1
            finally:
                front.stop()
            if front is fronts[-1] and index + 1 < len(plan):   # budget spent: nothing prestarted
                report.note(f"SKIPPED {[c.name for c, _ in plan[index + 1:]]}: time budget")
                break
    finally:
        for front in fronts:
            front.stop()
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.time_budget_s, args.min_point_s, time.monotonic())
    points = load_points(args)
    pool = prompt_pool(args.prompts, max(p.num_requests for p in points))
    config = {key: value for key, value in vars(args).items() if key not in ("out_dir", "logs_dir", "configs", "burst")}
    config.update(dtype=args.dtype or default_dtype(args.device), burst=vars(args.burst), num_prompts=len(pool),
                  points={p.label: {"kind": p.kind, "num_requests": p.num_requests, "concurrency": p.concurrency}
                          for p in points},
                  gpus=gpu_names(), cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    report = SweepReport(args.out_dir, config, args.configs)
    cfg = engine_config(args, args.configs)
    model_dir = resolve_model_dir(args.target)
    draft_dir = resolve_draft_dir(cfg, model_dir)
    report.config["draft_dir"] = draft_dir
    engines = Engines("engines", args.logs_dir)
    status = 1
    with tqdm(total=args.rounds * len(args.configs) * len(points), desc="load sweep", unit="point") as progress:
        try:
            start = time.monotonic()
            engines.start([verifier_spec(cfg, model_dir), drafter_spec(cfg, model_dir, draft_dir)], progress.write)
            report.note(f"engines SERVING after {time.monotonic() - start:.1f} s ({cfg.num_engine_slots} KV slots each)")
            status = run_configs(args, cfg, (model_dir, os.path.basename(os.path.normpath(draft_dir))), pool,
                                 points, budget, report, progress)
        finally:
            engines.stop()
    report.write()
    print(open(os.path.join(args.out_dir, "results.md"), encoding="utf-8").read())
    return status


if __name__ == "__main__":
    sys.exit(main())
