"""Versions through shared memory, the learner's side (docs/sync.md; the worker's: shm_reader.py).

Two memfd segments, double-buffered and sealed; notices on topic `S` name the tensors written
so far, so a worker copies while the learner writes. Each segment starts with a sequence
number, odd while written: a worker whose copy saw it move was lapped and takes the latest."""

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
from .codec import byte_view, dtype_name, entry_role, same_role, seal, wire_dtype
from .copyhash import copy_xxh3

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
