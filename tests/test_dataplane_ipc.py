"""Same-host IPC data plane (specdec.dataplane.ipc, specdec.dataplane.shm) on its CPU twin
(/dev/shm files: the code path of CUDA IPC minus the handle export), and the dist plane's
backend choice (specdec.dataplane.nccl: NCCL only when both ends are CUDA)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import uuid

import pytest
import torch
import torch.distributed as dist

from specdec.dataplane import nccl as dataplane_nccl
from specdec.dataplane import shm as dataplane_shm
from specdec.dataplane.dist import DataPlaneUnavailableError, DraftProbsMissingError
from specdec.dataplane.ipc import IpcPlaneConfig, IpcProbsClient, IpcProbsServer
from minedraft.probes import free_loopback_ports


@pytest.fixture
def ipc_plane():
    name = f"test-{uuid.uuid4().hex[:12]}"
    server = IpcProbsServer(IpcPlaneConfig(name=name, num_slots=2, max_batch_size=2))
    server.start()
    client = IpcProbsClient(IpcPlaneConfig(name=name, connect_timeout_s=5))
    yield server, client
    client.close()
    server.stop()
    assert not os.path.exists(server.cfg.meta_path)


def _probs(b: int, k: int, vocab: int, dtype=torch.float32) -> torch.Tensor:
    return torch.softmax(torch.randn(b, k, vocab), dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ipc_fetch_is_exact_and_keeps_dtype(ipc_plane, dtype):
    server, client = ipc_plane
    probs = _probs(3, 4, 50, dtype)
    server.publish(7, ["a", "b", "c"], probs)
    fetched = client.fetch(7, ["a", "b", "c"])
    assert fetched.dtype == dtype and torch.equal(fetched, probs)
    assert client.cfg.num_slots == 2  # read from the drafter's header


def test_ipc_fetch_selects_rows_and_copies(ipc_plane):
    server, client = ipc_plane
    probs = _probs(3, 2, 10)
    server.publish(1, ["a", "b", "c"], probs)
    fetched = client.fetch(1, ["c", "a"])  # "b" aborted between draft and verify
    assert torch.equal(fetched, probs[[2, 0]])
    server.publish(3, ["x"], _probs(1, 2, 10))  # same slot (3 % 2 == 1): the fetched copy stays
    assert torch.equal(fetched, probs[[2, 0]])


def test_ipc_old_missing_and_unknown_ids_fail_clearly(ipc_plane):
    server, client = ipc_plane
    for step in range(4):
        server.publish(step, ["a"], _probs(1, 2, 10))
    with pytest.raises(DraftProbsMissingError, match="step 1"):
        client.fetch(1, ["a"])  # overwritten by step 3
    with pytest.raises(DraftProbsMissingError, match="zzz"):
        client.fetch(3, ["zzz"])
    assert client.fetch(2, ["a"]).shape == (1, 2, 10)


def test_ipc_slot_being_written_is_not_read(ipc_plane):
    server, client = ipc_plane
    server.publish(0, ["a"], _probs(1, 2, 10))
    server._meta.slots[0][0] += 1  # sequence word odd: a write in progress
    with pytest.raises(DraftProbsMissingError):
        client.fetch(0, ["a"])


def test_ipc_buffer_grows_and_client_reopens(ipc_plane):
    server, client = ipc_plane
    server.publish(0, ["a"], _probs(1, 2, 10))
    assert client.fetch(0, ["a"]).shape == (1, 2, 10)
    bigger = _probs(2, 6, 300)
    server.publish(1, ["a", "b"], bigger)
    assert server.num_reallocations == 2
    assert torch.equal(client.fetch(1, ["a", "b"]), bigger)


def test_ipc_publish_validates():
    server = IpcProbsServer(IpcPlaneConfig(name=f"test-{uuid.uuid4().hex[:12]}", max_ids_bytes=4))
    try:
        with pytest.raises(ValueError, match="b=2"):
            server.publish(0, ["a", "b"], torch.rand(1, 2, 3))
        with pytest.raises(ValueError, match="dtype"):
            server.publish(0, ["a"], torch.zeros(1, 2, 3, dtype=torch.int32))
        with pytest.raises(ValueError, match="max_ids_bytes"):
            server.publish(0, ["abcdef"], torch.rand(1, 2, 3))
    finally:
        server.stop()


def test_ipc_client_without_drafter_is_unavailable():
    client = IpcProbsClient(IpcPlaneConfig(name=f"absent-{uuid.uuid4().hex[:12]}", connect_timeout_s=0.2))
    with pytest.raises(DataPlaneUnavailableError, match="no drafter"):
        client.fetch(0, ["a"])


@pytest.mark.parametrize("field, value", [("name", ""), ("name", "a/b"), ("num_slots", 0),
                                          ("max_batch_size", 0), ("max_ids_bytes", 0), ("connect_timeout_s", 0)])
def test_ipc_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        IpcPlaneConfig(**{field: value})


def test_shm_descriptor_round_trip_and_errors(tmp_path):
    path = str(tmp_path / "buf")
    buffer = dataplane_shm.allocate(64, "cpu", path)
    buffer[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    mapped = dataplane_shm.open_shared(dataplane_shm.export_file(path, 64))
    assert mapped.tolist()[:4] == [1, 2, 3, 4]
    mapped[5] = 9  # the same memory, no copy
    assert int(buffer[5]) == 9
    with pytest.raises(dataplane_shm.DescriptorError):
        dataplane_shm.open_shared(b"x")
    with pytest.raises(dataplane_shm.DescriptorError, match="truncated"):
        dataplane_shm.open_shared(b"i\x01")
    with pytest.raises(ValueError, match="export_file"):
        dataplane_shm.export(buffer)


def _drafter_process(name: str, ready, done) -> None:
    server = IpcProbsServer(IpcPlaneConfig(name=name, num_slots=4))
    gen = torch.Generator().manual_seed(5)
    server.publish(11, ["r0", "r1"], torch.softmax(torch.randn(2, 3, 40, generator=gen), -1).bfloat16())
    ready.set()
    done.wait(60)
    server.stop()


def test_ipc_across_processes():
    name = f"test-{uuid.uuid4().hex[:12]}"
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_drafter_process, args=(name, ready, done))
    proc.start()
    try:
        assert ready.wait(60)
        fetched = IpcProbsClient(IpcPlaneConfig(name=name, connect_timeout_s=10)).fetch(11, ["r1", "r0"])
        gen = torch.Generator().manual_seed(5)
        expected = torch.softmax(torch.randn(2, 3, 40, generator=gen), -1).bfloat16()
        assert fetched.dtype == torch.bfloat16 and torch.equal(fetched, expected[[1, 0]])
    finally:
        done.set()
        proc.join(30)
    assert proc.exitcode == 0


def _free_port() -> int:
    return free_loopback_ports(1)[0]   # below the ephemeral range (minedraft.probes)


def test_dist_plane_uses_nccl_only_when_both_ends_are_cuda():
    port = _free_port()
    timeout = datetime.timedelta(seconds=10)
    master = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
    worker = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
    master.set("device/1", "cuda")
    assert dataplane_nccl.post_device_and_read_peer(master, 0, 1, "cpu", 10) == "cuda"
    assert dataplane_nccl.post_device_and_read_peer(worker, 1, 0, "cuda:0", 10) == "cpu"
    assert dataplane_nccl.make_bulk_group(master, 0, 2, "cpu", "cuda") is None
    assert dataplane_nccl.make_bulk_group(master, 0, 2, "cpu", "cpu") is None


def test_stack_runs_engines_on_ipc_and_the_coordinator_out_of_band():
    from minedraft.stack import StackConfig, coordinator_spec, drafter_spec

    cfg = StackConfig(data_plane="ipc")
    coordinator = coordinator_spec(cfg).argv
    assert coordinator[coordinator.index("--data-plane") + 1] == "dist"
    drafter = drafter_spec(cfg, "target-dir", "draft-dir").argv
    assert drafter[drafter.index("--data-plane") + 1] == "ipc"
    assert drafter[drafter.index("--ipc-name") + 1] == f"stack-{cfg.dist_port}"


def test_default_data_plane_is_ipc_on_gpu_and_inline_on_cpu():
    from minedraft.cli import build_parser, stack_config
    from minedraft.stack import default_data_plane

    assert default_data_plane("cuda") == "ipc" and default_data_plane("cpu") == "inline"
    assert stack_config(build_parser().parse_args(["up"]), "psd").data_plane == "inline"
    assert stack_config(build_parser().parse_args(["up", "--device", "cuda"]), "psd").data_plane == "ipc"
    assert stack_config(build_parser().parse_args(["up", "--device", "cuda", "--data-plane", "dist"]),
                        "psd").data_plane == "dist"


def test_ipc_client_follows_a_drafter_restart_and_reports_a_stopped_one():
    name = f"test-{uuid.uuid4().hex[:12]}"
    first = IpcProbsServer(IpcPlaneConfig(name=name, num_slots=2))
    first.publish(0, ["a"], _probs(1, 2, 10))
    client = IpcProbsClient(IpcPlaneConfig(name=name, connect_timeout_s=2))
    assert client.fetch(0, ["a"]).shape == (1, 2, 10)
    second = IpcProbsServer(IpcPlaneConfig(name=name, num_slots=4))  # restart: a new file replaces it
    probs = _probs(2, 3, 20)
    second.publish(5, ["a", "b"], probs)
    assert torch.equal(client.fetch(5, ["a", "b"]), probs) and client.cfg.num_slots == 4
    second.stop()
    with pytest.raises(DataPlaneUnavailableError, match="gone"):
        client.fetch(5, ["a", "b"])
    first.stop()


def test_ipc_ragged_rows_carry_their_k_and_are_checked(ipc_plane):
    """Each row's k_i is stored after the request ids; a fetch describing the rows otherwise raises."""
    server, client = ipc_plane
    probs = _probs(3, 4, 10)
    probs[0, 2:] = 0
    server.publish(5, ["a", "b", "c"], probs, [2, 4, 0])
    assert torch.equal(client.fetch(5, ["b", "a"], [4, 2]), probs[[1, 0]])
    with pytest.raises(ValueError, match=r"differ from the \[2\]"):
        client.fetch(5, ["a"], [4])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        server.publish(6, ["a"], probs[:1], [-1])
