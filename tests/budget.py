"""The suite's time budget, defended at every run: a pytest plugin (loaded by
tests/conftest.py) that sums each test's setup, call and teardown time and, at the end,

- with `ASYNCFP8_TEST_BUDGET_S` set (CI sets it: .ci/run, docs/testing.md),
  fails the session when the whole run took longer, naming its slowest tests;
- lists every test not marked `slow` that took more than `FAST_LIMIT_S`, since `make
  test-fast` (`-m "not slow"`) is the inner loop and must stay within 3 minutes.

docs/testing.md says how to keep a new test cheap."""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

BUDGET_ENV = "ASYNCFP8_TEST_BUDGET_S"
# A test over this is slow: mark it (`@pytest.mark.slow`) so make test-fast skips it.
FAST_LIMIT_S = 5.0
SLOWEST_SHOWN = 25


def budget_s() -> float | None:
    """The budget from the environment, or None; a value that is not a positive number
    is refused before any test runs."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise pytest.UsageError(f"{BUDGET_ENV}={raw!r}: expected a positive number of seconds")
    return value


class SuiteBudget:
    def __init__(self, budget: float | None):
        self.budget = budget
        self.started = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)
        self.unmarked: set[str] = set()
        self.over_budget = False

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration
        if "slow" not in report.keywords:
            self.unmarked.add(report.nodeid)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def slowest(self, count: int) -> list[tuple[str, float]]:
        return sorted(self.seconds.items(), key=lambda kv: -kv[1])[:count]

    def pytest_sessionfinish(self, session, exitstatus):
        if self.budget is not None and self.elapsed() > self.budget:
            self.over_budget = True
            if exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        write = terminalreporter.write_line
        elapsed = self.elapsed()
        unmarked = [
            (nodeid, s)
            for nodeid, s in self.slowest(len(self.seconds))
            if nodeid in self.unmarked and s > FAST_LIMIT_S
        ]
        if unmarked:
            terminalreporter.section("tests over the fast limit without the slow mark")
            write(
                f"{len(unmarked)} test(s) took more than {FAST_LIMIT_S:.0f} s and are not "
                "marked slow (make test-fast runs them): mark them or make them cheaper"
            )
            for nodeid, s in unmarked:
                write(f"  {s:7.1f} s  {nodeid}")
        terminalreporter.section("suite time")
        shown = f"; budget {self.budget:.0f} s ({BUDGET_ENV})" if self.budget else ""
        write(f"the suite took {elapsed:.0f} s ({elapsed / 60:.1f} min){shown}")
        if self.over_budget:
            write(
                f"OVER BUDGET: {elapsed:.0f} s > {self.budget:.0f} s. The "
                f"{SLOWEST_SHOWN} slowest tests (setup + call + teardown):",
                red=True,
                bold=True,
            )
            for nodeid, s in self.slowest(SLOWEST_SHOWN):
                write(f"  {s:7.1f} s  {nodeid}", red=True)
            write("docs/testing.md says how to make a test cheaper or move a soak to bench/.")


def pytest_configure(config):
    config.pluginmanager.register(SuiteBudget(budget_s()), "asyncfp8-suite-budget")
