"""Run with only the GPU machine's packages importable (tests/test_gpu_machine.py runs it
in a subprocess under `tests.gpu_machine.machine_env()`): what bench/gpu.sh and
`pytest -m gpu` load there must load, and the weight-sync paths they use must work.

    python tests/gpu_machine_check.py

Loads every asyncfp8 module, every test module (pytest collects them all for `-m gpu`)
and every bench script bench/gpu.sh runs; then encodes a version as a delta against a
base and decodes it (the zstd streams, the delta scan, the xxh3 checksums of the copy)
and copies and hashes bytes as the shared-memory path does. Prints one line per failure
and exits 1 if there is any.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import re
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Loaded only where numba is installed (copyhash falls back without it).
NEEDS_NUMBA = {"asyncfp8.sync._xxh3_jit"}


def asyncfp8_modules() -> list[str]:
    import asyncfp8

    names = [asyncfp8.__name__]
    for info in pkgutil.walk_packages(asyncfp8.__path__, "asyncfp8."):
        if info.name.rpartition(".")[2] != "__main__" and info.name not in NEEDS_NUMBA:
            names.append(info.name)
    return names


def test_modules() -> list[str]:
    files = [REPO / "tests" / "conftest.py", *sorted((REPO / "tests").rglob("test_*.py"))]
    return [".".join(f.relative_to(REPO).with_suffix("").parts) for f in files]


def bench_scripts() -> list[str]:
    """The bench scripts bench/gpu.sh runs (and `common`, which they share)."""
    script = (REPO / "bench" / "gpu.sh").read_text()
    return sorted({"common", *re.findall(r"\bbench/(\w+)\.py\b", script)})


def delta_round_trip() -> None:
    """A version encoded as a delta against its base and decoded: the delta scan, zstd."""
    import torch

    from asyncfp8.sync import decode_version, encode_version

    generator = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(256, 256, generator=generator).to(torch.bfloat16)}
    new = base["w"].clone()
    new.view(torch.int16).view(-1)[::50] += 1  # a few elements one ULP up: a small update
    messages = encode_version(1, [("w", new)], {}, base=base, base_version=0)
    if not any(b"delta" in frame for frames in messages for frame in frames[:1]):
        raise AssertionError("the update was not sent as a delta")
    version = decode_version(messages, base=base, base_version=0)
    if not torch.equal(version.weights["w"].view(torch.int16), new.view(torch.int16)):
        raise AssertionError("the delta round trip changed the tensor")


def full_round_trip() -> None:
    """A whole version, each part copied and checksummed (xxh3) on both sides."""
    import torch

    from asyncfp8.sync import decode_version, encode_version

    weights = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    version = decode_version(encode_version(2, weights.items(), {}))
    if not torch.equal(version.weights["w"], weights["w"]):
        raise AssertionError("the full-version round trip changed the tensor")


def shared_memory_copy() -> None:
    """The copy-and-hash of the shared-memory path (more than XXH3's 240-byte short path)."""
    import xxhash

    from asyncfp8.sync.copyhash import copy_xxh3

    source = bytes(range(256)) * 40
    target = bytearray(len(source))
    if copy_xxh3(memoryview(source), memoryview(target)) != xxhash.xxh3_64_intdigest(source):
        raise AssertionError("copy_xxh3's digest is not XXH3-64's")
    if bytes(target) != source:
        raise AssertionError("copy_xxh3 did not copy")


def import_test_module(name: str) -> None:
    """A test module as pytest collects it: one that skips itself at import for want of
    an extra the GPU machine lacks (ray, say) is collected as skipped, not an error."""
    from _pytest.outcomes import Skipped

    with contextlib.suppress(Skipped):
        importlib.import_module(name)


def main() -> int:
    failures: list[str] = []

    def attempt(what: str, action) -> None:
        try:
            action()
        except BaseException as err:  # even a module that exits: reported, and on to the next
            last = traceback.extract_tb(err.__traceback__)[-1]
            failures.append(f"{what}: {type(err).__name__}: {err} ({last.filename}:{last.lineno})")

    sys.path.insert(0, str(REPO))
    for name in asyncfp8_modules():
        attempt(name, lambda name=name: importlib.import_module(name))
    for name in test_modules():
        attempt(name, lambda name=name: import_test_module(name))
    sys.path.insert(0, str(REPO / "bench"))
    for name in bench_scripts():
        attempt(f"bench/{name}.py", lambda name=name: importlib.import_module(name))
    for check in (delta_round_trip, full_round_trip, shared_memory_copy):
        attempt(check.__name__, check)
    loaded = sorted({"numba", "llvmlite", "vllm"} & set(sys.modules))
    if loaded:
        failures.append(f"loaded what the GPU machine lacks: {loaded}")
    for line in failures:
        print(line)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
