"""The suite's time budget (tests/budget.py): over it, pytest fails naming the slowest
tests; a test over the fast limit without the slow mark is named; a budget that is not
a positive number is refused before any test runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.budget import budget_s

REPO = Path(__file__).resolve().parents[1]

TESTS = """
import time
import pytest

def test_quick():
    pass

def test_sleepy():
    time.sleep(0.4)

@pytest.mark.slow
def test_marked():
    time.sleep(0.4)
"""


def run_pytest(tmp_path, budget, *args):
    (tmp_path / "test_sample.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  slow: slow\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "ASYNCFP8_TEST_BUDGET_S": budget}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.budget", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_over_budget_fails_naming_the_slowest_and_the_unmarked_slow_tests(tmp_path):
    (tmp_path / "conftest.py").write_text("import tests.budget as b\nb.FAST_LIMIT_S = 0.2\n")
    done = run_pytest(tmp_path, "0.2")
    assert done.returncode == 1, done.stdout
    assert "3 passed" in done.stdout
    unmarked, slowest = done.stdout.split("without the slow mark")[1].split("OVER BUDGET")
    assert "test_sample.py::test_sleepy" in unmarked
    assert "test_marked" not in unmarked and "test_quick" not in unmarked
    assert "test_sample.py::test_sleepy" in slowest and "test_sample.py::test_marked" in slowest


def test_a_suite_within_its_budget_passes_and_says_its_time(tmp_path):
    done = run_pytest(tmp_path, "600")
    assert done.returncode == 0, done.stdout
    assert "the suite took" in done.stdout and "budget 600 s" in done.stdout
    assert "OVER BUDGET" not in done.stdout and "without the slow mark" not in done.stdout


def test_a_budget_that_is_not_a_positive_number_is_refused(tmp_path, monkeypatch):
    done = run_pytest(tmp_path, "soon")
    assert done.returncode == 4, done.stdout + done.stderr
    assert "ASYNCFP8_TEST_BUDGET_S='soon': expected a positive number" in done.stderr
    for bad in ("-5", "0", "nan"):
        monkeypatch.setenv("ASYNCFP8_TEST_BUDGET_S", bad)
        with pytest.raises(pytest.UsageError, match="positive number"):
            budget_s()
    monkeypatch.setenv("ASYNCFP8_TEST_BUDGET_S", "1500")
    assert budget_s() == 1500
