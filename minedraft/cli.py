"""The ``minedraft`` command line: ``up``, ``generate``, ``prompts``, ``demo``, ``distill``.

Only ``distill`` imports torch (lazily, through ``distill.run``).
"""
from __future__ import annotations

import argparse
import os
import sys

from minedraft.engine_backend import ENGINES
from minedraft.placement import ALL_SMS, DEVICES, NO_GPU, default_dtype, parse_gpu_list
from minedraft.stack import (BALANCERS, DATA_PLANES, DEFAULT_STREAM_INTERVAL, DEFAULT_STREAM_INTERVAL_MS, DEFAULT_TARGET,
                             K_POLICIES, MODES, StackConfig, default_data_plane)

DEFAULT_GATEWAY = "127.0.0.1:50051"
DEFAULT_PROMPTS = "../shared/data/spec_bench/question.jsonl"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell convention
EXIT_FAILED = 1  # the gateway failed the request (any gRPC error but INVALID_ARGUMENT)
EXIT_INVALID = 2  # bad input: a flag value, or the gateway answered INVALID_ARGUMENT
GENERATE_EPILOG = ("exit status: 0 done; 2 the gateway refused the request (INVALID_ARGUMENT, e.g. a prompt "
                   "longer than max_model_len); 1 any other gRPC error (e.g. UNAVAILABLE: no gateway at "
                   "--gateway), printed as 'error: <status code>: <details>'")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (``--max-tokens 0`` would mean "unset" on the wire)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``minedraft up`` (also used by ``minedraft demo``)."""
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens: draft tokens per step")
    p.add_argument("--max-num-seqs", type=int, default=4, help="m: requests per batch (engines get 2m KV slots)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the verifier (torchrun when > 1)")
    p.add_argument("--data-plane", choices=DATA_PLANES, default=None,
                   help="how draft probs travel (default: ipc on cuda, the fastest on one host: "
                        "bench/results/HISTORY.md 'GPU: data plane and TP'; inline on cpu)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model: alias, HF dir or .gguf")
    p.add_argument("--draft", default="", help="draft dir (default: drafts/smollm2-135m-instruct if present, "
                                               "else the target's first 4 layers, untrained)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + output tokens per request")
    p.add_argument("--dtype", default=None, help="engine parameter / KV dtype (default: float32 on cpu, "
                                                 "bfloat16 on cuda)")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where the engines run")
    p.add_argument("--verifier-gpus", default="", help="cuda: GPU index per verifier TP rank, e.g. 0 or 0,1 "
                                                        "(default 0..tp-1)")
    p.add_argument("--drafter-gpu", type=int, default=NO_GPU, help="cuda: the drafter's GPU (default: tp)")
    p.add_argument("--cuda-mps", action="store_true",
                   help="cuda: run the engines under a private CUDA MPS daemon, so a drafter sharing the "
                        "verifier's GPU drafts while it verifies (needs nvidia-cuda-mps-control)")
    p.add_argument("--cuda-mps-verifier-sm-percent", type=int, default=ALL_SMS, metavar="P",
                   help="cuda + --cuda-mps: the verifier's kernels use at most P%% of the GPU's SMs "
                        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so the drafter's find SMs free (default 100: no limit)")
    p.add_argument("--draft-sessions", action="store_true",
                   help="--engine vllm: the drafter keeps each request's draft request resident in vLLM instead "
                        "of admitting it again every draft call (specdec.vllm_backend.draft_sessions)")
    p.add_argument("--draft-proposer", action="store_true",
                   help="--engine vllm: the drafter drafts with vLLM's own draft-model proposer, k - 1 greedy tokens "
                        "inside the engine step after each sampled one: one engine step per draft call instead of k "
                        "(specdec.vllm_backend.draft; not with --draft-sessions; with vLLM 0.24 slower than k steps: 4x per draft "
                        "call on an H100, BENCHMARKS.md)")
    p.add_argument("--draft-processes", type=int, default=1, metavar="P",
                   help="run the drafter's engine as P processes on its device, each request homed on one, so a "
                        "draft call's engine steps run side by side on P host cores (drafter_svc.processes; "
                        "default 1)")
    p.add_argument("--bench-fixed-acceptance", type=float, default=None, metavar="P",
                   help="BENCHMARK-ONLY: the verifier accepts each draft token with probability P instead of "
                        "rejection sampling (changes the output distribution; for random:<preset> models)")
    p.add_argument("--no-pin", action="store_true", help="do not pin verifier/drafter to cores 0/1")
    p.add_argument("--host", default="127.0.0.1", help="address every service binds")
    p.add_argument("--port", type=int, default=50051, help="gateway port (coordinator, drafter, verifier: +1, +2, +3)")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API port (0 = off)")
    p.add_argument("--runs-dir", default="runs", help="logs go to RUNS_DIR/<timestamp>/<service>.log")
    p.add_argument("--metrics-port", type=int, default=0, help="coordinator Prometheus /metrics port (0 = off)")
    p.add_argument("--step-log", default="", help="coordinator writes one JSON line per step here (minedraft timeline)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds until every service is SERVING")
    p.add_argument("--k-policy", choices=K_POLICIES, default="fixed",
                   help="fixed: k = --k; adaptive: k in [1, --k] toward t_draft = t_verify (coordinator.adaptive)")
    p.add_argument("--balancer", choices=BALANCERS, default="paper",
                   help="paper: MineDraft's assign(); feedback: keep balancing PSD batches by step cost")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="engines prefill prompts admitted together in one forward up to this many padded "
                        "tokens (0: one per forward; default 8192 on cuda, 0 on cpu)")
    p.add_argument("--max-graph-prefill-tokens", type=int, default=None,
                   help="engines replay a CUDA graph per power-of-two length bucket for one-prompt prefills up "
                        "to this many tokens (0: off; default 1024 on cuda with graphs, else 0)")
    p.add_argument("--engine", choices=ENGINES, default="native",
                   help="what runs the models: native (our transformers engine, the CPU default) or vllm "
                        "(vLLM's engine; on CPU from .venv-vllm: bash bench/engines/setup_vllm.sh)")
    p.add_argument("--engine-python", default="", help="--engine vllm: the Python with vLLM (default: found)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="--engine vllm on cuda: the verifier's share of its GPU (default 0.85, 0.55 when "
                        "the drafter shares it)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="--engine vllm: no torch.compile / CUDA graphs (faster start, slower steps)")
    p.add_argument("--api-key", default="", help="the gateway requires this key (authorization: Bearer KEY; "
                                                 "default: $MINEDRAFT_API_KEY if set, else none)")
    p.add_argument("--max-queue-len", type=int, default=1024, help="coordinator: most waiting requests "
                                                                   "(more get RESOURCE_EXHAUSTED / HTTP 429)")
    p.add_argument("--grace", type=float, default=5.0, help="coordinator and gateway: drain seconds on SIGTERM")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="ar steps decode this many tokens per request in one Verify call (multi-step "
                        "decoding: fewer round trips; default 32 with --engine vllm, 1 with native)")
    p.add_argument("--stream-decode-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="stream a multi-step call's tokens as each step decodes them (default); "
                        "--no-stream-decode-steps: at the call's end, one chunk per call")
    p.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                   help="streamed multi-step calls: decode steps per partial message, as vLLM's "
                        "--stream-interval (1: every step; larger: fewer, larger chunks)")
    p.add_argument("--stream-interval-ms", type=int, default=DEFAULT_STREAM_INTERVAL_MS,
                   help="... or a partial message once this many ms passed since the last, where steps are "
                        "slow (0: steps only)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="coordinator admits at most this many prompt tokens between two steps, so running "
                        "requests keep decoding and first tokens stream sooner (0: no limit; a longer prompt "
                        "is admitted alone; default as vLLM: 4096 on cpu, 8192 on cuda)")


DEFAULT_GATEWAY_PORT, DEFAULT_DIST_PORT, DIST_PORT_SPAN = 50051, 29600, 30000


def dist_port_for(gateway_port: int) -> int:
    """The data plane's TCPStore port (and so the ipc plane's shared-file name) of a stack on
    ``gateway_port``: 29600 for the default 50051, and as far from it as the gateway port is, so
    two stacks on one host (``--port``) do not share a rendezvous."""
    return DEFAULT_DIST_PORT + (gateway_port - DEFAULT_GATEWAY_PORT) % DIST_PORT_SPAN


def stack_config(args: argparse.Namespace, mode: str) -> StackConfig:
    """StackConfig from the ``up`` flags (raises ValueError naming a bad field)."""
    return StackConfig(mode=mode, num_speculative_tokens=args.k, max_num_seqs=args.max_num_seqs,
                       tensor_parallel_size=args.tp,
                       data_plane=args.data_plane or default_data_plane(args.device, args.engine),
                       target=args.target,
                       draft=args.draft, max_model_len=args.max_model_len,
                       dtype=args.dtype or default_dtype(args.device), device=args.device,
                       verifier_gpus=parse_gpu_list(args.verifier_gpus), drafter_gpu=args.drafter_gpu,
                       cuda_mps=args.cuda_mps, verifier_sm_percent=args.cuda_mps_verifier_sm_percent,
                       bench_fixed_acceptance=args.bench_fixed_acceptance,
                       is_pinned=not args.no_pin, host=args.host, gateway_port=args.port, http_port=args.http_port,
                       coordinator_port=args.port + 1, drafter_port=args.port + 2, verifier_port=args.port + 3,
                       dist_port=dist_port_for(args.port),
                       runs_dir=args.runs_dir, startup_timeout_s=args.startup_timeout,
                       metrics_port=args.metrics_port, step_log=args.step_log, k_policy=args.k_policy,
                       balancer=args.balancer, max_prefill_tokens=args.max_prefill_tokens,
                       max_graph_prefill_tokens=args.max_graph_prefill_tokens,
                       max_num_batched_tokens=args.max_num_batched_tokens, engine=args.engine,
                       engine_python=args.engine_python, gpu_memory_utilization=args.gpu_memory_utilization,
                       enforce_eager=args.enforce_eager, draft_sessions=args.draft_sessions,
                       draft_proposer=args.draft_proposer, draft_processes=args.draft_processes,
                       api_key=args.api_key,
                       max_queue_len=args.max_queue_len,
                       grace_s=args.grace, num_decode_steps=args.decode_steps,
                       stream_decode_steps=args.stream_decode_steps, stream_interval=args.stream_interval,
                       stream_interval_ms=args.stream_interval_ms)


def add_prompts_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``minedraft prompts`` (also used by ``minedraft demo``)."""
    p.add_argument("--limit", type=int, default=32, help="first N prompts of the file")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="output tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None, help="per-request seed base (seed + index)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")


def _cmd_up(args) -> int:
    from minedraft.launcher import run_until_signal

    return run_until_signal(stack_config(args, args.mode))


def _cmd_generate(args) -> int:
    """Streams the answer to stdout; a gRPC error is one line on stderr (see ``GENERATE_EPILOG``)."""
    import grpc

    from minedraft.client import GenerationError, MineDraftClient

    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        kwargs["prompt"] = args.prompt
    try:
        with MineDraftClient(args.gateway, api_key=args.api_key) as client:
            for delta in client.stream_text(**kwargs):
                print(delta, end="", flush=True)
    except grpc.RpcError as exc:  # the call's status, e.g. INVALID_ARGUMENT or UNAVAILABLE
        return _generate_failed(exc.code().name, exc.details())
    except GenerationError as exc:  # an error inside the stream, e.g. RESOURCE_EXHAUSTED
        return _generate_failed(exc.code_name, exc.message)
    finally:
        print()
    return 0


def _generate_failed(code_name: str, details: str | None) -> int:
    one_line = (details or "").replace("\n", " ")
    print(f"error: {code_name}: {one_line}", file=sys.stderr)
    return EXIT_INVALID if code_name == "INVALID_ARGUMENT" else EXIT_FAILED


def _cmd_prompts(args) -> int:
    from minedraft.prompts import PromptsConfig, format_metrics, results_as_records, run_prompts, write_json

    cfg = PromptsConfig(path=args.file, gateway=args.gateway, limit=args.limit, concurrency=args.concurrency,
                        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                        ignore_eos=args.ignore_eos, wait_s=args.wait, api_key=args.api_key)
    metrics, results = run_prompts(cfg)
    print(format_metrics(metrics))
    if args.out:
        write_json(args.out, metrics)
    if args.outputs:
        write_json(args.outputs, results_as_records(results))
    return 0


def _cmd_demo(args) -> int:
    from minedraft.demo import run_demo

    return run_demo(args, [stack_config(args, mode) for mode in args.modes.split(",")])


def _cmd_distill(args, rest: list[str]) -> int:
    from distill.run import main as distill_main  # torch: imported only here

    return int(distill_main(rest) or 0)


def _cmd_timeline(args) -> int:
    from minedraft.timeline import main as timeline_main

    return timeline_main(args.input, args.out, args.first_step, args.max_steps)


def add_api_key_arg(p: argparse.ArgumentParser) -> None:
    """``--api-key`` of the client commands (default ``$MINEDRAFT_API_KEY``, as the gateway's)."""
    p.add_argument("--api-key", default=os.environ.get("MINEDRAFT_API_KEY", ""),
                   help="API key of a gateway started with --api-key (default: $MINEDRAFT_API_KEY)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minedraft", description="MineDraft: batch-parallel speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start verifier, drafter, coordinator, gateway; run until Ctrl-C")
    up.add_argument("--mode", choices=MODES, default="psd", help="ar, sd, psd (MineDraft) or auto (per step)")
    add_stack_args(up)
    gen = sub.add_parser("generate", help="stream one answer from a running stack", epilog=GENERATE_EPILOG)
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default=DEFAULT_GATEWAY)
    gen.add_argument("--max-tokens", type=positive_int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", dest="chat", action="store_false", help="send as raw text, not a chat message")
    add_api_key_arg(gen)
    prompts = sub.add_parser("prompts", help="run Spec-Bench prompts through a running stack, print metrics")
    prompts.add_argument("file", help="Spec-Bench format jsonl")
    prompts.add_argument("--gateway", default=DEFAULT_GATEWAY)
    prompts.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the gateway's health")
    prompts.add_argument("--out", default="", help="write the metrics as JSON here")
    prompts.add_argument("--outputs", default="", help="write per-request outputs as JSON here")
    add_api_key_arg(prompts)
    add_prompts_args(prompts)
    demo = sub.add_parser("demo", help="for each mode: up, prompts, down; then a side-by-side table")
    demo.add_argument("--modes", default="ar,sd,psd")
    demo.add_argument("--prompts-file", default=DEFAULT_PROMPTS)
    demo.add_argument("--out-dir", default="runs/demo", help="results.json and per-mode outputs go here")
    add_stack_args(demo)
    add_prompts_args(demo)
    timeline = sub.add_parser("timeline", help="draw recorded steps (--step-log file or OTLP JSON) as a PNG")
    timeline.add_argument("input", help="coordinator --step-log JSONL, or an OTLP JSON trace export")
    timeline.add_argument("--out", default="timeline.png", help="PNG to write")
    timeline.add_argument("--first-step", type=int, default=0, help="first step id drawn (0 = the first)")
    timeline.add_argument("--max-steps", type=int, default=30, help="steps drawn")
    sub.add_parser("distill", help="train a draft model (distill.run; see `minedraft distill --help`)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "distill":
        return _cmd_distill(None, argv[1:])
    args = build_parser().parse_args(argv)
    try:
        handler = {"up": _cmd_up, "generate": _cmd_generate, "prompts": _cmd_prompts, "demo": _cmd_demo,
                   "timeline": _cmd_timeline}[args.command]
        return handler(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: every stack was stopped on the way out
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
