"""``python -m bench.engines.engines_compare``: our modes on both engine backends against vLLM itself (issue 24).

Every system serves the same OpenAI-compatible chat API and is driven by the same streaming
load generator (``bench.common.loadgen``, closed loop) on the same Spec-Bench prompts, one system at a
time on the same machine, in one run:

- ours: ``<mode>-<engine>``, mode ``ar``/``sd``/``psd``/``auto``, engine ``vllm`` or ``native``
  (``minedraft up --engine ...``): gateway -> coordinator -> drafter + verifier as processes;
  ``ar``/``sd`` with ``2m`` requests per batch, ``psd``/``auto`` with two batches of ``m``;
- vLLM: ``vllm-ar`` (its OpenAI server, no speculation) and ``vllm-sd-k<K>`` (its
  ``draft_model`` speculative decoding with the same draft, k = K); ``max_num_seqs = 2m``.

Random-weight paper-scale shapes (``--target random:llama-8b --draft random:qwen3-0.6b``) take
``--fixed-acceptance P``: ours ``--bench-fixed-acceptance P``, vLLM its benchmark-only
``rejection_sample_method="synthetic"`` with per-position rates P, P^2, ..., P^K, the same
process (each draft token accepted with probability P given its predecessors were), so both do
the same speculative work. Such outputs are NOT the target's distribution (labelled so).

Ours ``sd``, ``psd`` and ``auto`` with the same engine flags run on one start of their engines, each
behind its own coordinator and gateway (``bench.engines.shared_engines``; ``--no-share-engines``:
a start each), so a lease measures more systems.

Per system and concurrency it records output tokens/s, TTFT and latency p50/p99, mean acceptance
length (ours: usage extension; vLLM: /metrics counters) and ours' step-time split (coordinator
step log); then ours/vLLM ratios per concurrency (each against ``vllm-ar`` and against the best
vLLM system) and, at temperature 0 with real weights, the greedy outputs compared with
``vllm-ar``'s prompt by prompt. Results go to ``--out-dir``: ``results.json`` and ``results.md``,
rewritten after every system (a crash keeps what ran); logs to ``--work-dir``.

Example (the device script ``bench/engines/engines_compare_device.sh`` runs the H200 tables)::

    python -m bench.engines.engines_compare --device cuda --target random:llama-8b --draft random:qwen3-0.6b \\
        --fixed-acceptance 0.7 --cuda-mps --systems vllm-ar,vllm-sd-k4,ar-vllm,psd-vllm \\
        --concurrencies 1,4,16,32,64 --max-tokens 256 --out-dir bench/results/engines_h200
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass

from bench.engines.compare_systems import OursServer, VllmServer, parse_system
from bench.engines.shared_engines import SharedEngines, group_systems
from bench.common.loadgen import LoadConfig, load_spec_bench, run_load
from bench.engines.report_compare import markdown, ratios_by_concurrency, greedy_vs_reference
from bench.common.stats import SpecCounts, spec_counts_from_usage, step_split, summarize
from bench.common.suite import git_commit, machine
from minedraft.prompts import write_json

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "data", "spec_bench",
                            "question.jsonl")
NUM_WARMUP_TOKENS = 16
SKIPPED = "skipped: time budget"   # a failure entry report_compare.merge drops


@dataclass(frozen=True)
class CompareConfig:
    """One comparison run (validated: ValueError names the field)."""

    out_dir: str
    work_dir: str = ""
    data: str = DEFAULT_DATA
    systems: tuple[str, ...] = ("vllm-ar", "vllm-sd-k4", "ar-vllm", "sd-vllm", "psd-vllm")
    concurrencies: tuple[int, ...] = (1, 4, 16, 32, 64)
    requests_per_client: int = 2
    min_requests: int = 4
    max_requests: int = 128
    max_tokens: int = 256
    temperature: float = 0.0
    ignore_eos: bool = True
    target: str = "smollm2-135m-instruct"
    draft: str = ""
    device: str = "cuda"
    dtype: str = "bfloat16"
    k: int = 4
    m: int = 32
    max_model_len: int = 1024
    fixed_acceptance: float | None = None
    cuda_mps: bool = False
    drafter_gpu: int = 0
    num_warmup: int = 8
    time_budget_s: float = 0.0
    startup_timeout_s: float = 600.0
    enforce_eager: bool = False
    vllm_python: str = ""
    decode_steps: int | None = None   # None: the engine's default (minedraft.engine_backend.DEFAULT_DECODE_STEPS)
    share_engines: bool = True   # ours sd / psd / auto on the same engines start them once (bench.engines.shared_engines)

    def __post_init__(self) -> None:
        group_systems(self.systems)   # ValueError: a system named twice (records are keyed by system and concurrency)
        for name in self.systems:
            if parse_system(name).verifier_sm_percent < 100 and not self.cuda_mps:  # ValueError naming the system
                raise ValueError(f"systems: {name!r} limits the verifier's SMs under MPS: needs --cuda-mps")
        checks = {"concurrencies": all(c >= 1 for c in self.concurrencies) and bool(self.concurrencies),
                  "max_tokens": self.max_tokens >= 1, "k": self.k >= 1, "m": self.m >= 1,
                  "requests_per_client": self.requests_per_client >= 1, "decode_steps": self.decode_steps is None or 1 <= self.decode_steps <= 64,
                  "fixed_acceptance": self.fixed_acceptance is None or 0 <= self.fixed_acceptance <= 1}
        for name, is_ok in checks.items():
            if not is_ok:
                raise ValueError(f"{name}: out of range, got {getattr(self, name)!r}")

    def num_requests(self, concurrency: int) -> int:
        return max(self.min_requests, min(self.max_requests, self.requests_per_client * concurrency))


def run_system(name: str, cfg: CompareConfig, prompts, deadline: float) -> list[dict]:
    """Start ``name`` once, run every concurrency (until ``deadline``), stop it; one record each."""
    logs = os.path.join(cfg.work_dir or cfg.out_dir, "logs", name)
    server = (VllmServer if parse_system(name).family == "vllm" else OursServer)(name, cfg, logs)
    return run_started(name, cfg, server, prompts, deadline)


def run_started(name: str, cfg: CompareConfig, server, prompts, deadline: float, **extra) -> list[dict]:
    """Start ``server`` (by ``deadline`` at the latest), warm it up, run every concurrency (until
    ``deadline``), stop it; one record each, with ``extra`` in every record."""
    server.start_deadline = deadline   # a start-up that would outrun the time budget is stopped and reported
    records = []
    started = time.monotonic()
    with server as endpoint:
        startup_s = time.monotonic() - started
        if cfg.num_warmup:
            run_load(prompts[:cfg.num_warmup], LoadConfig(endpoint.base_url, endpoint.model, cfg.num_warmup,
                                                          NUM_WARMUP_TOKENS, ignore_eos=True))
        for concurrency in cfg.concurrencies:
            if time.monotonic() > deadline:
                records.append({"system": name, "concurrency": concurrency, "startup_s": startup_s,
                                "skipped": "time budget", **extra})
                continue
            records.append({**_measure(name, cfg, server, endpoint, prompts[:cfg.num_requests(concurrency)],
                                       concurrency, startup_s), **extra})
    return records


def run_group(names: tuple[str, ...], cfg: CompareConfig, prompts, deadline: float, report) -> None:
    """Systems that run the same engines (``shared_engines.group_systems``): the engines start once,
    then each system's coordinator and gateway in turn, through ``run_reported``; a system that
    fails is reported and the next one still runs, on the same engines while they live."""
    if time.monotonic() > deadline:
        report([], [{"system": name, "error": SKIPPED} for name in names])
        return
    logs = os.path.join(cfg.work_dir or cfg.out_dir, "logs")
    engines = SharedEngines(names, cfg, os.path.join(logs, "engines-" + names[0]))
    engines.start_deadline = deadline
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(engines)
        except Exception as exc:  # noqa: BLE001 -- reported for every system of the group
            report([], [{"system": name, "error": f"{type(exc).__name__}: shared engines: {exc}"[-3000:]}
                        for name in names])
            return
        shared = {"shared_engines": names[0], "engines_startup_s": time.monotonic() - started}
        for name in names:
            def run_on_engines(name: str = name) -> list[dict]:
                engines.check_alive()
                front = engines.front(name, os.path.join(logs, name))
                return run_started(name, cfg, front, prompts, deadline, **shared)

            run_reported(name, deadline, report, run_on_engines)


def run_reported(name: str, deadline: float, report, run) -> None:
    """``report(run(), [])``; past ``deadline`` the system is reported as skipped instead, and a
    ``run`` that raises as failed (the next system still runs)."""
    if time.monotonic() > deadline:
        report([], [{"system": name, "error": SKIPPED}])
        return
    try:
        report(run(), [])
    except Exception as exc:  # noqa: BLE001 -- reported; the next system still runs
        report([], [{"system": name, "error": f"{type(exc).__name__}: {exc}"[-3000:]}])
        print(f"[engines_compare] {name} failed: {str(exc)[-800:]}", file=sys.stderr, flush=True)


def _measure(name: str, cfg: CompareConfig, server, endpoint, prompts, concurrency: int, startup_s: float) -> dict:
    load = LoadConfig(endpoint.base_url, endpoint.model, concurrency, cfg.max_tokens, temperature=cfg.temperature,
                      seed=0 if cfg.temperature > 0 else None, ignore_eos=cfg.ignore_eos)
    before = server.metrics()
    run = run_load(prompts, load)
    after = server.metrics()
    spec = spec_counts_from_usage(run.results) if not after else SpecCounts(
        after["num_draft_tokens"] - before.get("num_draft_tokens", 0.0),
        after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0.0),
        after["num_drafts"] - before.get("num_drafts", 0.0))
    print(f"[engines_compare] {name} c={concurrency}: {sum(r.num_output_tokens for r in run.results) / run.wall_s:.1f} "
          f"tok/s ({len(run.results)} requests, {run.wall_s:.1f} s)", file=sys.stderr, flush=True)
    return {"system": name, "concurrency": concurrency, "startup_s": startup_s,
            "metrics": summarize(run.results, run.wall_s, 1, spec),
            "step_split": step_split(endpoint.step_log, run.start_s, run.end_s) if endpoint.step_log else None,
            "errors": sorted({r.error for r in run.results if r.error})[:5],
            "outputs": {r.prompt_id: r.text for r in run.results if r.is_ok}}


def run_compare(cfg: CompareConfig, command: str) -> dict:
    """Every system in turn, ours sharing engines where they can (a system that fails to start is
    recorded; the others still run); results written after each system."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    prompts = load_spec_bench(cfg.data, max(cfg.num_requests(c) for c in cfg.concurrencies))
    deadline = time.monotonic() + (cfg.time_budget_s or float("inf"))
    meta = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": command, "config": asdict(cfg), "machine": _machine()}
    records, failures = [], []

    def report(new_records: list[dict], new_failures: list[dict]) -> None:
        records.extend(new_records)
        failures.extend(new_failures)
        write_results(cfg, meta, records, failures)

    for group in group_systems(cfg.systems) if cfg.share_engines else [(name,) for name in cfg.systems]:
        if len(group) > 1:
            run_group(group, cfg, prompts, deadline, report)
        else:
            run_reported(group[0], deadline, report, lambda: run_system(group[0], cfg, prompts, deadline))
    return write_results(cfg, meta, records, failures)


def write_results(cfg: CompareConfig, meta: dict, records: list[dict], failures: list[dict]) -> dict:
    results = {"meta": meta, "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in records],
               "ratios": ratios_by_concurrency(records),
               "greedy_vs_vllm_ar": greedy_vs_reference(records) if cfg.temperature == 0 else [],
               "failures": failures}
    write_json(os.path.join(cfg.out_dir, "results.json"), results)
    write_json(os.path.join(cfg.out_dir, "outputs.json"), {f"{r['system']}-c{r['concurrency']}": r.get("outputs", {})
                                                           for r in records})
    with open(os.path.join(cfg.out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown(results, cfg))
    return results


def _machine() -> str:
    """The GPUs when torch sees any, else ``bench.common.suite.machine()`` (CPU, cores, memory)."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    except ImportError:
        pass
    return machine()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None) -> CompareConfig:
    p = argparse.ArgumentParser(prog="python -m bench.engines.engines_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--work-dir", default="")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--systems", default=",".join(CompareConfig.systems))
    p.add_argument("--concurrencies", default="1,4,16,32,64")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--max-requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--draft", default="")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=4, help="ours: num_speculative_tokens")
    p.add_argument("--m", type=int, default=32, help="requests per batch of psd/auto (ar, sd, vLLM: 2m)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--fixed-acceptance", type=float, default=None, metavar="P",
                   help="BENCHMARK-ONLY: both sides accept each draft token with probability P")
    p.add_argument("--cuda-mps", action="store_true", help="ours: drafter and verifier share GPU 0 under CUDA MPS")
    p.add_argument("--drafter-gpu", type=int, default=0)
    p.add_argument("--num-warmup", type=int, default=8)
    p.add_argument("--time-budget-s", type=float, default=0.0, help="stop starting measurements after this (0: none)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--vllm-python", default="", help="the Python with vLLM (default: engine_backend's choice)")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="ours: tokens per Verify call in ar steps (multi-step; default: the engine's, 32 on vllm, 1 on native)")
    p.add_argument("--no-share-engines", dest="share_engines", action="store_false",
                   help="start every system's engines anew (default: ours sd / psd / auto with the same engine "
                        "flags share one start of them, bench.engines.shared_engines)")
    a = p.parse_args(argv)
    return CompareConfig(out_dir=a.out_dir, work_dir=a.work_dir, data=a.data, systems=tuple(a.systems.split(",")),
                         concurrencies=_ints(a.concurrencies), requests_per_client=a.requests_per_client,
                         min_requests=a.min_requests, max_requests=a.max_requests, max_tokens=a.max_tokens,
                         temperature=a.temperature, ignore_eos=a.ignore_eos, target=a.target, draft=a.draft,
                         device=a.device, dtype=a.dtype, k=a.k, m=a.m, max_model_len=a.max_model_len,
                         fixed_acceptance=a.fixed_acceptance, cuda_mps=a.cuda_mps, drafter_gpu=a.drafter_gpu,
                         num_warmup=a.num_warmup, time_budget_s=a.time_budget_s,
                         startup_timeout_s=a.startup_timeout_s, enforce_eager=a.enforce_eager,
                         vllm_python=a.vllm_python, decode_steps=a.decode_steps, share_engines=a.share_engines)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    command = "python -m bench.engines.engines_compare " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    results = run_compare(cfg, command)
    print(json.dumps({"out_dir": cfg.out_dir, "num_runs": len(results["runs"]), "failures": results["failures"]}))
    return 1 if results["failures"] and not results["runs"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
