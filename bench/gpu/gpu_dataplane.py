"""Per-step draft-probs data-plane time, NCCL vs CUDA IPC vs inline protobuf, and its share of a
verify step (MineDraft paper Table 1: 50-58% of a step at k = 1 over PCIe; aim < 5% on NVLink).

Two processes: this one is verifier rank 0 (``--verifier-device``, e.g. cuda:0); it starts a
drafter process (``--drafter-device``, e.g. cuda:1). For each (vocab V, dtype, batch b, k, plane)
the drafter samples q = softmax(randn [b, k, V]) in ``dtype`` on its device, then per iteration
  - nccl  : ``DraftProbsServer.publish`` (buffers) + verifier ``DraftProbsClient.fetch`` (store
            request, gloo header + ids, NCCL recv GPU->GPU), ``specdec.dataplane.dist``;
  - ipc   : ``IpcProbsServer.publish`` (copy into the shared slot + stream sync) + verifier
            ``IpcProbsClient.fetch`` (peer copy + seqlock check), ``specdec.dataplane.ipc``;
  - inline: drafter ``tensor_to_proto`` (D2H) + ``SerializeToString``; verifier ``ParseFromString``
            + ``proto_to_tensor`` + H2D. The two gRPC hops through the coordinator are NOT timed
            (the bytes cross via a /dev/shm file outside the timer): a LOWER BOUND for inline.
  - ids   : temperature 0, token ids only: int32 [b, k] encoded + decoded (same on every plane).
Data-plane ms = drafter-side ms + verifier-side ms (both end with a CUDA sync), median over
``--iters`` after ``--warmup``; every transfer is checked exactly (float64 checksum, untimed). The verify step is ``TargetWorker.verify`` (eager, bf16) of a
random-weight Llama of each preset's shapes (``bench.gpu.gpu_dataplane_models``) on the verifier's
device, b requests of ``--context-len`` tokens, k drafts with probs (temperature 1).
Writes ``gpu_dataplane.json`` and ``gpu_dataplane.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu.gpu_dataplane_models import PRESETS, time_verify_steps  # noqa: E402
from bench.gpu.gpu_dataplane_report import write_report  # noqa: E402
from minedraft.v1 import engine_pb2  # noqa: E402
from specdec.dataplane.dist import DistPlaneConfig, DraftProbsClient, DraftProbsServer  # noqa: E402
from specdec.dataplane.ipc import IpcPlaneConfig, IpcProbsClient, IpcProbsServer  # noqa: E402
from specdec.dataplane.shm import SHM_DIR  # noqa: E402
from engine_svc.tensor_proto import proto_to_tensor, tensor_to_proto  # noqa: E402

PLANES = ("nccl", "ipc", "inline", "ids")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STOP = "stop"


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _probs(b: int, k: int, vocab: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(b * 1000 + k)
    return torch.softmax(torch.randn(b, k, vocab, device=device, generator=gen), dim=-1).to(dtype)


def _store(args, is_master: bool) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", args.control_port, 2, is_master,
                         timeout=datetime.timedelta(seconds=args.timeout_s), wait_for_workers=False)


def run_drafter(args) -> None:
    """Drafter process: publish what each ``cmd/<i>`` asks, answer ``done/<i>`` = drafter ms."""
    if torch.device(args.drafter_device).type == "cuda":
        torch.cuda.set_device(args.drafter_device)
    store = _store(args, is_master=False)
    dist_server = DraftProbsServer(DistPlaneConfig(port=args.dist_port, device=args.drafter_device,
                                                   max_buffered_steps=4, connect_timeout_s=args.timeout_s))
    dist_server.start()
    ipc_server = IpcProbsServer(IpcPlaneConfig(name=args.ipc_name, device=args.drafter_device, num_slots=4,
                                               max_batch_size=max(args.batches)))
    store.set("drafter/ready", "1")
    cache: dict[tuple, torch.Tensor] = {}
    index = 0
    try:
        while True:
            store.wait([f"cmd/{index}"])
            command = store.get(f"cmd/{index}").decode()
            if command == STOP:
                return
            plane, vocab, dtype, b, k, step = command.split(",")
            b, k, vocab, step = int(b), int(k), int(vocab), int(step)
            key = (b, k, vocab, dtype)
            if key not in cache:
                cache.clear()
                cache[key] = _probs(b, k, vocab, DTYPES[dtype], args.drafter_device)
            probs, ids = cache[key], [f"r{i}" for i in range(b)]
            tensor = probs if plane == "inline" else probs[..., 0].to(torch.int32)  # ids: [b, k] int32
            _sync(args.drafter_device)
            start = time.perf_counter()
            if plane == "nccl":
                dist_server.publish(step, ids, probs)
            elif plane == "ipc":
                ipc_server.publish(step, ids, probs)
            else:
                blob = engine_pb2.DraftResponse(step_id=step, draft_probs=tensor_to_proto(tensor)).SerializeToString()
            drafter_ms = _ms(start)
            if plane in ("inline", "ids"):  # the bytes cross outside the timers (TCPStore caps values at 8 MB)
                with open(_blob_path(args, index), "wb") as handle:
                    handle.write(blob)
            store.set(f"done/{index}", f"{drafter_ms!r},{_checksum(tensor if plane == 'ids' else probs)}")
            index += 1
    finally:
        dist_server.stop()
        ipc_server.stop()


def _blob_path(args, index: int) -> str:
    return os.path.join(SHM_DIR, f"{args.ipc_name}-inline-{index}.pb")


def _checksum(tensor: torch.Tensor) -> str:
    """Exact fingerprint (float64 sum on the CPU, deterministic) to check what arrived, untimed."""
    return repr(float(tensor.detach().double().cpu().sum()))


def _verifier_side(args, plane: str, step: int, b: int, clients, index: int, device: str) -> tuple[float, str]:
    ids = [f"r{i}" for i in range(b)]
    if plane in ("inline", "ids"):
        path = _blob_path(args, index)
        with open(path, "rb") as handle:
            blob = handle.read()
        os.unlink(path)
    _sync(device)
    start = time.perf_counter()
    if plane == "nccl":
        received = clients["nccl"].fetch(step, ids)
    elif plane == "ipc":
        received = clients["ipc"].fetch(step, ids)
    else:
        received = proto_to_tensor(engine_pb2.DraftResponse.FromString(blob).draft_probs, device)
    _sync(device)
    return _ms(start), _checksum(received)


def measure_planes(args, store, clients) -> list[dict]:
    """Rows {plane, vocab, dtype, b, k, bytes, drafter_ms, verifier_ms, total_ms (medians), p90}."""
    rows, index = [], 0
    for vocab in sorted({PRESETS[m]["vocab_size"] for m in args.models}):
        for dtype in args.dtypes:
            for b in args.batches:
                for k in args.ks:
                    for plane in args.planes:
                        if plane == "ids" and dtype != args.dtypes[0]:
                            continue
                        samples, mismatches = [], 0
                        iters = args.iters if plane != "inline" else max(3, args.iters // 4)
                        for it in range(args.warmup + iters):
                            step = index
                            store.set(f"cmd/{index}", f"{plane},{vocab},{dtype},{b},{k},{step}")
                            store.wait([f"done/{index}"])
                            verifier_ms, received = _verifier_side(args, plane, step, b, clients, index,
                                                                   args.verifier_device)
                            drafter_ms, sent = store.get(f"done/{index}").decode().split(",")
                            drafter_ms, mismatches = float(drafter_ms), mismatches + (sent != received)
                            index += 1
                            if it >= args.warmup:
                                samples.append((drafter_ms, verifier_ms))
                        totals = sorted(d + v for d, v in samples)
                        itemsize = 4 if plane == "ids" else torch.empty((), dtype=DTYPES[dtype]).element_size()
                        rows.append({
                            "plane": plane, "vocab": vocab, "dtype": "int32" if plane == "ids" else dtype,
                            "b": b, "k": k, "bytes": b * k * (1 if plane == "ids" else vocab) * itemsize,
                            "drafter_ms": statistics.median(d for d, _ in samples),
                            "verifier_ms": statistics.median(v for _, v in samples),
                            "total_ms": statistics.median(totals),
                            "total_p90_ms": totals[min(len(totals) - 1, int(0.9 * len(totals)))],
                            "num_iters": len(samples), "num_checksum_mismatches": mismatches})
                        print(json.dumps(rows[-1]), flush=True)
    store.set(f"cmd/{index}", STOP)
    return rows


def run_verifier(args) -> dict:
    if torch.device(args.verifier_device).type == "cuda":
        torch.cuda.set_device(args.verifier_device)
    store = _store(args, is_master=True)
    drafter = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "drafter", *sys.argv[1:]])
    try:
        store.wait(["drafter/ready"])
        clients = {"nccl": DraftProbsClient(DistPlaneConfig(port=args.dist_port, device=args.verifier_device,
                                                             connect_timeout_s=args.timeout_s)),
                   "ipc": IpcProbsClient(IpcPlaneConfig(name=args.ipc_name, device=args.verifier_device))}
        clients["nccl"].connect()
        clients["ipc"].connect()
        rows = measure_planes(args, store, clients)
        clients["nccl"].close()
        drafter.wait(args.timeout_s)
    finally:
        if drafter.poll() is None:
            drafter.kill()
    verify = [] if args.skip_verify else time_verify_steps(args.models, args.batches, args.ks, args.verifier_device,
                                                           args.context_len, args.verify_iters)
    return {"command": " ".join(["python", "bench/gpu/gpu_dataplane.py", *sys.argv[1:]]),
            "drafter_device": args.drafter_device, "verifier_device": args.verifier_device,
            "device_name": torch.cuda.get_device_name(args.verifier_device) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "planes": rows, "verify": verify}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--role", default="verifier", choices=["verifier", "drafter"])
    p.add_argument("--drafter-device", default="cuda:1")
    p.add_argument("--verifier-device", default="cuda:0")
    p.add_argument("--ks", type=_ints, default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--batches", type=_ints, default=[4, 8, 16])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    p.add_argument("--planes", type=lambda s: s.split(","), default=list(PLANES))
    p.add_argument("--models", type=lambda s: s.split(","), default=["smollm2-135m", "llama-8b"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--verify-iters", type=int, default=8)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--skip-verify", action="store_true")
    p.add_argument("--control-port", type=int, default=29710)
    p.add_argument("--dist-port", type=int, default=29711)
    p.add_argument("--ipc-name", default="bench-dataplane")
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    unknown = set(args.planes) - set(PLANES) or set(args.dtypes) - set(DTYPES) or set(args.models) - set(PRESETS)
    if unknown:
        p.error(f"unknown plane/dtype/model {sorted(unknown)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.role == "drafter":
        run_drafter(args)
        return
    result = run_verifier(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_dataplane.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    write_report(result, os.path.join(args.out, "gpu_dataplane.md"))


if __name__ == "__main__":
    main()
