"""Optional CurveZMQ on both channels.

With `curve.enabled`, the learner's sockets are CURVE servers holding the server secret
key, and accept only clients whose public key is in `<keys_dir>/clients/` (checked by
pyzmq's ZAP authenticator); workers are CURVE clients that know the server's public key,
so they cannot be fed weights by anyone who lacks the server's secret key. Off, ZeroMQ
is plain TCP: anyone who can reach the ports can push trajectories into the learner and
connect a socket that receives the weights (and a worker pointed at a rogue address
would apply whatever it is sent). Keep it off only on a trusted single machine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER = "server"
CLIENT = "client"
CLIENTS_DIR = "clients"


@dataclass(frozen=True)
class Curve:
    enabled: bool = False
    keys_dir: str | None = None

    def path(self) -> Path:
        if not self.keys_dir:
            raise ValueError(
                "CURVE is enabled but no keys_dir is set (make keys with `python -m asyncfp8.sync.keys --out DIR`)"
            )
        path = Path(self.keys_dir)
        if not path.is_dir():
            raise FileNotFoundError(
                f"CURVE keys_dir {str(path)!r} does not exist; make it with `python -m asyncfp8.sync.keys --out {path}`"
            )
        return path


_authenticators: dict[int, ThreadAuthenticator] = {}
_lock = threading.Lock()


def _authenticator(context: zmq.Context, clients: Path) -> None:
    """One ZAP authenticator per context, allowing exactly the client keys in `clients`."""
    with _lock:
        if id(context) not in _authenticators:
            auth = ThreadAuthenticator(context)
            auth.start()
            auth.configure_curve(domain="*", location=str(clients))
            _authenticators[id(context)] = auth


def secure_server(socket: zmq.Socket, curve: Curve | None) -> None:
    if curve is None or not curve.enabled:
        return
    keys = curve.path()
    public, secret = zmq.auth.load_certificate(keys / f"{SERVER}.key_secret")
    _authenticator(socket.context, keys / CLIENTS_DIR)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True


def secure_client(socket: zmq.Socket, curve: Curve | None) -> None:
    if curve is None or not curve.enabled:
        return
    keys = curve.path()
    public, secret = zmq.auth.load_certificate(keys / f"{CLIENT}.key_secret")
    server_public, _ = zmq.auth.load_certificate(keys / f"{SERVER}.key")
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = server_public


def stop_authenticators() -> None:
    with _lock:
        for auth in _authenticators.values():
            auth.stop()
        _authenticators.clear()
