"""Publishing policy versions (learner) and receiving them (workers).

Why PUB plus a snapshot ROUTER: every worker needs every version, so the learner
publishes each once on a PUB socket (fan-out without per-worker bookkeeping) as
deltas against the previous version. PUB drops messages for a subscriber that is too
slow or not yet connected; that is detected (a missing chunk, a delta whose base the
worker lacks) and repaired by asking the ROUTER for the latest *full* snapshot, as does
a worker that starts late or restarts. A worker applies a version only once all its
chunks have arrived and every checksum holds: whole or not at all.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import zmq

from ..failpoints import failpoint
from .codec import Version, VersionAssembler, encode_chunks, parse_header
from .limits import Limits, RejectedMessage, RejectionLog
from .security import Curve, HandshakeWatch, secure_client, secure_server

log = logging.getLogger("asyncfp8.sync")
SNAPSHOT_REQUEST = msgpack.packb({"want": "latest"})
NONE_RETRY = 1.0  # s between snapshot requests while the learner has published nothing


@dataclass
class PublishStats:
    version: int
    wire_bytes: int
    chunks: int
    seconds: float


class VersionPublisher:
    """Learner side: `publish(version, named_tensors)` streams a version out; a
    background thread answers snapshot requests with the latest full version."""

    def __init__(
        self,
        publish_address: str,
        snapshot_address: str,
        chunk_bytes: int = 64 << 20,
        curve: Curve | None = None,
        send_hwm: int = 64,
        context: zmq.Context | None = None,
        watch: HandshakeWatch | None = None,
    ):
        self.context = context or zmq.Context.instance()
        self.chunk_bytes = chunk_bytes
        self.pub = self.context.socket(zmq.PUB)
        secure_server(self.pub, curve)
        self.pub.sndhwm = send_hwm  # past this, chunks for a slow worker are dropped; it resyncs
        self.pub.linger = 0
        self.pub.bind(publish_address)
        self.publish_address = self.pub.getsockopt_string(
            zmq.LAST_ENDPOINT
        )  # resolves "tcp://127.0.0.1:*"
        self.state: dict[str, torch.Tensor] = {}
        self.stream = uuid.uuid4().hex[:12]  # this publisher: chunks of two never mix
        self.version: int | None = None
        self.policy, self.engine_config = "", {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._router = self.context.socket(zmq.ROUTER)
        secure_server(self._router, curve)
        self._router.linger = 0
        self._router.bind(snapshot_address)
        self.snapshot_address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        if watch is not None:
            watch.watch(self.pub, "version")
            watch.watch(self._router, "snapshot")
        self.snapshots_served = 0
        self.rejections = RejectionLog(log)
        self._thread = threading.Thread(
            target=self._serve_snapshots, name="asyncfp8-snapshots", daemon=True
        )
        self._thread.start()

    def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        policy: str = "",
        engine_config: Mapping[str, Any] | None = None,
        copy: bool = True,
    ) -> PublishStats:
        """Streams version `version` out, as patches against the previous one where
        smaller. The publisher keeps the tensors as the base of the next delta; `copy`
        clones them first, which is needed when they alias weights the caller will
        update in place (a BF16 model's parameters), and a wasted copy when they are
        fresh (cast from FP32 master weights, or quantized)."""
        started = time.perf_counter()
        with self._lock:
            if self.version is not None and version <= self.version:
                raise ValueError(f"versions must increase: {version} after {self.version}")
            base_version = self.version
            self.version = None  # until the whole version is out, no snapshot may mix two versions
            wire, chunks = 0, 0
            stream = (
                ((name, tensor.detach().clone()) for name, tensor in named_tensors)
                if copy
                else named_tensors
            )
            for message in encode_chunks(
                version,
                stream,
                base=self.state,
                base_version=base_version,
                policy=policy,
                engine_config=engine_config,
                chunk_bytes=self.chunk_bytes,
                update_base=True,
                stream=self.stream,
            ):
                if chunks:
                    failpoint("publish.between_chunks")
                self.pub.send_multipart(message, copy=False)
                wire += sum(len(frame) for frame in message)
                chunks += 1
            self.version, self.policy, self.engine_config = (
                version,
                policy,
                dict(engine_config or {}),
            )
        return PublishStats(version, wire, chunks, time.perf_counter() - started)

    def _serve_snapshots(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._closed.is_set():
            self.rejections.tick()
            if not dict(poller.poll(100)):
                continue
            try:
                identity, *request = self._router.recv_multipart()
            except zmq.ZMQError:
                break
            if request != [SNAPSHOT_REQUEST]:
                size = sum(len(frame) for frame in request)
                self.rejections(
                    "snapshot request",
                    f"{len(request)} frames, {size} bytes; not the one valid request",
                )
                continue
            with self._lock:
                if self.version is None:
                    self._router.send_multipart([identity, msgpack.packb({"kind": "none"})])
                    continue
                for message in encode_chunks(
                    self.version,
                    self.state.items(),
                    policy=self.policy,
                    engine_config=self.engine_config,
                    chunk_bytes=self.chunk_bytes,
                    stream=self.stream,
                ):
                    self._router.send_multipart([identity, *message], copy=False)
                self.snapshots_served += 1

    @property
    def rejected(self) -> int:
        return self.rejections.total

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self.rejections.flush()
        self.pub.close()
        self._router.close()


class VersionSubscriber:
    """Worker side: `poll()` returns the newest complete, verified Version (or None).
    It keeps the current version's tensors, the base that deltas are applied to."""

    def __init__(
        self,
        publish_address: str,
        snapshot_address: str,
        curve: Curve | None = None,
        limits: Limits | None = None,
        context: zmq.Context | None = None,
        snapshot_timeout: float = 10.0,
        watch: HandshakeWatch | None = None,
    ):
        self.context = context or zmq.Context.instance()
        self.snapshot_timeout = snapshot_timeout
        self._requested_at = 0.0
        self.limits = limits or Limits()
        self.sub = self.context.socket(zmq.SUB)
        self.dealer = self.context.socket(zmq.DEALER)
        for socket in (self.sub, self.dealer):
            secure_client(socket, curve)
            socket.maxmsgsize = self.limits.max_message_bytes
            socket.linger = 0
        self.sub.rcvhwm = 0  # keep what arrives: the PUB side bounds the queue
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        if watch is not None:
            watch.watch(self.sub, "version")
            watch.watch(self.dealer, "snapshot")
        self.sub.connect(publish_address)
        self.dealer.connect(snapshot_address)
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.rejections = RejectionLog(log)
        self.snapshot_requests = 0
        self._live: VersionAssembler | None = None
        self._snapshot: VersionAssembler | None = None
        self._snapshot_pending = False
        self._missed_base: int | None = None  # the last version logged as a delta we lack
        self.request_snapshot()

    def request_snapshot(self) -> None:
        if not self._snapshot_pending:
            self.dealer.send(SNAPSHOT_REQUEST)
            self._snapshot_pending, self._snapshot = True, None
            self._requested_at = time.monotonic()
            self.snapshot_requests += 1

    @property
    def rejected(self) -> int:
        return self.rejections.total

    def poll(self, timeout_ms: int = 0) -> Version | None:
        """Handles every message waiting (waiting up to `timeout_ms` for the first)."""
        self.rejections.tick()
        since = time.monotonic() - self._requested_at
        if self._snapshot_pending and since > self.snapshot_timeout:
            self._snapshot_pending = False  # the request or its reply was lost (learner restart?)
            self.request_snapshot()
        elif self.version is None and not self._snapshot_pending and since > NONE_RETRY:
            # "Nothing published yet" an instant before the first version went out on the
            # PUB socket, which this subscriber may have joined too late to see: ask again.
            self.request_snapshot()
        newest = None
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        while ready:
            if self.sub in ready:
                newest = self._take(self._on_live(self.sub.recv_multipart(copy=False))) or newest
            if self.dealer in ready:
                newest = (
                    self._take(self._on_snapshot(self.dealer.recv_multipart(copy=False))) or newest
                )
            ready = dict(poller.poll(0))
        return newest

    def _take(self, version: Version | None) -> Version | None:
        if version is None or (self.version is not None and version.number <= self.version):
            return None
        self.version, self.tensors = version.number, version.tensors
        log.info(
            "applied version %d (%d tensors, %d bytes on the wire)",
            version.number,
            len(version.tensors),
            version.wire_bytes,
        )
        return version

    def _reject(self, source: str, reason: str) -> None:
        self.rejections(f"{source} message", reason)

    def _on_live(self, frames) -> Version | None:
        frames = [f.buffer for f in frames]
        try:
            header = parse_header(bytes(frames[0]), self.limits) if len(frames) == 2 else None
            if header is None:
                raise RejectedMessage(f"expected 2 frames, got {len(frames)}")
            if self.version is not None and header["version"] <= self.version:
                return None  # already have it (e.g. from a snapshot)
            new = (
                self._live is None
                or self._live.version != header["version"]
                or self._live.header["stream"] != header["stream"]
            )
            if new and self._live is not None:
                log.info(
                    "dropped incomplete version %d (%d chunks received): version %d started",
                    self._live.version,
                    self._live.next_chunk,
                    header["version"],
                )
                self._live = None
            patches = any(entry["encoding"] == "patch" for entry in header["tensors"])
            if patches and header["base_version"] != self.version:
                # A delta against a version this worker missed: not a bad message.
                if self._missed_base != header["version"]:
                    self._missed_base = header["version"]
                    log.info(
                        "version %d is a delta against version %s, this worker has %s: "
                        "asking for a snapshot",
                        header["version"],
                        header["base_version"],
                        self.version,
                    )
                self._live = None
                self.request_snapshot()
                return None
            if new:
                if header["chunk"] != 0:
                    # Joined in the middle of a version (late start, or a dropped chunk 0):
                    # not a bad message; the snapshot will bring us up to date.
                    log.debug(
                        "joined version %d at chunk %d; waiting for a snapshot",
                        header["version"],
                        header["chunk"],
                    )
                    self.request_snapshot()
                    return None
                self._live = VersionAssembler(self.tensors, self.version, self.limits)
            version = self._live.feed(frames)
        except RejectedMessage as err:
            self._live = None
            self._reject("version", str(err))
            self.request_snapshot()
            return None
        if version is not None:
            self._live = None
        return version

    def _on_snapshot(self, frames) -> Version | None:
        frames = [f.buffer for f in frames]
        if len(frames) == 1:
            try:
                reply = msgpack.unpackb(bytes(frames[0]))
            except Exception:
                reply = None
            if reply == {"kind": "none"}:
                self._snapshot_pending = (
                    False  # nothing published yet: the live channel will bring v0
                )
            else:
                self._reject("snapshot", "malformed one-frame reply")
            return None
        try:
            if self._snapshot is None:
                self._snapshot = VersionAssembler(limits=self.limits)
            version = self._snapshot.feed(frames)
        except RejectedMessage as err:
            self._snapshot, self._snapshot_pending = None, False
            self._reject("snapshot", str(err))
            return None
        if version is not None:
            self._snapshot, self._snapshot_pending = None, False
        return version

    def close(self) -> None:
        self.rejections.flush()
        self.sub.close()
        self.dealer.close()
