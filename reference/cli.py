"""``python -m reference``: the command line of the in-process reference loops.

Reads Spec-Bench / MT-bench style prompts, builds the target worker (and the draft worker for
``sd``/``psd``), runs ``reference.loop.ReferenceLoop`` and prints each text plus output
tokens/s and the mean acceptance length.
"""

from __future__ import annotations

from reference.loop import MODES, LoopConfig, ReferenceLoop, Request
from reference.loop import __doc__ as generate_doc
from specdec.sample.sampling import SamplingParams
from specdec.engine.worker import DraftWorker, TargetWorker

DEFAULT_DRAFT_DIR = "drafts/smollm2-135m-instruct"
DEFAULT_DRAFT_LAYERS = (0, 1, 2, 3)


def read_prompts(path: str, limit: int | None) -> list[str]:
    """First turn of each line of a Spec-Bench / MT-bench style jsonl file."""
    import json

    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row["turns"][0] for row in rows[:limit]]


def build_workers(args) -> tuple[TargetWorker, DraftWorker | None, str]:
    """Target worker, draft worker (None for ``ar``) and the target's tokenizer dir."""
    import os

    from specdec.config import CacheConfig, ModelConfig
    from specdec.models.draft_format import build_draft_from_target
    from specdec.models.resolve import resolve_model_dir
    from specdec.engine.runner import ModelRunner

    target_cfg = ModelConfig(model=args.target, dtype=args.dtype)
    cache_cfg = CacheConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    target_runner = ModelRunner(target_cfg, cache_cfg)
    target = TargetWorker(target_runner, seed=args.seed)
    if args.mode == "ar":
        return target, None, resolve_model_dir(target_cfg)
    draft_path = args.draft or (DEFAULT_DRAFT_DIR if os.path.isdir(DEFAULT_DRAFT_DIR) else None)
    if draft_path is not None:
        draft_runner = ModelRunner(ModelConfig(model=draft_path, dtype=args.dtype), cache_cfg)
    else:  # untrained draft: the first target layers, sharing its embeddings
        model = build_draft_from_target(target_runner.model, list(DEFAULT_DRAFT_LAYERS))
        draft_runner = ModelRunner(ModelConfig(dtype=args.dtype), cache_cfg, model=model)
    drafter = DraftWorker(draft_runner, target_vocab_size=target_runner.vocab_size, seed=args.seed)
    return target, drafter, resolve_model_dir(target_cfg)


def parse_args(argv: list[str] | None):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m reference", description=generate_doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, default="sd")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompts", default="/work/shared/data/spec_bench/question.jsonl")
    parser.add_argument("--limit", type=int, default=16, help="number of prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None, help="per-request seed base")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help=f"draft dir (default {DEFAULT_DRAFT_DIR} "
                        f"if present, else target layers {DEFAULT_DRAFT_LAYERS})")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints each generated text, output tokens/s and mean acceptance length."""
    from transformers import AutoTokenizer

    args = parse_args(argv)
    cfg = LoopConfig(args.mode, args.k, args.max_num_seqs)
    target, drafter, tokenizer_dir = build_workers(args)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    requests = []
    for i, text in enumerate(read_prompts(args.prompts, args.limit)):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens,
                                seed=None if args.seed is None else args.seed + i)
        requests.append(Request(f"req-{i}", list(ids), params))
    stats = ReferenceLoop(cfg, target, drafter).run(requests)
    if not args.quiet:
        for request in requests:
            text = tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            print(f"=== {request.request_id} [{request.finish_reason}] ===\n{text}\n")
    print(f"mode={args.mode} k={args.k} requests={len(requests)} "
          f"output_tokens={stats.num_output_tokens} elapsed_s={stats.elapsed_s:.2f} "
          f"output_tokens_per_s={stats.output_tokens_per_s:.2f} "
          f"mean_acceptance_length={stats.mean_acceptance_length:.3f}"
          + (f" parallel_steps={stats.num_parallel_steps}/{stats.num_steps}"
             if args.mode == "psd" else ""))
    return 0
