"""Engine-level CPU split vs vLLM: prefill time and decode step of N resident requests, one core.

The end-to-end suite (``bench.common.suite``) compares whole stacks; this script isolates the engines.
For the SAME prompts (the first ``--num-prompts`` Spec-Bench prompts through the model dir's
chat template, passed to both engines as token ids), float32, on one core pinned with
``os.sched_setaffinity`` (``--core``, default the last usable one) and one thread, it measures:

- ours, in process: ``specdec.engine.worker.TargetWorker`` over ``specdec.engine.runner.ModelRunner``
  (``max_num_seqs = N``, ``max_model_len = 2048``). Prefill: wall s to admit all N prompts with
  one ``add_requests`` per prompt (as the verifier does on CPU), after one untimed short prompt.
  Decode: wall ms of each of ``--num-steps`` ``verify(ids, [[]] * N, None)`` calls (one greedy
  token for each of the N rows), after one untimed step; median and mean.
- vLLM offline (``vllm.LLM``, prefix caching off, 2 GiB KV cache), in a subprocess of
  ``--vllm-python`` running this same file with ``--vllm-worker`` (VLLM_CPU_NUM_OF_RESERVED_CPU=1,
  VLLM_CPU_KVCACHE_SPACE=2): wall s of ``generate`` of the N prompts with max_tokens 1
  (= prefill + one sampled token), 1 + S and 1 + 2S (S = ``--num-steps``, ignore_eos, greedy),
  after an untimed warm-up generate; decode ms/step = (t(1 + 2S) - t(1 + S)) / S. Both runs
  include the ~17 s prefill, whose run-to-run noise (~1 s) is divided by S: use S >= 64 (on the
  2-core dev host S = 16 gave 118 ms/step, S = 64 173 ms/step, the ad-hoc runs 171).

Ratios are ours / vLLM (above 1: ours slower): prefill time, and decode step (ours' mean, as
vLLM's figure is a mean over S steps; the median ratio is given too). Outputs in ``--out-dir``:
``results.json`` (config, machine, date, git commit, both sides' figures, ratios) and
``results.md``. Progress (and vLLM's log) goes to stderr. Takes ~3-4 min for 32 prompts.

Usage:
    python -m bench.engines.engine_vllm [--model DIR] [--num-prompts 32] [--num-steps 64] [--core C]
        [--skip-vllm] [--out-dir bench/results/engine_vllm]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DATA = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "spec_bench", "question.jsonl"))
MAX_MODEL_LEN = 2048
DTYPE = "float32"
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def log(message: str) -> None:
    print(f"[engine_vllm] {message}", file=sys.stderr, flush=True)


@contextmanager
def pinned(core: int):
    """This thread (and threads/processes it starts) on ``core`` only; the old affinity after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def prompt_ids(model_dir: str, data: str, num_prompts: int) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` Spec-Bench prompts as single-turn chats."""
    from transformers import AutoTokenizer

    from bench.common.loadgen import load_spec_bench

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = []
    for prompt in load_spec_bench(data, num_prompts):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True)
        ids.append(list(chat["input_ids"] if hasattr(chat, "keys") else chat))   # transformers 5: BatchEncoding
    return ids


def measure_ours(model_dir: str, ids: list[list[int]], num_steps: int) -> dict:
    """Prefill s of all prompts (one add_requests each) and ms of ``num_steps`` N-row decode steps."""
    from specdec.config import CacheConfig, ModelConfig
    from specdec.engine.runner import ModelRunner
    from specdec.sample.sampling import SamplingParams
    from specdec.engine.worker import TargetWorker

    runner = ModelRunner(ModelConfig(model=model_dir, dtype=DTYPE, device="cpu", num_threads=1),
                         CacheConfig(max_num_seqs=len(ids), max_model_len=MAX_MODEL_LEN))
    worker = TargetWorker(runner, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 2, ignore_eos=True)
    worker.add_requests([("warm", ids[0][:50], params)])
    worker.release("warm")
    start = time.perf_counter()
    for i, row in enumerate(ids):
        worker.add_requests([(str(i), row, params)])
    prefill_s = time.perf_counter() - start
    request_ids = [str(i) for i in range(len(ids))]
    worker.verify(request_ids, [[] for _ in ids], None)                    # untimed first step
    step_ms = []
    for _ in range(num_steps):
        start = time.perf_counter()
        outputs = worker.verify(request_ids, [[] for _ in ids], None)
        step_ms.append((time.perf_counter() - start) * 1e3)
        assert len(outputs) == len(ids) and all(len(o.token_ids) == 1 for o in outputs)
    return {"prefill_s": prefill_s, "step_ms": step_ms, "decode_ms_median": statistics.median(step_ms),
            "decode_ms_mean": statistics.mean(step_ms)}


def vllm_figures(generate_s: dict, num_steps: int) -> dict:
    """Prefill s and decode ms/step from vLLM's generate wall times keyed by max_tokens."""
    t1, t_s, t_2s = (float(generate_s[str(m)]) for m in (1, 1 + num_steps, 1 + 2 * num_steps))
    decode_ms = (t_2s - t_s) / num_steps * 1e3
    if min(t1, decode_ms) <= 0:
        raise ValueError(f"vLLM timings do not grow with max_tokens: {generate_s}")
    return {"prefill_s": t1, "decode_ms_per_step": decode_ms, "generate_s": dict(generate_s)}


def vllm_worker(args: argparse.Namespace) -> None:
    """``--vllm-worker`` (in vLLM's venv): generate wall times per max_tokens -> ``--result-file``."""
    import vllm
    from vllm.inputs import TokensPrompt

    os.sched_setaffinity(0, {args.core})
    with open(args.ids_file, encoding="utf-8") as f:
        prompts = [TokensPrompt(prompt_token_ids=row) for row in json.load(f)]
    llm = vllm.LLM(model=args.model, dtype=DTYPE, max_num_seqs=len(prompts), max_model_len=MAX_MODEL_LEN, seed=0,
                   kv_cache_memory_bytes=2 * 1024**3, enable_prefix_caching=False)
    llm.generate(prompts[:2], vllm.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    generate_s = {}
    for max_tokens in (1, 1 + args.num_steps, 1 + 2 * args.num_steps):
        params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        generate_s[str(max_tokens)] = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs), "vLLM stopped early"
        log(f"vLLM generate max_tokens={max_tokens}: {generate_s[str(max_tokens)]:.2f} s")
    with open(args.result_file, "w", encoding="utf-8") as f:
        json.dump({"generate_s": generate_s, "vllm": vllm.__version__}, f)


def measure_vllm(args: argparse.Namespace, model_dir: str, ids: list[list[int]]) -> dict:
    """Runs the ``--vllm-worker`` subprocess on the same token ids; its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        ids_file, result_file = os.path.join(tmp, "ids.json"), os.path.join(tmp, "result.json")
        with open(ids_file, "w", encoding="utf-8") as f:
            json.dump(ids, f)
        subprocess.run([args.vllm_python, os.path.abspath(__file__), "--vllm-worker", "--model", model_dir,
                        "--core", str(args.core), "--num-steps", str(args.num_steps), "--ids-file", ids_file,
                        "--result-file", result_file], check=True, cwd=REPO, stdout=sys.stderr,
                       env={**os.environ, **VLLM_ENV})
        with open(result_file, encoding="utf-8") as f:
            raw = json.load(f)
    return {**vllm_figures(raw["generate_s"], args.num_steps), "version": raw["vllm"]}


def ratios(ours: dict, vllm: dict) -> dict:
    return {"prefill": ours["prefill_s"] / vllm["prefill_s"],
            "decode_step_mean": ours["decode_ms_mean"] / vllm["decode_ms_per_step"],
            "decode_step_median": ours["decode_ms_median"] / vllm["decode_ms_per_step"]}


def to_markdown(result: dict) -> str:
    cfg, ours, vllm, ratio = result["config"], result["ours"], result["vllm"], result.get("ratios")
    lines = [f"# Engine split on one core: ours vs vLLM ({cfg['num_prompts']} prompts, {DTYPE})", "",
             f"{result['date']}, {result['machine']}, commit `{result['git_commit']}`; model `{cfg['model']}`; "
             f"{cfg['prompt_tokens']} prompt tokens; core {cfg['core']}; command: `{result['command']}`", "",
             f"| engine | prefill s ({cfg['num_prompts']} prompts) | decode ms/step median | decode ms/step mean |",
             "|---|---|---|---|",
             f"| ours | {ours['prefill_s']:.2f} | {ours['decode_ms_median']:.1f} | {ours['decode_ms_mean']:.1f} |"]
    if vllm is not None:
        lines.append(f"| vLLM {vllm['version']} | {vllm['prefill_s']:.2f} | - | {vllm['decode_ms_per_step']:.1f} |")
        lines.append(f"| ours / vLLM | {ratio['prefill']:.3f} | {ratio['decode_step_median']:.3f} | "
                     f"{ratio['decode_step_mean']:.3f} |")
    vllm_note = "" if vllm is None else f" (vLLM: (t(1+2S) - t(1+S)) / S, S = {cfg['num_steps']})"
    lines += ["", f"Decode: {cfg['num_steps']} steps of {cfg['num_prompts']} rows{vllm_note}."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engines.engine_vllm", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help=f"HF model dir (default: resolved {DEFAULT_MODEL})")
    p.add_argument("--data", default=DEFAULT_DATA, help="Spec-Bench question.jsonl")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--num-steps", type=int, default=64, help="S (see the docstring: keep it >= 64)")
    p.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)))
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-python", default=os.path.join(REPO, ".venv-vllm", "bin", "python"))
    p.add_argument("--out-dir", default=os.path.join(REPO, "bench", "results", "engine_vllm"))
    p.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ids-file", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.num_steps < 1:
        p.error("--num-prompts and --num-steps must be >= 1")
    return args


def run(args: argparse.Namespace, command: str) -> dict:
    from bench.common.suite import git_commit, machine
    from minedraft.prompts import write_json

    model_dir = args.model
    if model_dir is None:
        from minedraft.launcher import resolve_model_dir
        model_dir = resolve_model_dir(DEFAULT_MODEL)
    ids = prompt_ids(model_dir, args.data, args.num_prompts)
    log(f"{len(ids)} prompts, {sum(map(len, ids))} tokens; ours on core {args.core}")
    with pinned(args.core):
        ours = measure_ours(model_dir, ids, args.num_steps)
    log(f"ours: prefill {ours['prefill_s']:.2f} s, decode {ours['decode_ms_median']:.1f} ms/step (median)")
    vllm = None if args.skip_vllm else measure_vllm(args, model_dir, ids)
    config = {"model": model_dir, "dtype": DTYPE, "num_prompts": len(ids), "num_steps": args.num_steps,
              "core": args.core, "threads": 1, "max_model_len": MAX_MODEL_LEN, "data": args.data,
              "prompt_tokens": sum(map(len, ids)), "prompt_lens": [len(row) for row in ids]}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": machine(), "git_commit": git_commit(), "command": command, "config": config,
              "ours": ours, "vllm": vllm, "ratios": None if vllm is None else ratios(ours, vllm)}
    write_json(os.path.join(args.out_dir, "results.json"), result)
    with open(os.path.join(args.out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(to_markdown(result))
    log(f"wrote {args.out_dir}/results.json and results.md")
    return result


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.vllm_worker:
        return vllm_worker(args)
    return run(args, "python -m bench.engines.engine_vllm " + " ".join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
