"""Versions through shared memory, for workers on the learner's host.

The learner keeps two segments (double-buffered: version N+1 is written while workers
may still be copying N), each sized from the first version and pre-faulted once, and
writes every version into the one that does not hold the latest. Small notices on the
version PUB socket (topic `S`, sealed msgpack) name the segment and the tensors written
so far with their offsets and xxh3-64 checksums, one per `chunk_bytes` group, so a
worker copies group k into its own tensors while the learner writes group k+1; the
final notice completes the version.

Segments are memfd files, not names in /dev/shm: they have no name to leak, the kernel
frees them when the last process holding one exits (kill -9 included), and they work
in a container without /dev/shm. A worker gets their descriptors from the learner over
a Unix socket in the abstract namespace (also nameless: gone with the learner), after
a check that it runs as the same user, and maps them read-only; they are sealed
against resizing, so no mapping can fault. A worker on another host, or in another
network namespace, cannot reach that socket: it gets a logged reason and ZeroMQ.

Whole or nothing: each segment starts with a sequence number that is odd while it is
written. A worker copies, checks every tensor's checksum against the notice, then
checks that the sequence number did not move: if it moved, the learner has lapped the
worker (written two newer versions) and the worker takes the newer one instead; if it
did not move and a checksum fails, the segment is corrupt, which the subscriber
answers by falling back to ZeroMQ for good.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import struct
import threading
import uuid
from typing import Any

import msgpack
import numpy as np
import torch

from ..precision.manifest import TensorRole
from .codec import (
    Storage,
    Version,
    byte_view,
    checked_tensor_fields,
    dtype_name,
    entry_role,
    is_count,
    received_version,
    same_role,
    seal,
    unseal,
    wire_dtype,
)
from .copyhash import copy_xxh3
from .limits import Limits, RejectedMessage

log = logging.getLogger("asyncfp8.sync")
SHM_TOPIC = b"S"
FORMAT = 3  # 2: notices name pieces of tensors (at, length, checksum of the piece); 3: roles
MAGIC = b"AFP8SHM1"
HEADER_BYTES = 4096  # magic, sequence number, version; the tensors start on the next page
ALIGN = 64
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class ShmUnavailable(RuntimeError):
    """Shared memory cannot be used with this learner (the reason says why)."""


def seal_notice(notice: dict[str, Any]) -> bytes:
    return SHM_TOPIC + seal(msgpack.packb(notice, use_bin_type=True))


class SegmentWriter:
    """Learner side: the two segments, the descriptor server, and the notices."""

    def __init__(self, stream: str, chunk_bytes: int):
        self.stream, self.chunk_bytes = stream, max(1, chunk_bytes)
        self.address = f"\0asyncfp8-shm-{stream}-{uuid.uuid4().hex[:8]}"
        self.generation = 0  # bumped whenever the segments are made anew (a new layout)
        self.layout: dict[str, dict[str, Any]] | None = None  # name -> entry with offset
        self.size = 0
        self.fds: list[int] = []
        self.maps: list[mmap.mmap] = []
        self.latest: int | None = None  # the segment holding the latest complete version
        self.latest_notice: dict[str, Any] | None = None
        self._lock = threading.Lock()  # segments vs the descriptor server
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.address)
        self._server.listen(16)
        self._server.settimeout(0.2)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="asyncfp8-shm", daemon=True)
        self._thread.start()

    # -- writing a version ---------------------------------------------------------------------

    def begin(self, version: int) -> None:
        self.version, self.written, self.pending, self.held = version, {}, [], []
        self.pieces: list[dict[str, Any]] = []  # every piece written, in order
        self.target = None
        self.since_notice, self.chunk = 0, 0
        self.bytes_moved = 0  # tensor bytes written into the segment, plus the notices
        if self.layout is not None:
            self._open_target()

    def _open_target(self) -> None:
        self.target = 1 - self.latest if self.latest is not None else 0
        seq = self._read_seq(self.target)
        self.seq = seq + 1 if seq % 2 == 0 else seq + 2  # odd while written, even when done
        self._write_header(self.target, self.seq, -1)

    def put(self, role: TensorRole, name: str, tensor: torch.Tensor) -> list[bytes]:
        """Writes one tensor of the version; the notices to send now (a group is done)."""
        tensor = tensor.detach().contiguous()
        entry = None if self.layout is None else self.layout.get(name)
        fits = (
            entry is not None
            and name not in self.written
            and same_role(entry, role.wire())
            and entry["dtype"] == dtype_name(tensor.dtype)
            and entry["shape"] == list(tensor.shape)
        )
        if self.target is None or not fits:
            self._hold(role, name, tensor)
            return []
        return self._write(name, entry, byte_view(tensor))

    def _write(
        self, name: str, entry: dict[str, Any], source: memoryview, notify: bool = True
    ) -> list[bytes]:
        """Copies a tensor into the segment piece by piece: a notice goes out whenever
        `chunk_bytes` have been written, in the middle of a tensor too, so that a worker
        copies the first pieces of a large tensor while the learner writes the next. Pieces
        start at multiples of 64 bytes into the tensor (aligned copies). Without `notify`
        every piece waits for the final notice."""
        target = self._view(self.target, entry["offset"], entry["bytes"])
        self.written[name] = entry
        notices, at = [], 0
        while True:
            length = entry["bytes"] - at
            if notify:  # up to the end of the group, rounded up to keep pieces aligned
                room = self.chunk_bytes - self.since_notice
                length = min(length, -(-room // ALIGN) * ALIGN)
            piece = entry | {
                "at": at,
                "length": length,
                "checksum": copy_xxh3(source[at : at + length], target[at : at + length]),
            }
            self.pieces.append(piece)
            self.pending.append(piece)
            self.since_notice += length
            if notify and self.since_notice >= self.chunk_bytes:
                notices.append(self._notice(final=False))
            at += length
            if at >= entry["bytes"]:
                break
        return notices

    def _hold(self, role: TensorRole, name: str, tensor: torch.Tensor) -> None:
        """A tensor the segments have no place for (first version, or a new layout): the
        version is written at `commit` into segments made for it. What was already
        written into the old ones is copied out first."""
        if self.target is not None:
            log.info(
                "version %d does not fit the shared segments (%s): making new ones",
                self.version,
                name,
            )
            self._hold_written()
        if dtype_name(tensor.dtype) is None:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be sent")
        self.held.append((role, name, tensor))

    def commit(self, policy: str, engine_config: dict[str, Any]) -> bytes:
        """Completes the version; the final notice."""
        if self.target is not None and len(self.written) != len(self.layout):
            missing = sorted(set(self.layout) - set(self.written))[:3]
            log.info(
                "version %d lacks tensors of the shared segments (%s): making new ones",
                self.version,
                missing,
            )
            self._hold_written()
        if self.target is None:
            self._make_segments(self.held)
            self._open_target()
            for _, name, tensor in self.held:
                self._write(name, self.layout[name], byte_view(tensor), notify=False)
            self.held = []
        self._write_header(self.target, self.seq + 1, self.version)
        self.latest = self.target
        notice = self._notice(final=True, policy=policy, engine_config=engine_config)
        self.latest_notice = self._full_notice(policy, engine_config)
        return notice

    def _hold_written(self) -> None:
        """What was written into the current segments, copied out to be written again
        into new ones at `commit`."""
        for written in self.written.values():
            view = self._tensor_view(self.target, written)
            self.held.append((entry_role(written), written["name"], view.clone()))
        self.target, self.written, self.pending, self.pieces = None, {}, [], []

    def abort(self) -> None:
        """The version was not completed (an exception while publishing): the target
        segment stays odd, and nothing refers to it."""
        self.target, self.held = None, []

    def state(self) -> dict[str, torch.Tensor]:
        """The latest complete version as tensors viewing its segment."""
        if self.latest is None:
            return {}
        return {name: self._tensor_view(self.latest, entry) for name, entry in self.layout.items()}

    # -- notices -------------------------------------------------------------------------------

    def _base_notice(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "kind": "shm",
            "version": self.version,
            "stream": self.stream,
            "address": self.address,
            "generation": self.generation,
            "segment": self.target,
            "seq": self.seq,
            "segment_bytes": self.size,
        }

    def _notice(self, final: bool, **fields) -> bytes:
        notice = self._base_notice() | {
            "chunk": self.chunk,
            "final": final,
            "tensors": self.pending,
            "total_tensors": len(self.written) if final else None,
            **fields,
        }
        self.pending, self.since_notice = [], 0
        self.chunk += 1
        frame = seal_notice(notice)
        self.bytes_moved += len(frame) + sum(piece["length"] for piece in notice["tensors"])
        return frame

    def _full_notice(self, policy: str, engine_config: dict[str, Any]) -> dict[str, Any]:
        return self._base_notice() | {
            "chunk": 0,
            "final": True,
            "tensors": list(self.pieces),
            "total_tensors": len(self.written),
            "policy": policy,
            "engine_config": engine_config,
        }

    def snapshot_notice(self) -> bytes | None:
        """The latest complete version as one notice, for a worker that asks."""
        return None if self.latest_notice is None else seal_notice(self.latest_notice)

    # -- segments ------------------------------------------------------------------------------

    def _make_segments(self, tensors: list[tuple[TensorRole, str, torch.Tensor]]) -> None:
        layout, cursor = {}, HEADER_BYTES
        for role, name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            layout[name] = {
                "name": name,
                **role.wire(),
                "dtype": dtype_name(tensor.dtype),
                "shape": list(tensor.shape),
                "offset": cursor,
                "bytes": nbytes,
            }
            cursor += -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            self._release()
            self.generation += 1
            self.layout, self.size, self.latest = layout, cursor, None
            for index in range(2):
                fd = os.memfd_create(
                    f"asyncfp8-{self.stream}-{self.generation}-{index}",
                    os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING,
                )
                os.ftruncate(fd, cursor)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
                segment = mmap.mmap(fd, cursor, flags=mmap.MAP_SHARED)
                np.frombuffer(segment, dtype=np.uint8)[:] = 0  # pre-fault every page now
                segment[:8] = MAGIC
                self.fds.append(fd)
                self.maps.append(segment)
        log.info(
            "shared segments for versions: 2 x %.1f MB (memfd, generation %d)",
            cursor / 1e6,
            self.generation,
        )

    def _view(self, index: int, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.maps[index])[offset : offset + nbytes]

    def _tensor_view(self, index: int, entry: dict[str, Any]) -> torch.Tensor:
        dtype, shape = wire_dtype(entry["dtype"]), entry["shape"]
        if not entry["bytes"]:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(
            self.maps[index], dtype=torch.uint8, count=entry["bytes"], offset=entry["offset"]
        )
        return flat.view(dtype).view(shape)

    def _read_seq(self, index: int) -> int:
        return struct.unpack_from("<Q", self.maps[index], 8)[0]

    def _write_header(self, index: int, seq: int, version: int) -> None:
        struct.pack_into("<Qq", self.maps[index], 8, seq, version)

    def _release(self) -> None:
        for segment in self.maps:
            # A tensor still viewing it keeps the mapping until that tensor goes.
            with contextlib.suppress(BufferError):
                segment.close()
        for fd in self.fds:
            os.close(fd)
        self.maps, self.fds = [], []

    # -- descriptor server ---------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            with connection:
                try:
                    self._answer(connection)
                except OSError as err:
                    log.warning("shared-memory descriptor request failed: %s", err)

    def _answer(self, connection: socket.socket) -> None:
        connection.settimeout(5)
        credentials = connection.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
        )
        pid, uid, _ = struct.unpack("3i", credentials)
        if uid != os.getuid():
            log.warning(
                "refused shared memory to process %d of user %d (this learner runs as %d)",
                pid,
                uid,
                os.getuid(),
            )
            return
        with self._lock:
            reply = msgpack.packb({"generation": self.generation, "bytes": self.size})
            socket.send_fds(connection, [reply], list(self.fds))

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._server.close()
        with self._lock:
            self._release()


def parse_notice(frame: bytes, limits: Limits) -> dict[str, Any]:
    """A shared-memory notice, checked field by field; RejectedMessage says what is wrong."""
    frame = bytes(frame)
    if len(frame) > limits.max_header_bytes or frame[:1] != SHM_TOPIC:
        raise RejectedMessage("not a shared-memory notice (topic byte or size)")
    try:
        notice = msgpack.unpackb(unseal(frame[1:], "notice"), raw=False, strict_map_key=True)
    except RejectedMessage:
        raise
    except Exception as err:
        raise RejectedMessage(f"notice is not msgpack: {err}") from None

    def check(condition: bool, reason: str) -> None:
        if not condition:
            raise RejectedMessage(f"notice: {reason}")

    check(isinstance(notice, dict), "not a map")
    check(notice.get("format") == FORMAT and notice.get("kind") == "shm", "unknown format")
    for key in ("version", "generation", "seq", "segment_bytes", "chunk"):
        check(is_count(notice.get(key)), f"field {key!r} missing or not a count")
    for key in ("stream", "address"):
        check(isinstance(notice.get(key), str), f"field {key!r} missing or not a string")
    check(notice.get("segment") in (0, 1), "segment is not 0 or 1")
    check(isinstance(notice.get("final"), bool), "field 'final' missing")
    check(isinstance(notice.get("tensors"), list), "no tensor list")
    check(len(notice["tensors"]) <= limits.max_tensors, "too many tensors")
    if notice["final"]:
        check(is_count(notice.get("total_tensors")), "final notice without total_tensors")
        check(isinstance(notice.get("policy"), str), "final notice without policy")
        check(isinstance(notice.get("engine_config"), dict), "final notice without engine_config")
    for entry in notice["tensors"]:
        name, nbytes = checked_tensor_fields(entry, limits, "notice: ")
        for key in ("offset", "bytes", "at", "length", "checksum"):
            check(is_count(entry.get(key)), f"{name}: {key} missing or not a count")
        check(entry["bytes"] == nbytes, f"{name}: byte count does not match its shape")
        check(
            entry["offset"] >= HEADER_BYTES
            and entry["offset"] + entry["bytes"] <= notice["segment_bytes"],
            f"{name}: outside the segment",
        )
        check(
            entry["at"] + entry["length"] <= entry["bytes"]
            and (entry["length"] > 0 or entry["bytes"] == 0),
            f"{name}: piece outside the tensor",
        )
    return notice


class SegmentReader:
    """Worker side: the learner's two segments, mapped read-only."""

    def __init__(self, connect_timeout: float = 5.0):
        self.connect_timeout = connect_timeout
        self.key: tuple[str, int] | None = None  # (descriptor address, generation) mapped
        self.maps: list[mmap.mmap] = []

    def attach(self, address: str, generation: int, size: int) -> None:
        """Maps the segments a notice names (once per learner and generation)."""
        if self.key == (address, generation):
            return
        self.release()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(self.connect_timeout)
                connection.connect(address)
                reply, fds, _, _ = socket.recv_fds(connection, 1024, 2)
        except OSError as err:
            raise ShmUnavailable(
                f"cannot reach the learner's shared-memory socket ({err}): another host, "
                "another network namespace, or a learner that is gone"
            ) from None
        try:
            info = msgpack.unpackb(reply) if reply else None
            if not isinstance(info, dict) or len(fds) != 2:
                raise ShmUnavailable(
                    f"the learner answered without its two segments ({len(fds)} descriptors; "
                    "a different user?)"
                )
            if info.get("generation") != generation or info.get("bytes") != size:
                raise ShmUnavailable(
                    f"the learner's segments changed while connecting (generation "
                    f"{info.get('generation')}, {info.get('bytes')} bytes; the notice says "
                    f"{generation}, {size})"
                )
            maps = []
            for fd in fds:
                if os.fstat(fd).st_size != size:
                    raise ShmUnavailable("a segment's size is not the one announced")
                if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                    raise ShmUnavailable("a segment is not sealed against resizing")
                maps.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
            for segment in maps:
                if segment[:8] != MAGIC:
                    raise ShmUnavailable("a segment does not start with the expected magic")
        except OSError as err:
            raise ShmUnavailable(f"cannot map the shared segments: {err}") from None
        finally:
            for fd in fds:
                os.close(fd)
        self.maps, self.key = maps, (address, generation)
        log.info("mapped the learner's shared segments (2 x %.1f MB)", size / 1e6)

    def seq(self, index: int) -> int:
        return struct.unpack_from("<Q", self.maps[index], 8)[0]

    def view(self, index: int, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.maps[index])[offset : offset + nbytes]

    def release(self) -> None:
        for segment in self.maps:
            with contextlib.suppress(BufferError):
                segment.close()
        self.maps, self.key = [], None


class Lapped(Exception):
    """The learner rewrote the segment while this worker copied from it."""


class ShmCorrupt(Exception):
    """A checksum failed although the segment was not rewritten meanwhile."""


class ShmAssembler:
    """The tensors of one version from the notices naming them, copied out of the
    segment into buffers from `storage` and checked; `feed` returns the Version after
    the final notice. Raises Lapped or ShmCorrupt (see above), RejectedMessage for
    notices that do not belong together."""

    def __init__(self, reader: SegmentReader, storage: Storage | None = None):
        self.reader = reader
        self.storage = storage or (lambda name, dtype, shape: torch.empty(shape, dtype=dtype))
        self.first: dict[str, Any] | None = None
        self.version: int | None = None
        self.next_chunk = 0
        self.entries: dict[str, dict[str, Any]] = {}  # name -> its first piece
        self.tensors: dict[str, torch.Tensor] = {}
        self.received: dict[str, int] = {}  # bytes of each tensor copied so far
        self.complete: set[str] = set()
        self.wire_bytes = 0

    def feed(self, notice: dict[str, Any], frame_bytes: int) -> Version | None:
        if self.first is None:
            self.first, self.version = notice, notice["version"]
        key = ("version", "stream", "generation", "segment", "seq", "address")
        if any(notice[k] != self.first[k] for k in key) or notice["chunk"] != self.next_chunk:
            raise RejectedMessage(
                f"notice of version {notice['version']} chunk {notice['chunk']} inside version "
                f"{self.version} at chunk {self.next_chunk}"
            )
        self.next_chunk += 1
        self.wire_bytes += frame_bytes
        segment = notice["segment"]
        for piece in notice["tensors"]:
            name = piece["name"]
            entry = self.entries.get(name)
            if entry is None:
                if piece["at"] != 0:
                    raise RejectedMessage(f"{name}: first piece starts at byte {piece['at']}")
                entry = self.entries[name] = piece
                self.tensors[name] = self.storage(
                    name, wire_dtype(entry["dtype"]), tuple(entry["shape"])
                )
                self.received[name] = 0
            elif (
                name in self.complete
                or piece["at"] != self.received[name]
                or not same_role(piece, entry)
                or any(piece[key] != entry[key] for key in ("dtype", "shape", "offset", "bytes"))
            ):
                raise RejectedMessage(f"notice names {name} twice, or its pieces do not follow")
            at, length = piece["at"], piece["length"]
            source = self.reader.view(segment, entry["offset"] + at, length)
            target = byte_view(self.tensors[name])[at : at + length]
            if copy_xxh3(source, target) != piece["checksum"]:
                if self.reader.seq(segment) > notice["seq"] + 1:
                    raise Lapped()
                raise ShmCorrupt(f"{name}: checksum mismatch in shared segment {segment}")
            self.received[name] += length
            if self.received[name] == entry["bytes"]:
                self.complete.add(name)
        # The notice's seq is the odd number of the write; the writer makes it even (+1)
        # when the version is complete, and odd again (+2) when it starts rewriting.
        if self.reader.seq(segment) > notice["seq"] + 1:
            raise Lapped()
        if not notice["final"]:
            return None
        if not notice["total_tensors"] == len(self.entries) == len(self.complete):
            raise RejectedMessage(
                f"{len(self.complete)} of {len(self.entries)} tensors complete, total_tensors "
                f"says {notice['total_tensors']}"
            )
        weights, extra, manifest = received_version(self.entries, self.tensors)
        return Version(
            self.version,
            weights,
            extra,
            None,
            notice["policy"],
            notice["engine_config"],
            self.wire_bytes,
            transport="shm",
            manifest=manifest,
        )
