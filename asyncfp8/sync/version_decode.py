"""Receiving a version's chunk messages (the format is codec.py's): each header checked
against its schema and the receiver's limits (`parse_header`; anything wrong is a
RejectedMessage naming it), then the chunks assembled into a Version, each payload
written straight into the tensor it belongs to, deltas applied against the previous
version, every checksum verified (`VersionAssembler`, `decode_version`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from .codec import (
    FORMAT_VERSION,
    VERSION_TOPIC,
    Storage,
    Version,
    byte_view,
    checked_tensor_fields,
    checksum,
    is_count,
    received_version,
    same_role,
    unseal,
    wire_dtype,
)
from .delta import apply_delta
from .limits import Limits, RejectedMessage


def _check(condition: bool, reason: str) -> None:
    if not condition:
        raise RejectedMessage(reason)


PART_FIELDS = {
    "data": ("at", "offset", "length", "checksum"),
    "delta": ("offset", "length", "checksum", "changes", "escapes", "gap_bytes", "raw_bytes"),
}


def parse_header(frame: bytes, limits: Limits) -> dict[str, Any]:
    """The chunk header (topic and digest checked, then the schema); RejectedMessage
    says what is wrong."""
    _check(
        len(frame) <= limits.max_header_bytes,
        f"header of {len(frame)} bytes exceeds {limits.max_header_bytes}",
    )
    frame = bytes(frame)
    _check(frame[:1] == VERSION_TOPIC, "not a version chunk (topic byte)")
    frame = unseal(frame[1:], "header")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as err:
        raise RejectedMessage(f"header is not msgpack: {err}") from None
    _check(isinstance(header, dict), "header is not a map")
    _check(
        header.get("format") == FORMAT_VERSION,
        f"unknown format {header.get('format')!r} (expected {FORMAT_VERSION})",
    )
    _check(header.get("kind") == "version", f"not a version message (kind {header.get('kind')!r})")
    for key, kind in (
        ("version", int),
        ("chunk", int),
        ("final", bool),
        ("tensors", list),
        ("policy", str),
        ("engine_config", dict),
        ("stream", str),
        ("payload_bytes", int),
    ):
        _check(
            isinstance(header.get(key), kind),
            f"header field {key!r} missing or not {kind.__name__}",
        )
    _check(
        header["version"] >= 0 and 0 <= header["chunk"] < limits.max_chunks,
        "version or chunk out of range",
    )
    _check(
        0 <= header["payload_bytes"] <= limits.max_message_bytes,
        f"payload of {header['payload_bytes']} bytes out of range",
    )
    _check(
        header.get("base_version") is None or isinstance(header["base_version"], int),
        "bad base_version",
    )
    _check(
        len(header["tensors"]) <= limits.max_tensors,
        f"{len(header['tensors'])} tensors exceed {limits.max_tensors}",
    )
    if header["final"]:
        _check(is_count(header.get("total_tensors")), "final chunk without total_tensors")
    for entry in header["tensors"]:
        _check_entry(entry, header["payload_bytes"], limits)
    return header


def _check_entry(entry: Any, payload_bytes: int, limits: Limits) -> None:
    """One tensor entry of a chunk header: name, role, dtype, shape and size within the
    limits, encoding, and its one part inside the chunk's `payload_bytes`."""
    name, nbytes = checked_tensor_fields(entry, limits)
    _check(
        nbytes <= limits.max_tensor_bytes,
        f"{name}: {entry['shape']} exceeds max_tensor_bytes",
    )
    _check(
        entry.get("encoding") in ("full", "delta"),
        f"{name}: unknown encoding {entry.get('encoding')!r}",
    )
    # A delta's result is checked whole after it is applied; a full tensor is its
    # parts, each checked against its own checksum (and bytes placed in order).
    if entry["encoding"] == "delta":
        _check(is_count(entry.get("result_checksum")), f"{name}: no checksum")
    else:
        _check(entry.get("result_checksum") is None, f"{name}: unexpected result checksum")
    parts = entry.get("parts")
    role = "data" if entry["encoding"] == "full" else "delta"
    _check(
        isinstance(parts, list)
        and len(parts) == 1
        and isinstance(parts[0], dict)
        and parts[0].get("role") == role,
        f"{name}: parts do not match the {entry['encoding']} encoding",
    )
    part = parts[0]
    for key in PART_FIELDS[role]:
        _check(is_count(part.get(key)), f"{name}: part without a valid {key}")
    _check(
        part["offset"] + part["length"] <= payload_bytes,
        f"{name}: data outside the payload",
    )


class VersionAssembler:
    """Collects the chunks of one version, verifies each, and rebuilds the tensors against
    `base` (the receiver's current tensors) into buffers from `storage` (fresh by default;
    a subscriber passes its spare ones). `begin(header)` says where the payload goes (a
    slice of a tensor, or None), `finish(payload)` checks and applies it, returning the
    Version after the final chunk; `feed(frames)` does both. Nothing unverified comes out."""

    def __init__(
        self,
        base: Mapping[str, torch.Tensor] | None = None,
        base_version: int | None = None,
        limits: Limits | None = None,
        storage: Storage | None = None,
    ):
        self.base, self.base_version, self.limits = base or {}, base_version, limits or Limits()
        self.storage = storage or (lambda name, dtype, shape: torch.empty(shape, dtype=dtype))
        self.version: int | None = None
        self.next_chunk = 0
        self.header: dict[str, Any] | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.entries: dict[str, dict[str, Any]] = {}  # name -> its first declaration
        self.received: dict[str, int] = {}  # full tensors: bytes received so far
        self.complete: set[str] = set()
        self.wire_bytes = 0
        self._chunk: dict[str, Any] | None = None
        self._header_bytes = 0

    def begin(self, header_frame: bytes) -> tuple[dict[str, Any], memoryview | None]:
        """Checks a chunk's header; returns it and the buffer its payload belongs in when
        that is one slice of one tensor (else None: the caller receives it anywhere)."""
        header = parse_header(header_frame, self.limits)
        if self.version is None:
            self.version, self.header = header["version"], header
        _check(
            header["version"] == self.version and header["stream"] == self.header["stream"],
            f"chunk of version {header['version']} (stream {header['stream']!r}) inside "
            f"version {self.version} (stream {self.header['stream']!r})",
        )
        _check(
            header["chunk"] == self.next_chunk,
            f"chunk {header['chunk']} arrived, {self.next_chunk} expected",
        )
        self.next_chunk += 1
        for entry in header["tensors"]:
            self._declare(entry, header)
        self._chunk, self._header_bytes = header, len(header_frame)
        entries = header["tensors"]
        if len(entries) == 1 and entries[0]["encoding"] == "full":
            part = entries[0]["parts"][0]
            if part["offset"] == 0 and part["length"] == header["payload_bytes"]:
                view = byte_view(self.tensors[entries[0]["name"]])
                return header, view[part["at"] : part["at"] + part["length"]]
        return header, None

    def finish(self, payload: memoryview | bytes, digest: int | None = None) -> Version | None:
        """Checks the chunk's payload (in the buffer `begin` named, or anywhere) and
        rebuilds its tensors; the Version after the final chunk, else None. `digest`:
        the XXH3-64 of the payload's bytes where the receiver computed it while copying
        them (then a chunk that is one part is not read again to check it)."""
        header, self._chunk = self._chunk, None
        _check(header is not None, "payload without a header")
        view = memoryview(payload).cast("B")
        _check(
            len(view) == header["payload_bytes"],
            f"payload of {len(view)} bytes, the header says {header['payload_bytes']}",
        )
        _check(
            self._header_bytes + len(view) <= self.limits.max_message_bytes,
            "message exceeds max_message_bytes",
        )
        for entry in header["tensors"]:
            part = entry["parts"][0]
            data = view[part["offset"] : part["offset"] + part["length"]]
            # A part that is the whole payload: the receiver hashed it while copying.
            known = digest is not None and part["offset"] == 0 and part["length"] == len(view)
            _check(
                (digest if known else xxhash.xxh3_64_intdigest(data)) == part["checksum"],
                f"{entry['name']}: payload checksum mismatch",
            )
        for entry in header["tensors"]:
            part = entry["parts"][0]
            self._apply(entry, part, view[part["offset"] : part["offset"] + part["length"]])
        self.wire_bytes += self._header_bytes + len(view)
        if not header["final"]:
            return None
        _check(
            header["total_tensors"] == len(self.entries) == len(self.complete),
            f"{len(self.complete)} of {len(self.entries)} tensors complete, "
            f"total_tensors says {header['total_tensors']}",
        )
        weights, extra, manifest = received_version(self.entries, self.tensors)
        return Version(
            self.version,
            weights,
            extra,
            header.get("base_version"),
            header["policy"],
            header["engine_config"],
            self.wire_bytes,
            manifest=manifest,
        )

    def feed(self, frames: list[bytes]) -> Version | None:
        _check(len(frames) == 2, f"expected 2 frames (header, payload), got {len(frames)}")
        _check(
            len(frames[0]) + len(frames[1]) <= self.limits.max_message_bytes,
            "message exceeds max_message_bytes",
        )
        _, destination = self.begin(frames[0])
        if destination is not None and len(frames[1]) == len(destination):
            destination[:] = memoryview(frames[1]).cast("B")
            return self.finish(destination)
        return self.finish(frames[1])

    def _declare(self, entry: dict[str, Any], header: dict[str, Any]) -> None:
        name = entry["name"]
        first = self.entries.get(name)
        if first is not None:
            _check(
                entry["encoding"] == "full"
                and name not in self.complete
                and same_role(entry, first)
                and all(
                    entry[key] == first[key]
                    for key in ("dtype", "shape", "encoding", "result_checksum")
                ),
                f"{name}: sent again, or continued with different fields",
            )
            return
        _check(
            len(self.entries) < self.limits.max_tensors * self.limits.max_chunks,
            "too many tensors",
        )
        dtype, shape = wire_dtype(entry["dtype"]), tuple(entry["shape"])
        if entry["encoding"] == "delta":
            _check(
                header.get("base_version") == self.base_version and name in self.base,
                f"{name}: delta against version {header.get('base_version')}, "
                f"but this receiver has {self.base_version}",
            )
            base = self.base[name]
            _check(
                base.dtype == dtype and tuple(base.shape) == shape,
                f"{name}: delta does not fit the base tensor",
            )
        try:
            tensor = self.storage(name, dtype, shape)
        except RuntimeError as err:  # allocation failed
            raise RejectedMessage(f"{name}: no room for {shape} {dtype}: {err}") from None
        self.entries[name], self.tensors[name], self.received[name] = entry, tensor, 0

    def _apply(self, entry: dict[str, Any], part: dict[str, Any], data: memoryview) -> None:
        name = entry["name"]
        tensor = self.tensors[name]
        if entry["encoding"] == "delta":
            apply_delta(
                self.base[name],
                data,
                part["changes"],
                part["escapes"],
                part["gap_bytes"],
                part["raw_bytes"],
                out=tensor,
            )
        else:
            target = byte_view(tensor)
            _check(
                part["at"] == self.received[name] and part["at"] + part["length"] <= len(target),
                f"{name}: bytes {part['at']}..{part['at'] + part['length']} out of order or "
                f"outside the tensor ({self.received[name]} of {len(target)} received)",
            )
            destination = target[part["at"] : part["at"] + part["length"]]
            if not _same_memory(destination, data):
                destination[:] = data
            self.received[name] += part["length"]
            if self.received[name] == len(target):
                self.complete.add(name)  # every byte of it came in a verified part, in order
            return
        _check(
            checksum(tensor) == entry["result_checksum"],
            f"{name}: rebuilt tensor checksum mismatch",
        )
        self.complete.add(name)


def _same_memory(a: memoryview, b: memoryview) -> bool:
    if len(a) != len(b) or not len(a):
        return len(a) == len(b) == 0
    address = np.frombuffer(a, dtype=np.uint8).ctypes.data
    return address == np.frombuffer(b, dtype=np.uint8).ctypes.data


def decode_version(
    messages: Iterable[list[bytes]],
    base: Mapping[str, torch.Tensor] | None = None,
    base_version: int | None = None,
    limits: Limits | None = None,
) -> Version:
    """The Version held in `messages` (all chunks, in order); RejectedMessage if any is bad."""
    assembler = VersionAssembler(base, base_version, limits)
    for frames in messages:
        version = assembler.feed(list(frames))
        if version is not None:
            return version
    raise RejectedMessage("the version's final chunk is missing")
