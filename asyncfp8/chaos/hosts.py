"""Hosts that really are separate, on one machine: a Linux network namespace per host, each
joined to one bridge by a veth pair, so the learner and each worker have an address, a
network stack and a link of their own; `cut` takes a link down like a pulled cable and
`restore` brings it back. Needs root (or CAP_NET_ADMIN) and the `ip` tool. Use:
`with Hosts(["learner", "w0"]) as hosts: hosts.command("w0", [...])` (`hosts.address(name)`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

SUBNET_PREFIX = "10.213"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can): what a test skips with."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"af8probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


class Hosts:
    """Namespaces named after the hosts (prefixed with this process's id and a count, so
    that neither two test sessions nor two Hosts of one process collide), one /24 subnet,
    one bridge in the calling namespace."""

    made = 0  # Hosts made by this process: each gets names of its own

    def __init__(self, names: Sequence[str]):
        tag = os.getpid() % 100_000
        Hosts.made += 1
        self.names = list(names)
        # Interface names are at most 15 bytes: "af8" + 5 + 2 + "o" + the host index.
        self.prefix = f"af8{tag}{Hosts.made % 100:02d}"
        self.bridge = f"{self.prefix}br"
        self.subnet = f"{SUBNET_PREFIX}.{tag % 250 + 1}"
        self._made: list[str] = []

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 1}"

    def _outer(self, name: str) -> str:
        """The bridge side of the host's veth pair (what `cut` takes down)."""
        return f"{self.prefix}o{self.names.index(name)}"

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _ip("link", "set", self.bridge, "up")
            for index, name in enumerate(self.names):
                namespace, outer, inner = self.namespace(name), self._outer(name), f"eth{index}"
                _ip("netns", "add", namespace)
                self._made.append(name)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", namespace)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", namespace, "addr", "add", f"{self.address(name)}/24", "dev", inner)
                _ip("-n", namespace, "link", "set", inner, "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the host's namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace(name), *argv]

    def cut(self, name: str) -> None:
        """The host's cable pulled out: nothing reaches it or leaves it."""
        _ip("link", "set", self._outer(name), "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self._outer(name), "up")

    def close(self) -> None:
        for made in reversed(self._made):
            if made == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            else:
                # The pair goes now (deleting one end deletes both); with the namespace only,
                # the kernel would remove it later, once the namespace's processes are gone.
                subprocess.run(["ip", "link", "del", self._outer(made)], capture_output=True)
                subprocess.run(["ip", "netns", "del", self.namespace(made)], capture_output=True)
        self._made.clear()
