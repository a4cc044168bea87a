"""Copy and checksum in one pass: `copy_xxh3(source, target)` copies the bytes and returns
their XXH3-64 (as `xxhash.xxh3_64_intdigest`), reading each byte once (docs/sync.md).

numba is imported on the first call, not with this module (see `delta.py`). Inputs of 240
bytes or less, and all inputs where numba is missing, are copied then hashed with xxhash.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import xxhash

SHORT = 240  # XXH3's long-input path starts above this

log = logging.getLogger(__name__)


@functools.cache
def _kernel():
    """The numba kernel and its constants, or None without numba."""
    try:
        from . import _xxh3_jit
    except ImportError as err:
        log.info("copy_xxh3: %s; copying, then hashing with xxhash (two reads)", err)
        return None

    secret = np.frombuffer(_SECRET, dtype=np.uint8)
    keys = secret.view(np.uint64).copy()  # stripe s: words s..s+7; the scramble: 16..23
    last = secret[121 : 121 + 64].copy().view(np.uint64)  # secret size - 64 - 7
    merge = secret[11 : 11 + 64].copy().view(np.uint64)
    return _xxh3_jit.copy_xxh3_long, keys, last, merge


def _array(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8)


def copy_xxh3(source: memoryview, target: memoryview | None) -> int:
    """Copies `source` into `target` (same length; None: only hashes) and returns the
    XXH3-64 of the bytes, read once. The GIL is released while it runs."""
    src = _array(source)
    n = src.size
    if target is not None and len(target) != n:
        raise ValueError(f"copy of {n} bytes into {len(target)}")
    kernel = _kernel() if n > SHORT else None  # numba is not loaded for short inputs
    if kernel is None:
        if target is not None and n:
            target[:] = source
        return xxhash.xxh3_64_intdigest(source)
    kernel, keys, last, merge = kernel
    words = n // 8 * 8
    src64 = src[:words].view(np.uint64)
    if target is None:
        return int(kernel(src, src, src64, src64, keys, last, merge, 2))
    dst = _array(target)
    dst64 = dst[:words].view(np.uint64)
    mode = 0 if dst.ctypes.data % 64 == 0 else 1
    return int(kernel(src, dst, src64, dst64, keys, last, merge, mode))


# XXH3's default secret (xxhash.h, XXH3_kSecret).
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
