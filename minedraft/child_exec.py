"""``python -m minedraft.child_exec CPUS -- COMMAND...``: how the launcher starts a service.

Sets PR_SET_PDEATHSIG (SIGTERM when the launcher thread that started it goes away) and, when
``CPUS`` is not ``-``, the CPU affinity (comma-separated ids), then ``exec``s ``COMMAND``.
Doing this in a fresh interpreter instead of a ``subprocess`` ``preexec_fn`` keeps Python code
out of the fork child: ``preexec_fn`` is unsafe while other threads run (a launcher whose
threads are busy in gRPC crashed its restarted child with SIGSEGV). Torch-free.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
NO_CPUS = "-"


def main(argv: list[str]) -> None:
    """Raises SystemExit(2) on a malformed command line."""
    if len(argv) < 3 or argv[1] != "--":
        sys.exit(f"usage: python -m minedraft.child_exec CPUS|{NO_CPUS} -- COMMAND...")
    cpus, command = argv[0], argv[2:]
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        sys.exit(1)
    if cpus != NO_CPUS:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
