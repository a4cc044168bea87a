"""Trajectories from workers to the learner, each delivered and counted exactly once.

DEALER to ROUTER: the learner acknowledges what it accepts and deduplicates by (sender,
sequence number), the worker resends until acknowledged. Work leases travel on the same
sockets (`[b"lease", request]`, answered by `on_lease`; docs/sync.md, 'Trajectories').
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from .codec import seal, unseal
from .limits import Limits, RejectedMessage, RejectionLog
from .security import Curve, HandshakeWatch, secure_client, secure_server

log = logging.getLogger("asyncfp8.sync")
FORMAT_VERSION = 1
LEASE_FRAME = b"lease"
MAX_LEASE_WANT = 4096


@dataclass
class Trajectory:
    """One sampled completion. `logprobs` are the rollout engine's (fp32) log-probabilities
    of `token_ids`; `versions` the policy version each token was generated under."""

    prompt_ids: Sequence[int]
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    reward: float
    group_id: str
    prompt_index: int = 0
    finish_reason: str = "stop"
    worker_id: str = ""
    seq: int = -1
    meta: dict[str, Any] = field(default_factory=dict)
    sender: str = ""  # the sending process, "<worker_id>/<incarnation>" (set on receipt)
    #: the learner's log-prob of each token under its version's weights, scored ahead
    #: (train/proximal_thread.py; never sent)
    proximal_logprobs: Sequence[float] | None = None
    #: MoE: the experts the engine routed each prompt and completion token to, uint8
    #: [tokens, layers, top_k] row-major (asyncfp8/moe/routes.py; NO_ROUTE where none ran)
    routes: bytes | None = None

    def encode(self, sender: str) -> bytes:
        n = len(self.token_ids)
        if not (len(self.logprobs) == len(self.versions) == n):
            raise ValueError(
                f"token_ids, logprobs and versions must have one entry per token: "
                f"{n}, {len(self.logprobs)}, {len(self.versions)}"
            )
        message = msgpack.packb(
            {
                "format": FORMAT_VERSION,
                "sender": sender,
                "worker_id": self.worker_id,
                "seq": self.seq,
                "prompt_ids": np.asarray(self.prompt_ids, dtype=np.int32).tobytes(),
                "token_ids": np.asarray(self.token_ids, dtype=np.int32).tobytes(),
                "logprobs": np.asarray(self.logprobs, dtype=np.float32).tobytes(),
                "versions": np.asarray(self.versions, dtype=np.int32).tobytes(),
                "reward": float(self.reward),
                "group_id": str(self.group_id),
                "prompt_index": int(self.prompt_index),
                "finish_reason": self.finish_reason,
                "meta": self.meta,
                "routes": self.routes,
            },
            use_bin_type=True,
        )
        return seal(message)

    @staticmethod
    def decode(payload: bytes, limits: Limits) -> tuple[str, Trajectory]:
        """(sender, trajectory); RejectedMessage says what is wrong."""
        if len(payload) > limits.max_message_bytes:
            raise RejectedMessage(
                f"trajectory of {len(payload)} bytes exceeds {limits.max_message_bytes}"
            )
        payload = unseal(payload, "trajectory")
        try:
            msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as err:
            raise RejectedMessage(f"not msgpack: {err}") from None
        if not isinstance(msg, dict) or msg.get("format") != FORMAT_VERSION:
            raise RejectedMessage("not a trajectory message of a known format")
        types = {
            "sender": str,
            "worker_id": str,
            "seq": int,
            "prompt_ids": bytes,
            "token_ids": bytes,
            "logprobs": bytes,
            "versions": bytes,
            "reward": float,
            "group_id": str,
            "prompt_index": int,
            "finish_reason": str,
            "meta": dict,
        }
        for key, kind in types.items():
            if not isinstance(msg.get(key), kind):
                raise RejectedMessage(f"field {key!r} missing or not {kind.__name__}")
        arrays = {}
        for key, dtype in (
            ("prompt_ids", np.int32),
            ("token_ids", np.int32),
            ("logprobs", np.float32),
            ("versions", np.int32),
        ):
            if len(msg[key]) % 4:
                raise RejectedMessage(
                    f"{key}: {len(msg[key])} bytes is not a whole number of 4-byte values"
                )
            arrays[key] = np.frombuffer(msg[key], dtype=dtype)
        n = len(arrays["token_ids"])
        if not (len(arrays["logprobs"]) == len(arrays["versions"]) == n) or n > limits.max_tokens:
            raise RejectedMessage(
                f"token_ids / logprobs / versions lengths {n}, {len(arrays['logprobs'])}, "
                f"{len(arrays['versions'])} differ or exceed {limits.max_tokens}"
            )
        if (
            not np.isfinite(msg["reward"])
            or np.isnan(arrays["logprobs"]).any()
            or (arrays["logprobs"] > 1e-3).any()
        ):
            raise RejectedMessage(
                "reward or logprobs are not valid (NaN, infinite reward, or positive logprob)"
            )
        if msg["seq"] < 0:
            raise RejectedMessage(f"negative sequence number {msg['seq']}")
        routes = _checked_routes(msg.get("routes"), len(arrays["prompt_ids"]) + n)
        trajectory = Trajectory(
            prompt_ids=arrays["prompt_ids"].tolist(),
            token_ids=arrays["token_ids"].tolist(),
            logprobs=arrays["logprobs"].tolist(),
            versions=arrays["versions"].tolist(),
            reward=msg["reward"],
            group_id=msg["group_id"],
            prompt_index=msg["prompt_index"],
            finish_reason=msg["finish_reason"],
            worker_id=msg["worker_id"],
            seq=msg["seq"],
            meta=msg["meta"],
            sender=msg["sender"],
            routes=routes,
        )
        return msg["sender"], trajectory


def _checked_routes(routes: Any, tokens: int) -> bytes | None:
    """A message's routes, bytes of a whole number per token (or none); the learner checks
    them against its model (learner/inbox.py)."""
    if routes is not None and (not isinstance(routes, bytes) or len(routes) % max(tokens, 1)):
        raise RejectedMessage(
            f"routes: not bytes, or {len(routes) if isinstance(routes, bytes) else '?'} "
            f"bytes are no whole number per token of its {tokens} tokens"
        )
    return routes


class SeenSequences:
    """The sequence numbers seen from one sender: all below `watermark`, plus `above`."""

    def __init__(self):
        self.watermark, self.above = 0, set()

    def add(self, seq: int) -> bool:
        """True if `seq` is new."""
        if seq < self.watermark or seq in self.above:
            return False
        self.above.add(seq)
        while self.watermark in self.above:
            self.above.remove(self.watermark)
            self.watermark += 1
        return True


class TrajectorySender:
    """Worker side. `send()` numbers and sends; `pump()` takes acknowledgements and
    resends what is overdue; `flush()` waits until everything is acknowledged."""

    def __init__(
        self,
        address: str,
        worker_id: str,
        curve: Curve | None = None,
        context: zmq.Context | None = None,
        max_unacked: int = 1024,
        resend_after: float = 5.0,
        watch: HandshakeWatch | None = None,
    ):
        self.context = context or zmq.Context.instance()
        self.worker_id = worker_id
        self.sender = f"{worker_id}/{uuid.uuid4().hex[:12]}"
        self.socket = self.context.socket(zmq.DEALER)
        secure_client(self.socket, curve)
        self.socket.identity = self.sender.encode()
        self.socket.linger = 0
        if watch is not None:
            watch.watch(self.socket, "trajectory")
        self.socket.connect(address)
        self.max_unacked, self.resend_after = max_unacked, resend_after
        self.outbox: OrderedDict[int, list] = OrderedDict()  # seq -> [payload, last sent time]
        self.next_seq = 0
        self.resent = 0
        self.replies: deque[dict] = deque()  # lease replies, in arrival order
        self.last_heard = time.monotonic()  # when the learner last answered anything

    def send(self, trajectory: Trajectory, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while len(self.outbox) >= self.max_unacked:  # backpressure: the learner is behind
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(self.outbox)} trajectories unacknowledged for {timeout} s"
                )
            self.pump(timeout_ms=100)
        trajectory.worker_id, trajectory.seq = self.worker_id, self.next_seq
        payload = trajectory.encode(self.sender)
        self.outbox[self.next_seq] = [payload, 0.0]
        self._transmit(self.next_seq)
        self.next_seq += 1
        return trajectory.seq

    def _transmit(self, seq: int) -> None:
        entry = self.outbox[seq]
        try:
            self.socket.send(entry[0], zmq.NOBLOCK)
            entry[1] = time.monotonic()
        except zmq.Again:
            entry[1] = 0.0  # no peer yet: the next pump retries

    def pump(self, timeout_ms: int = 0) -> None:
        if self.socket.poll(timeout_ms):
            while True:
                try:
                    reply = msgpack.unpackb(self.socket.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except Exception:
                    log.warning("trajectory sender: ignored a malformed acknowledgement")
                    continue
                self.last_heard = time.monotonic()
                if isinstance(reply, dict) and isinstance(reply.get("ack"), int):
                    self.outbox.pop(reply["ack"], None)
                elif isinstance(reply, dict) and reply.get("kind") == "lease":
                    self.replies.append(reply)
        now = time.monotonic()
        for seq, (_, sent_at) in list(self.outbox.items()):
            if now - sent_at > self.resend_after:
                self.resent += sent_at > 0
                self._transmit(seq)

    def request_lease(self, want: int, version: int | None, stats: dict[str, float]) -> None:
        """Asks the learner for up to `want` groups of work; the answer arrives in
        `replies` (after a `pump`)."""
        request = {
            "format": FORMAT_VERSION,
            "sender": self.sender,
            "worker_id": self.worker_id,
            "want": int(want),
            "version": version,
            "stats": {key: float(value) for key, value in stats.items()},
        }
        self.socket.send_multipart([LEASE_FRAME, seal(msgpack.packb(request))])

    def flush(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.outbox and time.monotonic() < deadline:
            self.pump(timeout_ms=50)
        return not self.outbox

    def close(self) -> None:
        self.socket.close()


def decode_lease_request(payload: bytes, limits: Limits) -> dict[str, Any]:
    """A worker's lease request, checked field by field; RejectedMessage says what is wrong."""
    if len(payload) > limits.max_header_bytes:
        raise RejectedMessage(f"lease request of {len(payload)} bytes is too large")
    try:
        request = msgpack.unpackb(unseal(payload, "lease request"), raw=False)
    except RejectedMessage:
        raise
    except Exception as err:
        raise RejectedMessage(f"lease request is not msgpack: {err}") from None
    if not isinstance(request, dict) or request.get("format") != FORMAT_VERSION:
        raise RejectedMessage("not a lease request of a known format")
    checks = {
        "sender": lambda v: isinstance(v, str) and v,
        "worker_id": lambda v: isinstance(v, str),
        "want": lambda v: isinstance(v, int) and 1 <= v <= MAX_LEASE_WANT,
        "version": lambda v: v is None or isinstance(v, int),
        "stats": lambda v: (
            isinstance(v, dict)
            and all(isinstance(k, str) and isinstance(x, float) for k, x in v.items())
        ),
    }
    for key, valid in checks.items():
        if not valid(request.get(key)):
            raise RejectedMessage(f"lease request field {key!r} missing or invalid")
    return request


class TrajectoryReceiver:
    """Learner side: `poll()` returns the new trajectories, each exactly once, and
    answers lease requests with `on_lease(request) -> reply` (a dict)."""

    def __init__(
        self,
        address: str,
        curve: Curve | None = None,
        limits: Limits | None = None,
        context: zmq.Context | None = None,
        on_lease: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        watch: HandshakeWatch | None = None,
    ):
        self.context = context or zmq.Context.instance()
        self.limits = limits or Limits()
        self.socket = self.context.socket(zmq.ROUTER)
        secure_server(self.socket, curve)
        # Frames somewhat over the limit reach `decode`, which rejects them with a logged
        # reason; ZeroMQ cuts the connection of a peer sending one over twice the limit
        # before buffering it (that one is not logged by asyncfp8: it never arrives).
        self.socket.maxmsgsize = 2 * self.limits.max_message_bytes
        self.socket.linger = 0
        if watch is not None:
            watch.watch(self.socket, "trajectory")
        self.socket.bind(address)
        self.address = self.socket.getsockopt_string(
            zmq.LAST_ENDPOINT
        )  # resolves "tcp://127.0.0.1:*"
        self.seen: dict[str, SeenSequences] = {}
        self.accepted = self.duplicates = 0
        self.rejections = RejectionLog(log)
        self.on_lease = on_lease

    @property
    def rejected(self) -> int:
        return self.rejections.total

    def poll(self, timeout_ms: int = 0, max_messages: int = 4096) -> list[Trajectory]:
        fresh: list[Trajectory] = []
        self.rejections.tick()
        if not self.socket.poll(timeout_ms):
            return fresh
        for _ in range(max_messages):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) == 3 and frames[1] == LEASE_FRAME and self.on_lease is not None:
                self._answer_lease(frames[0], frames[2])
                continue
            if len(frames) != 2:
                self.rejections("trajectory message", f"{len(frames) - 1} frames, expected 1")
                continue
            identity, payload = frames
            try:
                sender, trajectory = Trajectory.decode(payload, self.limits)
            except RejectedMessage as err:
                self.rejections("trajectory message", str(err))
                continue
            self.socket.send_multipart([identity, msgpack.packb({"ack": trajectory.seq})])
            if self.seen.setdefault(sender, SeenSequences()).add(trajectory.seq):
                self.accepted += 1
                fresh.append(trajectory)
            else:
                self.duplicates += 1
        return fresh

    def _answer_lease(self, identity: bytes, payload: bytes) -> None:
        try:
            request = decode_lease_request(payload, self.limits)
        except RejectedMessage as err:
            self.rejections("lease request", str(err))
            return
        reply = dict(self.on_lease(request))
        reply["kind"] = "lease"
        self.socket.send_multipart([identity, msgpack.packb(reply)])

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint stores so that a restarted learner still deduplicates."""
        return {
            sender: {"watermark": s.watermark, "above": sorted(s.above)}
            for sender, s in self.seen.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = {}
        for sender, saved in state.items():
            seen = SeenSequences()
            seen.watermark, seen.above = int(saved["watermark"]), set(saved["above"])
            self.seen[sender] = seen

    def close(self) -> None:
        self.rejections.flush()
        self.socket.close()
