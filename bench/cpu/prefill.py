"""Admission (prefill) cost of the engines: one prompt per forward vs batched, and cuDNN SDPA.

Times ``TargetWorker.add_requests`` (what the verifier's and drafter's ``AddRequests`` run) for
batches of ``--num-prompts`` prompts of random lengths in ``[--min-len, --max-len]`` tokens,
every rep with new lengths (as in service, where every prompt has a length of its own), for:

- ``one_per_forward``: ``max_prefill_tokens = 0`` (one forward per prompt, before the change);
- ``batched``: ``max_prefill_tokens = --max-prefill-tokens`` (several prompts per forward);
- ``one_per_forward_cudnn`` (CUDA only, ``--with-cudnn``): one per forward with cuDNN's SDPA
  allowed on the dynamic path again, as before ``specdec.kv.slot_attention`` left it out;
- ``one_per_forward_graphs`` (CUDA only): one per forward, each prompt of at most
  ``max_graph_prefill_tokens`` (default 1024) padded to its length bucket and run as a replayed
  CUDA graph (``StaticStepper.prefill``; graphs precaptured at start-up, as in service). The
  other variants set ``max_graph_prefill_tokens = 0`` (the dynamic path, as before).

A time is the host wall time of one ``add_requests`` call ending with a device synchronize; the
slots are released after each rep. Rep 0 includes first-use costs (allocator growth, kernel
selection); the table gives every rep. ``--profile N`` also profiles N more one-prompt
``add_requests`` calls (after 2 unprofiled ones) with ``torch.profiler`` (ops by host and by
device time) and ``cProfile`` (Python functions by cumulative time), into ``prefill_profile.txt``:
where a launch-bound prefill spends its host time. Model weights do not matter for the time: the default
target is ``random:smollm2-135m`` (**random weights**, SmolLM2-135M's shape). Writes
``prefill.json`` and ``prefill.md`` under ``--out``.

    python bench/cpu/prefill.py --device cuda --dtype bfloat16 --with-cudnn --out "$OUT/prefill"
    python bench/cpu/prefill.py --model random:tiny-llama --num-prompts 3 --num-reps 1 --out /tmp/p
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.cpu.cpu_step import write_results  # noqa: E402
from specdec.kv import slot_attention  # noqa: E402
from specdec.config import CacheConfig, ModelConfig  # noqa: E402
from specdec.engine.runner import ModelRunner  # noqa: E402
from specdec.sample.sampling import SamplingParams  # noqa: E402
from specdec.engine.worker import TargetWorker  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_adds(worker: TargetWorker, device: str, lengths: list[list[int]], vocab: int, seed: int) -> list[float]:
    """ms of one ``add_requests`` per rep; ``lengths[rep]`` are that rep's prompt lengths."""
    rng, times = random.Random(seed), []
    for rep, rep_lengths in enumerate(lengths):
        items = [(f"r{rep}-{i}", [rng.randrange(100, vocab) for _ in range(n)], GREEDY)
                 for i, n in enumerate(rep_lengths)]
        _sync(device)
        start = time.perf_counter()
        worker.add_requests(items)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        for request_id, _, _ in items:
            worker.release(request_id)
    return times


def run_variant(args, budget: int, allow_cudnn: bool, lengths: list[list[int]],
                is_graph: bool = False) -> list[float]:
    """Fresh runner and timed adds: the dynamic prefill path (no graph precapture), or with
    ``is_graph`` the default one-prompt graph prefill (graphs precaptured)."""
    default_backends = slot_attention.DYNAMIC_SDPA_BACKENDS
    if allow_cudnn:
        slot_attention.DYNAMIC_SDPA_BACKENDS = [torch.nn.attention.SDPBackend.CUDNN_ATTENTION, *default_backends]
    try:
        cfg = ModelConfig(model=args.model, dtype=args.dtype, device=args.device, cuda_graph_precapture=is_graph,
                          max_prefill_tokens=budget, max_graph_prefill_tokens=None if is_graph else 0)
        runner = ModelRunner(cfg, CacheConfig(max_num_seqs=args.num_prompts, max_model_len=args.max_len + 8))
        return time_adds(TargetWorker(runner, seed=0), args.device, lengths, runner.vocab_size, args.seed)
    finally:
        slot_attention.DYNAMIC_SDPA_BACKENDS = default_backends


def profile_adds(args, num_calls: int) -> str:
    """Text report of ``num_calls`` one-prompt ``add_requests`` (one forward each), profiled."""
    import cProfile
    import io
    import pstats

    cfg = ModelConfig(model=args.model, dtype=args.dtype, device=args.device, cuda_graph_precapture=False,
                      max_prefill_tokens=0, max_graph_prefill_tokens=0)
    runner = ModelRunner(cfg, CacheConfig(max_num_seqs=2, max_model_len=args.max_len + 8))
    worker, rng = TargetWorker(runner, seed=0), random.Random(args.seed)
    lengths = [[rng.randint(args.min_len, args.max_len)] for _ in range(num_calls + 2)]
    time_adds(worker, args.device, lengths[:2], runner.vocab_size, args.seed)  # first-use costs
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(args.device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        times = time_adds(worker, args.device, lengths[2:], runner.vocab_size, args.seed + 1)
    profiler = cProfile.Profile()
    profiler.enable()
    py_times = time_adds(worker, args.device, lengths[2:], runner.vocab_size, args.seed + 2)
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(45)
    averages = prof.key_averages()
    sections = [f"{num_calls} one-prompt add_requests, lengths {[n for (n,) in lengths[2:]]}: ms {times} "
                f"(under torch.profiler), {py_times} (under cProfile)",
                averages.table(sort_by="self_cpu_time_total", row_limit=35)]
    if torch.device(args.device).type == "cuda":
        sections.append(averages.table(sort_by="self_cuda_time_total", row_limit=20))
    return "\n\n".join(sections + [stream.getvalue()])


def compare_causal_with_mask(args, length: int = 300) -> dict:
    """Max |logit difference| of one whole-prompt prefill through the batched layout's causal
    shortcut (``CAUSAL_MASK``) against its explicit mask and, on CUDA, against the one-prompt
    graph prefill (``StaticStepper.prefill``), on ``args.device``/``args.dtype``."""
    is_cuda = torch.device(args.device).type == "cuda"
    cfg = ModelConfig(model=args.model, dtype=args.dtype, device=args.device, cuda_graph_precapture=False,
                      max_graph_prefill_tokens=length + 8 if is_cuda else 0)
    runner = ModelRunner(cfg, CacheConfig(max_num_seqs=1, max_model_len=length + 8))
    runner.cache.is_rowwise = False
    tokens = random.Random(args.seed).choices(range(100, runner.vocab_size), k=length)
    stepper, buckets = runner.static_stepper, ()
    if stepper is not None:
        buckets, stepper.prefill_buckets = stepper.prefill_buckets, ()   # dynamic path first
    logits = []
    for is_shortcut in (True, False):  # False: the explicit-mask path, as for a padded batch
        runner.cache.is_causal_shortcut = is_shortcut
        logits.append(_prefill_once(runner, tokens))
    result = {"length": length, "max_abs_logit_diff": _max_diff(logits[0], logits[1]),
              "is_argmax_equal": _is_argmax_equal(logits[0], logits[1])}
    if buckets:
        stepper.prefill_buckets = buckets
        graph = _prefill_once(runner, tokens)
        assert stepper.used_prefill_shapes, "the graph prefill did not run"
        result["graph_vs_causal"] = {"max_abs_logit_diff": _max_diff(graph, logits[0]),
                                     "is_argmax_equal": _is_argmax_equal(graph, logits[0])}
    return result


def _prefill_once(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    slot = runner.allocate_slot()
    logits = runner.prefill([slot], [tokens], torch.float32).float()
    runner.free_slot(slot)
    return logits


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _is_argmax_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.argmax(-1), b.argmax(-1)))


def to_markdown(result: dict) -> str:
    lines = [f"# Prefill of {result['num_prompts']} new-length prompts per add_requests", "",
             f"{result['date']}, {result['device_name']}, model `{result['model']}` ({result['dtype']})"
             f"{' -- RANDOM WEIGHTS' if result['model'].startswith('random:') else ''}; command: "
             f"`{result['command']}`", "",
             "| variant | " + " | ".join(f"rep {i} ms" for i in range(result["num_reps"])) + " | tokens per rep |",
             "|---|" + "---|" * (result["num_reps"] + 1)]
    for name, times in result["variants"].items():
        lines.append(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times)
                     + f" | {', '.join(str(sum(rep)) for rep in result['lengths'])} |")
    if "causal_vs_mask" in result:
        lines += ["", f"causal shortcut vs explicit mask, one prefill: `{result['causal_vs_mask']}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python bench/cpu/prefill.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--num-reps", type=int, default=3)
    parser.add_argument("--min-len", type=int, default=50)
    parser.add_argument("--max-len", type=int, default=400)
    parser.add_argument("--max-prefill-tokens", type=int, default=8192, help="the batched variant's budget")
    parser.add_argument("--with-cudnn", action="store_true", help="CUDA: also time cuDNN SDPA allowed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N one-prompt add_requests -> prefill_profile.txt")
    parser.add_argument("--check-paths", action="store_true",
                        help="also compare the causal shortcut with the explicit mask (max |logit diff|)")
    parser.add_argument("--out", required=True, help="output stem dir")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    lengths = [[rng.randint(args.min_len, args.max_len) for _ in range(args.num_prompts)] for _ in range(args.num_reps)]
    variants = {"one_per_forward": run_variant(args, 0, False, lengths),
                "batched": run_variant(args, args.max_prefill_tokens, False, lengths)}
    is_cuda = torch.device(args.device).type == "cuda"
    if args.with_cudnn and is_cuda:
        variants["one_per_forward_cudnn"] = run_variant(args, 0, True, lengths)
    if is_cuda:
        variants["one_per_forward_graphs"] = run_variant(args, 0, False, lengths, is_graph=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device_name": torch.cuda.get_device_name(args.device) if is_cuda else platform.processor() or "cpu",
              "command": "python bench/cpu/prefill.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts, "num_reps": args.num_reps,
              "lengths": lengths, "variants": variants, "torch": torch.__version__}
    if args.check_paths:
        result["causal_vs_mask"] = compare_causal_with_mask(args)
    write_results(os.path.join(args.out, "prefill"), result, to_markdown(result))
    if args.profile > 0:
        with open(os.path.join(args.out, "prefill_profile.txt"), "w") as f:
            f.write(profile_adds(args, args.profile))
    return result


if __name__ == "__main__":
    main()
