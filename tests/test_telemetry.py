"""Tracing, metrics and the timeline on a real psd stack (four processes, tiny models).

An in-process OTLP/gRPC receiver (opentelemetry-proto's TraceService) collects every span the
services export (``OTEL_EXPORTER_OTLP_ENDPOINT`` points at it). Checked: each request's trace
holds the gateway's and the coordinator's spans, and the ``coordinator.step`` spans that link to
it hold the drafter's and verifier's (forward, sampling, data plane), so a request reaches all four
services; step spans carry the step attributes; the coordinator's /metrics counters equal the
totals of the responses' usage; ``minedraft timeline`` renders the run's step log and OTLP export.
"""
from __future__ import annotations

import dataclasses
import json
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from minedraft import telemetry, timeline
from minedraft.cli import main as cli_main
from minedraft.client import MineDraftClient
from minedraft.launcher import Stack
from test_e2e_stack import _config, _free_ports, _status, model_dirs  # noqa: F401 (fixture)

NUM_REQUESTS = 5  # > 2m = 4: one waits in the queue
STEP_ATTRIBUTES = ("mode", "step_id", "num_verify", "num_draft", "k", "num_draft_tokens", "num_accepted_tokens",
                   "draft_ms", "verify_ms", "data_plane_ms", "idle_ms", "is_parallel", "request_ids")
ENGINE_SPANS = {"verifier.verify", "verifier.data_plane_receive", "target.forward", "target.rejection_sample",
                "drafter.draft", "drafter.data_plane_send", "draft.catch_up_forward", "draft.forward", "draft.sample"}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every ExportTraceServiceRequest it receives."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[dict]:
        """Every span as a dict: name, service, trace/span/parent ids, attributes, links."""
        out = []
        for request in list(self.requests):
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attrs = {a.key: _value(a.value) for a in span.attributes}
                        out.append(dict(name=span.name, service=resource.get("service.name"),
                                        trace_id=span.trace_id, span_id=span.span_id, parent=span.parent_span_id,
                                        attrs=attrs, links={link.span_id for link in span.links}))
        return out


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver():
    servicer = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


@pytest.fixture(scope="module")
def traced_run(model_dirs, receiver, tmp_path_factory):  # noqa: F811 (fixture imported above)
    """A psd stack exporting to ``receiver``; NUM_REQUESTS requests (greedy and seeded sampled)."""
    servicer, otlp_port = receiver
    target, draft = model_dirs
    tmp = tmp_path_factory.mktemp("telemetry")
    metrics_port, http_port = _free_ports(2)
    cfg = dataclasses.replace(_config("psd", target, draft, str(tmp / "runs")), metrics_port=metrics_port,
                              http_port=http_port, step_log=str(tmp / "steps.jsonl"))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with pytest.MonkeyPatch.context() as mp, Stack(cfg) as stack:
        for key, value in env.items():
            mp.setenv(key, value)
        stack.start(target, log=lambda line: None)
        with futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
            results = list(pool.map(lambda i: _generate(cfg, i), range(NUM_REQUESTS)))
        status = _status(cfg)
        metrics = _get(f"http://{cfg.host}:{cfg.metrics_port}/metrics")
        gateway_metrics = _get(f"http://{cfg.host}:{cfg.http_port}/metrics")
        spans = _wait_for_spans(servicer, status.num_steps)
        yield dict(cfg=cfg, results=results, status=status, metrics=metrics, gateway_metrics=gateway_metrics,
                   spans=spans, receiver=servicer)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _generate(cfg, i: int):
    sampled = dict(temperature=0.8, seed=100 + i) if i % 2 else dict(temperature=0)
    with MineDraftClient(f"{cfg.host}:{cfg.gateway_port}", timeout_s=240) as client:
        return client.generate(messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                               max_tokens=8 + 4 * i, request_id=f"otel-{i}", **sampled)


def _wait_for_spans(servicer: OtlpReceiver, num_steps: int, timeout_s: float = 60.0, quiet_s: float = 1.0) -> list[dict]:
    """The spans once every request's and step's span arrived, every span's parent with them, and
    no span came for ``quiet_s`` (each service exports every 100 ms, in its own process: a
    request's span can arrive before its parent, the Generate server span, which ends after it)."""
    deadline = time.monotonic() + timeout_s
    count, changed = -1, time.monotonic()
    while True:
        spans = servicer.spans()
        if len(spans) != count:
            count, changed = len(spans), time.monotonic()
        names = [s["name"] for s in spans]
        ids = {s["span_id"] for s in spans}
        is_complete = (names.count("gateway.generate") >= NUM_REQUESTS and names.count("coordinator.request") >= NUM_REQUESTS
                       and names.count("coordinator.step") >= num_steps and all(not s["parent"] or s["parent"] in ids
                                                                             for s in spans))
        if (is_complete and time.monotonic() - changed >= quiet_s) or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_tracing_is_configured_only_with_an_endpoint():
    assert not telemetry.is_tracing_configured({})
    assert telemetry.is_tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"})
    assert not telemetry.is_tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4317",
                                                "OTEL_TRACES_EXPORTER": "none"})
    assert not telemetry.is_tracing_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://j:4317",
                                                "OTEL_SDK_DISABLED": "true"})
    assert telemetry.server_interceptors() == () and telemetry.client_interceptors() == ()  # off in this process


def test_each_request_trace_reaches_all_four_services(traced_run):
    spans, results = traced_run["spans"], traced_run["results"]
    by_id = {s["span_id"]: s for s in spans}
    assert [s["name"] for s in spans if s["parent"] and s["parent"] not in by_id] == []   # no orphans in Jaeger
    steps = [s for s in spans if s["name"] == "coordinator.step"]
    for result, i in zip(results, range(NUM_REQUESTS)):
        request_id = f"otel-{i}"
        [gateway] = [s for s in spans if s["name"] == "gateway.generate" and s["attrs"]["minedraft.request_id"] == request_id]
        in_trace = [s for s in spans if s["trace_id"] == gateway["trace_id"]]
        [coord] = [s for s in in_trace if s["name"] == "coordinator.request"]
        assert coord["attrs"]["minedraft.request_id"] == request_id
        assert by_id[coord["parent"]]["service"] == "coordinator"  # the Generate server span
        assert {s["service"] for s in in_trace} == {"gateway", "coordinator"}
        assert gateway["attrs"]["minedraft.finish_reason"] == result.finish_reason
        assert gateway["attrs"]["minedraft.completion_tokens"] == result.usage.completion_tokens
        assert gateway["attrs"]["minedraft.accepted_tokens"] == result.usage.num_accepted_tokens
        assert gateway["attrs"]["minedraft.ttft_ms"] > 0 and coord["attrs"]["minedraft.queue_wait_ms"] >= 0
        linked = [s for s in steps if coord["span_id"] in s["links"]]
        assert linked and all(request_id in s["attrs"]["minedraft.request_ids"] for s in linked)
        step_traces = {s["trace_id"] for s in linked}
        services = {s["service"] for s in spans if s["trace_id"] in step_traces}
        assert {"coordinator", "drafter", "verifier"} <= services


def test_step_spans_have_the_step_attributes_and_engine_children(traced_run):
    spans, results, status = traced_run["spans"], traced_run["results"], traced_run["status"]
    steps = [s for s in spans if s["name"] == "coordinator.step"]
    assert len(steps) == status.num_steps
    for step in steps:
        assert all(f"minedraft.{key}" in step["attrs"] for key in STEP_ATTRIBUTES), step["attrs"]
    assert any(s["attrs"]["minedraft.is_parallel"] for s in steps)
    assert sum(s["attrs"]["minedraft.num_accepted_tokens"] for s in steps) == sum(
        r.usage.num_accepted_tokens for r in results)
    assert sum(s["attrs"]["minedraft.num_draft_tokens"] for s in steps) == sum(r.usage.num_draft_tokens for r in results)
    step_traces = {s["trace_id"] for s in steps}
    warm_up_traces = {s["trace_id"] for s in spans if s["name"] in ("drafter.warm_up", "verifier.warm_up")}
    assert len(warm_up_traces) == 2
    engine = [s for s in spans if s["name"] in ENGINE_SPANS]
    assert all(s["trace_id"] in step_traces | warm_up_traces and s["parent"] for s in engine)
    assert {s["name"] for s in engine if s["trace_id"] in step_traces} == ENGINE_SPANS


def _sample(metrics_text: str, name: str, labels: dict | None = None) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and (labels is None or all(sample.labels.get(k) == v for k, v in labels.items())):
                return sample.value
    raise AssertionError(f"{name} {labels} not exported")


def test_metrics_counters_equal_the_run_totals(traced_run):
    text, results = traced_run["metrics"], traced_run["results"]
    usage = [r.usage for r in results]
    assert _sample(text, "minedraft:spec_decode_num_drafts_total") == sum(u.num_drafts for u in usage)
    assert _sample(text, "minedraft:spec_decode_num_draft_tokens_total") == sum(u.num_draft_tokens for u in usage)
    accepted = sum(u.num_accepted_tokens for u in usage)
    assert _sample(text, "minedraft:spec_decode_num_accepted_tokens_total") == accepted
    per_pos = sum(_sample(text, "minedraft:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(p)})
                  for p in range(traced_run["cfg"].num_speculative_tokens))
    assert per_pos == accepted
    assert _sample(text, "minedraft:generation_tokens_total") == sum(u.completion_tokens for u in usage)
    assert _sample(text, "minedraft:time_to_first_token_seconds_count") == NUM_REQUESTS
    assert _sample(text, "minedraft:e2e_request_latency_seconds_count") == NUM_REQUESTS
    status = traced_run["status"]
    assert _sample(text, "minedraft:psd_parallel_step_ratio") == pytest.approx(
        status.num_parallel_steps / status.num_steps)
    gateway = traced_run["gateway_metrics"]  # the gateway's HTTP /metrics
    reasons = {r.finish_reason for r in results}
    assert sum(_sample(gateway, "minedraft:gateway_requests_total", {"finish_reason": f}) for f in reasons) == NUM_REQUESTS
    assert _sample(gateway, "minedraft:gateway_time_to_first_token_seconds_count") == NUM_REQUESTS


def test_step_log_phases_carry_each_services_own_time_on_the_call(traced_run):
    with open(traced_run["cfg"].step_log, encoding="utf-8") as f:
        phases = [phase for line in f for phase in json.loads(line)["phases"]]
    assert {p["engine"] for p in phases} == {"drafter", "verifier"}
    assert all(p["compute_ms"] <= p["service_ms"] <= p["rpc_ms"] for p in phases)
    assert all(p["core_ms"] == p["core_steps"] == 0 for p in phases)   # no vLLM engine core in the native engine
    # the handler starts after the RPC is sent and ends before its answer arrives (one clock; the
    # send time is the receipt's minus rpc_ms, so allow a few hundred microseconds either way)
    assert all(p["start_s"] <= p["sent_s"] <= p["service_start_s"] + 3e-4 for p in phases)
    assert all(p["service_start_s"] + p["service_ms"] / 1e3 <= p["sent_s"] + p["rpc_ms"] / 1e3 + 3e-4 for p in phases)


def test_timeline_renders_step_log_and_otlp_export(traced_run, tmp_path):
    status = traced_run["status"]
    ratio = status.num_parallel_steps / status.num_steps
    otlp = tmp_path / "traces.jsonl"
    otlp.write_text("\n".join(json.dumps(json_format.MessageToDict(r)) for r in traced_run["receiver"].requests))
    for source in (traced_run["cfg"].step_log, str(otlp)):
        steps = timeline.load_steps(source)
        assert len(steps) == status.num_steps
        assert timeline.parallel_step_ratio(steps) == pytest.approx(ratio)
        assert all(step.phases for step in steps)
        out = tmp_path / "timeline.png"
        assert cli_main(["timeline", source, "--out", str(out)]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        out.unlink()


def test_timeline_refuses_input_without_steps(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"resourceSpans": []}) + "\n")
    with pytest.raises(ValueError, match="no coordinator steps"):
        timeline.load_steps(str(path))
