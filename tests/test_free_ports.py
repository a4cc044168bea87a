"""`free_ports`: a port it returns is free on every address of the host, not only on
the loopback (on Ray the learner binds its ports on 0.0.0.0, and the raylets of the
nodes beside it listen on the node's own IP), below the kernel's ephemeral range (where
an outgoing connection could take a dead learner's port before its resume binds it), and
not handed out twice in a row by one process."""

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from asyncfp8.launch import processes
from asyncfp8.launch.processes import EPHEMERAL_FLOOR, PORT_RANGE, ephemeral_range, free_ports

ROOT = Path(__file__).resolve().parents[1]

# In a network namespace of its own (the host's ports untouched): the range is two ports,
# and a listener holds one of them on 127.0.0.2, an address of the loopback that is not
# 127.0.0.1. A port chosen by binding 127.0.0.1 alone could be that taken one.
IN_NAMESPACE = """
import os, socket, subprocess, sys
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
os.environ["ASYNCFP8_PORT_RANGE"] = "40000-40001"
listener = socket.socket()
listener.bind(("127.0.0.2", 40001))
listener.listen()
from asyncfp8.launch.processes import free_ports
chosen = [free_ports(1)[0] for _ in range(20)]
print(*chosen)
for port in set(chosen):
    probe = socket.socket()
    probe.bind(("0.0.0.0", port))  # as the learner binds on Ray
    probe.close()
"""


def test_a_port_taken_on_another_local_address_is_not_handed_out():
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs util-linux's unshare and iproute2's ip")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no network namespace for this user: {probe.stderr.decode().strip()}")
    done = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", IN_NAMESPACE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(done.stdout.split()) == {"40000"}, done.stdout


def test_by_default_ports_come_from_below_the_ephemeral_range(monkeypatch):
    monkeypatch.delenv(PORT_RANGE, raising=False)
    low = ephemeral_range()[0]
    ports = free_ports(5) + free_ports(5)
    assert len(set(ports)) == 10  # taken in turn: no port twice in a row
    assert all(EPHEMERAL_FLOOR <= p < max(low, EPHEMERAL_FLOOR + 1024) for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))


def test_the_range_can_be_given_and_a_bad_one_is_refused(monkeypatch):
    taken = socket.socket()
    taken.bind(("", 0))
    busy = taken.getsockname()[1]
    try:
        monkeypatch.setenv(PORT_RANGE, f"{busy}-{busy}")
        with pytest.raises(RuntimeError, match="only 0 of 1 ports free"):
            free_ports(1)
        monkeypatch.setattr(processes, "_cursor", None)
        monkeypatch.setenv(PORT_RANGE, f"{busy}-{busy + 40}")
        assert busy not in free_ports(3)
    finally:
        taken.close()
    for bad in ("12000", "9-20", "30000-20000", "a-b"):
        monkeypatch.setenv(PORT_RANGE, bad)
        with pytest.raises(ValueError, match=PORT_RANGE):
            free_ports(1)
