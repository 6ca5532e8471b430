"""Unit tests of the torch-free CLI pieces: stack config and service command lines, prompts
loading and metrics, the demo table, and the CLI's argument handling."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from minedraft import cli
from minedraft.client import GenerationResult, build_request
from minedraft.demo import format_identity, format_table
from minedraft.prompts import format_metrics, load_prompts, percentile, summarize
from minedraft.stack import StackConfig, build_service_specs
from minedraft.v1 import common_pb2


@pytest.mark.parametrize("field,value", [("mode", "fast"), ("num_speculative_tokens", 0), ("max_num_seqs", 0),
                                         ("tensor_parallel_size", 0), ("data_plane", "nccl"), ("gateway_port", 0),
                                         ("max_prefill_tokens", -1), ("max_num_batched_tokens", -1),
                                         ("max_graph_prefill_tokens", -1)])
def test_stack_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        StackConfig(**{field: value})


def test_stack_config_refuses_graph_prefills_with_batched_prefill_or_on_cpu():
    with pytest.raises(ValueError, match="max_graph_prefill_tokens"):
        StackConfig(max_graph_prefill_tokens=512, max_prefill_tokens=8192, device="cuda")
    with pytest.raises(ValueError, match="max_graph_prefill_tokens"):
        StackConfig(max_graph_prefill_tokens=512)                       # cpu: no graphs
    StackConfig(max_graph_prefill_tokens=512, max_prefill_tokens=0, device="cuda")
    StackConfig(max_graph_prefill_tokens=0)


@pytest.mark.parametrize("field", ["max_prefill_tokens", "max_graph_prefill_tokens"])
@pytest.mark.parametrize("value", [True, 1.5, "64", -1])
def test_stack_config_prefill_counts_must_be_ints(field, value):
    with pytest.raises(ValueError, match=field):
        StackConfig(**{field: value})


@pytest.mark.parametrize("module", ["verifier_svc.__main__", "drafter_svc.__main__"])
def test_engines_refuse_graph_prefills_on_cpu_before_serving(module, capsys):
    import importlib

    parse_args = importlib.import_module(module).parse_args
    base = ["--draft", "/d"] if module.startswith("drafter") else []
    with pytest.raises(SystemExit) as exc:
        parse_args(base + ["--max-graph-prefill-tokens", "64"])         # --device cpu (default)
    assert exc.value.code == 2 and "max_graph_prefill_tokens" in capsys.readouterr().err
    assert parse_args(base + ["--device", "cuda:0", "--max-graph-prefill-tokens", "64"]).max_graph_prefill_tokens == 64


def test_service_specs_psd_pins_engines_and_shares_settings():
    cfg = StackConfig(mode="psd", num_speculative_tokens=3, max_num_seqs=4, draft="/d", max_model_len=512)
    specs = {s.name: s for s in build_service_specs(cfg, "/target")}
    assert list(specs) == ["verifier", "drafter", "coordinator", "gateway"]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        assert specs["verifier"].cpus == (cpus[0],) and specs["drafter"].cpus == (cpus[1],)
    for name in ("verifier", "drafter"):
        argv = specs[name].argv
        assert argv[argv.index("--max-num-seqs") + 1] == "8"  # 2m slots
        assert argv[argv.index("--num-threads") + 1] == "1"
        assert argv[argv.index("--max-model-len") + 1] == "512"
        assert "--max-prefill-tokens" not in argv   # engines' own device default
        assert "--max-graph-prefill-tokens" not in argv
    coord = specs["coordinator"].argv
    assert coord[coord.index("--k") + 1] == "3" and coord[coord.index("--mode") + 1] == "psd"
    cfg = StackConfig(max_prefill_tokens=0, max_graph_prefill_tokens=256, draft="/d", device="cuda")
    for spec in build_service_specs(cfg, "/target")[:2]:
        assert spec.argv[spec.argv.index("--max-prefill-tokens") + 1] == "0"
        assert spec.argv[spec.argv.index("--max-graph-prefill-tokens") + 1] == "256"
    assert coord[coord.index("--max-num-batched-tokens") + 1] == "4096"   # vLLM's CPU default
    coord = build_service_specs(StackConfig(max_num_batched_tokens=0, draft="/d"), "/target")[2].argv
    assert coord[coord.index("--max-num-batched-tokens") + 1] == "0"
    gateway = specs["gateway"].argv
    assert gateway[gateway.index("--tokenizer") + 1] == "/target"


def test_service_specs_ar_has_no_drafter_and_tp_uses_torchrun():
    specs = build_service_specs(StackConfig(mode="ar", tensor_parallel_size=2), "/target")
    assert [s.name for s in specs] == ["verifier", "coordinator", "gateway"]
    assert "torch.distributed.run" in specs[0].argv and "--nproc-per-node=2" in specs[0].argv


def test_load_prompts_takes_first_turns(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "turns": [f"first {i}", f"second {i}"]} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_prompts(str(path), 3) == [("0", "first 0"), ("1", "first 1"), ("2", "first 2")]


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def _result(tokens: int, drafted: int, accepted: int, drafts: int, ttft: float, latency: float) -> GenerationResult:
    usage = common_pb2.Usage(completion_tokens=tokens, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                             num_drafts=drafts)
    return GenerationResult(usage=usage, ttft_s=ttft, latency_s=latency, finish_reason="length")


def test_summarize_mean_acceptance_length_and_rates():
    results = [_result(10, 12, 6, 3, 0.1, 1.0), _result(20, 16, 10, 4, 0.3, 2.0)]
    metrics = summarize(results, wall_s=2.0)
    assert metrics["output_tokens_per_s"] == 15.0 and metrics["requests_per_s"] == 1.0
    assert metrics["mean_acceptance_length"] == pytest.approx(1 + 16 / 7)
    assert metrics["acceptance_rate"] == pytest.approx(16 / 28)
    assert metrics["ttft_ms_p50"] == pytest.approx(200.0) and metrics["latency_ms_p99"] == pytest.approx(1990.0)
    assert summarize([_result(5, 0, 0, 0, 0.1, 0.2)], 1.0)["mean_acceptance_length"] == 1.0


def test_demo_table_has_ratios():
    table = format_table({"ar": {"output_tokens_per_s": 10.0, "mean_acceptance_length": 1.0, "ttft_ms_p50": 1.0,
                                 "latency_ms_p50": 2.0, "latency_ms_p99": 3.0},
                          "psd": {"output_tokens_per_s": 15.0, "mean_acceptance_length": 2.5, "ttft_ms_p50": 1.0,
                                  "latency_ms_p50": 2.0, "latency_ms_p99": 3.0}})
    assert "1.50x" in table.splitlines()[-1]


def test_demo_states_output_identity_and_prints_no_nan():
    by_mode = {"ar": {"num_requests": 4, "num_outputs_equal_to_ar": 4},
               "sd": {"num_requests": 4, "num_outputs_equal_to_ar": 4},
               "psd": {"num_requests": 4, "num_outputs_equal_to_ar": 3}}
    assert format_identity(by_mode) == "greedy outputs equal to ar's: sd 4/4, psd 3/4"
    assert "not compared" in format_identity({"sd": {"num_requests": 4}})
    assert "nan" not in format_metrics({"acceptance_rate": float("nan"), "x": 1.5}).lower()


def test_demo_identity_line_gives_the_right_reason_when_nothing_was_compared():
    """``--modes ar`` said "needs ar among the modes"; ar alone has nothing to compare with."""
    only_ar = format_identity({"ar": {"num_requests": 4, "num_outputs_equal_to_ar": 4}})
    assert only_ar == "outputs not compared: only ar ran, no speculative mode to compare with it"
    no_ar = format_identity({"sd": {"num_requests": 4}, "psd": {"num_requests": 4}})
    assert no_ar == "outputs not compared: ar, the reference, was not among the modes"
    sampled = format_identity({"ar": {"num_requests": 4}, "psd": {"num_requests": 4}})  # temperature > 0
    assert sampled == "outputs not compared with ar's (needs temperature 0 and no --bench-fixed-acceptance)"


def test_build_request_needs_exactly_one_input():
    with pytest.raises(ValueError, match="prompt"):
        build_request("a", prompt_token_ids=[1])
    request = build_request(messages=[{"role": "user", "content": "hi"}], max_tokens=3, stop=["x"])
    assert request.WhichOneof("input") == "messages" and list(request.sampling.stop) == ["x"]


def test_cli_rejects_bad_values_and_stays_torch_free(capsys):
    assert cli.main(["prompts", "/no/such/file.jsonl"]) == 2
    assert "path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["up", "--mode", "fast"])
    code = ("import sys, minedraft.cli, minedraft.launcher, minedraft.prompts, minedraft.demo, minedraft.client; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_results_json_is_strict_json(tmp_path):
    from minedraft.prompts import write_json

    path = tmp_path / "r" / "results.json"
    write_json(str(path), {"ar": {"acceptance_rate": math.nan, "tok_s": 1.5, "xs": [math.nan, 2]}})
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict {c}")) == {
        "ar": {"acceptance_rate": None, "tok_s": 1.5, "xs": [None, 2]}}


@pytest.mark.parametrize("command", [["generate", "hi"], ["prompts", "prompts.jsonl"], ["demo"]])
def test_max_tokens_zero_or_negative_is_refused_by_the_cli(command, capsys):
    from minedraft.cli import build_parser

    for bad in ("0", "-3"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([*command, "--max-tokens", bad])
        assert info.value.code == 2 and "--max-tokens: must be >= 1" in capsys.readouterr().err
    assert build_parser().parse_args([*command, "--max-tokens", "5"]).max_tokens == 5


def test_python_dash_m_minedraft_is_the_cli(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "minedraft", "up", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("usage: minedraft up"), done.stderr[-1000:]


def test_up_passes_api_key_queue_limit_and_grace_to_the_services():
    """Issue 25.6: ``minedraft up --api-key/--max-queue-len/--grace``; the key goes in the
    gateway's environment only (not on a command line that ``ps`` shows)."""
    from minedraft.cli import build_parser, stack_config

    args = build_parser().parse_args(["up", "--api-key", "k3y", "--max-queue-len", "7", "--grace", "2.5",
                                      "--draft", "/d"])
    specs = {s.name: s for s in build_service_specs(stack_config(args, args.mode), "/target")}
    coordinator, gateway = specs["coordinator"].argv, specs["gateway"].argv
    assert coordinator[coordinator.index("--max-queue-len") + 1] == "7"
    assert coordinator[coordinator.index("--grace") + 1] == "2.5" == gateway[gateway.index("--grace") + 1]
    assert specs["gateway"].env["MINEDRAFT_API_KEY"] == "k3y"
    assert all("k3y" not in " ".join(s.argv) for s in specs.values())
    assert all("MINEDRAFT_API_KEY" not in s.env for name, s in specs.items() if name != "gateway")
    plain = build_service_specs(StackConfig(draft="/d"), "/target")[-1]
    assert "MINEDRAFT_API_KEY" not in plain.env


@pytest.mark.parametrize("queue_len, max_n", [(7, "7"), (1024, "16")])
def test_up_caps_the_gateways_choices_at_the_coordinators_queue(queue_len, max_n):
    """Break-it finding: ``n`` / ``best_of`` samples are queued together, so with more than
    ``--max-queue-len`` of them a request was refused with 429 on every retry; the gateway's
    ``--max-n`` now stops it with 400 naming ``n`` / ``best_of``."""
    from minedraft.cli import build_parser, stack_config

    args = build_parser().parse_args(["up", "--max-queue-len", str(queue_len), "--draft", "/d"])
    gateway = {s.name: s for s in build_service_specs(stack_config(args, args.mode), "/target")}["gateway"].argv
    assert gateway[gateway.index("--max-n") + 1] == max_n


def test_up_passes_decode_steps_to_the_coordinator():
    from minedraft.cli import build_parser, stack_config

    args = build_parser().parse_args(["up", "--mode", "ar", "--decode-steps", "8", "--stream-interval", "3",
                                      "--stream-interval-ms", "20"])
    coordinator = {s.name: s for s in build_service_specs(stack_config(args, args.mode), "/target")}["coordinator"].argv
    assert coordinator[coordinator.index("--decode-steps") + 1] == "8"
    assert coordinator[coordinator.index("--stream-interval") + 1] == "3"
    assert coordinator[coordinator.index("--stream-interval-ms") + 1] == "20"


@pytest.mark.parametrize("engine, steps", [("native", "1"), ("vllm", "32")])
def test_up_decodes_the_engines_default_tokens_per_ar_call(engine, steps):
    """Without --decode-steps: 32 on vLLM (its verifier admits newcomers inside a call), 1 on native."""
    from minedraft.cli import build_parser, stack_config

    args = build_parser().parse_args(["up", "--mode", "ar", "--engine", engine, "--engine-python", sys.executable])
    coordinator = {s.name: s for s in build_service_specs(stack_config(args, args.mode), "/target")}["coordinator"].argv
    assert coordinator[coordinator.index("--decode-steps") + 1] == steps


@pytest.mark.parametrize("field, value", [("max_queue_len", 0), ("grace_s", -1.0), ("grace_s", 20.0),
                                          ("num_decode_steps", 0), ("num_decode_steps", 65),
                                          ("stream_interval", 0), ("stream_interval", 65),
                                          ("stream_interval_ms", -1), ("stream_interval_ms", 60_001)])
def test_stack_config_refuses_bad_queue_and_grace(field, value):
    with pytest.raises(ValueError, match=field):
        StackConfig(**{field: value})


def test_two_stacks_on_one_host_get_their_own_data_plane_rendezvous():
    """Issue 25.6: --port moves the dist plane's TCPStore port and the ipc plane's file name too."""
    from minedraft.cli import build_parser, stack_config

    def plane(port: int) -> tuple[int, str]:
        args = build_parser().parse_args(["up", "--port", str(port), "--draft", "/d"])
        cfg = stack_config(args, args.mode)
        verifier = build_service_specs(cfg, "/target")[0].argv
        return cfg.dist_port, verifier[verifier.index("--ipc-name") + 1]

    assert plane(50051) == (29600, "stack-29600")          # the documented default
    assert plane(52051)[0] == 31600 and plane(52051) != plane(50051) != plane(50061)
    assert all(1 <= plane(p)[0] <= 65535 for p in (1, 8000, 65532))   # 65532: its verifier gets 65535
