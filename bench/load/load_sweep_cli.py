"""Command line and configuration grid of ``bench/load/load_sweep.py`` (issue 10's load sweep).

A configuration is named ``<mode>[-k<K>]-m<M>[-b<B>][-adaptive][-feedback]``: ``mode`` one of ar,
sd, psd, auto; ``K`` = num_speculative_tokens (the upper bound under ``-adaptive``, i.e. the
coordinator's ``--k-policy adaptive``); ``M`` = max_num_seqs (m: ar/sd run m requests, psd/auto
two batches of m); ``B`` = ``--max-num-batched-tokens`` (prompt tokens per admission, 0 = no
limit; default the stack's per-device default); ``-feedback`` = ``--balancer feedback`` (default
``paper``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench.common.loadgen import BurstConfig

SWEEP_MODES = ("ar", "sd", "psd", "auto")
DEFAULT_CONCURRENCIES = (1, 4, 16, 64)
# Issue 10's grid: every fixed (mode, k, m) below, psd with adaptive k, auto (adaptive k, feedback balancer).
DEFAULT_CONFIGS = ("ar-m16", "sd-k4-m16", "psd-k4-m16", "psd-k4-m16-adaptive", "auto-k4-m16-adaptive-feedback",
                   "ar-m4", "ar-m32", "sd-k2-m4", "sd-k2-m16", "sd-k4-m4", "psd-k2-m4", "psd-k2-m16", "psd-k4-m4")
NO_K = 0


@dataclass(frozen=True)
class SweepConfig:
    """One configuration of the sweep (see module docstring for the name syntax)."""

    name: str
    mode: str
    k: int
    m: int
    k_policy: str = "fixed"
    balancer: str = "paper"
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in SWEEP_MODES:
            raise ValueError(f"mode: must be one of {SWEEP_MODES}, got {self.mode!r}")
        if self.m < 1:
            raise ValueError(f"m: must be >= 1, got {self.m}")
        if (self.mode == "ar") != (self.k == NO_K) or self.k < 0:
            raise ValueError(f"k: ar takes no k, speculative modes k >= 1; got {self.k} for {self.mode}")

    @property
    def is_fixed(self) -> bool:
        """A fixed (mode, k, m): ar, sd or psd with ``--k-policy fixed`` (the baselines of issue 10)."""
        return self.mode != "auto" and self.k_policy == "fixed"

    @property
    def max_num_running(self) -> int:
        """Requests running at once: 2m for psd and auto (two batches), m for ar and sd."""
        return 2 * self.m if self.mode in ("psd", "auto") else self.m


def parse_config(name: str) -> SweepConfig:
    """``SweepConfig`` of a name such as ``psd-k4-m16-adaptive``. Raises ValueError."""
    parts = name.split("-")
    mode, k, m, k_policy, balancer, budget = parts[0], NO_K, 0, "fixed", "paper", None
    for part in parts[1:]:
        if part[:1] == "b" and part[1:].isdigit():
            budget = int(part[1:])
        elif part == "adaptive":
            k_policy = "adaptive"
        elif part == "feedback":
            balancer = "feedback"
        elif part[:1] in ("k", "m") and part[1:].isdigit():
            k, m = (int(part[1:]), m) if part[0] == "k" else (k, int(part[1:]))
        else:
            raise ValueError(f"configs: cannot parse {part!r} in {name!r}")
    return SweepConfig(name, mode, k, m, k_policy, balancer, budget)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.load.load_sweep",
                                description="Load sweep: fixed (mode, k, m) vs adaptive k vs auto mode")
    p.add_argument("--out-dir", required=True, help="results.json, results.md, load_sweep.png")
    p.add_argument("--logs-dir", default="runs/load_sweep", help="service and step logs")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--drafter-gpu", type=int, default=1,
                   help="cuda: the drafter's GPU (the verifier runs on GPU 0; 0 shares it on a one-GPU machine)")
    p.add_argument("--cuda-mps", action="store_true",
                   help="cuda: the engines run under a private CUDA MPS daemon (minedraft up --cuda-mps)")
    p.add_argument("--dtype", default=None, help="engine dtype (default: the device's, minedraft.placement)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="the engines' --max-prefill-tokens (padded tokens per batched prefill; 0: one per forward)")
    p.add_argument("--max-graph-prefill-tokens", type=int, default=None,
                   help="the engines' --max-graph-prefill-tokens (0: one-prompt prefills on the dynamic path)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target alias, dir or .gguf")
    p.add_argument("--draft", default="", help="draft dir ('' = the target's default draft)")
    p.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl", help="Spec-Bench jsonl")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated configuration names")
    p.add_argument("--concurrencies", default=",".join(map(str, DEFAULT_CONCURRENCIES)),
                   help="closed-loop load points (requests in flight)")
    p.add_argument("--requests-per-client", type=int, default=1, help="closed loop: requests = max(min, this * c)")
    p.add_argument("--min-requests", type=int, default=8, help="closed loop: fewest requests of a point")
    p.add_argument("--max-requests", type=int, default=0, help="closed loop: most requests of a point (0 = no cap)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="bursty trace and sampling seed")
    p.add_argument("--num-bursts", type=int, default=BurstConfig.num_bursts)
    p.add_argument("--burst-size", default=f"{BurstConfig.min_burst_size},{BurstConfig.max_burst_size}",
                   help="min,max requests per burst")
    p.add_argument("--gap-s", default=f"{BurstConfig.min_gap_s},{BurstConfig.max_gap_s}", help="min,max quiet gap (s)")
    p.add_argument("--num-trickle", type=int, default=BurstConfig.num_trickle, help="single requests per gap")
    p.add_argument("--no-burst", action="store_true", help="skip the bursty open-loop point")
    p.add_argument("--num-warmup", type=int, default=2,
                   help="unmeasured requests per configuration, up to its max running requests at once (the "
                        "engines capture a CUDA graph per new batch bucket and verify width on first use)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole configuration list this many times; a point reports the median round "
                        "(bench.load.load_sweep_report)")
    p.add_argument("--time-budget-s", type=float, default=520.0, help="no point starts after this")
    p.add_argument("--min-point-s", type=float, default=8.0, help="a point starts only if this much is left")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    try:
        args.configs = tuple(parse_config(name) for name in args.configs.split(",") if name)
        args.concurrencies = tuple(int(c) for c in args.concurrencies.split(",") if c)
        burst_min, burst_max = (int(x) for x in args.burst_size.split(","))
        gap_min, gap_max = (float(x) for x in args.gap_s.split(","))
        args.burst = BurstConfig(args.num_bursts, burst_min, burst_max, min_gap_s=gap_min, max_gap_s=gap_max,
                                 num_trickle=args.num_trickle)
    except ValueError as exc:
        p.error(str(exc))
    if not args.configs or not args.concurrencies or min(args.concurrencies) < 1:
        p.error("--configs and --concurrencies (each >= 1) must not be empty")
    if args.cuda_mps and args.device != "cuda":
        p.error("--cuda-mps: only with --device cuda")
    if args.drafter_gpu < 0:
        p.error(f"--drafter-gpu: must be >= 0, got {args.drafter_gpu}")
    if args.rounds < 1:
        p.error(f"--rounds: must be >= 1, got {args.rounds}")
    return args
