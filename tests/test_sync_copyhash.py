"""copy_xxh3 (asyncfp8/sync/copyhash.py): the fused copy + XXH3-64 that the shared-memory
path uses on both sides must copy every byte and give exactly xxhash's digest, for every
length (XXH3's short paths, partial blocks, partial stripes, a tail of less than a word)
and alignment (non-temporal stores for a 64-byte aligned target, ordinary ones else)."""

import sys

import numpy as np
import pytest
import torch
import xxhash

from asyncfp8.sync.copyhash import copy_xxh3

LENGTHS = [0, 1, 3, 16, 17, 128, 129, 240, 241, 255, 256, 1023, 1024, 1025, 1087, 1088]
LENGTHS += [2047, 2048, 2049, 4096 + 7, 3 * 1024 + 64 * 5 + 13, 65536, (1 << 20) + 3]


def aligned(n: int, misalign: int = 0) -> np.ndarray:
    raw = np.zeros(n + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + misalign
    return raw[start : start + n]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("target_misalign", [0, 8, 3])
def test_copies_every_byte_and_matches_xxhash(n, target_misalign):
    rng = np.random.default_rng(n)
    source = aligned(n, misalign=(n % 7))
    source[:] = rng.integers(0, 256, n, dtype=np.uint8)
    target = aligned(n, target_misalign)
    target[:] = 0xA5
    digest = copy_xxh3(memoryview(source), memoryview(target))
    assert digest == xxhash.xxh3_64_intdigest(source)
    assert target.tobytes() == source.tobytes()
    assert copy_xxh3(memoryview(source), None) == digest


@pytest.mark.parametrize("n", [241, 1024, 1025, 5000, 70001])
def test_one_flipped_bit_anywhere_changes_the_digest(n):
    """What the receiver relies on: a corrupted byte in any part of a tensor (first block,
    the partial last block, the last stripe, the tail) fails its checksum."""
    rng = np.random.default_rng(1)
    source = rng.integers(0, 256, n, dtype=np.uint8)
    good = copy_xxh3(memoryview(source), None)
    for at in sorted({0, 63, 64, 1023, n // 2, n - 65, n - 64, n - 9, n - 1} & set(range(n))):
        spoiled = source.copy()
        spoiled[at] ^= 0x01
        target = np.empty_like(spoiled)
        digest = copy_xxh3(memoryview(spoiled), memoryview(target))
        assert digest != good and digest == xxhash.xxh3_64_intdigest(spoiled), at


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8, torch.float64]
)
def test_tensors_round_trip_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    tensor = (torch.randn(333, 129, generator=g) * 3).to(dtype)
    tensor.view(torch.uint8).reshape(-1)[:8] = torch.tensor([0x80, 0xFF, 0x7F, 0, 1, 2, 3, 4])
    out = torch.empty_like(tensor)
    source = memoryview(tensor.view(torch.uint8).reshape(-1).numpy())
    digest = copy_xxh3(source, memoryview(out.view(torch.uint8).reshape(-1).numpy()))
    assert digest == xxhash.xxh3_64_intdigest(source)
    assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))


def test_a_target_of_another_length_is_refused():
    with pytest.raises(ValueError):
        copy_xxh3(memoryview(bytes(300)), memoryview(bytearray(299)))


@pytest.fixture
def without_numba(monkeypatch):
    """copyhash as where numba is not installed (the GPU machine): its kernel's module
    does not import."""
    import asyncfp8.sync
    import asyncfp8.sync.copyhash as copyhash

    copyhash._kernel.cache_clear()
    monkeypatch.setitem(sys.modules, "asyncfp8.sync._xxh3_jit", None)  # import raises
    monkeypatch.delattr(asyncfp8.sync, "_xxh3_jit", raising=False)  # a kernel loaded before
    yield
    copyhash._kernel.cache_clear()


@pytest.mark.parametrize("n", [0, 240, 241, 4096 + 7, 70001])
def test_without_numba_it_copies_and_gives_the_same_digest(without_numba, n):
    import asyncfp8.sync.copyhash as copyhash

    rng = np.random.default_rng(n)
    source = rng.integers(0, 256, n, dtype=np.uint8)
    target = np.zeros_like(source)
    digest = copy_xxh3(memoryview(source), memoryview(target))
    assert digest == xxhash.xxh3_64_intdigest(source)
    assert target.tobytes() == source.tobytes()
    assert copy_xxh3(memoryview(source), None) == digest
    assert n <= 240 or copyhash._kernel() is None  # the fallback, not the kernel, ran
