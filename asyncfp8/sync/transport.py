"""Where a version travels: the snapshot protocol's fixed messages, the transports a
worker may ask for, and whether an address is on this host (where shared memory can
work). The publisher (version_publisher.py) and the subscriber (version_subscriber.py)
both read these."""

from __future__ import annotations

import ipaddress
import socket

import msgpack

SNAPSHOT_REQUEST = msgpack.packb({"want": "latest"})
SHM_SNAPSHOT_REQUEST = msgpack.packb({"want": "latest", "via": "shm"})
NONE_REPLY = msgpack.packb({"kind": "none"})  # nothing published yet
NO_SHM_REPLY = msgpack.packb({"kind": "no-shm"})  # this learner does not offer shared memory
NONE_RETRY = 1.0  # s between snapshot requests while the learner has published nothing
TRANSPORTS = ("auto", "shm", "tcp")
SEND_BUFFER_BYTES = 2 << 30  # what the PUB socket may queue for one slow subscriber
# A shared-memory notice per this many chunks' worth written (16 MiB at the default 4 MiB):
# each notice costs a worker ~0.1 ms of Python, and the full BF16 version of the bench
# went 39% / 44-48% / 53-55% of memcpy with a notice per 1 / 4 / 16 MiB.
SHM_GROUP_CHUNKS = 4


def check_transport(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"sync.transport must be one of {TRANSPORTS}, got {transport!r}")
    return transport


def is_local(address: str) -> bool:
    """Whether a ZeroMQ address points at this host (where shared memory can work)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    except (OSError, ValueError):
        return False
    return ip.is_loopback or assigned_here(ip)


def assigned_here(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `ip` is an address of one of this host's interfaces: a socket binds to it
    only then. (What the host name resolves to is not enough: on a machine whose name
    resolves to 127.0.0.1, a Ray node's own LAN address looked remote, and its workers
    took versions over TCP with deltas: Ray ran at 0.905-0.941 of the launcher's trained
    samples/s, 0.958 once they took shared memory; docs/running.md.)"""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True
