"""Publishing policy versions (learner side; version_subscriber.py receives them).

One XPUB fans each version out (topic `V`: chunks; topic `S`: shared-memory notices), and a
ROUTER answers snapshot requests from workers that missed something; the XPUB shows which
topics anyone takes, so nothing is encoded for nobody (docs/sync.md, 'Weight versions').
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from asyncfp8.run.failpoints import failpoint

from ..precision.manifest import TensorRole
from .codec import (
    VERSION_TOPIC,
    Tagged,
    encode_tagged,
    entry_role,
    tag_sections,
)
from .delta import copy_bits
from .limits import RejectionLog
from .security import Curve, HandshakeWatch, secure_server
from .shm import (
    SHM_TOPIC,
    SegmentWriter,
)
from .transport import (
    NO_SHM_REPLY,
    NONE_REPLY,
    SEND_BUFFER_BYTES,
    SHM_GROUP_CHUNKS,
    SHM_SNAPSHOT_REQUEST,
    SNAPSHOT_REQUEST,
    check_transport,
)

log = logging.getLogger("asyncfp8.sync")


@dataclass
class PublishStats:
    version: int
    wire_bytes: int  # bytes of chunks sent on the ZeroMQ path (0 when nobody takes it)
    chunks: int  # messages sent: chunks and shared-memory notices
    seconds: float
    media: tuple[str, ...] = ()  # where it went: "tcp" (chunks), "shm" (segment + notices)
    shm_bytes: int = 0  # bytes written into the shared segment, notices included

    @property
    def bytes(self) -> int:
        """Everything the version moved, on either medium."""
        return self.wire_bytes + self.shm_bytes


class VersionPublisher:
    """Learner side: `publish(version, weights, extra)` sends a version out; a
    background thread answers snapshot requests with the latest whole version."""

    def __init__(
        self,
        publish_address: str,
        snapshot_address: str,
        chunk_bytes: int = 4 << 20,
        curve: Curve | None = None,
        send_hwm: int | None = None,
        context: zmq.Context | None = None,
        watch: HandshakeWatch | None = None,
        transport: str = "auto",
        zstd_level: int = 1,
    ):
        self.context = context or zmq.Context.instance()
        self.chunk_bytes, self.zstd_level = max(1, chunk_bytes), zstd_level
        self.offers_shm = check_transport(transport) != "tcp"
        self.pub = self.context.socket(zmq.XPUB)
        secure_server(self.pub, curve)
        # Past this many queued messages, chunks for a slow worker are dropped; it resyncs.
        self.pub.sndhwm = send_hwm or max(64, SEND_BUFFER_BYTES // self.chunk_bytes)
        self.pub.linger = 0
        self.pub.bind(publish_address)
        self.publish_address = self.pub.getsockopt_string(
            zmq.LAST_ENDPOINT
        )  # resolves "tcp://127.0.0.1:*"
        self.topics: set[bytes] = set()  # topics someone subscribes to (XPUB reports them)
        self.state: dict[str, torch.Tensor] = {}  # the latest version: the base of deltas
        self.roles: dict[str, TensorRole] = {}  # of the latest version's tensors, for snapshots
        self._state_in_shm = False  # state views the latest segment rather than own copies

        # Frames sent zero-copy from `state` (a full tensor's chunks): ZeroMQ reads them
        # until these say done, and `state` must not change under them (`_settle_state`).
        self._sending: list[zmq.MessageTracker] = []
        self.stream = uuid.uuid4().hex[:12]  # this publisher: chunks of two never mix
        self.shm: SegmentWriter | None = None  # made when a local worker first subscribes
        self.version: int | None = None
        self.policy, self.engine_config = "", {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # Cleared while a BackgroundPublisher has a publish in flight: close() waits for it.
        self.in_flight = threading.Event()
        self.in_flight.set()
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

    def _subscriptions(self) -> None:
        """Takes the XPUB's subscription messages (call with the lock held): the first
        subscriber to a topic arrives as b"\\x01" + topic, the last to leave as b"\\x00"."""
        while True:
            try:
                message = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                self.topics.add(message[1:])
            elif message[:1] == b"\x00":
                self.topics.discard(message[1:])

    def _wanted(self, topic: bytes) -> bool:
        return any(topic.startswith(prefix) for prefix in self.topics)

    def publish(
        self,
        version: int,
        weights: Iterable[tuple[str, torch.Tensor]],
        extra: Mapping[str, torch.Tensor] | None = None,
        policy: str = "",
        engine_config: Mapping[str, Any] | None = None,
        roles: Mapping[str, TensorRole] | None = None,
    ) -> PublishStats:
        """Sends version `version`: `weights` (streamed) and `extra` (e.g. KV scales) as
        separate sections, each tensor with its role in `roles` (`codec.tag_sections`), with
        the policy name and the engine config it was made for. The publisher keeps its own
        copy (the next delta's base, what snapshots send): the caller may reuse its tensors
        as soon as this returns."""
        started = time.perf_counter()
        engine_config = dict(engine_config or {})
        with self._lock:
            if self.version is not None and version <= self.version:
                raise ValueError(f"versions must increase: {version} after {self.version}")
            self._subscriptions()
            to_shm = self.offers_shm and self._wanted(SHM_TOPIC)
            to_tcp = self._wanted(VERSION_TOPIC)
            base_version = self.version
            self.version = None  # until the whole version is out, no snapshot may mix two versions
            self._settle_state(base_version)
            if not to_shm and self._state_in_shm:
                # The latest segment is read by workers: deltas must not update it in place.
                self.state = {name: t.clone() for name, t in self.state.items()}
                self._state_in_shm = False
            if to_shm and self.shm is None:
                to_shm = self._make_writer()
            tagged = self._into_segment(version, tag_sections(weights, extra, roles), to_shm)
            wire, sent = 0, 0
            update_base = not self._state_in_shm and not to_shm
            try:
                if to_tcp:
                    for message in encode_tagged(
                        version,
                        tagged,
                        base=self.state,
                        base_version=base_version,
                        policy=policy,
                        engine_config=engine_config,
                        chunk_bytes=self.chunk_bytes,
                        update_base=update_base,
                        stream=self.stream,
                        zstd_level=self.zstd_level,
                        share_base=update_base,
                    ):
                        if sent:
                            failpoint("publish.between_chunks")
                        # Only frames that may be views of `state` need watching.
                        tracker = self.pub.send_multipart(message, copy=False, track=update_base)
                        if tracker is not None and not tracker.done:
                            self._sending.append(tracker)
                        wire += sum(len(frame) for frame in message)
                        sent += 1
                elif to_shm:
                    for _ in tagged:
                        pass
                else:
                    self._keep(tagged)
                if to_shm:
                    if sent:
                        failpoint("publish.between_chunks")
                    self.pub.send_multipart(
                        [self.shm.commit(policy, engine_config), b""], copy=False
                    )
                    self.state, self._state_in_shm = self.shm.state(), True
                    self.roles = {name: entry_role(e) for name, e in self.shm.layout.items()}
                    sent += 1
            except BaseException:
                if self.shm is not None:
                    self.shm.abort()
                raise
            self.version, self.policy, self.engine_config = version, policy, engine_config
        media = ("tcp",) * to_tcp + ("shm",) * to_shm
        shm_bytes = self.shm.bytes_moved if to_shm else 0
        return PublishStats(version, wire, sent, time.perf_counter() - started, media, shm_bytes)

    def _settle_state(self, latest: int | None) -> None:
        """Lets `state` change in place again (call with the lock held, before anything
        writes into it). Full tensors' chunks go out zero-copy from `state`; while a stalled
        subscriber keeps some queued, the state moves to fresh copies and the queued frames
        keep the old memory alive: a frame never changes after it was sent."""
        busy = [tracker for tracker in self._sending if not tracker.done]
        self._sending = []
        if busy and not self._state_in_shm:
            log.debug(
                "%d chunks of version %s still queued for a slow subscriber: copying the "
                "publisher's state rather than updating it under them",
                len(busy),
                latest,
            )
            self.state = {name: tensor.clone() for name, tensor in self.state.items()}

    def _make_writer(self) -> bool:
        """The shared segments' writer, made when a local worker first wants it; False
        (logged, and no more offers) where this host cannot provide them."""
        try:
            self.shm = SegmentWriter(self.stream, SHM_GROUP_CHUNKS * self.chunk_bytes)
        except (OSError, AttributeError) as err:  # no memfd / abstract sockets (not Linux)
            log.warning("cannot offer shared memory to local workers (%s): ZeroMQ only", err)
            self.offers_shm = False
        return self.shm is not None

    def _into_segment(self, version: int, tagged: Tagged, to_shm: bool) -> Iterator:
        """The tensors (their roles noted for snapshots), each written into the shared
        segment on its way past, with a notice per `chunk_bytes` written, when local
        workers take shared memory."""
        if to_shm:
            self.shm.begin(version)
        notices = 0
        for role, name, tensor in tagged:
            self.roles[name] = role
            if not to_shm:
                yield role, name, tensor
                continue
            for notice in self.shm.put(role, name, tensor):
                if notices:
                    failpoint("publish.between_chunks")
                self.pub.send_multipart([notice, b""], copy=False)
                notices += 1
            yield role, name, tensor

    def _keep(self, tagged: Tagged) -> None:
        """Nobody subscribes: only the state moves on, for snapshots and later deltas."""
        for _, name, tensor in tagged:
            old = self.state.get(name)
            if old is not None and old.dtype == tensor.dtype and old.shape == tensor.shape:
                copy_bits(old, tensor)
            else:
                self.state[name] = tensor.detach().clone()

    def _serve_snapshots(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._closed.is_set():
            self.rejections.tick()
            if self._lock.acquire(blocking=False):
                try:
                    self._subscriptions()
                finally:
                    self._lock.release()
            if not dict(poller.poll(100)):
                continue
            try:
                identity, *request = self._router.recv_multipart()
            except zmq.ZMQError:
                break
            if request not in ([SNAPSHOT_REQUEST], [SHM_SNAPSHOT_REQUEST]):
                size = sum(len(frame) for frame in request)
                self.rejections(
                    "snapshot request",
                    f"{len(request)} frames, {size} bytes; not one of the valid requests",
                )
                continue
            with self._lock:
                if self.version is None:
                    self._router.send_multipart([identity, NONE_REPLY])
                elif request == [SHM_SNAPSHOT_REQUEST]:
                    self._router.send_multipart([identity, *self._shm_snapshot()])
                else:
                    for message in encode_tagged(
                        self.version,
                        ((self.roles[name], name, t) for name, t in self.state.items()),
                        policy=self.policy,
                        engine_config=self.engine_config,
                        chunk_bytes=self.chunk_bytes,
                        stream=self.stream,
                    ):
                        self._router.send_multipart([identity, *message], copy=False)
                self.snapshots_served += 1

    def _shm_snapshot(self) -> list[bytes]:
        """The latest version as one shared-memory notice (writing it into a segment
        first if it went out on the ZeroMQ path only)."""
        if not self.offers_shm or (self.shm is None and not self._make_writer()):
            return [NO_SHM_REPLY]
        if self.shm.latest_notice is None or self.shm.latest_notice["version"] != self.version:
            self.shm.begin(self.version)
            for name, tensor in list(self.state.items()):
                self.shm.put(self.roles[name], name, tensor)
            self.shm.commit(self.policy, self.engine_config)
            if self._state_in_shm:  # the views now point at a segment about to be reused
                self.state = self.shm.state()
        return [self.shm.snapshot_notice(), b""]

    @property
    def rejected(self) -> int:
        return self.rejections.total

    def close(self) -> None:
        if not self.in_flight.wait(timeout=300):
            log.warning("closing the publisher with a version still being published")
        self._closed.set()
        self._thread.join(timeout=5)
        self.rejections.flush()
        self.pub.close()
        self._router.close()
        if self.shm is not None:
            self.state = {}
            self.shm.close()
