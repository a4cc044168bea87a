"""Receiving policy versions (worker side): the PUB/ROUTER design is in
version_publisher.py's docstring. A worker applies a version only once all of it has
arrived and every checksum holds; a missing chunk or a delta whose base it lacks makes
it ask the snapshot ROUTER for the latest whole version."""

from __future__ import annotations

import logging
import time

import msgpack
import numpy as np
import torch
import zmq

from .codec import VERSION_TOPIC, Version
from .copyhash import copy_xxh3
from .limits import Limits, RejectedMessage, RejectionLog
from .security import Curve, HandshakeWatch, secure_client
from .shm import SHM_TOPIC, ShmUnavailable
from .shm_reader import Lapped, SegmentReader, ShmAssembler, ShmCorrupt, parse_notice
from .transport import NONE_RETRY, SHM_SNAPSHOT_REQUEST, SNAPSHOT_REQUEST, check_transport, is_local
from .version_decode import VersionAssembler, parse_header

log = logging.getLogger("asyncfp8.sync")


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
        (a worker whose engine did not run it as sent: asyncfp8/refit/probe.py); it comes back
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
            # A snapshot is written into fresh buffers: a live version may be half in the
            # spare ones.
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
