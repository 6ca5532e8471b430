"""The whole MineDraft stack on GPUs: ar, sd and psd through the gateway (issue 8, GPU part).

``python -m bench.gpu.gpu_stack --out-dir DIR --target T [--parts a,b,c,d] [--device cuda] ...``

Parts (each runs only while ``--time-budget-s`` lasts; results are written after every run):

- ``a``: the real target (SmolLM2-135M-Instruct) and its distilled draft; verifier on GPU 0,
  drafter on GPU 1; ar, sd, psd on the same Spec-Bench prompts; at temperature 0 the outputs of
  sd and psd are compared with ar's.
- ``b``: standard SD given the same hardware: two data-parallel ``sd`` replicas, one per GPU
  (each with its drafter and verifier on that GPU), the prompts split between them.
- ``c``: paper scale, ``--paper-target`` (random:llama-8b) and ``--paper-draft``
  (random:qwen3-0.6b), random weights, acceptance fixed by the BENCHMARK-ONLY
  ``--bench-fixed-acceptance`` (``specdec.sample.fixed_acceptance``): ar, sd, psd, every output labelled.
- ``d``: part b at paper scale (two sd replicas of the random models, same fixed acceptance).

The engines of a part are started once; each mode then gets its own coordinator and gateway
in front of them (the engines are mode-agnostic), so a mode switch does not reload models.
Metrics per run: ``minedraft.prompts.summarize`` (output tokens/s, TTFT and end-to-end latency
p50/p99 in ms, mean acceptance length). Outputs: ``results.json`` and ``results.md`` in
``--out-dir``; service logs under ``--logs-dir``.
With ``--device cpu`` the same script runs on this machine (tiny limits) as its CPU twin.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, replace

from bench.gpu.gpu_stack_cli import gpu_names, parse_args
from bench.gpu.gpu_stack_report import Report, RunResult, merge_runs, summarize_step_log
from specdec.sample.bench_only import fixed_acceptance_label
from minedraft.launcher import Stack, resolve_model_dir
from minedraft.placement import default_dtype
from minedraft.prompts import PromptsConfig, run_prompts
from minedraft.stack import (StackConfig, coordinator_spec, drafter_spec, free_loopback_ports, gateway_spec,
                             resolve_draft_dir, verifier_spec)

REPLICA_GPUS = (0, 1)
RANDOM_TOKENIZER_ENV = "MINEDRAFT_RANDOM_TOKENIZER"   # specdec.models.random_models: tokenizer of random:<preset>


@dataclass(frozen=True)
class Budget:
    """Wall-clock budget of the whole benchmark (seconds since ``start``)."""

    total_s: float
    min_run_s: float
    start: float = 0.0

    def left_s(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    def allows(self, what: str, log=print) -> bool:
        """Whether ``min_run_s`` is still left; logs a skip otherwise."""
        if self.left_s() >= self.min_run_s:
            return True
        log(f"SKIPPED {what}: {self.left_s():.0f} s of the time budget left (< {self.min_run_s:.0f} s)")
        return False


def _ports(count: int) -> list[int]:
    return free_loopback_ports(count)


def engine_config(args, target: str, draft: str, verifier_gpu: int, drafter_gpu: int,
                  fixed_acceptance: float | None, dtype: str | None = None) -> StackConfig:
    """The StackConfig shared by a part's engines and fronts (fresh loopback ports)."""
    gpu_kwargs = dict(verifier_gpus=(verifier_gpu,), drafter_gpu=drafter_gpu) if args.device == "cuda" else {}
    verifier_port, drafter_port, dist_port = _ports(3)
    return StackConfig(mode="psd", num_speculative_tokens=args.k, max_num_seqs=args.max_num_seqs,
                       target=target, draft=draft, max_model_len=args.max_model_len,
                       dtype=dtype or args.dtype or default_dtype(args.device), device=args.device,
                       verifier_port=verifier_port, drafter_port=drafter_port, dist_port=dist_port,
                       runs_dir=args.logs_dir, startup_timeout_s=args.startup_timeout_s,
                       bench_fixed_acceptance=fixed_acceptance, **gpu_kwargs)


class Engines:
    """A part's running engines (verifier and/or drafter processes), started once."""

    def __init__(self, name: str, logs_dir: str) -> None:
        self.stack = Stack(StackConfig(runs_dir=logs_dir), run_dir=os.path.join(logs_dir, name))

    def start(self, specs, log=print) -> None:
        self.stack.add_services(specs, log)

    def stop(self) -> None:
        self.stack.stop()


def _draft_name(cfg: StackConfig, model_dir: str) -> str:
    name = os.path.basename(os.path.normpath(resolve_draft_dir(cfg, model_dir)))
    if cfg.bench_fixed_acceptance is not None:
        name += f" [{fixed_acceptance_label(cfg.bench_fixed_acceptance)}]"
    return name


def start_front(cfg: StackConfig, mode: str, model_dir: str, run_dir: str, log=print) -> tuple[Stack, StackConfig]:
    """A coordinator (``mode``) and gateway in front of ``cfg``'s engines; SERVING on return."""
    gateway_port, coordinator_port = _ports(2)
    front_cfg = replace(cfg, mode=mode, gateway_port=gateway_port, coordinator_port=coordinator_port,
                        step_log=os.path.join(run_dir, "steps.jsonl"))
    front = Stack(front_cfg, run_dir=run_dir)
    try:
        front.add_services([coordinator_spec(front_cfg), gateway_spec(front_cfg, model_dir, _draft_name(cfg, model_dir))], log)
    except BaseException:
        front.stop()
        raise
    return front, front_cfg


def prompts_config(args, front_cfg: StackConfig, path: str, concurrency: int, ignore_eos: bool) -> PromptsConfig:
    return PromptsConfig(path=path, gateway=f"{front_cfg.host}:{front_cfg.gateway_port}", limit=args.limit,
                         concurrency=concurrency, max_tokens=args.max_tokens, temperature=args.temperature,
                         seed=args.seed, ignore_eos=ignore_eos, wait_s=args.startup_timeout_s)


def run_modes(args, part: str, cfg: StackConfig, model_dir: str, budget: Budget, report, log=print) -> None:
    """ar, sd, psd in turn in front of the part's engines (``2m`` requests in flight each)."""
    for mode in args.modes:
        if not budget.allows(f"part {part} {mode}", log):
            report.skip(part, mode, "time budget")
            continue
        log(f"\n=== part {part}: {mode} ===")
        front, front_cfg = start_front(cfg, mode, model_dir, os.path.join(args.logs_dir, f"{part}-{mode}"), log)
        try:
            metrics, results = run_prompts(prompts_config(args, front_cfg, args.prompts, 2 * args.max_num_seqs,
                                                          ignore_eos=cfg.bench_fixed_acceptance is not None))
        finally:
            front.stop()
        metrics.update(summarize_step_log(front_cfg.step_log))
        report.add(part, RunResult(mode, metrics, results))
        log(report.summary_line(part, mode))


def run_replicas(args, part: str, cfgs: list[StackConfig], model_dir: str, budget: Budget, report, log=print) -> None:
    """Two ``sd`` replicas at once, each with half the prompts (``m`` in flight each: 2m in all)."""
    if not budget.allows(f"part {part} 2x sd", log):
        report.skip(part, "2x sd", "time budget")
        return
    log(f"\n=== part {part}: 2x sd (one replica per GPU) ===")
    halves = split_prompts(args.prompts, args.limit, os.path.join(args.logs_dir, f"{part}-prompts"))
    fronts = [start_front(cfg, "sd", model_dir, os.path.join(args.logs_dir, f"{part}-sd{i}"), log)
              for i, cfg in enumerate(cfgs)]
    outcomes: list = [None] * len(fronts)

    def one(index: int) -> None:
        try:
            outcomes[index] = run_prompts(prompts_config(args, fronts[index][1], halves[index], args.max_num_seqs,
                                                         ignore_eos=cfgs[index].bench_fixed_acceptance is not None))
        except Exception as exc:  # reported below, after both threads ended
            outcomes[index] = exc

    start = time.perf_counter()
    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(fronts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for front, _ in fronts:
            front.stop()
    errors = [o for o in outcomes if isinstance(o, Exception)]
    if errors:
        raise errors[0]
    run = merge_runs("2x sd", [results for _, results in outcomes], time.perf_counter() - start)
    for index, (_, front_cfg) in enumerate(fronts):   # per replica: their steps overlap in time
        run.metrics[f"replica{index}_steps"] = summarize_step_log(front_cfg.step_log)
    report.add(part, run)
    log(report.summary_line(part, "2x sd"))


def spread_prompts(path: str, limit: int, out_path: str) -> str:
    """Writes ``limit`` rows of ``path`` evenly spaced through it (row ``floor(i * n / limit)``)
    to ``out_path`` and returns it: a Spec-Bench file lists its categories one after another."""
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip()]
    chosen = [rows[i * len(rows) // limit] for i in range(min(limit, len(rows)))]
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        f.writelines(chosen)
    return out_path


def split_prompts(path: str, limit: int, out_dir: str) -> list[str]:
    """The first ``limit`` rows of ``path`` dealt alternately into two files (one per replica)."""
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip()][:limit]
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"half{i}.jsonl") for i in range(2)]
    for i, out in enumerate(paths):
        with open(out, "w", encoding="utf-8") as f:
            f.writelines(rows[i::2])
    return paths


def _replica_configs(cfg: StackConfig, device: str) -> list[StackConfig]:
    """Replica 0 = the running verifier (GPU 0) + a new drafter on GPU 0; replica 1 = a new
    verifier on GPU 1 + the running drafter (GPU 1). On cpu: a new drafter and a new verifier."""
    drafter_port, verifier_port = _ports(2)
    if device == "cuda":
        return [replace(cfg, drafter_gpu=REPLICA_GPUS[0], drafter_port=drafter_port),
                replace(cfg, verifier_gpus=(REPLICA_GPUS[1],), verifier_port=verifier_port)]
    return [replace(cfg, drafter_port=drafter_port), replace(cfg, verifier_port=verifier_port)]


def run_pair(args, parts: tuple[str, str], target: str, draft: str, fixed_acceptance: float | None,
             dtype: str | None, budget: Budget, report, log=print) -> None:
    """A part's modes (verifier GPU 0, drafter GPU 1), then its 2x sd replicas on the same models."""
    modes_part, replicas_part = parts
    wanted = [p for p in parts if p in args.parts]
    if not wanted or not budget.allows(f"parts {'/'.join(wanted)}", log):
        for part in wanted:
            report.skip(part, "all runs", "time budget")
        return
    model_dir = resolve_model_dir(target)
    cfg = engine_config(args, target, draft, 0, args.drafter_gpu, fixed_acceptance, dtype)
    report.note(modes_part, f"engine dtype {cfg.dtype}")
    engines = Engines(f"{modes_part}-engines", args.logs_dir)
    extra = Engines(f"{replicas_part}-engines", args.logs_dir)
    try:
        start = time.monotonic()
        engines.start([verifier_spec(cfg, model_dir), drafter_spec(cfg, model_dir, resolve_draft_dir(cfg, model_dir))], log)
        report.note(modes_part, f"engines SERVING after {time.monotonic() - start:.1f} s")
        if modes_part in args.parts:
            run_modes(args, modes_part, cfg, model_dir, budget, report, log)
        if replicas_part in args.parts and args.device == "cuda" and args.drafter_gpu == 0:
            report.skip(replicas_part, "2x sd", "one GPU (--drafter-gpu 0): no second replica GPU")
        elif replicas_part in args.parts and budget.allows(f"part {replicas_part} engines", log):
            replicas = _replica_configs(cfg, args.device)
            extra.start([drafter_spec(replicas[0], model_dir, resolve_draft_dir(cfg, model_dir)),
                         verifier_spec(replicas[1], model_dir)], log)
            run_replicas(args, replicas_part, replicas, model_dir, budget, report, log)
    finally:
        extra.stop()
        engines.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.time_budget_s, args.min_run_s, time.monotonic())
    config = {key: value for key, value in vars(args).items() if key not in ("out_dir", "logs_dir")}
    config["dtype"] = args.dtype or default_dtype(args.device)
    config["paper_dtype"] = args.paper_dtype or default_dtype(args.device)
    config.update(gpus=gpu_names(), cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    if args.spread:
        args.prompts = spread_prompts(args.prompts, args.limit, os.path.join(args.logs_dir, "prompts.jsonl"))
    report = Report(args.out_dir, config)
    status = 0
    plans = ((("a", "b"), args.target, args.draft, None, args.dtype),
             (("c", "d"), args.paper_target, args.paper_draft, args.fixed_acceptance, args.paper_dtype))
    for parts, target, draft, fixed, dtype in plans:
        try:
            run_pair(args, parts, target, draft, fixed, dtype, budget, report)
        except Exception as exc:  # a failed part must not lose the others' results
            print(f"error in parts {parts}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            report.note(parts[0], f"FAILED: {type(exc).__name__}: {str(exc)[-3000:]}")
            status = 1
        if parts == ("a", "b") and os.environ.get(RANDOM_TOKENIZER_ENV) is None and args.target.endswith(".gguf"):
            os.environ[RANDOM_TOKENIZER_ENV] = resolve_model_dir(args.target)  # random:<preset> tokenizer
    report.write()
    print(open(os.path.join(args.out_dir, "results.md"), encoding="utf-8").read())
    return status


if __name__ == "__main__":
    sys.exit(main())
