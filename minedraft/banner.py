"""What ``minedraft up`` prints once every service is SERVING (torch-free)."""
from __future__ import annotations

from minedraft.stack import StackConfig


def banner_lines(cfg: StackConfig, run_dir: str) -> list[str]:
    """What ``minedraft up`` prints once every service is SERVING: mode, the gateway's gRPC address,
    its OpenAI HTTP API, every Prometheus ``/metrics`` address (the gateway's, on the HTTP port, and
    the coordinator's ``--metrics-port``; the engines serve none), the logs, CUDA MPS (on, or a hint
    when the drafter shares the verifier's GPU without it), and how to stop."""
    http = f"http://{cfg.host}:{cfg.http_port}"
    lines = [f"MineDraft up: mode {cfg.mode}, gateway gRPC {cfg.host}:{cfg.gateway_port}, logs {run_dir}",
             f"  OpenAI HTTP API: {http}/v1" if cfg.http_port else "  OpenAI HTTP API: off (--http-port 0)",
             f"  metrics: gateway {http}/metrics" if cfg.http_port else "  metrics: gateway off (no HTTP port)"]
    lines[-1] += (f", coordinator http://{cfg.host}:{cfg.metrics_port}/metrics" if cfg.metrics_port
                  else ", coordinator off (--metrics-port 0)")
    lines[-1] += "; drafter and verifier serve none"
    placement = cfg.placement
    if cfg.uses_cuda_mps:
        share = (f", the verifier on at most {cfg.verifier_sm_percent}% of the SMs"
                 if cfg.verifier_sm_percent < 100 else "")
        lines.append(f"  CUDA MPS: on (a private daemon; its logs in {run_dir}/mps){share}")
    elif cfg.cuda_mps:
        lines.append("  CUDA MPS: not used (ar runs the target alone: nothing shares its GPU)")
    elif placement.is_shared_gpu and cfg.has_drafter:
        lines.append(f"  note: the drafter shares GPU {placement.resolved_drafter_gpu} with the verifier, so their "
                     "kernels take turns; --cuda-mps lets them run at the same time")
    lines.append("  running in the foreground: Ctrl-C stops every service")
    return lines
