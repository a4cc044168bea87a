import socket

from asyncfp8.launch import processes
from asyncfp8.launch.processes import EPHEMERAL_FLOOR, ephemeral_range, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    # Outgoing connections take their source ports from the ephemeral range: a port
    # drawn there could be taken by one between a learner's death and its resume.
    low, high = ephemeral_range()
    assert EPHEMERAL_FLOOR < low <= high
    ports = free_ports(5)
    assert len(set(ports)) == 5
    assert all(EPHEMERAL_FLOOR <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    taken = [socket.socket() for _ in range(3)]
    for s in taken:
        s.bind(("", 0))
    busy = [s.getsockname()[1] for s in taken]
    # only the busy ports and one free one below the "range": the free one is chosen
    low = max(busy) + 2
    monkeypatch.setattr(processes, "EPHEMERAL_FLOOR", min(busy))
    monkeypatch.setattr(processes, "ephemeral_range", lambda: (low, low + 100))
    monkeypatch.setattr(
        processes.random, "sample", lambda seq, k: sorted(busy) + [p for p in seq if p not in busy]
    )
    try:
        (port,) = free_ports(1)
    finally:
        for s in taken:
            s.close()
    assert port not in busy


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(processes, "ephemeral_range", lambda: (EPHEMERAL_FLOOR + 1, 60999))
    ports = free_ports(2)
    assert len(set(ports)) == 2 and all(p > 0 for p in ports)
