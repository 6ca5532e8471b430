"""A private CUDA MPS control daemon for one stack's engines (``minedraft up --cuda-mps``). Torch-free.

Without MPS, processes on one GPU take turns in time slices: a drafter that shares the verifier's
GPU (``--drafter-gpu 0`` on a one-GPU host) cannot draft while the verifier verifies, so PSD's
overlap of drafting and verification (DESIGN.md) is lost. Under NVIDIA's Multi-Process Service the
kernels of both processes run on the GPU at the same time. Measured on one H200 with the drafter
sharing GPU 0 (bench/results/HISTORY.md, runs 17-19): psd-k4-m16 1858 tok/s with MPS against 1448 without.

The daemon is private to the stack: it is started with ``CUDA_MPS_PIPE_DIRECTORY`` set to a fresh
temporary directory, only the stack's engines get that directory, and ``stop`` quits it. No GPU
setting is changed (compute mode, clocks and MIG stay as found), and other CUDA programs on the
host do not connect to it. See https://docs.nvidia.com/deploy/mps/ for what MPS shares. A launcher
killed with SIGKILL cannot quit it: ``echo quit | CUDA_MPS_PIPE_DIRECTORY=<pipe dir>
nvidia-cuda-mps-control`` does; the pipe dir is written to ``<run dir>/mps/pipe_dir.txt``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

MPS_CONTROL = "nvidia-cuda-mps-control"  # ships with the NVIDIA driver
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
QUIT_COMMAND = "quit\n"
CONTROL_TIMEOUT_S = 30.0
MAX_SOCKET_PATH = 107  # bytes of a Unix socket address (sun_path, 108 with the NUL)
CONTROL_SOCKET = "control"  # the daemon's socket in the pipe directory
FALLBACK_TEMP_DIR = "/tmp"
PIPE_DIR_FILE = "pipe_dir.txt"  # in the log dir: how to reach a daemon whose launcher was killed


class CudaMpsError(RuntimeError):
    """The MPS control daemon could not be started."""


@dataclass
class CudaMpsDaemon:
    """One ``nvidia-cuda-mps-control -d`` with its own pipe and log directories.

    Attributes:
        pipe_dir: the daemon's ``CUDA_MPS_PIPE_DIRECTORY`` (clients find it there).
        log_dir: its ``CUDA_MPS_LOG_DIRECTORY`` (``control.log``, ``server.log``).
        control: the control program (``MPS_CONTROL``, looked up on ``PATH``).
    """

    pipe_dir: str
    log_dir: str
    control: str = MPS_CONTROL
    is_running: bool = False

    @classmethod
    def started(cls, run_dir: str, control: str = MPS_CONTROL) -> "CudaMpsDaemon":
        """A running daemon logging to ``<run_dir>/mps`` (absolute: the daemon leaves the working
        directory), its pipe directory fresh under the system temp dir, or under ``/tmp`` when that
        is too long for the control socket's Unix address (``MAX_SOCKET_PATH``).

        Raises:
            CudaMpsError: as ``start``, or no short enough pipe directory; nothing is left behind.
        """
        pipe_dir = _short_temp_dir()
        daemon = cls(pipe_dir=pipe_dir, log_dir=os.path.abspath(os.path.join(run_dir, "mps")), control=control)
        try:
            daemon.start()
        except BaseException:
            shutil.rmtree(pipe_dir, ignore_errors=True)
            raise
        return daemon

    @property
    def env(self) -> dict[str, str]:
        """What a CUDA child needs to run as a client of this daemon."""
        return {PIPE_ENV: self.pipe_dir, LOG_ENV: self.log_dir}

    def start(self) -> None:
        """Start the daemon (it forks into the background; ``-d`` returns at once). Its output goes
        to ``<log_dir>/control-start.log``, not to pipes a forked daemon could hold open.

        Raises:
            CudaMpsError: naming ``--cuda-mps``: the control program is not on ``PATH``, it failed,
                or it did not return within ``CONTROL_TIMEOUT_S``.
        """
        path = shutil.which(self.control)
        if path is None:
            raise CudaMpsError(f"--cuda-mps: {self.control} not found on PATH (it ships with the NVIDIA driver)")
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, PIPE_DIR_FILE), "w") as f:
            f.write(self.pipe_dir + "\n")
        out_path = os.path.join(self.log_dir, "control-start.log")
        try:
            with open(out_path, "w") as out:
                code = subprocess.run([path, "-d"], env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, timeout=CONTROL_TIMEOUT_S).returncode
        except (OSError, subprocess.SubprocessError) as exc:
            raise CudaMpsError(f"--cuda-mps: {self.control} -d: {exc}") from None
        if code != 0:
            with open(out_path, errors="replace") as out:
                raise CudaMpsError(f"--cuda-mps: {self.control} -d exited with code {code}: {out.read().strip()}")
        self.is_running = True

    def stop(self) -> None:
        """Quit the daemon (and its server) after the clients are gone; idempotent, never raises
        (a daemon that is already gone is fine)."""
        if not self.is_running:
            return
        self.is_running = False
        path = shutil.which(self.control)
        if path is not None:
            try:
                subprocess.run([path], input=QUIT_COMMAND, env={**os.environ, **self.env}, capture_output=True,
                               text=True, timeout=CONTROL_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError):
                pass
        shutil.rmtree(self.pipe_dir, ignore_errors=True)


def _short_temp_dir() -> str:
    """A fresh ``minedraft-mps-*`` directory whose control socket path fits ``MAX_SOCKET_PATH``.

    Raises:
        CudaMpsError: neither the system temp dir nor ``FALLBACK_TEMP_DIR`` is short enough.
    """
    for parent in (None, FALLBACK_TEMP_DIR):
        path = tempfile.mkdtemp(prefix="minedraft-mps-", dir=parent)
        if len(os.path.join(path, CONTROL_SOCKET).encode()) <= MAX_SOCKET_PATH:
            return path
        os.rmdir(path)
    raise CudaMpsError(f"--cuda-mps: no temp dir short enough for the MPS control socket ({MAX_SOCKET_PATH} bytes)")
