"""What every fault scenario shares (asyncfp8/chaos/scenarios.py, learner_kills.py,
refit_scenarios.py): the `FaultReport` a scenario returns (what was injected, what was
lost, how long recovery took, every check with what it saw), the audit that fills it,
and the waits and kills the scenarios are made of."""

from __future__ import annotations

import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncfp8.learner.ledger import read_ledger
from asyncfp8.run.files import LATEST_VERSION_FILE

from .audit import Audit, audit
from .cluster import Cluster

GROUP_SIZE = 4  # the cluster's run.group_size
PREEMPTED = 128 + signal.SIGTERM  # the learner's exit code after a SIGTERM checkpoint
# A run that goes on until the scenario stops it (SIGTERM: the learner checkpoints then).
OPEN_ENDED = ("run.steps=100000", "run.checkpoint_every=100000")


@dataclass
class FaultReport:
    fault: str
    injected: int
    lost: int = 0
    recovery_s: list[float] = field(default_factory=list)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, seen: Any = "") -> None:
        self.checks.append((name, bool(ok), str(seen)))

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.checks) and self.lost == 0

    def failures(self) -> str:
        failed = [f"- {name}: {seen}" for name, ok, seen in self.checks if not ok]
        return "\n".join([f"{self.fault}: lost {self.lost}", *failed])

    def row(self) -> dict[str, Any]:
        recovery = self.recovery_s
        return {
            "fault": self.fault,
            "injected": self.injected,
            "lost": self.lost,
            "recovery_median_s": statistics.median(recovery) if recovery else None,
            "recovery_max_s": max(recovery) if recovery else None,
            "checks_passed": sum(ok for _, ok, _ in self.checks),
            "checks": len(self.checks),
        }


def finish(c: Cluster, learner: subprocess.Popen, report: FaultReport, max_staleness: int = 1):
    """Stops the learner with SIGTERM (it checkpoints), then audits the whole run."""
    learner.send_signal(signal.SIGTERM)
    code = learner.wait(timeout=120)
    report.check("learner stops cleanly on SIGTERM (checkpoint written)", code == PREEMPTED, code)
    c.stop()
    result = audit_run(c, report, max_staleness)
    report.details |= {
        "dropped_stale_groups": result.dropped_stale_groups,
        "max_step_gap_s": round(max(result.step_gaps_s, default=0.0), 2),
    }
    report.check(
        "staleness bound held at every step", result.stale_samples == 0, result.stale_samples
    )
    return result


def audit_run(c: Cluster, report: FaultReport, max_staleness: int) -> Audit:
    """Audits the run and records what was lost, with a check for each kind of loss."""
    result = audit(c.run_dir, GROUP_SIZE, max_staleness)
    report.lost = result.lost
    report.details |= {"steps": result.steps, "trained_samples": result.trained_samples}
    report.check("no sample trained twice", not result.duplicate_samples, result.duplicate_samples)
    report.check("no prompt trained twice", not result.duplicate_prompts, result.duplicate_prompts)
    report.check("no group trained half", not result.incomplete_groups, result.incomplete_groups)
    report.check(
        "every prompt handed out is accounted for", not result.lost_prompts, result.lost_prompts
    )
    return result


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what} within {timeout} s")


def kill_after_a_step(c: Cluster, learner: subprocess.Popen, delay_s: float) -> None:
    """SIGKILLs `learner` `delay_s` after it has trained its first step (a random moment of
    the scenario's choosing, once the incarnation is up and training)."""
    started = time.time()
    wait_for(
        lambda: alive(learner, c) and any(r["time"] > started for r in read_ledger(c.run_dir)[-1:]),
        120,
        "the resumed learner to train a step",
    )
    time.sleep(delay_s)
    learner.kill()


def alive(process: subprocess.Popen, c: Cluster) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"the learner exited with {process.returncode}:\n{c.log('learner')}")
    return True


def trained_senders(run_dir: Path) -> set[str]:
    return {m[0] for r in read_ledger(run_dir) for _, _, members in r["groups"] for m in members}


def first_trained_at(run_dir: Path, sender_prefix: str, exclude: set[str]) -> float | None:
    for record in read_ledger(run_dir):
        for _, _, members in record["groups"]:
            if any(s.startswith(sender_prefix) and s not in exclude for s, _, _ in members):
                return record["time"]
    return None


def latest_version(c: Cluster) -> int:
    return int((c.run_dir / LATEST_VERSION_FILE).read_text())
