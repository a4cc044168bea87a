"""Weight versions as ZeroMQ messages `[header, payload]`, one per chunk (docs/sync.md).

Each tensor carries its role (`TensorRole`), which puts it in `weights` or `extra`, and goes
whole or as a delta against the receiver's previous version (`delta.py`). This module is the
format and the sending side; version_decode.py checks and assembles the versions received.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from ..precision.manifest import WIRE_KEYS, TensorRole, default_role
from .copyhash import copy_xxh3
from .delta import Delta, encode_delta
from .limits import Limits, RejectedMessage

# 3: a full tensor has no result checksum (its parts' checksums cover it); 4: each
# tensor's role (role, layer, kv_part) replaces its section
FORMAT_VERSION = 4
VERSION_TOPIC = b"V"  # first byte of a chunk's header frame: what a SUB socket filters on
SECTIONS = ("weights", "extra")


def wire_dtype(name: object) -> torch.dtype | None:
    """The torch dtype a header's `dtype` names (torch's own name: `float8_e4m3fn`), or
    None. Any real dtype travels (floating point of any width, bool, whole-byte
    integers), so a precision's storage dtypes (asyncfp8.precision.storage) need no
    table here; complex, quantized and sub-byte placeholder dtypes do not."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or str(dtype) != f"torch.{name}":
        return None
    if dtype.is_floating_point or dtype == torch.bool:
        return dtype
    bits = 8 * dtype.itemsize
    return dtype if name in (f"int{bits}", f"uint{bits}") else None


def dtype_name(dtype: torch.dtype) -> str | None:
    """The name a header gives `dtype`, or None if it cannot travel (see `wire_dtype`)."""
    name = str(dtype).removeprefix("torch.")
    return name if wire_dtype(name) is dtype else None


DIGEST_BYTES = 8

Storage = Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor]


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


def aligned_empty(size: int) -> np.ndarray:
    """An uninitialized byte buffer starting on a 64-byte boundary (a cache line: the
    copy into it can use non-temporal stores)."""
    raw = np.empty(size + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + size]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes (it must be contiguous), writable when the tensor is."""
    flat = tensor.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def checksum(tensor: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(byte_view(tensor.contiguous()))


@dataclass
class Version:
    """A decoded, verified version: what a worker hands to its engine. A subscriber
    reuses its buffers: the tensors hold until it has received two newer versions
    (engines copy what they are given, so that is never a constraint for them)."""

    number: int
    weights: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    base_version: int | None = None
    policy: str = ""
    engine_config: dict[str, Any] = field(default_factory=dict)
    wire_bytes: int = 0
    transport: str = "tcp"  # how it arrived: "tcp" (any ZeroMQ transport) or "shm"
    #: every tensor's role, as its header says (`asyncfp8.precision.manifest`); None for
    #: a Version made in process (the engine then takes its own roles)
    manifest: dict[str, TensorRole] | None = None


def entry_role(entry: Mapping[str, Any]) -> TensorRole:
    """The role a received header entry carries (RejectedMessage if malformed)."""
    try:
        return TensorRole.from_wire(entry)
    except ValueError as err:
        raise RejectedMessage(f"{entry.get('name')}: {err}") from None


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def checked_tensor_fields(entry: Any, limits: Limits, prefix: str = "") -> tuple[str, int]:
    """A received tensor entry's name, role, dtype and shape, checked (a RejectedMessage
    naming what is wrong, after `prefix`): its name and its size in bytes. The chunk
    headers (version_decode.py) and the shared-memory notices (shm.py) both hold them."""

    def check(condition: bool, reason: str) -> None:
        if not condition:
            raise RejectedMessage(prefix + reason)

    check(
        isinstance(entry, dict) and isinstance(entry.get("name"), str),
        "tensor entry without a name",
    )
    name = entry["name"]
    entry_role(entry)
    dtype = wire_dtype(entry.get("dtype"))
    check(dtype is not None, f"{name}: unknown dtype {entry.get('dtype')!r}")
    shape = entry.get("shape")
    check(
        isinstance(shape, list)
        and len(shape) <= limits.max_ndim
        and all(is_count(d) for d in shape),
        f"{name}: bad shape {shape!r}",
    )
    return name, math.prod(shape) * dtype.itemsize


def same_role(entry: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    return all(entry.get(key) == other.get(key) for key in WIRE_KEYS)


def received_version(
    entries: Mapping[str, Mapping[str, Any]], tensors: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, TensorRole]]:
    """A received version's (weights, extra, manifest), split by the roles its entries carry."""
    manifest = {name: entry_role(entry) for name, entry in entries.items()}
    sections: dict[str, dict[str, torch.Tensor]] = {section: {} for section in SECTIONS}
    for name, role in manifest.items():
        sections[role.section][name] = tensors[name]
    return sections["weights"], sections["extra"], manifest


Tagged = Iterable[tuple[TensorRole, str, torch.Tensor]]  # (role, name, tensor)


def tag_sections(
    weights: Iterable[tuple[str, torch.Tensor]],
    extra: Mapping[str, torch.Tensor] | None,
    roles: Mapping[str, TensorRole] | None = None,
) -> Iterator[tuple[TensorRole, str, torch.Tensor]]:
    """(role, name, tensor) for the weights, then the extra tensors. A tensor's role is
    read from `roles` once it has come (a stream may fill `roles` as it yields, as
    `version_weights` does); one without a role is a plain weight, or an `extra`."""
    if roles is None:  # an empty dict may be the one a stream fills: keep it
        roles = {}
    for section, named in (("weights", weights), ("extra", (extra or {}).items())):
        for name, tensor in named:
            role = roles.get(name) or default_role(section)
            if role.section != section:
                raise ValueError(f"{name}: a {role.role.value} tensor sent as {section}")
            yield role, name, tensor


def encode_chunks(
    version: int,
    weights: Iterable[tuple[str, torch.Tensor]],
    extra: Mapping[str, torch.Tensor] | None = None,
    roles: Mapping[str, TensorRole] | None = None,
    **options: Any,
) -> Iterator[list[bytes]]:
    """One `[header, payload]` message per chunk of about `chunk_bytes`, streamed from
    `weights` then `extra`, each tensor with its role in `roles`; `options` are
    `encode_tagged`'s. A tensor with an entry of its dtype and shape in `base` goes as a
    delta when smaller; `update_base` leaves this version in `base` (a sender keeps one copy).
    `stream` names the sender: one version never mixes chunks of two (a resumed learner)."""
    return encode_tagged(version, tag_sections(weights, extra, roles), **options)


class _Chunks:
    """The chunk `encode_tagged` is filling: its parts (each with its bytes, and where in
    `base` they also go or None), their tensors' entries and its size; one message each."""

    def __init__(self, header: dict[str, Any], chunk_bytes: int, share_base: bool):
        self.header = header  # the fields every chunk's header shares
        self.chunk_bytes, self.share_base = chunk_bytes, share_base
        self.pending: list[tuple[dict, memoryview, memoryview | None]] = []
        self.entries: dict[str, dict[str, Any]] = {}  # name -> its entry in this chunk
        self.size, self.index = 0, 0
        self.names: set[str] = set()  # every tensor of the version so far

    @property
    def full(self) -> bool:
        return self.size >= self.chunk_bytes

    def add(
        self, entry: dict[str, Any], part: dict[str, Any], data: memoryview, into: memoryview | None
    ) -> None:
        self.entries.setdefault(entry["name"], entry | {"parts": []})["parts"].append(part)
        self.pending.append((part, data, into))
        self.size += len(data)

    def add_full(
        self, entry: dict[str, Any], data: memoryview, kept: memoryview | None
    ) -> Iterator[list[bytes]]:
        """A whole tensor's bytes, cut where the chunk fills (yielding each chunk filled)."""
        at = 0
        while True:
            if self.full:
                yield self.flush()
            length = min(len(data) - at, self.chunk_bytes - self.size)
            self.add(
                entry | {"encoding": "full"},
                {"role": "data", "at": at, "length": length},
                data[at : at + length],
                None if kept is None else kept[at : at + length],
            )
            at += length
            if at >= len(data):
                return

    def flush(self) -> list[bytes]:
        """The chunk made of what is pending; the next one starts empty."""
        out = self.message(final=False)
        self.pending, self.entries, self.size = [], {}, 0
        self.index += 1
        return out

    def message(self, final: bool) -> list[bytes]:
        if self.share_base and len(self.pending) == 1 and self.pending[0][2] is not None:
            # One slice of one tensor: copied (and hashed, one pass) into the base only,
            # and sent from there.
            part, data, into = self.pending[0]
            part |= {"offset": 0, "checksum": copy_xxh3(data, into)}
            payload = into
        else:
            payload = aligned_empty(self.size)
            target = memoryview(payload)
            cursor = 0
            for part, data, into in self.pending:
                # One pass: the bytes are hashed from the registers they are copied from.
                written = target[cursor : cursor + len(data)]
                part |= {"offset": cursor, "checksum": copy_xxh3(data, written)}
                if into is not None and len(into):
                    into[:] = written
                cursor += len(data)
        header = self.header | {
            "chunk": self.index,
            "final": final,
            "payload_bytes": self.size,
            "tensors": list(self.entries.values()),
            "total_tensors": len(self.names) if final else None,
        }
        return [VERSION_TOPIC + seal(msgpack.packb(header, use_bin_type=True)), payload]


def _tensor_entry(
    role: TensorRole, name: str, tensor: torch.Tensor, version: int, names: set[str]
) -> dict[str, Any]:
    """A tensor's entry in its chunks' headers (refusing a dtype the wire lacks, and a
    name sent twice), its name added to `names`."""
    if dtype_name(tensor.dtype) is None:
        raise ValueError(f"{name}: dtype {tensor.dtype} cannot be sent")
    if name in names:
        raise ValueError(f"{name}: sent twice in version {version}")
    names.add(name)
    return {
        "name": name,
        **role.wire(),
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "result_checksum": None,  # a full tensor's parts each have theirs
    }


def _delta_part(delta: Delta) -> dict[str, Any]:
    return {
        "role": "delta",
        "length": len(delta.blob),
        "changes": delta.changes,
        "escapes": delta.escapes,
        "gap_bytes": delta.gap_bytes,
        "raw_bytes": delta.raw_bytes,
    }


def encode_tagged(
    version: int,
    tagged: Tagged,
    base: dict[str, torch.Tensor] | None = None,
    base_version: int | None = None,
    policy: str = "",
    engine_config: Mapping[str, Any] | None = None,
    chunk_bytes: int = 4 << 20,
    update_base: bool = False,
    stream: str = "",
    zstd_level: int = 1,
    share_base: bool = False,
) -> Iterator[list[bytes]]:
    """`encode_chunks` over (role, name, tensor) triples. With `update_base`, a tensor
    that goes whole is copied into `base` and into its message in one pass (read once).
    With `share_base` too, a chunk that is one slice of one such tensor is not copied a
    second time: its payload frame is a view of `base` (the caller must then keep `base`
    from changing until ZeroMQ has sent those frames: `VersionPublisher` tracks them)."""
    chunk_bytes = max(1, chunk_bytes)
    header = {
        "format": FORMAT_VERSION,
        "kind": "version",
        "version": version,
        "stream": stream,
        "base_version": base_version,
        "policy": policy,
        "engine_config": dict(engine_config or {}),
    }
    chunks = _Chunks(header, chunk_bytes, share_base)
    cut = False  # the last tensor spanned chunks: whatever comes next starts a new one
    for role, name, tensor in tagged:
        tensor = tensor.detach().contiguous()
        entry = _tensor_entry(role, name, tensor, version, chunks.names)
        old = None if base is None else base.get(name)
        delta, keep = None, None  # keep: the base tensor a whole tensor is also copied into
        if old is not None and old.dtype == tensor.dtype and old.shape == tensor.shape:
            delta = encode_delta(
                tensor, old, zstd_level, update_base=update_base, defer_whole=update_base
            )
            if delta is not None:
                entry["result_checksum"] = checksum(tensor)
            elif update_base:
                keep = old
        elif update_base and base is not None:
            keep = base[name] = torch.empty(tensor.shape, dtype=tensor.dtype)
        data = memoryview(delta.blob) if delta is not None else byte_view(tensor)
        # A full tensor that does not fit in the room left starts a chunk, and one that
        # spans chunks ends its last one: each part of it is then a chunk of its own,
        # which the receiver takes straight into its tensor (`recv_into`) and the
        # publisher sends from its base, with no copy through a scratch or message buffer.
        spans = delta is None and len(data) > chunk_bytes
        if chunks.size and (
            cut or spans or (delta is None and chunks.size + len(data) > chunk_bytes)
        ):
            yield chunks.flush()
        cut = spans
        if delta is not None:
            chunks.add(entry | {"encoding": "delta"}, _delta_part(delta), data, None)
        else:
            yield from chunks.add_full(entry, data, None if keep is None else byte_view(keep))
        if chunks.full:
            yield chunks.flush()
    yield chunks.message(final=True)


def encode_version(
    version: int,
    weights: Iterable[tuple[str, torch.Tensor]],
    extra: Mapping[str, torch.Tensor] | None = None,
    **kwargs,
) -> list[list[bytes]]:
    """All chunk messages of a version (see `encode_chunks` for the arguments)."""
    return list(encode_chunks(version, weights, extra, **kwargs))
