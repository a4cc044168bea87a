"""What a broken network or a hostile peer sends. Everything here targets loopback
ports of a run started by `Cluster`, in bounded counts."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter

import msgpack
import zmq

from asyncfp8.sync import Trajectory
from asyncfp8.sync.codec import DIGEST_BYTES, seal
from asyncfp8.sync.trajectories import FORMAT_VERSION, LEASE_FRAME
from asyncfp8.sync.transport import SNAPSHOT_REQUEST


def genuine_trajectory(sender: str = "chaos/0", seq: int = 0, lease: int = 0) -> bytes:
    """A well-formed trajectory message, as a worker would send it."""
    return Trajectory(
        prompt_ids=[1, 2, 3],
        token_ids=[4, 5],
        logprobs=[-0.5, -1.0],
        versions=[0, 0],
        reward=1.0,
        group_id="chaos",
        seq=seq,
        meta={"lease": lease},
    ).encode(sender)


def lease_request(sender: str, want: int = 1) -> list[bytes]:
    """A well-formed lease request, as a worker would send it."""
    request = {
        "format": FORMAT_VERSION,
        "sender": sender,
        "worker_id": sender.split("/")[0],
        "want": want,
        "version": None,
        "stats": {},
    }
    return [LEASE_FRAME, seal(msgpack.packb(request))]


def bad_trajectory_frames(rng: random.Random, count: int, limit_bytes: int):
    """`count` bad messages for the learner's trajectory socket, as (source, frames):
    the source is the kind of rejection the learner must log for it."""
    genuine = genuine_trajectory()
    wrong_fields = {
        "format": FORMAT_VERSION,
        "sender": "chaos/0",
        "seq": "not a number",
    }
    nan_logprobs = msgpack.unpackb(genuine[8:], raw=False)
    nan_logprobs["logprobs"] = bytes(4) + b"\x00\x00\xc0\x7f"  # [0.0, NaN]
    torn_routes = msgpack.unpackb(genuine[8:], raw=False)
    torn_routes["routes"] = bytes(7)  # an MoE's routes, not a whole number per token (5)
    makers = [
        ("trajectory message", lambda: [rng.randbytes(rng.randrange(0, 2000))]),
        ("trajectory message", lambda: [genuine[: rng.randrange(len(genuine))]]),
        ("trajectory message", lambda: [flip_byte(genuine, rng)]),
        ("trajectory message", lambda: [seal(bytes(limit_bytes + 1000))]),  # over the limit
        ("trajectory message", lambda: [seal(msgpack.packb(wrong_fields))]),
        ("trajectory message", lambda: [seal(msgpack.packb(nan_logprobs))]),
        ("trajectory message", lambda: [seal(msgpack.packb(torn_routes))]),
        ("trajectory message", lambda: [b"junk", rng.randbytes(50)]),  # extra frames
        ("lease request", lambda: [LEASE_FRAME, rng.randbytes(rng.randrange(0, 300))]),
        (
            "lease request",
            lambda: [
                LEASE_FRAME,
                seal(msgpack.packb({"format": FORMAT_VERSION, "sender": "x", "want": 10**9})),
            ],
        ),
    ]
    return [(source, make()) for source, make in (rng.choice(makers) for _ in range(count))]


def flip_byte(frame: bytes, rng: random.Random) -> bytes:
    position = rng.randrange(len(frame))
    return (
        frame[:position]
        + bytes([frame[position] ^ (1 << rng.randrange(8))])
        + frame[position + 1 :]
    )


class Flood:
    """Plain-TCP ZeroMQ peers sending bad frames to the learner's sockets."""

    def __init__(self, host: str, trajectory_port: int, snapshot_port: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.context = zmq.Context()
        self.trajectory_address = f"tcp://{host}:{trajectory_port}"
        self.snapshot_address = f"tcp://{host}:{snapshot_port}"
        self.host, self.ports = host, (trajectory_port, snapshot_port)
        self.sent: Counter = Counter()  # rejection source -> frames sent
        self.replayed = self.replays_acknowledged = 0
        self.cut_by_zeromq = 0
        self.raw_connections = 0
        self.snapshots_received = 0

    def _dealer(self, address: str) -> zmq.Socket:
        dealer = self.context.socket(zmq.DEALER)
        dealer.linger = 10_000  # the learner may be slow to read under a flood: let it
        dealer.connect(address)
        return dealer

    def trajectories(self, count: int, limit_bytes: int, seconds: float) -> None:
        """`count` bad messages spread over `seconds` (a flood, not a stall)."""
        dealer = self._dealer(self.trajectory_address)
        for i, (source, frames) in enumerate(bad_trajectory_frames(self.rng, count, limit_bytes)):
            dealer.send_multipart(frames)
            self.sent[source] += 1
            if seconds and i % 50 == 49:
                time.sleep(seconds * 50 / count)
        dealer.close()

    def replay(self, trained: list[tuple[str, int, int]]) -> None:
        """Sends again (sender, seq, lease) trajectories the learner already took: each
        must be acknowledged and counted as a duplicate, never trained again."""
        dealer = self._dealer(self.trajectory_address)
        for sender, seq, lease in trained:
            dealer.send(genuine_trajectory(sender, seq, lease))
            self.replayed += 1
        deadline = time.monotonic() + 20
        while self.replays_acknowledged < len(trained) and time.monotonic() < deadline:
            if dealer.poll(200):
                self.replays_acknowledged += "ack" in msgpack.unpackb(dealer.recv())
        dealer.close()

    def huge(self, count: int, limit_bytes: int) -> None:
        """Frames over twice the limit: ZeroMQ drops the connection before buffering
        them; they never reach (or count in) the learner."""
        for _ in range(count):
            dealer = self._dealer(self.trajectory_address)
            dealer.send(bytes(2 * limit_bytes + 4096))
            self.cut_by_zeromq += 1
            dealer.close()

    def snapshot_requests(self, count: int, valid: int = 0) -> None:
        """Malformed snapshot requests (each rejected), then `valid` well-formed ones:
        without CURVE, anyone who reaches the port can download the weights."""
        dealer = self._dealer(self.snapshot_address)
        for _ in range(count):
            frames = self.rng.choice(
                [
                    [self.rng.randbytes(self.rng.randrange(1, 500))],
                    [SNAPSHOT_REQUEST, b"extra"],
                    [b""],
                ]
            )
            dealer.send_multipart(frames)
            self.sent["snapshot request"] += 1
        for _ in range(valid):
            dealer.send(SNAPSHOT_REQUEST)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if dealer.poll(500):
                    header = dealer.recv_multipart()[0]
                    # topic byte, xxh3-64 digest, then the msgpack header
                    final = msgpack.unpackb(header[1 + DIGEST_BYTES :], raw=False).get("final")
                    if final:
                        self.snapshots_received += 1
                        break
        dealer.close()

    def raw_tcp(self, count: int) -> None:
        """Connections that speak no ZeroMQ at all (a port scanner, an HTTP client)."""
        for i in range(count):
            port = self.ports[i % 2]
            with socket.create_connection((self.host, port), timeout=5) as raw:
                raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + self.rng.randbytes(200))
                time.sleep(0.05)
            self.raw_connections += 1

    def close(self) -> None:
        self.context.term()


class CorruptingRelay:
    """Stands between the learner's PUB socket and one worker (its `sync.version_port`
    points here) and, while `spoil` is set, spoils messages: a flipped header or payload
    byte, a truncated header, an injected random message, an older one replayed. A worker
    must reject every header or injected fault, a payload fault unless it holds that version
    already (then ignored), and ignore replays of versions it has passed."""

    def __init__(self, upstream: str, seed: int = 0, probability: float = 0.5):
        self.rng = random.Random(seed)
        self.probability = probability
        self.context = zmq.Context()
        self.xsub = self.context.socket(zmq.XSUB)
        self.xsub.connect(upstream)
        self.xpub = self.context.socket(zmq.XPUB)
        self.port = self.xpub.bind_to_random_port("tcp://127.0.0.1")
        self.spoil = threading.Event()
        self.counts: Counter = Counter()
        self._history: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def always_rejected(self) -> int:
        return self.counts["header"] + self.counts["truncated"] + self.counts["injected"]

    @property
    def spoiled(self) -> int:
        return self.always_rejected + self.counts["payload"]

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.xsub, zmq.POLLIN)
        poller.register(self.xpub, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                if sock is self.xpub:  # subscriptions go upstream unchanged
                    self.xsub.send_multipart(self.xpub.recv_multipart())
                    continue
                frames = self.xsub.recv_multipart()
                self._history = [*self._history[-20:], frames]
                if self.spoil.is_set() and self.rng.random() < self.probability:
                    self.xpub.send_multipart(self._spoiled(frames))
                else:
                    self.counts["passed"] += 1
                    self.xpub.send_multipart(frames)

    def _spoiled(self, frames: list[bytes]) -> list[bytes]:
        kind = self.rng.choice(["header", "payload", "truncated", "injected", "replayed"])
        self.counts[kind] += 1
        header, payload = frames
        # The header's first byte is the topic the worker subscribes to: a message whose
        # topic changed would not reach it at all, so faults go after it.
        topic, rest = header[:1], header[1:]
        if kind == "header":
            return [topic + flip_byte(rest, self.rng), payload]
        if kind == "payload" and payload:
            return [header, flip_byte(payload, self.rng)]
        if kind == "payload":  # nothing to flip (a shared-memory notice): a header fault then
            self.counts["payload"] -= 1
            self.counts["header"] += 1
            return [topic + flip_byte(rest, self.rng), payload]
        if kind == "truncated":
            return [topic + rest[: self.rng.randrange(len(rest))], payload]
        if kind == "injected":
            return [topic + self.rng.randbytes(64), self.rng.randbytes(self.rng.randrange(1, 4096))]
        return self.rng.choice(self._history[:-1] or [frames])  # replayed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.xsub.close(linger=0)
        self.xpub.close(linger=0)
        self.context.term()


def steps_per_second(records: list[dict], start: float, end: float) -> float:
    """Learner steps per second in [start, end) by the ledger's wall-clock times."""
    inside = [r for r in records if start <= r["time"] < end]
    return len(inside) / max(end - start, 1e-9) if inside else 0.0
