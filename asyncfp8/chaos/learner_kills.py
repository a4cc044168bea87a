"""Faults 2 and 7 of docs/reliability.md: the learner SIGKILLed mid-step, mid-publish,
mid-write (a torn line in metrics.jsonl or ledger.jsonl) or at random, and resumed from
its last checkpoint each time, with the workers never restarted and the run's files
followed as its readers follow them."""

from __future__ import annotations

import itertools
import random
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncfp8.learner.ledger import read_ledger
from asyncfp8.report.summary import per_step, summarize
from asyncfp8.run.failpoints import ENV as FAILPOINTS_ENV
from asyncfp8.run.records import read_metrics

from .audit import applied_versions
from .cluster import Cluster
from .fault_report import FaultReport, audit_run, kill_after_a_step, latest_version

# How each kind of learner kill is armed: a fail point of asyncfp8/run/failpoints.py hit at a
# count drawn from this range for one incarnation (counts are per process), or "random":
# SIGKILL at a random moment once the incarnation has trained a step.
KILL_POINTS = {
    # Past the first versions of the incarnation, so that the workers have reconnected.
    "learner.mid_step": (3, 12),
    # About 15 chunks per version here (sync.chunk_mb=0.02): part of a version has left.
    "publish.between_chunks": (35, 40),
    # The 2nd to 5th line this incarnation writes to that file, torn.
    "metrics.mid_line": (2, 5),
    "ledger.mid_line": (2, 5),
}
TORN_FILES = {"metrics.mid_line": "metrics.jsonl", "ledger.mid_line": "ledger.jsonl"}


def learner_kills(
    work_dir: Path,
    model_dir: Path,
    kinds: tuple[str, ...] = ("learner.mid_step", "publish.between_chunks", "random"),
    seed: int = 0,
    steps: int = 80,
    checkpoint_every: int = 4,
    fault: str = "learner SIGKILL mid-step / mid-publish / random + resume",
) -> FaultReport:
    """Kills the learner once per entry of `kinds` (KILL_POINTS, or "random") and resumes it
    from its last checkpoint each time; the workers are never restarted and this process
    follows the run's files as the progress bar, the report and the audit read them. Nothing
    may crash, nothing half-sent may be applied, every step must be in each file once and
    the audit be clean."""
    unknown = set(kinds) - set(KILL_POINTS) - {"random"}
    if unknown:
        raise ValueError(f"no learner kill {sorted(unknown)}: {[*KILL_POINTS, 'random']}")
    rng = random.Random(seed)
    c = _kill_cluster(work_dir, model_dir, steps, checkpoint_every)
    report = FaultReport(fault, len(kinds))
    reader = _Follower(c.run_dir, steps)
    try:
        reader.start()
        kills = _kill_each_kind(c, report, kinds, rng)
        _finish_run(c, report, kills.workers)
    finally:
        reader.stop()
        c.stop()
    _check_after_kills(c, report, reader, kills, len(kinds), steps, checkpoint_every)
    return report


@dataclass
class _Kills:
    """What the kill cycles left: when the learner died, the newest version published at
    each death, the versions it may have died publishing, and the workers it started."""

    deaths: list[float] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    half_sent: list[int] = field(default_factory=list)
    workers: list[subprocess.Popen] = field(default_factory=list)


def _kill_cluster(work_dir: Path, model_dir: Path, steps: int, checkpoint_every: int) -> Cluster:
    """A two-worker run whose versions go out in several chunks, so one can be half sent."""
    return Cluster(
        work_dir,
        model_dir,
        f"run.steps={steps}",
        "run.workers=2",
        f"run.checkpoint_every={checkpoint_every}",
        "sync.chunk_mb=0.02",  # several chunks per version, so one can be half sent
        "run.lease_timeout=4",
        "sync.resend_after=2",
    )


def _kill_each_kind(
    c: Cluster, report: FaultReport, kinds: tuple[str, ...], rng: random.Random
) -> _Kills:
    """Starts the learner once per kind (resuming after the first), armed to die there, and
    the workers once; checks each death was a SIGKILL and a torn kind left its line torn."""
    kills = _Kills()
    for cycle, kind in enumerate(kinds):
        resume = ["run.resume=true"] if cycle else []
        if kind == "random":
            learner = c.learner(*resume)
            kill_after_a_step(c, learner, rng.uniform(0.05, 1.5))
        else:
            hit = rng.randint(*KILL_POINTS[kind])
            learner = c.learner(*resume, env={FAILPOINTS_ENV: f"{kind}={hit}"})
        if not kills.workers:
            kills.workers = [c.worker(i) for i in (0, 1)]
        code = learner.wait(timeout=240)
        kills.deaths.append(time.time())
        kills.published.append(latest_version(c))
        report.check(f"cycle {cycle} ({kind}): the learner died by SIGKILL", code == -9, code)
        if kind == "publish.between_chunks":
            kills.half_sent.append(kills.published[-1])  # or the one before: see below
        if kind in TORN_FILES:
            text = (c.run_dir / TORN_FILES[kind]).read_bytes()
            report.check(
                f"cycle {cycle}: {TORN_FILES[kind]} was left with a torn last line",
                bool(text) and not text.endswith(b"\n"),
                text[-80:],
            )
    return kills


def _finish_run(c: Cluster, report: FaultReport, workers: list[subprocess.Popen]) -> None:
    """Resumes the learner a last time to the end of the run; the workers, never restarted,
    must finish when it tells them to."""
    learner = c.learner("run.resume=true")
    code = learner.wait(timeout=300)
    report.check("the last resumed learner finished the run", code == 0, code)
    for i, worker in enumerate(workers):
        report.check(
            f"worker {i} was never restarted and finished when told",
            worker.wait(timeout=60) == 0,
            worker.returncode,
        )


def _check_after_kills(
    c: Cluster,
    report: FaultReport,
    reader: _Follower,
    kills: _Kills,
    resumes: int,
    steps: int,
    checkpoint_every: int,
) -> None:
    """Reads the finished run back: how long each recovery took, versions that never go
    back, the half-sent versions, the resumes, the files, the audit and the sample total."""
    records = read_ledger(c.run_dir)
    report.recovery_s = [
        min((r["time"] for r in records if r["time"] > died), default=float("nan")) - died
        for died in kills.deaths
    ]
    versions = [r["version"] for r in records]
    report.check("trained versions never go back", versions == sorted(versions), versions)
    metrics = read_metrics(c.run_dir)
    _check_half_sent(c, report, kills.half_sent)
    _check_resumes(c, report, metrics, resumes, checkpoint_every, kills.published[-1])
    _check_files(c, report, reader, metrics, records, steps, resumes)
    report.details["resumes"] = resumes
    result = audit_run(c, report, max_staleness=1)
    report.check("all steps trained", result.steps == steps, result.steps)
    # The totals came back with each checkpoint: the count covers every incarnation. It
    # counts the complete groups received, so groups later dropped as too stale are in it.
    total = metrics[-1].get("total/samples", 0)
    report.check(
        "total/samples counts at least every trained sample, across incarnations",
        total >= result.trained_samples,
        (total, result.trained_samples),
    )


def _check_half_sent(c: Cluster, report: FaultReport, half_sent: list[int]) -> None:
    """No worker applied a version the learner died publishing, and one received part
    of each (its log says it dropped it incomplete)."""
    worker_logs = [c.log(f"worker-{i}", tail=0) for i in (0, 1)]

    def dropped(version: int) -> bool:
        return any(f"dropped incomplete version {version} " in log for log in worker_logs)

    # The learner reserves a version's number before its first chunk leaves and
    # publishes in the background, so when it died the next number may already have
    # been reserved while the version half sent was the one before it.
    half_sent = [latest - 1 if dropped(latest - 1) else latest for latest in half_sent]
    for i, log in enumerate(worker_logs):
        applied = applied_versions(log)
        report.check(
            f"worker {i} applied increasing versions only", applied == sorted(set(applied)), applied
        )
        for version in half_sent:
            report.check(
                f"worker {i} never applied the half-sent version {version}",
                version not in applied,
                applied,
            )
    report.details["half_sent_versions"] = half_sent
    report.check(
        "the half-sent version reached a worker and was dropped incomplete",
        all(dropped(v) for v in half_sent),
        half_sent,
    )


def _check_resumes(
    c: Cluster,
    report: FaultReport,
    metrics: list[dict],
    resumes: int,
    checkpoint_every: int,
    last_published: int,
) -> None:
    """Each resumed learner said where it resumed (a checkpoint's step, the data position
    included), and the last one numbered its versions past every version published
    before it (the workers hold one)."""
    log = c.log("learner", tail=0)
    steps = [int(s) for s in re.findall(r"resumed from \S+: step (\d+), version", log)]
    report.check(
        "every resumed learner said where it resumed, data position included",
        len(steps) == log.count("next prompt") == resumes,
        steps,
    )
    report.check(
        "every resume is from a checkpoint's step",
        all(s % checkpoint_every == 0 for s in steps),
        steps,
    )
    marked = [r for r in metrics if "run/resumed_from_step" in r]
    report.check(
        "metrics.jsonl marks the last resume at the step after its checkpoint",
        bool(marked) and steps and marked[-1]["step"] == steps[-1] + 1,
        [r["step"] for r in marked],
    )
    first = marked[-1]["sync/version"] if marked else None
    report.check(
        "the last resumed learner's versions start past every version published before",
        first is not None and first > last_published,
        (first, last_published),
    )


def _check_files(
    c: Cluster,
    report: FaultReport,
    reader: _Follower,
    metrics: list[dict],
    records: list[dict],
    steps: int,
    kills: int,
) -> None:
    """The readers followed the files through every kill without failing, and each file
    holds every step once and no torn line: each resume cut it back to its checkpoint."""
    report.check("the readers never failed", not reader.errors, reader.errors[:3])
    report.check("the readers read throughout", reader.reads > kills, reader.reads)
    report.check(
        "the progress bar ended at the last step",
        reader.progress_step == steps,
        reader.progress_step,
    )
    for name, lines in (("metrics", metrics), ("ledger", records)):
        trained = [r["step"] for r in lines if r["step"] > 0]  # step 0: the first evaluation
        report.check(
            f"{name}.jsonl holds every step once", trained == list(range(1, steps + 1)), ""
        )
        on_disk = (c.run_dir / f"{name}.jsonl").read_text().splitlines()
        report.check(
            f"{name}.jsonl has no torn line left", len(on_disk) == len(lines), len(on_disk)
        )


def torn_writes(
    work_dir: Path, model_dir: Path, kills: int = 20, seed: int = 0, steps: int = 150
) -> FaultReport:
    """`learner_kills` `kills` times in a row, checkpoints every 2 steps: in the middle of
    writing a line of metrics.jsonl, in the middle of a line of ledger.jsonl (fail points
    that leave the line torn), and at random moments, in turn."""
    kinds = ("metrics.mid_line", "ledger.mid_line", "random")
    return learner_kills(
        work_dir,
        model_dir,
        tuple(itertools.islice(itertools.cycle(kinds), kills)),
        seed,
        steps,
        checkpoint_every=2,
        fault="learner SIGKILL mid-write (torn lines) + resume, again and again",
    )


class _Follower:
    """Reads a run's files the way its readers do (the launcher's progress bar, the
    report's summary, the audit's ledger) every 50 ms on a thread, keeping any error."""

    def __init__(self, run_dir: Path, steps: int):
        from asyncfp8.launch.progress import Progress

        self.progress = Progress(run_dir, steps)
        self.run_dir, self.reads, self.errors = run_dir, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    @property
    def progress_step(self) -> int:
        return self.progress.bar.n

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._read()  # once more, after the last write

    def _follow(self) -> None:
        while not self._stop.wait(0.05):
            self._read()

    def _read(self) -> None:
        try:
            self.progress.update()
            if per_step(self.run_dir):  # the report refuses a run with no trained step yet
                summarize(self.run_dir)
            read_ledger(self.run_dir)
            self.reads += 1
        except Exception as err:
            self.errors.append(f"{type(err).__name__}: {err}")
