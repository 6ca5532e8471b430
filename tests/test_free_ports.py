"""``minedraft.probes.free_loopback_ports``: the ports test and soak stacks are started on."""
from __future__ import annotations

import random
import socket

from minedraft import probes


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    first_ephemeral = probes._first_ephemeral_port()
    ports = probes.free_loopback_ports(6)
    assert len(set(ports)) == 6
    if first_ephemeral > probes.LOW_PORT + 6:   # Linux: outgoing connections never take these
        assert all(probes.LOW_PORT <= p < first_ephemeral for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_bound_port_is_never_handed_out():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]

    class Pinned(random.Random):   # draws the taken port first, then anything
        def __init__(self):
            super().__init__(0)
            self.first = True

        def randrange(self, *args):
            if self.first:
                self.first = False
                return port
            return super().randrange(*args)

    try:
        ports = probes.free_loopback_ports(3, rng=Pinned())
        assert port not in ports and len(set(ports)) == 3
    finally:
        taken.close()


def test_without_the_kernel_range_the_kernel_picks(monkeypatch, tmp_path):
    monkeypatch.setattr(probes, "EPHEMERAL_RANGE", str(tmp_path / "missing"))
    assert probes._first_ephemeral_port() == 0
    ports = probes.free_loopback_ports(4)
    assert len(set(ports)) == 4 and all(p > 0 for p in ports)
