"""Publishing policy versions (learner) and receiving them (workers).

Why PUB plus a snapshot ROUTER: every worker needs every version, so the learner
publishes each once on a PUB socket (fan-out without per-worker bookkeeping). PUB drops
messages for a subscriber that is too slow or not yet connected; that is detected (a
missing chunk, a delta whose base the worker lacks) and repaired by asking the ROUTER
for the latest whole version, as does a worker that starts late or restarts. A worker
applies a version only once all of it has arrived and every checksum holds.

Two media, picked per worker from its address (`transport="auto"`): a worker on the
learner's host subscribes to the shared-memory notices (topic `S`, `shm.py`), any
other to the chunks (topic `V`: deltas against the previous version, compressed, in
frames of a few MiB received in place). The PUB socket is an XPUB, so the learner sees
which topics anyone subscribes to and does only the work someone will receive: no
delta encoding when every worker is local, no segment writes when none is.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from ..failpoints import failpoint
from ..precision.manifest import TensorRole
from .codec import (
    VERSION_TOPIC,
    Tagged,
    Version,
    VersionAssembler,
    encode_tagged,
    entry_role,
    parse_header,
    tag_sections,
)
from .copyhash import copy_xxh3
from .delta import copy_bits
from .limits import Limits, RejectedMessage, RejectionLog
from .security import Curve, HandshakeWatch, secure_client, secure_server
from .shm import (
    SHM_TOPIC,
    Lapped,
    SegmentReader,
    SegmentWriter,
    ShmAssembler,
    ShmCorrupt,
    ShmUnavailable,
    parse_notice,
)

log = logging.getLogger("asyncfp8.sync")
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
        """Sends version `version`: `weights` (streamed: one tensor at a time is enough)
        and `extra` (e.g. KV scales) as separate sections, each tensor with its role in
        `roles` (its manifest: `codec.tag_sections`), with the policy name and the
        engine config it was made for. The publisher keeps its own copy of the version
        (the base of the next delta, and what snapshots send): the tensors it is given
        may be reused by the caller as soon as this returns."""
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
        writes into it). The chunks of full tensors go out zero-copy from `state`; ZeroMQ
        is normally done with them long before the next version (the bench: always), but
        a subscriber that stalls keeps them queued (up to the send high-water mark). Then
        the state moves to fresh copies, and the queued frames keep the old memory alive
        until ZeroMQ drops or sends them: a frame never changes after it was sent."""
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


class VersionSubscriber:
    """Worker side: `poll()` returns the newest complete, verified Version (or None).
    It keeps the current version's tensors (the base deltas apply to) and the previous
    version's as the buffers the next one is written into, so versions after the first
    two allocate nothing."""

    def __init__(
        self,
        publish_address: str,
        snapshot_address: str,
        curve: Curve | None = None,
        limits: Limits | None = None,
        context: zmq.Context | None = None,
        snapshot_timeout: float = 10.0,
        watch: HandshakeWatch | None = None,
        transport: str = "auto",
    ):
        self.context = context or zmq.Context.instance()
        self.snapshot_timeout = snapshot_timeout
        self._requested_at = 0.0
        self.limits = limits or Limits()
        transport = check_transport(transport)
        self.shm = transport == "shm" or (transport == "auto" and is_local(publish_address))
        self.publish_address = publish_address
        self.sub = self.context.socket(zmq.SUB)
        self.dealer = self.context.socket(zmq.DEALER)
        for sock in (self.sub, self.dealer):
            secure_client(sock, curve)
            sock.maxmsgsize = self.limits.max_message_bytes
            sock.linger = 0
        self.sub.rcvhwm = 0  # keep what arrives: the PUB side bounds the queue
        self.sub.setsockopt(zmq.SUBSCRIBE, SHM_TOPIC if self.shm else VERSION_TOPIC)
        if watch is not None:
            watch.watch(self.sub, "version")
            watch.watch(self.dealer, "snapshot")
        self.sub.connect(publish_address)
        self.dealer.connect(snapshot_address)
        self.version: int | None = None
        self.current: Version | None = None
        self.tensors: dict[str, torch.Tensor] = {}  # the current version, both sections
        self._spare: dict[str, torch.Tensor] = {}  # the previous version's buffers
        self._scratch = np.empty(0, dtype=np.uint8)
        self.reader = SegmentReader()
        self.fallback_reason: str | None = None
        self.rejections = RejectionLog(log)
        self.snapshot_requests = 0
        self._live: VersionAssembler | ShmAssembler | None = None
        self._snapshot: VersionAssembler | None = None
        self._snapshot_pending = False
        self._missed_base: int | None = None  # the last version logged as a delta we lack
        self.request_snapshot()

    @property
    def transport(self) -> str:
        return "shm" if self.shm else "tcp"

    def request_snapshot(self) -> None:
        if not self._snapshot_pending:
            self.dealer.send(SHM_SNAPSHOT_REQUEST if self.shm else SNAPSHOT_REQUEST)
            self._snapshot_pending, self._snapshot = True, None
            self._requested_at = time.monotonic()
            self.snapshot_requests += 1

    def refetch(self) -> None:
        """Asks for the learner's latest full version even when it is the one taken last
        (a worker whose engine did not run it as sent: asyncfp8/refit.py); it comes back
        as a whole version, not a delta, so nothing held is its base."""
        if self.version is not None:
            self.version -= 1
        self._snapshot_pending = False
        self.request_snapshot()

    def fall_back(self, reason: str) -> None:
        """Shared memory is unusable: ZeroMQ from now on (logged with the reason)."""
        log.warning(
            "shared memory unusable: %s; receiving versions over ZeroMQ from %s instead",
            reason,
            self.publish_address,
        )
        self.fallback_reason, self.shm, self._live = reason, False, None
        self.reader.release()
        self.sub.setsockopt(zmq.UNSUBSCRIBE, SHM_TOPIC)
        self.sub.setsockopt(zmq.SUBSCRIBE, VERSION_TOPIC)
        self._snapshot_pending = False
        self.request_snapshot()

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
                newest = self._take(self._on_live()) or newest
            if self.dealer in ready:
                newest = self._take(self._on_snapshot()) or newest
            ready = dict(poller.poll(0))
        return newest

    def _take(self, version: Version | None) -> Version | None:
        if version is None or (self.version is not None and version.number <= self.version):
            return None
        self._spare = self.tensors
        self.version, self.current = version.number, version
        self.tensors = version.weights | version.extra
        live = self._live
        if live is not None and live.version is not None and live.version <= version.number:
            self._live = None
        log.info(
            "applied version %d (%d tensors, %d bytes on the wire, %s)",
            version.number,
            len(self.tensors),
            version.wire_bytes,
            version.transport,
        )
        return version

    def _storage(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The buffer a live version's tensor is written into: the previous version's,
        never the current one's (a delta's base, and whole-or-nothing)."""
        spare = self._spare.get(name)
        current = self.tensors.get(name)
        if (
            spare is not None
            and spare.dtype == dtype
            and tuple(spare.shape) == shape
            and (current is None or spare.data_ptr() != current.data_ptr() or not spare.numel())
        ):
            return spare
        return torch.empty(shape, dtype=dtype)

    def _reject(self, source: str, reason: str) -> None:
        self.rejections(f"{source} message", reason)

    def _rest(self, sock: zmq.Socket) -> int:
        """Receives and drops what is left of the current message; how many frames."""
        dropped = 0
        while sock.rcvmore:
            sock.recv(copy=False)
            dropped += 1
        return dropped

    def _payload_into(
        self, sock: zmq.Socket, buffer: memoryview | None, size: int
    ) -> tuple[memoryview, int | None]:
        """Receives the payload frame into `buffer` (or the scratch buffer), checking that
        it is exactly `size` bytes and the last frame of the message; returns it and,
        when it went into `buffer`, the XXH3-64 of its bytes: those are copied out of
        ZeroMQ's message and hashed in one pass (`copy_xxh3`), not copied by `recv_into`
        then read again for the checksum."""
        if not sock.rcvmore:
            raise RejectedMessage("expected 2 frames (header, payload), got 1")
        digest = None
        if buffer is not None and size:
            frame = sock.recv(copy=False)
            received = len(frame.buffer)
            if received == size:
                digest = copy_xxh3(frame.buffer, buffer)
            del frame
        else:
            if buffer is None:
                if self._scratch.size < size:
                    self._scratch = np.empty(size, dtype=np.uint8)
                buffer = memoryview(self._scratch)[:size]
            received = sock.recv_into(buffer) if size else len(sock.recv(copy=False))
        extra = self._rest(sock)
        if received != size or extra:
            raise RejectedMessage(
                f"payload of {received} bytes in {2 + extra} frames, the header says "
                f"{size} bytes in 2"
            )
        return buffer, digest

    def _on_live(self) -> Version | None:
        first = self.sub.recv(copy=False).bytes
        if first[:1] == SHM_TOPIC and not self.shm:
            self._rest(self.sub)  # queued before this worker fell back to ZeroMQ
            return None
        try:
            if first[:1] == SHM_TOPIC:
                return self._on_notice(first, self.sub)
            return self._on_chunk(first)
        except RejectedMessage as err:
            self._rest(self.sub)
            self._live = None
            self._reject("version", str(err))
            self.request_snapshot()
            return None

    def _on_chunk(self, first: bytes) -> Version | None:
        header = parse_header(first, self.limits)
        if self.version is not None and header["version"] <= self.version:
            self._rest(self.sub)
            return None  # already have it (e.g. from a snapshot)
        live = self._live if isinstance(self._live, VersionAssembler) else None
        new = (
            live is None
            or live.version != header["version"]
            or live.header["stream"] != header["stream"]
        )
        if new and self._live is not None:
            self._dropped_incomplete(self._live, header["version"])
            self._live = None
        deltas = any(entry["encoding"] == "delta" for entry in header["tensors"])
        if deltas and header["base_version"] != self.version:
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
            self._rest(self.sub)
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
                self._rest(self.sub)
                self.request_snapshot()
                return None
            self._live = VersionAssembler(self.tensors, self.version, self.limits, self._storage)
        header, destination = self._live.begin(first)
        payload, digest = self._payload_into(self.sub, destination, header["payload_bytes"])
        version = self._live.finish(payload, digest)
        if version is not None:
            self._live = None
        return version

    def _dropped_incomplete(self, assembler, started: int) -> None:
        log.info(
            "dropped incomplete version %d (%d chunks received): version %d started",
            assembler.version,
            assembler.next_chunk,
            started,
        )

    def _on_notice(self, first: bytes, sock: zmq.Socket, snapshot: bool = False):
        payload, _ = self._payload_into(sock, None, 0)  # a notice's second frame is empty
        notice = parse_notice(first, self.limits)
        if self.version is not None and notice["version"] <= self.version:
            return None
        try:
            self.reader.attach(notice["address"], notice["generation"], notice["segment_bytes"])
        except ShmUnavailable as err:
            self.fall_back(str(err))
            return None
        live = self._live if isinstance(self._live, ShmAssembler) else None
        key = (notice["version"], notice["stream"], notice["generation"])
        new = (
            snapshot
            or live is None
            or (live.version, live.first["stream"], live.first["generation"]) != key
        )
        if new and live is not None:
            self._dropped_incomplete(live, notice["version"])
        if new:
            self._live = None
            if notice["chunk"] != 0:
                log.debug("joined version %d at notice %d", notice["version"], notice["chunk"])
                self.request_snapshot()
                return None
            # A snapshot is written into fresh buffers: a live version may be half in the spare ones.
            storage = None if snapshot else self._storage
            assembler = ShmAssembler(self.reader, storage)
            if not snapshot:
                self._live = assembler
        else:
            assembler = live
        try:
            version = assembler.feed(notice, len(first) + len(payload))
        except Lapped:
            self._live = None
            log.info(
                "version %d was rewritten in shared memory while this worker copied it (it is "
                "two versions behind): taking the latest instead",
                notice["version"],
            )
            self.request_snapshot()
            return None
        except ShmCorrupt as err:
            self.fall_back(f"corrupted segment ({err})")
            return None
        if version is not None and not snapshot:
            self._live = None
        return version

    def _on_snapshot(self) -> Version | None:
        first = self.dealer.recv(copy=False).bytes
        if not self.dealer.rcvmore:
            try:
                reply = msgpack.unpackb(first)
            except Exception:
                reply = None
            if reply == {"kind": "none"}:
                # Nothing published yet: the live channel will bring the first version.
                self._snapshot_pending = False
            elif reply == {"kind": "no-shm"} and self.shm:
                self._snapshot_pending = False
                self.fall_back("the learner does not offer shared memory (sync.transport=tcp)")
            else:
                self._reject("snapshot", "malformed one-frame reply")
            return None
        try:
            if first[:1] == SHM_TOPIC and self.shm:
                self._snapshot_pending = False  # before: a lapped copy asks again
                return self._on_notice(first, self.dealer, snapshot=True)
            if self._snapshot is None:
                self._snapshot = VersionAssembler(limits=self.limits)
            header, destination = self._snapshot.begin(first)
            payload, digest = self._payload_into(self.dealer, destination, header["payload_bytes"])
            version = self._snapshot.finish(payload, digest)
        except RejectedMessage as err:
            self._rest(self.dealer)
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
        self.reader.release()
