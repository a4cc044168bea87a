"""Optional CurveZMQ on both channels: the learner's sockets are CURVE servers that accept only
the client keys in `<keys_dir>/clients/`, workers CURVE clients that know the server's key.
Off, ZeroMQ is plain TCP with no authentication: keep it off only on a trusted machine
(docs/sync.md, 'Authentication (CurveZMQ)').
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from .limits import RejectionLog

log = logging.getLogger("asyncfp8.security")

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
                "CURVE is enabled but no keys_dir is set "
                "(make keys with `python -m asyncfp8.sync.keys --out DIR`)"
            )
        path = Path(self.keys_dir)
        if not path.is_dir():
            raise FileNotFoundError(
                f"CURVE keys_dir {str(path)!r} does not exist; "
                f"make it with `python -m asyncfp8.sync.keys --out {path}`"
            )
        return path


_authenticators: dict[int, ThreadAuthenticator] = {}
_lock = threading.Lock()


class AllowedClients:
    """The ZAP check: a client key is allowed if its certificate is in `clients/`.
    Every refusal is logged (pyzmq's own authenticator logs them only at debug level)."""

    def __init__(self, clients: Path):
        self.clients = clients
        self.keys = set(zmq.auth.load_certificates(clients))
        self.refused = 0

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self.keys:
            return True
        self.refused += 1
        log.warning(
            "refused a CURVE client: its public key %s is not in %s",
            client_key.decode(errors="replace"),
            self.clients,
        )
        return False


def _authenticator(context: zmq.Context, clients: Path) -> None:
    """One ZAP authenticator per context, allowing exactly the client keys in `clients`."""
    with _lock:
        if id(context) not in _authenticators:
            auth = ThreadAuthenticator(context)
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=AllowedClients(clients))
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


HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed (not ZeroMQ, or the connection broke)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake refused by authentication",
}
PROTOCOL_ERRORS = {
    getattr(zmq, name): name.removeprefix("PROTOCOL_ERROR_")
    for name in dir(zmq)
    if name.startswith("PROTOCOL_ERROR_")
}


class HandshakeWatch:
    """Logs every failed handshake on the sockets it watches (through ZeroMQ's socket
    monitor): peers that are not ZeroMQ, lack the CURVE keys, or hold the wrong server
    key never reach the application, so this is the only place they show up. A client
    retries every 100 ms, so the lines are capped like rejected messages."""

    def __init__(self):
        self.rejections = RejectionLog(log)
        self._monitors: dict[zmq.Socket, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asyncfp8-handshakes", daemon=True)
        self._thread.start()

    @property
    def failures(self) -> int:
        return self.rejections.total

    def watch(self, socket: zmq.Socket, name: str) -> None:
        """Call from the thread that owns `socket`, before another thread uses it."""
        events = 0
        for event in HANDSHAKE_FAILURES:
            events |= event
        monitor = socket.get_monitor_socket(events)
        with self._lock:
            self._monitors[monitor] = name

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rejections.tick()
            with self._lock:
                monitors = dict(self._monitors)
            if not monitors:
                self._stop.wait(0.1)
                continue
            poller = zmq.Poller()
            for monitor in monitors:
                poller.register(monitor, zmq.POLLIN)
            for monitor, _ in poller.poll(100):
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.ZMQError:
                    continue
                if event["event"] not in HANDSHAKE_FAILURES:
                    continue
                value = event["value"]
                detail = PROTOCOL_ERRORS.get(value) or (
                    zmq.strerror(value) if value < 1000 else f"status {value}"
                )
                self.rejections(
                    f"{monitors[monitor]} handshake",
                    f"{HANDSHAKE_FAILURES[event['event']]} at "
                    f"{event['endpoint'].decode(errors='replace')}: {detail}",
                )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.rejections.flush()
        with self._lock:
            for monitor in self._monitors:
                monitor.close(linger=0)
            self._monitors.clear()
