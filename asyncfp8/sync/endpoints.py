"""The addresses the learner binds and the workers connect to, and the CURVE keys they
authenticate with, from the `sync` config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncfp8.sync.security import Curve


@dataclass(frozen=True)
class Endpoints:
    versions: str
    snapshots: str
    trajectories: str


def endpoints(sync: Any, side: str) -> Endpoints:
    """tcp:// addresses from the `sync` config: `side="bind"` for the learner,
    `"connect"` for workers."""
    host = sync.bind if side == "bind" else sync.host
    ports = {
        "versions": sync.version_port,
        "snapshots": sync.snapshot_port,
        "trajectories": sync.trajectory_port,
    }
    for name, port in ports.items():
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"sync.{name[:-1]}_port must be a port number, got {port!r}")
    return Endpoints(**{name: f"tcp://{host}:{port}" for name, port in ports.items()})


def curve(sync: Any) -> Curve | None:
    if not sync.curve.enabled:
        return None
    if not sync.curve.keys_dir:
        raise ValueError(
            "sync.curve.enabled=true needs sync.curve.keys_dir (make the keys with "
            "`python -m asyncfp8.sync.keys --out DIR`)"
        )
    return Curve(enabled=True, keys_dir=sync.curve.keys_dir)
