"""``python -m bench.common.suite``: ar, sd and psd side by side against vLLM's CPU build (issue 8).

One load generator (``bench.common.loadgen``: streaming OpenAI chat completions, closed loop at
concurrency 2m) drives every system (``bench.common.systems``) on the same Spec-Bench prompts. Each
system keeps 2m requests resident: ours ``ar``/``sd``/``sd-2core`` and vLLM with max_num_seqs = 2m,
``psd`` with two batches of m. Per system and workload it records output tokens/s, requests/s,
TTFT and end-to-end latency p50/p99, mean acceptance length (ours: usage extension; vLLM: its
/metrics spec-decode counters), tokens/s per core and, for ours, the step-time split from the
coordinator's step log; then ratios (``bench.common.report``) and, at temperature 0, whether the
speculative systems' outputs equal their ``ar``'s. Outputs in ``--out-dir``: ``results.json``,
``results.md``, PNG plots and ``outputs/<run>.json`` (per request); service logs, step logs and
the vLLM export go to ``--work-dir`` (default ``runs/bench/<name>``, not versioned).

Example (the CI test runs a tiny version)::

    python -m bench.common.suite --name cpu-final --systems ar,sd,psd,sd-2core,vllm-ar,vllm-sd \\
        --num-prompts 24 --max-tokens 128 --temperatures 0,1 --m 4 --k 4
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass

from bench.common.loadgen import SPEC_BENCH_TASKS, LoadConfig, load_spec_bench, run_load
from bench.common.report import compute_ratios, greedy_check, markdown, plot
from bench.common.stats import SpecCounts, spec_counts_from_usage, step_split, summarize, summarize_by_task
from bench.common.systems import AUTO_DTYPE, BENCH_DTYPES, OURS, SYSTEMS, OursSystem, VllmSystem, resolve_bench_dtype
from minedraft.prompts import write_json

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "data", "spec_bench",
                            "question.jsonl")
DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
NUM_WARMUP_TOKENS = 8


@dataclass(frozen=True)
class SuiteConfig:
    """Every setting of one suite run (validated; ValueError names the field)."""

    name: str = "cpu"
    out_dir: str = ""
    work_dir: str = ""
    data: str = DEFAULT_DATA
    num_prompts: int = 24
    tasks: tuple[str, ...] = SPEC_BENCH_TASKS
    max_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0,)
    ms: tuple[int, ...] = (4,)
    ks: tuple[int, ...] = (4,)
    systems: tuple[str, ...] = ("ar", "sd", "psd")
    target: str = "smollm2-135m-instruct"
    draft: str = ""
    max_model_len: int = 2048
    ignore_eos: bool = False
    seed: int = 0
    num_warmup: int = 2
    vllm_python: str = DEFAULT_VLLM_PYTHON
    vllm_kv_cache_gib: int = 4
    vllm_reserved_cpus: int = 1
    vllm_args: tuple[str, ...] = ()
    startup_timeout_s: float = 1200.0
    dtype: str = "float32"  # ours and vLLM; the CLI's --dtype auto picks bfloat16 on bf16 CPUs

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        checks = {"systems": (bool(self.systems) and not unknown, f"unknown {unknown}; choose from {list(SYSTEMS)}"),
                  "num_prompts": (self.num_prompts >= 1, "must be >= 1"),
                  "max_tokens": (self.max_tokens >= 1, "must be >= 1"),
                  "temperatures": (bool(self.temperatures) and min(self.temperatures) >= 0, "must be >= 0"),
                  "ms": (bool(self.ms) and min(self.ms) >= 1, "must be >= 1"),
                  "ks": (bool(self.ks) and min(self.ks) >= 1, "must be >= 1"),
                  "num_warmup": (self.num_warmup >= 0, "must be >= 0"),
                  "vllm_reserved_cpus": (self.vllm_reserved_cpus >= 0, "must be >= 0"),
                  "vllm_kv_cache_gib": (self.vllm_kv_cache_gib >= 1, "must be >= 1"),
                  "data": (os.path.isfile(self.data), "no such file"),
                  "dtype": (self.dtype in BENCH_DTYPES, f"must be one of {BENCH_DTYPES}")}
        for name, (is_ok, reason) in checks.items():
            if not is_ok:
                raise ValueError(f"{name}: {reason}, got {getattr(self, name)!r}")

    @property
    def has_vllm(self) -> bool:
        return any(SYSTEMS[s].family != OURS for s in self.systems)


def git_commit() -> str:
    """HEAD's hash, with ``+dirty`` when tracked files differ ("unknown" outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    """CPU model, usable cores, memory (GiB), OS and Python of this host."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (OSError, ValueError):
        mem_gib = float("nan")
    return (f"{model}, {len(os.sched_getaffinity(0))} usable cores, {mem_gib:.0f} GiB, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}")


def _run_id(system: str, m: int, k: int | None, temperature: float) -> str:
    return f"{system}{'' if k is None else f'-k{k}'}-m{m}-T{temperature:g}"


def _start(system: str, cfg: SuiteConfig, m: int, k: int, logs: str, model_dir: str, export: dict | None):
    spec = SYSTEMS[system]
    if spec.family == OURS:
        return OursSystem(spec, model_dir, cfg.target, cfg.draft, m, k, cfg.max_model_len, logs,
                          cfg.startup_timeout_s, dtype=cfg.dtype)
    return VllmSystem(spec, cfg.vllm_python, export["target"], export["draft"], m, k, cfg.max_model_len, logs,
                      cfg.vllm_kv_cache_gib, cfg.vllm_reserved_cpus, cfg.startup_timeout_s, cfg.vllm_args,
                      dtype=cfg.dtype)


def _spec_counts(before: dict, after: dict) -> SpecCounts | None:
    if not after:
        return None
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    return SpecCounts(delta["num_draft_tokens"], delta["num_accepted_tokens"], delta["num_drafts"])


def run_system(system: str, cfg: SuiteConfig, m: int, k: int | None, prompts, model_dir: str,
               export: dict | None, progress) -> list[tuple[dict, dict]]:
    """Start ``system`` once for (m, k), run every temperature, stop it. Returns (record, outputs) pairs."""
    spec = SYSTEMS[system]
    logs = os.path.join(cfg.work_dir or cfg.out_dir, "logs", _run_id(system, m, k, 0).rsplit("-T", 1)[0])
    out = []
    server = _start(system, cfg, m, k or 1, logs, model_dir, export)
    with server as endpoint:
        for temperature in cfg.temperatures:
            load = LoadConfig(endpoint.base_url, endpoint.model, concurrency=2 * m, max_tokens=cfg.max_tokens,
                              temperature=temperature, seed=cfg.seed if temperature > 0 else None,
                              ignore_eos=cfg.ignore_eos)
            if cfg.num_warmup:
                warm = LoadConfig(endpoint.base_url, endpoint.model, concurrency=cfg.num_warmup,
                                  max_tokens=min(NUM_WARMUP_TOKENS, cfg.max_tokens), temperature=temperature)
                run_load(prompts[:cfg.num_warmup], warm)
            before = server.metrics()
            run = run_load(prompts, load, on_done=lambda result: progress.update(1))
            spec_counts = spec_counts_from_usage(run.results) if spec.family == OURS else \
                _spec_counts(before, server.metrics())
            run_id = _run_id(system, m, k, temperature)
            record = {"run_id": run_id, "system": system, "family": spec.family, "mode": spec.mode, "m": m, "k": k,
                      "temperature": temperature, "max_num_seqs": spec.max_num_seqs(m), "concurrency": 2 * m,
                      "note": spec.note, "logs": logs,
                      "metrics": summarize(run.results, run.wall_s, spec.num_cores(len(os.sched_getaffinity(0)),
                                                                                  cfg.vllm_reserved_cpus), spec_counts),
                      "by_task": summarize_by_task(run.results),
                      "step_split": step_split(endpoint.step_log, run.start_s, run.end_s) if endpoint.step_log else None,
                      "errors": sorted({r.error for r in run.results if r.error})[:5]}
            write_json(os.path.join(cfg.out_dir, "outputs", f"{run_id}.json"), [asdict(r) for r in run.results])
            out.append((record, {r.prompt_id: r.text for r in run.results if r.is_ok}))
    return out


def plan(cfg: SuiteConfig) -> list[tuple[str, int, int | None]]:
    """(system, m, k) stacks to start, in order; k is None for systems without speculation."""
    return [(s, m, k) for s in cfg.systems for m in cfg.ms
            for k in (cfg.ks if SYSTEMS[s].is_speculative else (None,))]


def run_suite(cfg: SuiteConfig, command: str) -> dict:
    """Run every planned system, write results.json / results.md / plots; returns the results dict."""
    from tqdm import tqdm

    from bench.engines.export_hf import export_all
    from minedraft.launcher import resolve_model_dir

    os.makedirs(cfg.out_dir, exist_ok=True)
    prompts = load_spec_bench(cfg.data, cfg.num_prompts, cfg.tasks)
    model_dir = resolve_model_dir(cfg.target)
    export_dir = os.path.join(cfg.work_dir or cfg.out_dir, "vllm_export")
    export = export_all(cfg.target, cfg.draft, export_dir) if cfg.has_vllm else None
    stacks = plan(cfg)
    runs, outputs, failures = [], {}, []
    meta = _meta(cfg, command, export)
    with tqdm(total=len(stacks) * len(cfg.temperatures) * len(prompts), desc=cfg.name, unit="req") as progress:
        for system, m, k in stacks:
            progress.set_postfix_str(_run_id(system, m, k, 0).rsplit("-T", 1)[0])
            try:
                for record, texts in run_system(system, cfg, m, k, prompts, model_dir, export, progress):
                    runs.append(record)
                    outputs[record["run_id"]] = texts
            except RuntimeError as exc:  # a system that cannot start is reported, the others still run
                failures.append({"system": system, "m": m, "k": k, "error": str(exc)[-3000:]})
                print(f"\n{system} m={m} k={k} failed: {str(exc)[-600:]}", file=sys.stderr)
            write_results(cfg, meta, runs, outputs, failures)  # after every system: a crash keeps what ran
    meta["plots"] = plot(runs, cfg.out_dir, f"({cfg.name}, {meta['date_utc'][:10]}, {meta['git_commit'][:10]})") if runs else []
    return write_results(cfg, meta, runs, outputs, failures)


def write_results(cfg: SuiteConfig, meta: dict, runs: list[dict], outputs: dict, failures: list[dict]) -> dict:
    """Write ``results.json`` and ``results.md`` (ratios and greedy check recomputed); returns the results."""
    results = {"meta": meta, "runs": runs, "ratios": compute_ratios(runs), "greedy_check": greedy_check(runs, outputs),
               "failures": failures}
    write_json(os.path.join(cfg.out_dir, "results.json"), results)
    text = markdown(meta, runs, results["ratios"], results["greedy_check"])
    text += "".join(f"\n**FAILED** {f['system']} m={f['m']} k={f['k']}: `{f['error'][-400:]}`\n" for f in failures)
    with open(os.path.join(cfg.out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return results


def _meta(cfg: SuiteConfig, command: str, export: dict | None) -> dict:
    notes = [f"{name}: {SYSTEMS[name].note}" for name in cfg.systems]
    notes.append("every system keeps 2m requests resident at concurrency 2m: ours ar/sd/sd-2core and vLLM with "
                 "max_num_seqs = 2m, psd with two batches of m")
    notes.append("CPU timings: one shared host; TTFT/latency include queueing at concurrency 2m")
    notes.append(f"dtype: {cfg.dtype} for ours and vLLM (weights, activations, KV cache)"
                 + ("; bf16 kernels are not batch invariant: greedy sd/psd outputs may differ from ar's at "
                    "near-ties (bench/results/cpu_step_identity_bfloat16.json)" if cfg.dtype == "bfloat16" else ""))
    if export:
        notes.append(export["draft_meta"]["note"])
    return {"name": cfg.name, "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "machine": machine(), "command": command, "config": asdict(cfg),
            "workload": (f"{cfg.num_prompts} Spec-Bench prompts (tasks {','.join(cfg.tasks)}), {cfg.max_tokens} "
                         f"output tokens{' (ignore_eos)' if cfg.ignore_eos else ''}, temperatures {cfg.temperatures}, "
                         f"m {cfg.ms}, k {cfg.ks}"),
            "notes": notes}


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None) -> SuiteConfig:
    p = argparse.ArgumentParser(prog="python -m bench.common.suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="cpu")
    p.add_argument("--out-dir", default="", help="default bench/results/suite/<name>")
    p.add_argument("--work-dir", default="", help="logs and vLLM export; default runs/bench/<name>")
    p.add_argument("--data", default=DEFAULT_DATA, help="Spec-Bench question.jsonl")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--tasks", default=",".join(SPEC_BENCH_TASKS), help=f"subset of {','.join(SPEC_BENCH_TASKS)}")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0", help="comma-separated, e.g. 0,1")
    p.add_argument("--m", default="4", help="comma-separated m values; concurrency is 2m")
    p.add_argument("--k", default="4", help="comma-separated num_speculative_tokens values")
    p.add_argument("--systems", default="ar,sd,psd", help=f"comma-separated from {','.join(SYSTEMS)}")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--draft", default="", help="our draft dir (default: the launcher's)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="base seed for temperature > 0")
    p.add_argument("--num-warmup", type=int, default=2, help="warm-up requests per system and temperature")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-kv-cache-gib", type=int, default=4,
                   help="VLLM_CPU_KVCACHE_SPACE (GiB; 4 holds 2m=32 requests of 2048 tokens, target + draft)")
    p.add_argument("--vllm-reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    p.add_argument("--vllm-args", default="", help="extra vLLM server arguments (one string, shell-split)")
    p.add_argument("--dtype", default=AUTO_DTYPE, help=f"ours and vLLM: {AUTO_DTYPE} (bfloat16 if the CPU has "
                   f"native bf16, else float32) or one of {','.join(BENCH_DTYPES)}")
    a = p.parse_args(argv)
    return SuiteConfig(name=a.name, out_dir=a.out_dir or os.path.join("bench", "results", "suite", a.name),
                       work_dir=a.work_dir or os.path.join("runs", "bench", a.name),
                       data=a.data, num_prompts=a.num_prompts, tasks=tuple(t for t in a.tasks.split(",") if t),
                       max_tokens=a.max_tokens, temperatures=_floats(a.temperatures), ms=_ints(a.m), ks=_ints(a.k),
                       systems=tuple(s for s in a.systems.split(",") if s), target=a.target, draft=a.draft,
                       max_model_len=a.max_model_len, ignore_eos=a.ignore_eos, seed=a.seed, num_warmup=a.num_warmup,
                       vllm_python=a.vllm_python, vllm_kv_cache_gib=a.vllm_kv_cache_gib,
                       vllm_reserved_cpus=a.vllm_reserved_cpus, vllm_args=tuple(shlex.split(a.vllm_args)),
                       dtype=resolve_bench_dtype(a.dtype))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    command = "python -m bench.common.suite " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = run_suite(cfg, command)
    print(f"\nresults: {os.path.join(cfg.out_dir, 'results.md')} ({len(results['runs'])} runs, "
          f"{len(results['failures'])} failed)")
    return 1 if results["failures"] or not results["runs"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
