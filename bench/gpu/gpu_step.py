"""Engine step times on one GPU: eager vs CUDA graphs, against the card's memory-bandwidth floor.

For each model (random-weight presets of ``specdec.models.random_models``; the real SmolLM2 target too
when its package is installed) this times, through ``specdec.engine.runner.ModelRunner.forward``:

- the **decode step** (1 token per row; a draft step is a decode step of the draft model) and
- the **verify step** (k + 1 tokens per row),

at batch 1, 4 and 16, each slot holding ``--context-len`` cached tokens, with the dynamic eager
path (``cuda_graphs=False``) and with CUDA graphs (``specdec.engine.cuda_graphs``). A step's time is
the host wall time of one ``forward`` call including input preparation, the copy of the
logits to float32 and a device synchronize (median of ``--iters``); the KV cache is rolled back
after every step so all steps see the same context.

**Floor**: bytes a step must read (all parameters except an untied input embedding, of which a
step reads only b rows) divided by the card's best measured bandwidth (a large
device-to-device copy, counting read + written bytes, and a large read-only reduction).

**Greedy identity**: in-process ``ar``, ``sd`` and ``psd`` (``reference.loop``) on the GPU
with graphs on: sd/psd outputs must equal ar's token for token (target random:smollm2-135m in
float32, draft the same weights in bfloat16, so drafts are partly accepted, partly rejected).

All model outputs are **random weights** (labelled so in every output); timings do not depend on
the weight values. Writes ``gpu_step.json`` and ``gpu_step.md`` to ``--out``.

    python bench/gpu/gpu_step.py --out "$OUT"          # on the GPU machine
    python bench/gpu/gpu_step.py --device cpu --models random:tiny-llama --batches 1,4 --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu.gpu_step_identity import greedy_identity  # noqa: E402
from bench.gpu.gpu_step_report import write_markdown  # noqa: E402
from specdec.config import CacheConfig, ModelConfig  # noqa: E402
from specdec.models.random_models import is_random_spec  # noqa: E402
from specdec.engine.runner import ModelRunner  # noqa: E402

DEFAULT_MODELS = "random:smollm2-135m,random:qwen3-0.6b,random:llama-8b"
REAL_TARGET = "smollm2-135m-instruct"
NUM_WARMUP = 3
PROBE_BYTES = 4 << 30
NUM_PROBE_REPS = 10
MIB = 1 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_probe(device: torch.device, num_bytes: int) -> dict:
    """Best of a device-to-device copy (read + write bytes) and a read-only sum, in GB/s."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    results = {}
    for name, fn, moved in (("copy", lambda: dst.copy_(src), 2 * num_bytes),
                            ("read_sum", lambda: src.sum(dtype=torch.float32), num_bytes)):
        times = []
        for _ in range(NUM_PROBE_REPS + 1):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
        results[f"{name}_gb_per_s"] = moved / statistics.median(times[1:]) / 1e9
    results["probe_bytes"] = num_bytes
    results["best_gb_per_s"] = max(results["copy_gb_per_s"], results["read_sum_gb_per_s"])
    del src, dst
    return results


def step_read_bytes(runner: ModelRunner) -> int:
    """Parameter bytes a step reads: all but an untied input embedding (only b rows read)."""
    model = runner.model
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    return runner.weight_bytes - (0 if tied else embed.numel() * embed.element_size())


def time_steps(runner: ModelRunner, batch: int, num_tokens: int, context_len: int, iters: int,
               seed: int) -> tuple[float, torch.Tensor]:
    """Median ms of ``forward`` with ``num_tokens`` per row on ``batch`` slots; last logits."""
    rng = random.Random(seed)
    vocab = runner.input_vocab_size
    slots = [runner.allocate_slot() for _ in range(batch)]
    runner.prefill(slots, [[rng.randrange(3, vocab) for _ in range(context_len)]
                           for _ in slots])
    rows = [[rng.randrange(3, vocab) for _ in range(num_tokens)] for _ in slots]
    device = torch.device(runner.model_cfg.device)
    times = []
    try:
        for _ in range(NUM_WARMUP + iters):
            _sync(device)
            start = time.perf_counter()
            logits = runner.forward(slots, rows)
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
            for slot in slots:
                runner.truncate(slot, context_len)
    finally:
        for slot in slots:
            runner.free_slot(slot)
    return statistics.median(times[NUM_WARMUP:]), logits


def bench_model(spec: str, args, device: torch.device, floor_gb_per_s: float | None,
                modes: dict[str, dict], eager_logits: dict) -> dict:
    """Decode and verify step times of ``spec`` for each mode (ModelConfig overrides).

    The ``eager`` mode's logits are kept in ``eager_logits`` (per spec, kind, batch) to compare
    later modes against; each other mode gives one result row per (kind, batch).
    """
    cache = CacheConfig(max_num_seqs=max(args.batches), max_model_len=args.max_model_len)
    info = {"model": spec, "weights": "random weights" if is_random_spec(spec) else "real weights",
            "dtype": args.dtype, "steps": []}
    for mode, overrides in modes.items():
        start = time.perf_counter()
        runner = ModelRunner(ModelConfig(model=spec, dtype=args.dtype, device=str(device),
                                         **overrides), cache)
        _sync(device)
        info[f"load_s_{mode}"] = time.perf_counter() - start
        info["weight_bytes"], info["step_read_bytes"] = runner.weight_bytes, step_read_bytes(runner)
        info["floor_ms"] = (None if floor_gb_per_s is None
                            else info["step_read_bytes"] / floor_gb_per_s / 1e6)
        for batch in args.batches:
            for kind, num_tokens in (("decode", 1), ("verify", args.k + 1)):
                ms, logits = time_steps(runner, batch, num_tokens, args.context_len, args.iters,
                                        seed=batch)
                if mode == "eager":
                    eager_logits[(spec, kind, batch)] = (ms, logits)
                    continue
                info["steps"].append(_row(info, mode, kind, batch, num_tokens, ms, logits,
                                          eager_logits[(spec, kind, batch)]))
        if runner.static_stepper is not None:
            info[f"num_graphs_{mode}"] = runner.static_stepper.num_graphs
            info[f"capture_error_{mode}"] = runner.static_stepper.capture_error
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return info


def _row(info: dict, mode: str, kind: str, batch: int, num_tokens: int, ms: float,
         logits: torch.Tensor, eager: tuple[float, torch.Tensor]) -> dict:
    """One result row: eager ms, this mode's ms, speedup, ratio to the floor, logits diff."""
    eager_ms, eager_out = eager
    ref, out = eager_out.double(), logits.double()
    return dict(kind=kind, batch=batch, tokens_per_row=num_tokens, eager_ms=eager_ms,
                fast_mode=mode, fast_ms=ms, speedup=eager_ms / ms,
                fast_over_floor=None if info["floor_ms"] is None else ms / info["floor_ms"],
                logits_rel_diff=float((out - ref).norm() / ref.norm()),
                argmax_agreement=float((out.argmax(-1) == ref.argmax(-1)).float().mean()))


def _machine(device: torch.device) -> dict:
    info = dict(python=platform.python_version(), torch=torch.__version__,
                date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    import transformers

    info["transformers"] = transformers.__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / (1 << 30), 1),
                    cuda=torch.version.cuda)
    else:
        info.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python bench/gpu/gpu_step.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated model specs; "
                        f"{REAL_TARGET} is added when its package is installed")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--k", type=int, default=4, help="draft tokens; verify rows are k + 1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context-len", type=int, default=128, help="cached tokens per slot")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--identity-model", default="random:smollm2-135m")
    parser.add_argument("--identity-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48, help="identity run output length")
    parser.add_argument("--skip-identity", action="store_true")
    parser.add_argument("--compile-models", default="random:smollm2-135m,random:llama-8b",
                        help="models also timed with graphs + torch.compile'd decoder layers")
    parser.add_argument("--time-budget-s", type=float, default=420.0,
                        help="start no compile variant after this many seconds")
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.models = [m for m in args.models.split(",") if m]
    args.compile_models = [m for m in args.compile_models.split(",") if m]
    return args


def _phase(result: dict, args, name: str, fn) -> None:
    """Run one part; record its error instead of ending the run; rewrite the outputs after it."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - one part's failure must not lose the others
        result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        print(f"ERROR {name}: {exc!r}", flush=True)
    _write(result, args.out)


def _write(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_step.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    markdown = write_markdown(result)
    with open(os.path.join(out_dir, "gpu_step.md"), "w") as fh:
        fh.write(markdown)
    return markdown


def _add_model(result: dict, args, device, spec: str, modes: dict, eager_logits: dict) -> None:
    info = bench_model(spec, args, device, result["bandwidth"]["best_gb_per_s"], modes,
                       eager_logits)
    known = next((m for m in result["models"] if m["model"] == spec), None)
    if known is None:
        result["models"].append(info)
    else:
        known["steps"] += info.pop("steps")
        known.update(info)
    for row in info.get("steps", []):
        print(f"  {spec} ({info['weights']}) {row}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Phases: bandwidth, eager vs graphs per model, greedy identity, then graphs + compiled
    decoder layers (``ModelConfig.compile_layers``) for ``--compile-models`` while
    ``--time-budget-s`` allows."""
    args = _parse_args(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    from specdec.models.gguf import packaged_gguf_path

    try:
        if os.path.isfile(packaged_gguf_path()) and REAL_TARGET not in args.models:
            args.models.insert(1, REAL_TARGET)
    except FileNotFoundError:
        pass
    result = dict(machine=_machine(device), command="python bench/gpu/gpu_step.py "
                  + " ".join(sys.argv[1:] if argv is None else argv),
                  settings=dict(batches=args.batches, k=args.k, dtype=args.dtype,
                                context_len=args.context_len, max_model_len=args.max_model_len,
                                iters=args.iters), models=[], errors=[])
    probe_bytes = PROBE_BYTES if device.type == "cuda" else 64 * MIB
    result["bandwidth"] = bandwidth_probe(device, probe_bytes)
    print(f"bandwidth: {result['bandwidth']}", flush=True)
    fast = "graphs" if device.type == "cuda" else "static_eager"
    base_modes = {"eager": dict(cuda_graphs=False), fast: dict(static_shapes=True)}
    eager_logits: dict = {}
    for spec in args.models:
        _phase(result, args, spec, lambda spec=spec: _add_model(
            result, args, device, spec, base_modes, eager_logits))
    if not args.skip_identity:
        _phase(result, args, "greedy identity",
               lambda: result.update(greedy_identity=greedy_identity(args, device)))
    for spec in args.compile_models:
        if time.perf_counter() - started > args.time_budget_s:
            result["errors"].append(f"{spec} {fast}+compiled layers: skipped, time budget spent")
            continue
        torch._dynamo.reset()                  # no compiled graphs shared across models
        _phase(result, args, f"{spec} {fast}+compiled layers", lambda spec=spec: _add_model(
            result, args, device, spec,
            {f"{fast}+compiled layers": dict(static_shapes=True, compile_layers=True)},
            eager_logits))
    result["elapsed_s"] = time.perf_counter() - started
    print(_write(result, args.out))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
