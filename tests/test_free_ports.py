"""`free_ports`: a port it returns is free on every address of the host, not only on
the loopback. On Ray the learner binds its ports on 0.0.0.0 (`sync.bind=0.0.0.0`), and
the raylets of the nodes beside it listen on the node's own IP: a port free on
127.0.0.1 can be taken there, and the learner then fails at its first bind."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# In a network namespace of its own (the host's port range untouched): the ephemeral
# range is two ports, and a listener holds the odd one on 127.0.0.2, an address of the
# loopback that is not 127.0.0.1. Linux hands bind(port 0) odd ports first, so a port
# chosen by binding 127.0.0.1 alone is that taken one.
IN_NAMESPACE = """
import socket, subprocess, sys
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
open("/proc/sys/net/ipv4/ip_local_port_range", "w").write("40000 40001")
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
