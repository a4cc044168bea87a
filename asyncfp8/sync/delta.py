"""Lossless deltas between two versions of a tensor, near their entropy floor (docs/sync.md).

Per changed element: the gap since the previous change (LEB128 varint) and the bits' signed
difference in one byte, or an escape and the new bits whole; zstd on top. numba and zstandard
load on the first delta (docs/sync.md, 'imported late'); without numba, `_*_numpy` do the same.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from .copyhash import copy_xxh3
from .limits import RejectedMessage

ESCAPE = -128
WORD_VIEWS = {1: np.uint8, 2: np.uint16, 4: np.uint32}
PROBE = 1 << 14  # elements sampled to tell a rewritten tensor from an updated one
VARINT_MAX_BYTES = 9  # the decoder reads gaps of at most 63 bits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    """A compressed delta and what its decoder needs to check it."""

    blob: bytes
    changes: int  # elements that changed
    escapes: int  # of them, changes that did not fit in one byte
    gap_bytes: int  # length of the varint gap stream
    raw_bytes: int  # length of the three streams before compression


def element_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a flat unsigned array of 1-, 2- or 4-byte elements (a view)."""
    flat = tensor.detach().reshape(-1)
    size = flat.element_size()
    width = size if size in WORD_VIEWS else 4
    raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    return raw.view(WORD_VIEWS[width])


def _scan(new, base, words_new, words_base, escapes, deltas, gaps, budget, update_base):
    """Writes the three streams; returns (changes, escapes, gap bytes), or changes = -1
    as soon as they would exceed `budget` bytes (the tensor is then cheaper whole)."""
    width = new.itemsize
    per_word = 8 // width
    n = new.size
    changes = 0
    n_escapes = 0
    g = 0
    previous = -1
    bound = 1 << (8 * width)
    half = bound >> 1
    for k in range(words_new.size + 1):
        if k < words_new.size:
            if words_new[k] == words_base[k]:
                continue
            start, stop = k * per_word, (k + 1) * per_word
        else:  # the tail that does not fill a word
            start, stop = words_new.size * per_word, n
        for i in range(start, stop):
            a = np.int64(new[i])
            b = np.int64(base[i])
            if a == b:
                continue
            d = (a - b) % bound
            if d >= half:
                d -= bound
            gap = i - previous - 1
            previous = i
            while gap >= 128:
                gaps[g] = (gap & 127) | 128
                gap >>= 7
                g += 1
            gaps[g] = gap
            g += 1
            if -127 <= d <= 127:
                deltas[changes] = d
            else:
                deltas[changes] = ESCAPE
                escapes[n_escapes] = new[i]
                n_escapes += 1
            changes += 1
            if g + changes + n_escapes * width > budget:
                return -1, 0, 0
        if update_base:  # after the word's elements were compared with the old bits
            for i in range(start, stop):
                base[i] = new[i]
    return changes, n_escapes, g


def _apply(out, escapes, deltas, gaps):
    """Applies the streams to `out` (a copy of the base) in place; False if they are
    inconsistent with each other or with `out` (every read and write is bounds-checked:
    the streams come from the network)."""
    width = out.itemsize
    bound = 1 << (8 * width)
    n = out.size
    position = -1
    g = 0
    e = 0
    for c in range(deltas.size):
        gap = 0
        shift = 0
        while True:
            if g >= gaps.size or shift > 56:
                return False
            byte = np.int64(gaps[g])
            g += 1
            gap |= (byte & 127) << shift
            if byte < 128:
                break
            shift += 7
        position += gap + 1
        if position >= n:
            return False
        d = np.int64(deltas[c])
        if d == ESCAPE:
            if e >= escapes.size:
                return False
            out[position] = escapes[e]
            e += 1
        else:
            out[position] = (np.int64(out[position]) + d) % bound
    return g == gaps.size and e == escapes.size


def _sample(new, base, stride):
    """(elements that differ, of them those whose change does not fit in a byte,
    elements looked at) over every `stride`-th element of the two."""
    bound = 1 << (8 * new.itemsize)
    half = bound >> 1
    changed = 0
    escaped = 0
    count = 0
    for i in range(0, new.size, stride):
        count += 1
        a = np.int64(new[i])
        b = np.int64(base[i])
        if a == b:
            continue
        changed += 1
        d = (a - b) % bound
        if d >= half:
            d -= bound
        if d > 127 or d < -127:
            escaped += 1
    return changed, escaped, count


def _signed_steps(new: np.ndarray, base: np.ndarray) -> np.ndarray:
    """new - base per element as the signed difference of their bits (int64), wrapped
    into [-bound/2, bound/2) as the loops compute it."""
    bound = 1 << (8 * new.itemsize)
    d = (new.astype(np.int64) - base.astype(np.int64)) % bound
    return np.where(d >= bound >> 1, d - bound, d)


def _varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes of each value's LEB128 varint (7 bits a byte, at least one)."""
    lengths = np.ones(values.shape, dtype=np.int64)
    for shift in range(7, 64, 7):
        lengths += values >= (1 << shift)
    return lengths


def _scan_numpy(new, base, words_new, words_base, escapes, deltas, gaps, budget, update_base):
    """`_scan` with numpy (where numba is missing): the same streams and results (the
    budget is checked on the totals: they only grow, so the answer is the loop's)."""
    changed = np.flatnonzero(new != base)
    steps = _signed_steps(new[changed], base[changed])
    small = (steps >= -127) & (steps <= 127)
    gap_values = np.diff(changed, prepend=-1) - 1
    lengths = _varint_lengths(gap_values)
    n_changes, gap_bytes = changed.size, int(lengths.sum())
    n_escapes = int(np.count_nonzero(~small))
    if update_base:
        np.copyto(base, new)
    if gap_bytes + n_changes + n_escapes * new.itemsize > budget:
        return -1, 0, 0
    deltas[:n_changes] = np.where(small, steps, ESCAPE)
    escapes[:n_escapes] = new[changed[~small]]
    starts = np.cumsum(lengths) - lengths
    for byte in range(int(lengths.max(initial=0))):
        has = lengths > byte
        more = (lengths > byte + 1)[has]
        part = (gap_values[has] >> (7 * byte)) & 127
        gaps[starts[has] + byte] = part | np.where(more, 128, 0)
    return n_changes, n_escapes, gap_bytes


def _apply_numpy(out, escapes, deltas, gaps):
    """`_apply` with numpy (where numba is missing): the same checks and, when they pass,
    the same result."""
    bound = 1 << (8 * out.itemsize)
    ends = np.flatnonzero(gaps < 128)  # the last byte of each varint
    if ends.size != deltas.size or (gaps.size and (not ends.size or ends[-1] != gaps.size - 1)):
        return False
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    lengths = ends - starts + 1
    if lengths.size and lengths.max() > VARINT_MAX_BYTES:
        return False
    gap_values = np.zeros(deltas.size, dtype=np.int64)
    for byte in range(int(lengths.max(initial=0))):
        has = lengths > byte
        gap_values[has] |= (gaps[starts[has] + byte].astype(np.int64) & 127) << (7 * byte)
    if gap_values.size and gap_values.max() >= out.size:
        return False
    positions = np.cumsum(gap_values + 1) - 1  # increasing: the last one is the largest
    if positions.size and positions[-1] >= out.size:
        return False
    escaped = deltas == ESCAPE
    if np.count_nonzero(escaped) != escapes.size:
        return False
    out[positions[escaped]] = escapes
    stepped = positions[~escaped]
    moved = (out[stepped].astype(np.int64) + deltas[~escaped].astype(np.int64)) % bound
    out[stepped] = moved.astype(out.dtype)
    return True


def _sample_numpy(new, base, stride):
    """`_sample` with numpy."""
    steps = _signed_steps(new[::stride], base[::stride])
    changed = int(np.count_nonzero(steps))
    escaped = int(np.count_nonzero((steps > 127) | (steps < -127)))
    return changed, escaped, steps.size


@functools.cache
def _compiled():
    """(scan, apply, sample), compiled by numba on first use (see the module's
    docstring); their numpy twins where numba is not installed."""
    try:
        import numba
    except ImportError as err:
        log.info("weight deltas: %s; scanning with numpy (slower, the same streams)", err)
        return _scan_numpy, _apply_numpy, _sample_numpy
    jit = numba.njit(cache=True, nogil=True)
    return jit(_scan), jit(_apply), jit(_sample)


def copy_bits(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target[:] = source` for tensors of one dtype and size, through numpy: torch's
    `copy_` costs milliseconds per call on CPU tensors of a few MB here (it wakes its
    thread pool), 10-50x numpy's memcpy, and a model has hundreds of such tensors."""
    np.copyto(element_view(target), element_view(source.contiguous()))


def copy_whole(target: torch.Tensor, source: torch.Tensor) -> None:
    """`copy_bits` in one pass with non-temporal stores (`copy_xxh3`, its digest unused):
    numpy's copy of a tensor of a few MB writes with ordinary stores, ~6.8 GB/s here
    against ~12 (a publisher keeping its base for the next delta copies the whole model)."""
    source_bytes = memoryview(element_view(source.contiguous())).cast("B")
    copy_xxh3(source_bytes, memoryview(element_view(target)).cast("B"))


def clearly_whole(new: np.ndarray, base: np.ndarray) -> bool:
    """Whether a strided sample says the delta's raw streams would exceed the tensor
    (fresh weights, a new layer): then the tensor goes whole without a full scan. A numba
    loop counts the sample (numpy's temporaries cost ~0.3 ms a tensor);
    `_clearly_whole_numpy` is the same decision in numpy, which the tests hold it to."""
    if not new.size:
        return False
    _, _, sample = _compiled()
    changed, escaped, count = sample(new, base, max(1, new.size // PROBE))
    return 2 * (changed / count) + new.itemsize * (escaped / count) > new.itemsize


def _clearly_whole_numpy(new: np.ndarray, base: np.ndarray) -> bool:
    """`clearly_whole` in numpy (the reference the tests compare it with)."""
    if not new.size:
        return False
    changed, escaped, count = _sample_numpy(new, base, max(1, new.size // PROBE))
    return 2 * (changed / count) + new.itemsize * (escaped / count) > new.itemsize


def encode_delta(
    new: torch.Tensor,
    base: torch.Tensor,
    level: int = 1,
    update_base: bool = False,
    defer_whole: bool = False,
) -> Delta | None:
    """The delta turning `base` into `new` (same dtype and shape), or None when sending
    `new` whole is no larger. With `update_base`, `base` holds `new`'s bits afterwards (a
    publisher keeps one copy of the model); with `defer_whole` too, a None result leaves
    that copy to the caller (`base` may hold a mix of old and new bits meanwhile), which
    makes it while it copies `new` into its message: one read of `new` for both."""
    if new.dtype != base.dtype or new.shape != base.shape:
        raise ValueError(
            f"delta between {new.dtype}{list(new.shape)} and {base.dtype}{list(base.shape)}"
        )
    full = new.numel() * new.element_size()
    a, b = element_view(new.contiguous()), element_view(base)
    whole_words = (a.size * a.itemsize) // 8
    words_a = a[: whole_words * 8 // a.itemsize].view(np.uint64)
    words_b = b[: whole_words * 8 // b.itemsize].view(np.uint64)
    if clearly_whole(a, b):
        if update_base and not defer_whole:
            copy_whole(base, new)
        return None
    escapes = np.empty(a.size, dtype=a.dtype)
    deltas = np.empty(a.size, dtype=np.int8)
    gaps = np.empty(full + 16, dtype=np.uint8)
    scan, _, _ = _compiled()
    changes, n_escapes, gap_bytes = scan(
        a, b, words_a, words_b, escapes, deltas, gaps, full, update_base
    )
    if changes < 0:
        if update_base and not defer_whole:
            copy_whole(base, new)
        return None
    streams = b"".join(
        (escapes[:n_escapes].tobytes(), deltas[:changes].tobytes(), gaps[:gap_bytes].tobytes())
    )
    import zstandard

    blob = zstandard.ZstdCompressor(level=level).compress(streams)
    if len(blob) >= full:
        return None
    return Delta(blob, changes, n_escapes, gap_bytes, len(streams))


def apply_delta(
    base: torch.Tensor,
    blob: memoryview | bytes,
    changes: int,
    escapes: int,
    gap_bytes: int,
    raw_bytes: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`base` with the delta applied, written into `out` (a fresh tensor if None; never
    `base` itself); RejectedMessage if the delta is malformed or does not fit `base`."""
    values = element_view(base)
    width = values.itemsize
    if not (
        0 <= escapes <= changes <= values.size
        and gap_bytes >= 0
        and raw_bytes == escapes * width + changes + gap_bytes
    ):
        raise RejectedMessage("delta sizes do not add up or exceed the tensor")
    import zstandard

    try:
        streams = zstandard.ZstdDecompressor().decompress(bytes(blob), max_output_size=raw_bytes)
    except zstandard.ZstdError as err:
        raise RejectedMessage(f"delta does not decompress: {err}") from None
    if len(streams) != raw_bytes:
        raise RejectedMessage(f"delta decompresses to {len(streams)} bytes, {raw_bytes} declared")
    raw = np.frombuffer(streams, dtype=np.uint8)
    esc = raw[: escapes * width].view(values.dtype)
    deltas = raw[escapes * width : escapes * width + changes].view(np.int8)
    gaps = raw[escapes * width + changes :]
    if out is None:
        out = torch.empty_like(base)
    copy_bits(out, base)
    _, apply, _ = _compiled()
    if not apply(element_view(out), esc, deltas, gaps):
        raise RejectedMessage("delta indices fall outside the tensor or its streams disagree")
    return out
