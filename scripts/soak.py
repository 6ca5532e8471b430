"""Soak test: a bounded, mixed workload against a local MineDraft stack it starts itself.

    python scripts/soak.py --num-requests 2000 --concurrency 64 --abort-fraction 0.2 --out runs/soak.json
    python scripts/soak.py --tiny --num-requests 300 --concurrency 32       # tiny random models, fast
    python scripts/soak.py --tiny --engine vllm ...                          # both engines on vLLM

First the greedy prompts of the workload (prompt x penalties, ``--max-tokens`` each) run once
through an ``ar`` stack: the reference. Then it starts verifier, drafter, coordinator and gateway
(``minedraft.launcher.Stack``; the real SmolLM2-135M-Instruct target and the default draft, or
``--tiny``: a random head_dim-64 Llama and a draft that is it plus 1% noise, with the SmolLM2
tokenizer) and sends ``--num-requests`` chat requests, ``--concurrency`` at a time, mixed
(``soak_workload``): greedy, seeded and unseeded sampled, penalties, n=2 (some with best_of=3),
stop strings; ``--abort-fraction`` of them aborted at a random point (client cancel or Abort RPC).
Supervision is ``minedraft up``'s (``launcher.restart_exited``, polled from this thread): when
``--kill-drafter-at`` and ``--kill-coordinator-at`` of the requests are done, that service is
SIGKILLed and the supervisor restarts it on its port. Every stream must end within ``--deadline``
(else it is *hung*). After the drain it reads KV slots in use from both engines' ``GetInfo`` and
the coordinator's running/waiting counts (all must be 0), classifies every outcome
(``soak_checks``: failures of requests in flight at the coordinator kill are counted apart, as
``killed_in_flight``), compares every completed greedy output with the reference, and writes the
figures and goals as JSON. Exit status 0 only when every goal is met.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time

import grpc

from minedraft.launcher import POLL_S, Stack, resolve_model_dir, restart_exited
from minedraft.stack import StackConfig, free_loopback_ports as free_ports
from minedraft.v1 import coordinator_pb2, coordinator_pb2_grpc, engine_pb2, engine_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak_checks import goals, summarize  # noqa: E402
from soak_workload import greedy_reference, request_plan, run_workload  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--abort-fraction", type=float, default=0.2, help="share of requests aborted mid-stream")
    p.add_argument("--kill-drafter-at", type=float, default=0.3, help="SIGKILL the drafter when this share of "
                                                                    "requests is done; negative = never")
    p.add_argument("--kill-coordinator-at", type=float, default=0.6, help="same for the coordinator")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--mode", choices=["ar", "sd", "psd"], default="psd")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--engine", choices=["native", "vllm"], default="native")
    p.add_argument("--engine-python", default="", help="the Python of vLLM engines ('' = found)")
    p.add_argument("--tiny", action="store_true", help="tiny random target and draft instead of SmolLM2")
    p.add_argument("--no-reference", action="store_true", help="skip the ar reference (greedy not compared)")
    p.add_argument("--no-retry", action="store_true", help="do not re-send requests refused while the coordinator "
                                                         "is down (they then count as unavailable_while_down)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's RNG")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds per stream before it counts as hung")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--out", default="runs/soak.json")
    a = p.parse_args(argv)
    if a.num_requests < 1 or a.concurrency < 1 or not 0 <= a.abort_fraction <= 1 or not 1 <= a.min_tokens <= a.max_tokens:
        p.error("need num_requests >= 1, concurrency >= 1, abort_fraction in [0, 1], 1 <= min_tokens <= max_tokens")
    return a


def build_tiny_models(work_dir: str) -> tuple[str, str]:
    """(target_dir, draft_dir): a random 2-layer head_dim-64 Llama (vLLM's CPU attention needs
    head_dim >= 32) and the same plus 1% noise as draft, with the SmolLM2 tokenizer."""
    from specdec.models.gguf import packaged_gguf_path
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(packaged_gguf_path()),
                                              gguf_file=os.path.basename(packaged_gguf_path()))
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    dirs = []
    for name, noise in (("target", 0.0), ("draft", 0.01)):
        torch.manual_seed(7)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * torch.randn_like(param))
        path = os.path.join(work_dir, name)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1]


def stack_config(args: argparse.Namespace, target: str, draft: str, mode: str) -> StackConfig:
    gateway, coordinator, drafter, verifier, dist = free_ports(5)
    return StackConfig(mode=mode, num_speculative_tokens=args.k, max_num_seqs=args.max_num_seqs,
                       target=target, draft=draft, max_model_len=512 if args.tiny else 2048,
                       gateway_port=gateway, coordinator_port=coordinator, drafter_port=drafter,
                       verifier_port=verifier, dist_port=dist, runs_dir=args.runs_dir,
                       engine=args.engine, engine_python=args.engine_python,
                       enforce_eager=args.engine == "vllm", startup_timeout_s=900)


def run_supervised(stack: Stack, plans: list[dict], args: argparse.Namespace) -> tuple[list[dict], list[dict], list[str]]:
    """The workload in a thread of its own; this thread supervises as ``minedraft up`` does
    (children die with the thread that spawned them: PR_SET_PDEATHSIG) and SIGKILLs the services
    on schedule. Returns (results, kills, supervisor log lines)."""
    done, outcome = [0], {}
    address = f"{stack.cfg.host}:{stack.cfg.gateway_port}"

    def workload() -> None:
        outcome["results"] = asyncio.run(run_workload(address, plans, args, done))

    schedule = [(name, int(at * len(plans))) for name, at in (("drafter", args.kill_drafter_at),
                                                              ("coordinator", args.kill_coordinator_at))
                if at >= 0 and (name != "drafter" or stack.cfg.has_drafter)]
    schedule.sort(key=lambda item: item[1])
    kills, restarts, lines = [], {}, []
    thread = threading.Thread(target=workload, name="soak-workload")
    thread.start()
    while thread.is_alive():
        if schedule and done[0] >= schedule[0][1]:
            name, _ = schedule.pop(0)
            kill = {"service": name, "num_done_at_kill": done[0], "killed_at": time.monotonic()}
            kill["pid"] = stack.kill(name)
            restarted = restart_exited(stack, restarts, lines.append)  # what minedraft up's loop does
            kill["serving_at"] = time.monotonic() if name in restarted else None
            kill["down_s"] = round(time.monotonic() - kill["killed_at"], 2)
            kills.append(kill)
        else:
            restart_exited(stack, restarts, lines.append)  # an unexpected death shows in the log lines
        time.sleep(POLL_S)
    thread.join()
    if "results" not in outcome:
        raise RuntimeError("the workload failed; see the traceback above")
    return outcome["results"], kills, lines


def slots_in_use(cfg: StackConfig, timeout_s: float = 60.0) -> dict[str, int]:
    """KV slots still held per engine, and requests the coordinator still runs or queues, once
    idle (waits up to ``timeout_s`` for them to reach 0)."""
    deadline = time.monotonic() + timeout_s
    engines = [("verifier", engine_pb2_grpc.VerifierStub, cfg.verifier_port)]
    if cfg.has_drafter:
        engines.append(("drafter", engine_pb2_grpc.DrafterStub, cfg.drafter_port))
    while True:
        in_use = {}
        for name, stub_cls, port in engines:
            with grpc.insecure_channel(f"{cfg.host}:{port}") as channel:
                info = stub_cls(channel).GetInfo(engine_pb2.EngineInfoRequest(), timeout=30)
            in_use[name] = max(info.max_num_seqs - info.num_free_slots, len(info.request_ids))
        status = coordinator_status(cfg)
        in_use["coordinator"] = status.num_running + status.num_waiting
        if not any(in_use.values()) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.5)


def coordinator_status(cfg: StackConfig) -> coordinator_pb2.StatusResponse:
    with grpc.insecure_channel(f"{cfg.host}:{cfg.coordinator_port}") as channel:
        return coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(coordinator_pb2.StatusRequest(), timeout=30)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    plans = [request_plan(rng, i, args) for i in range(args.num_requests)]
    with tempfile.TemporaryDirectory(prefix="minedraft-soak-") as work_dir:
        if args.tiny:
            target, draft = build_tiny_models(work_dir)
            model_dir = target
        else:
            target, draft = "smollm2-135m-instruct", ""
            model_dir = resolve_model_dir(target)
        reference, ref_s = {}, 0.0
        if not args.no_reference:
            start = time.monotonic()
            with Stack(stack_config(args, target, draft, "ar")) as ref_stack:
                ref_stack.start(model_dir, log=lambda line: None)
                address = f"{ref_stack.cfg.host}:{ref_stack.cfg.gateway_port}"
                reference = asyncio.run(greedy_reference(address, plans, args.max_tokens, 2 * args.max_num_seqs))
            ref_s = time.monotonic() - start
        with Stack(stack_config(args, target, draft, args.mode)) as stack:
            stack.start(model_dir)
            start = time.monotonic()
            results, kills, lines = run_supervised(stack, plans, args)
            wall_s = time.monotonic() - start
            slots = slots_in_use(stack.cfg)
            status = coordinator_status(stack.cfg)
            run_dir = stack.run_dir
    summary = summarize(results, kills, reference, slots, wall_s, start)
    expected = tuple(name for name, at in (("drafter", args.kill_drafter_at), ("coordinator", args.kill_coordinator_at))
                     if at >= 0 and (name != "drafter" or args.mode != "ar"))
    met = goals(summary, expected)
    if args.no_reference:
        met["greedy_equal_ar"] = None  # not measured
    summary = {"goals": met, **summary, "reference_s": round(ref_s, 1),
               "supervisor_log": lines, "run_dir": run_dir, "args": vars(args),
               "coordinator": {"is_drafter_available": status.is_drafter_available,
                               "effective_mode": status.effective_mode, "num_steps": status.num_steps,
                               "num_draft_tokens": status.num_draft_tokens,
                               "num_accepted_tokens": status.num_accepted_tokens}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    skip = ("args", "requests", "failures", "killed_in_flight_sample", "unavailable_while_down_sample", "hung_sample",
            "supervisor_log")
    print(json.dumps({k: v for k, v in summary.items() if k not in skip}, indent=2))
    return 0 if all(v is not False for v in summary["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
