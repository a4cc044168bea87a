"""`make test` runs the suite on two pytest processes (tests/parallel.py): tests that share
a module fixture stay on one process, so it is built once, and the tests marked vllm run
first on theirs. Checked on a small suite of its own, run as make test runs the real one,
with a control run that leaves the groups out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CONFTEST = """
import os

pytest_plugins = ["tests.parallel"] if os.environ.get("GROUPED") == "1" else []


def record(line):
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {line}\\n")
"""

SHARING = """
import pytest
from conftest import record

@pytest.fixture(scope="module")
def built():
    record("built")

@pytest.mark.parametrize("i", range(6))
def test_shares(built, i):
    record(f"shares{i}")
"""

PLAIN = """
import pytest
from conftest import record

@pytest.mark.slow
@pytest.mark.parametrize("i", range(6))
def test_plain(i):
    record(f"plain{i}")

@pytest.mark.vllm
@pytest.mark.parametrize("i", range(3))
def test_engine(i):
    record(f"vllm{i}")
"""


def run_suite(pytester, monkeypatch, grouped: bool) -> list[tuple[str, str]]:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_a_sharing=SHARING, test_b_plain=PLAIN)
    pytester.makeini("[pytest]\nmarkers =\n  slow\n  vllm\n")
    record = pytester.path / f"record-{grouped}.txt"
    env = {"RECORD": str(record), "GROUPED": "1" if grouped else "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=15)
    return [tuple(line.split()) for line in record.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "control"])
def test_a_module_fixture_is_built_once_and_vllm_tests_run_first(pytester, monkeypatch, grouped):
    pytest.importorskip("xdist")
    lines = run_suite(pytester, monkeypatch, grouped)
    builds = [worker for worker, what in lines if what == "built"]
    workers_sharing = {worker for worker, what in lines if what.startswith("shares")}
    if grouped:
        assert len(builds) == 1 and len(workers_sharing) == 1, lines
        # the vllm tests all ran on one process, before anything else ran there
        (engine_worker,) = {worker for worker, what in lines if what.startswith("vllm")}
        on_it = [what for worker, what in lines if worker == engine_worker]
        assert on_it[:3] == ["vllm0", "vllm1", "vllm2"], lines
        # on each process the slow tests ran before the fast ones
        for worker in {worker for worker, _ in lines}:
            kinds = [what.rstrip("0123456789") for w, what in lines if w == worker]
            kinds = [kind for kind in kinds if kind in ("plain", "shares")]
            assert kinds == sorted(kinds), lines
    else:
        # without the groups xdist hands the sharing tests to both processes
        assert len(builds) == 2 and len(workers_sharing) == 2, lines
