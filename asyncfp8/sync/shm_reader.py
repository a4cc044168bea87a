"""Worker side of versions through shared memory (the learner's is shm.py): each notice
checked (`parse_notice`), the learner's segments mapped read-only (`SegmentReader`), and the
tensors a version's notices name copied out and verified piece by piece (`ShmAssembler`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import struct
from typing import Any

import msgpack
import torch

from .codec import (
    Storage,
    Version,
    byte_view,
    checked_tensor_fields,
    is_count,
    received_version,
    same_role,
    unseal,
    wire_dtype,
)
from .copyhash import copy_xxh3
from .limits import Limits, RejectedMessage
from .shm import FORMAT, HEADER_BYTES, MAGIC, SEALS, SHM_TOPIC, ShmUnavailable

log = logging.getLogger("asyncfp8.sync")


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
