"""Weight versions as ZeroMQ messages: a msgpack header and a safetensors payload.

A version is sent as one or more chunk messages `[header, payload]`. The payload is a
safetensors file; the header (msgpack) names the version, the delta base, the
precision policy and its engine config, and, for every tensor: name, dtype, shape,
encoding (`full` or `patch`), the byte offset and length of its data in the payload,
and two xxh3-64 checksums: of those payload bytes, and of the tensor once rebuilt.

A `patch` is lossless: the flat indices where the tensor's bytes changed since the
base version (gaps between them, in the narrowest unsigned type that fits) and the new
values there. For quantized policies the patch is taken on what the engine receives
(e4m3 / int8 bytes, scale blocks), never on BF16. Each tensor is sent in whichever
form is smaller.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import xxhash

from .limits import Limits, RejectedMessage

FORMAT_VERSION = 1
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Integer views of the same width: patches compare and copy bits, never float values
# (so -0.0 vs 0.0 and NaN payloads survive exactly).
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
GAP_TYPES = (
    (1 << 8, torch.uint8),
    (1 << 16, torch.uint16),
    (1 << 32, torch.uint32),
    (1 << 63, torch.int64),
)


DIGEST_BYTES = 8


def seal(frame: bytes) -> bytes:
    """`frame` prefixed with its xxh3-64 digest, so that no bit of it can change unseen."""
    return xxhash.xxh3_64_digest(frame) + frame


def unseal(frame: bytes | memoryview, what: str) -> bytes:
    frame = bytes(frame)
    if (
        len(frame) < DIGEST_BYTES
        or xxhash.xxh3_64_digest(frame[DIGEST_BYTES:]) != frame[:DIGEST_BYTES]
    ):
        raise RejectedMessage(f"{what} digest mismatch (corrupted or truncated)")
    return frame[DIGEST_BYTES:]


def checksum(tensor: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(raw_bytes(tensor))


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1).contiguous()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(BITS[tensor.element_size()])


def make_patch(new: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gaps, values) turning `base` into `new`, or None if the shapes or dtypes differ."""
    if base.shape != new.shape or base.dtype != new.dtype:
        return None
    changed = (as_bits(new) != as_bits(base)).nonzero().reshape(-1)
    gaps = torch.diff(changed, prepend=changed.new_tensor([-1]))
    gap_dtype = next(
        dtype for bound, dtype in GAP_TYPES if gaps.numel() == 0 or int(gaps.max()) < bound
    )
    return gaps.to(gap_dtype), new.detach().reshape(-1)[changed].contiguous()


def apply_patch(base: torch.Tensor, gaps: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    index = gaps.to(torch.int64).cumsum(0) - 1
    if index.numel() and (int(index[-1]) >= base.numel() or int(gaps.to(torch.int64).min()) < 1):
        raise RejectedMessage("patch indices fall outside the base tensor")
    if values.numel() != index.numel() or values.dtype != base.dtype:
        raise RejectedMessage("patch values do not match its indices or the base dtype")
    out = base.detach().reshape(-1).clone()
    out[index] = values
    return out.view(base.shape)


@dataclass
class Version:
    """A decoded, verified version: what a worker hands to its engine."""

    number: int
    tensors: dict[str, torch.Tensor]
    base_version: int | None = None
    policy: str = ""
    engine_config: dict[str, Any] = field(default_factory=dict)
    wire_bytes: int = 0


# The payload is a standard safetensors file (the `safetensors` library reads it; a
# test checks that). It is written and read here rather than by that library because
# its torch API copies every byte twice per side (1.2 GB/s measured), where this
# writes each tensor once into one buffer that ZeroMQ sends without a copy, and reads
# tensors as zero-copy views of the received frame.
ST_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
ST_TORCH = {name: dtype for dtype, name in ST_DTYPES.items()}


def pack_safetensors(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[memoryview, dict[str, tuple[int, int]]]:
    """(safetensors file as one buffer, {name: (byte offset, length) in it})."""
    header, cursor = {}, 0
    for name, tensor in tensors.items():
        length = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": ST_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [cursor, cursor + length],
        }
        cursor += length
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
    start = 8 + len(header_bytes)
    buffer = torch.empty(start + cursor, dtype=torch.uint8)
    buffer[:start] = torch.frombuffer(
        bytearray(struct.pack("<Q", len(header_bytes)) + header_bytes), dtype=torch.uint8
    )
    offsets = {}
    for name, tensor in tensors.items():
        begin, end = header[name]["data_offsets"]
        if end > begin:
            buffer[start + begin : start + end] = (
                tensor.detach().reshape(-1).contiguous().view(torch.uint8)
            )
        offsets[name] = (start + begin, end - begin)
    return memoryview(buffer.numpy()), offsets


def unpack_safetensors(payload: memoryview) -> dict[str, torch.Tensor]:
    """Tensors viewing `payload` (no copy); RejectedMessage if it is not a sound file."""
    try:
        (header_len,) = struct.unpack("<Q", bytes(payload[:8]))
        _check(header_len <= len(payload) - 8, "safetensors header longer than the payload")
        header = json.loads(bytes(payload[8 : 8 + header_len]))
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise RejectedMessage(f"payload is not a safetensors file: {err}") from None
    _check(isinstance(header, dict), "safetensors header is not a map")
    start, tensors = 8 + header_len, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        _check(
            isinstance(info, dict) and info.get("dtype") in ST_TORCH,
            f"{name}: unknown safetensors dtype",
        )
        dtype, shape, offsets = ST_TORCH[info["dtype"]], info.get("shape"), info.get("data_offsets")
        _check(
            isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape),
            f"{name}: bad shape",
        )
        _check(
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= len(payload) - start,
            f"{name}: data offsets out of range",
        )
        numel = math.prod(shape)
        _check(
            offsets[1] - offsets[0] == numel * dtype.itemsize,
            f"{name}: data length does not match its shape",
        )
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(
            payload, dtype=torch.uint8, count=offsets[1] - offsets[0], offset=start + offsets[0]
        )
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors


def encode_chunks(
    version: int,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    base: Mapping[str, torch.Tensor] | None = None,
    base_version: int | None = None,
    policy: str = "",
    engine_config: Mapping[str, Any] | None = None,
    chunk_bytes: int = 64 << 20,
    update_base: bool = False,
    stream: str = "",
) -> Iterator[list[bytes]]:
    """One `[header, payload]` message per chunk of about `chunk_bytes`, streamed from
    `named_tensors`. Tensors with an entry in `base` (the receiver's previous version)
    go as patches when that is smaller. With `update_base`, `base[name]` is replaced by
    the new tensor as soon as its patch is taken, so a sender keeps one copy of the
    model, not two. `stream` names the sending process: a receiver never assembles one
    version from chunks of two streams (a learner that died mid-publish and the one
    that resumed it)."""
    pending: dict[str, torch.Tensor] = {}
    entries: list[dict[str, Any]] = []
    size, chunk_index, total = 0, 0, 0

    def message(final: bool) -> list[bytes]:
        payload, offsets = pack_safetensors(pending)
        for entry in entries:
            for part in entry["parts"]:
                offset, length = offsets[part["key"]]
                digest = xxhash.xxh3_64_intdigest(payload[offset : offset + length])
                part.update(offset=offset, length=length, checksum=digest)
            if entry["encoding"] == "full":
                entry["result_checksum"] = entry["parts"][0]["checksum"]  # the same bytes
        header = {
            "format": FORMAT_VERSION,
            "kind": "version",
            "version": version,
            "stream": stream,
            "base_version": base_version,
            "policy": policy,
            "engine_config": dict(engine_config or {}),
            "chunk": chunk_index,
            "final": final,
            "tensors": entries,
            "total_tensors": total if final else None,
        }
        return [seal(msgpack.packb(header, use_bin_type=True)), payload]

    for name, tensor in named_tensors:
        tensor = tensor.detach().contiguous()
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be sent")
        full_bytes = tensor.numel() * tensor.element_size()
        patch = make_patch(tensor, base[name]) if base is not None and name in base else None
        if update_base and base is not None:
            base[name] = tensor
        entry = {"name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)}
        if patch is not None and sum(p.numel() * p.element_size() for p in patch) < full_bytes:
            gaps, values = patch
            entry["result_checksum"] = checksum(tensor)
            entry["encoding"] = "patch"
            entry["parts"] = [
                {"key": f"{name}::gaps", "role": "gaps"},
                {"key": f"{name}::values", "role": "values"},
            ]
            pending[f"{name}::gaps"], pending[f"{name}::values"] = gaps, values
            size += gaps.numel() * gaps.element_size() + values.numel() * values.element_size()
        else:
            entry["encoding"] = "full"
            entry["parts"] = [{"key": name, "role": "data"}]
            pending[name] = tensor
            size += full_bytes
        entries.append(entry)
        total += 1
        if size >= chunk_bytes:
            yield message(final=False)
            pending, entries, size = {}, [], 0
            chunk_index += 1
    yield message(final=True)


def encode_version(version: int, named_tensors, **kwargs) -> list[list[bytes]]:
    """All chunk messages of a version (see `encode_chunks` for the arguments)."""
    return list(encode_chunks(version, named_tensors, **kwargs))


def _check(condition: bool, reason: str) -> None:
    if not condition:
        raise RejectedMessage(reason)


def parse_header(frame: bytes, limits: Limits) -> dict[str, Any]:
    """The chunk header (digest-checked, then schema-checked); RejectedMessage says what is wrong."""
    _check(
        len(frame) <= limits.max_header_bytes,
        f"header of {len(frame)} bytes exceeds {limits.max_header_bytes}",
    )
    frame = unseal(frame, "header")
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
        header.get("base_version") is None or isinstance(header["base_version"], int),
        "bad base_version",
    )
    _check(
        len(header["tensors"]) <= limits.max_tensors,
        f"{len(header['tensors'])} tensors exceed {limits.max_tensors}",
    )
    if header["final"]:
        _check(isinstance(header.get("total_tensors"), int), "final chunk without total_tensors")
    for entry in header["tensors"]:
        _check(
            isinstance(entry, dict) and isinstance(entry.get("name"), str),
            "tensor entry without a name",
        )
        _check(
            entry.get("dtype") in DTYPES, f"{entry['name']}: unknown dtype {entry.get('dtype')!r}"
        )
        shape = entry.get("shape")
        _check(
            isinstance(shape, list)
            and len(shape) <= limits.max_ndim
            and all(isinstance(d, int) and d >= 0 for d in shape),
            f"{entry['name']}: bad shape {shape!r}",
        )
        _check(
            entry.get("encoding") in ("full", "patch"),
            f"{entry['name']}: unknown encoding {entry.get('encoding')!r}",
        )
        _check(isinstance(entry.get("result_checksum"), int), f"{entry['name']}: no checksum")
        parts = entry.get("parts")
        roles = ["data"] if entry["encoding"] == "full" else ["gaps", "values"]
        _check(
            isinstance(parts, list)
            and [p.get("role") for p in parts if isinstance(p, dict)] == roles,
            f"{entry['name']}: parts do not match the {entry['encoding']} encoding",
        )
        for part in parts:
            for key in ("offset", "length", "checksum"):
                _check(
                    isinstance(part.get(key), int) and part[key] >= 0,
                    f"{entry['name']}: part without a valid {key}",
                )
    return header


class VersionAssembler:
    """Collects the chunks of one version, verifies each, and rebuilds the tensors
    against `base` (the receiver's current tensors); `feed` returns the finished
    Version after the final chunk, else None. Nothing is returned unverified."""

    def __init__(
        self,
        base: Mapping[str, torch.Tensor] | None = None,
        base_version: int | None = None,
        limits: Limits | None = None,
    ):
        self.base, self.base_version, self.limits = base or {}, base_version, limits or Limits()
        self.version: int | None = None
        self.next_chunk = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.wire_bytes = 0
        self.header: dict[str, Any] | None = None

    def feed(self, frames: list[bytes]) -> Version | None:
        _check(len(frames) == 2, f"expected 2 frames (header, payload), got {len(frames)}")
        header_frame, payload = frames
        _check(
            len(header_frame) + len(payload) <= self.limits.max_message_bytes,
            "message exceeds max_message_bytes",
        )
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
        view = memoryview(payload)
        for entry in header["tensors"]:
            for part in entry["parts"]:
                _check(
                    part["offset"] + part["length"] <= len(view),
                    f"{entry['name']}: data outside the payload",
                )
                data = view[part["offset"] : part["offset"] + part["length"]]
                _check(
                    xxhash.xxh3_64_intdigest(data) == part["checksum"],
                    f"{entry['name']}: payload checksum mismatch",
                )
        stored = unpack_safetensors(view) if header["tensors"] else {}
        for entry in header["tensors"]:
            self.tensors[entry["name"]] = self._rebuild(entry, stored, header)
        self.wire_bytes += len(header_frame) + len(payload)
        if not header["final"]:
            return None
        _check(
            header["total_tensors"] == len(self.tensors),
            "tensor count does not match total_tensors",
        )
        return Version(
            self.version,
            self.tensors,
            header.get("base_version"),
            header["policy"],
            header["engine_config"],
            self.wire_bytes,
        )

    def _rebuild(self, entry, stored, header) -> torch.Tensor:
        name, dtype, shape = entry["name"], DTYPES[entry["dtype"]], tuple(entry["shape"])
        parts = {p["role"]: stored.get(p["key"]) for p in entry["parts"]}
        _check(all(t is not None for t in parts.values()), f"{name}: payload lacks its data")
        if entry["encoding"] == "full":
            tensor = parts["data"]
            _check(
                tensor.dtype == dtype and tuple(tensor.shape) == shape,
                f"{name}: payload dtype/shape differ from header",
            )
        else:
            _check(
                header.get("base_version") == self.base_version and name in self.base,
                f"{name}: patch against version {header.get('base_version')}, but this receiver has {self.base_version}",
            )
            base = self.base[name]
            _check(
                base.dtype == dtype and tuple(base.shape) == shape,
                f"{name}: patch does not fit the base tensor",
            )
            tensor = apply_patch(base, parts["gaps"], parts["values"])
            _check(
                checksum(tensor) == entry["result_checksum"],
                f"{name}: rebuilt tensor checksum mismatch",
            )
        return tensor


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
