"""The GPU machine stood in for on the CPU: with only its packages importable (the lists
in tests/gpu_machine.py, from ../shared/gpu/README.md), everything bench/gpu.sh and
`pytest -m gpu` load there loads, and the weight-sync paths work without numba."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_machine import machine_env

REPO = Path(__file__).resolve().parent.parent


def test_the_stand_in_hides_what_the_gpu_machine_lacks_and_keeps_what_it_has():
    code = """
import importlib.metadata, importlib.util, sys
for name in ("numba", "llvmlite", "vllm"):
    assert importlib.util.find_spec(name) is None, name
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(name + " imported")
try:
    importlib.metadata.version("numba")
except importlib.metadata.PackageNotFoundError:
    pass
else:
    raise AssertionError("numba's metadata is visible")
import json, sqlite3, zmq, zstandard, hydra, omegaconf, msgpack, xxhash, safetensors, yaml
import asyncfp8
assert asyncfp8.__file__.startswith(sys.argv[1]), asyncfp8.__file__
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code, str(REPO)],
        env=machine_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


@pytest.mark.slow
def test_what_the_gpu_runs_loads_and_syncs_with_the_gpu_machines_packages():
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "gpu_machine_check.py")],
        env=machine_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith("0 failures")
