"""The faults of docs/reliability.md against a real learner and workers on loopback (tiny
model; the learner's kills in learner_kills.py, the attacks in attack_scenarios.py; SCENARIOS
names all). A scenario injects its fault a bounded number of times, lets the run go on,
stops the learner (SIGTERM: it checkpoints), audits the run and returns a `FaultReport`:
what was injected, what was lost (must be 0), how long recovery took, every check."""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
from pathlib import Path

from asyncfp8.learner.ledger import read_ledger
from asyncfp8.run.records import read_metrics
from asyncfp8.sync.keys import make_keys

from .attack_scenarios import corrupt_flood, impersonation
from .audit import applied_versions
from .cluster import Cluster
from .fault_report import (
    GROUP_SIZE,
    OPEN_ENDED,
    FaultReport,
    alive,
    finish,
    first_trained_at,
    latest_version,
    trained_senders,
    wait_for,
)
from .hosts import Hosts
from .hosts import unavailable as hosts_unavailable
from .learner_kills import learner_kills, torn_writes

# -- 1. workers killed --------------------------------------------------------------------------


def worker_kills(
    work_dir: Path, model_dir: Path, kills: int = 3, seed: int = 0, lease_timeout: float = 3.0
) -> FaultReport:
    """SIGKILLs a random worker at random moments and starts a new one each time."""
    rng = random.Random(seed)
    stall_limit = lease_timeout + 6  # leases of the dead expire (checked every 1 s), then re-leased
    c = Cluster(
        work_dir,
        model_dir,
        *OPEN_ENDED,
        "run.workers=2",
        f"run.lease_timeout={lease_timeout}",
        "sync.resend_after=2",
    )
    report = FaultReport("worker SIGKILL + restart", injected=kills)
    try:
        learner = c.learner()
        workers = {i: c.worker(i, log_name=f"worker-{i}.0") for i in (0, 1)}
        c.wait_for_step(5)
        chaos_started = time.time()
        replacements = []
        for kill in range(kills):
            time.sleep(rng.uniform(0.5, 3.0))
            index = rng.choice([0, 1])
            before = {s for s in trained_senders(c.run_dir) if s.startswith(f"{index}/")}
            workers[index].kill()
            workers[index].wait()
            killed_at, latest = time.time(), latest_version(c)
            name = f"worker-{index}.{kill + 1}"
            workers[index] = c.worker(index, log_name=name)
            replacements.append((index, name, killed_at, latest, before))
            # The replacement must be trained on before the next kill (else a kill could
            # hit a worker that never rejoined, and prove nothing).
            back = wait_for(
                lambda i=index, b=before: first_trained_at(c.run_dir, f"{i}/", b),
                120,
                f"worker {index}'s replacement trained on",
            )
            report.recovery_s.append(back - killed_at)
        steps_at_end = c.last_step()
        c.wait_for_step(steps_at_end + 5)
        chaos_ended = time.time()
        for _, name, _, latest, _ in replacements:
            applied = applied_versions(c.log(name, tail=0))
            report.check(
                f"{name} resynced to the latest version (>= {latest})",
                applied and applied[0] >= latest,
                applied[:3],
            )
        result = finish(c, learner, report)
        records = read_ledger(c.run_dir)
        gaps = [
            b["time"] - a["time"]
            for a, b in itertools.pairwise(records)
            if chaos_started <= b["time"] <= chaos_ended
        ]
        report.details["max_stall_s"] = round(max(gaps, default=0.0), 2)
        report.check(
            f"learner never stalled longer than {stall_limit:.0f} s",
            max(gaps, default=0.0) <= stall_limit,
            report.details["max_stall_s"],
        )
        report.details["worker_incarnations_trained"] = len(result.senders)
        report.check(
            "every killed worker's replacement was trained on",
            len(result.senders) == 2 + kills,
            sorted(result.senders),
        )
    finally:
        c.stop()
    return report


# -- 5. a slow worker ---------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_until_busy(pid: int, patience_s: float, window_s: float = 0.3) -> bool:
    """Waits (at most `patience_s`) until the process burns more than half a core over
    `window_s`: a worker generating, so holding a lease, rather than one polling for
    capacity (which a fast machine leaves it doing most of the time)."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        before = _cpu_seconds(pid)
        time.sleep(window_s)
        if _cpu_seconds(pid) - before > 0.5 * window_s:
            return True
    return False


def slow_worker(
    work_dir: Path, model_dir: Path, pauses: int = 3, pause_s: float = 5.0, seed: int = 0
) -> FaultReport:
    """Freezes one worker (SIGSTOP, as a swapping or oversubscribed host would) for
    `pause_s` at a time until `pauses` freezes caught it holding a lease (a worker frozen
    while it waits for capacity holds none, and on a fast machine that is common); those
    leases expire while it is frozen; a freeze waits for the worker to be busy generating.
    At most `4 * pauses` freezes are tried."""
    rng = random.Random(seed)
    lease_timeout = 2.0
    c = Cluster(
        work_dir,
        model_dir,
        *OPEN_ENDED,
        "run.workers=2",
        f"run.lease_timeout={lease_timeout}",
        "run.max_staleness=1",
        # Longer generations: a worker holds its lease for most of its time, not 6 tokens'
        # worth between two round trips to the learner, so a freeze usually catches one.
        "run.max_new_tokens=48",
    )
    report = FaultReport("slow worker (SIGSTOP / SIGCONT)", injected=pauses)
    try:
        learner = c.learner()
        c.worker(0)
        slow = c.worker(1)
        c.wait_for_step(5)
        stalls = []
        caught = 0  # freezes during which one of the slow worker's leases expired
        while caught < pauses and len(stalls) < 4 * pauses:
            time.sleep(rng.uniform(0.5, 1.5))
            _wait_until_busy(slow.pid, patience_s=5.0)  # generating: it holds a lease
            expiries = c.log("learner", tail=0).count("expired after")
            os.kill(slow.pid, signal.SIGSTOP)
            stopped = time.time()
            time.sleep(pause_s)
            caught += c.log("learner", tail=0).count("expired after") > expiries
            os.kill(slow.pid, signal.SIGCONT)
            stalls.append(stopped)
        report.injected = len(stalls)
        time.sleep(3)
        c.wait_for_step(c.last_step() + 3)
        report.check("the slow worker is still running", slow.poll() is None, slow.poll())
        records = read_ledger(c.run_dir)
        for stopped in stalls:
            # How long the learner went without a step once the worker froze.
            times = [stopped] + [
                r["time"] for r in records if stopped < r["time"] < stopped + pause_s + 1
            ]
            report.recovery_s.append(max(b - a for a, b in itertools.pairwise(times)))
        finish(c, learner, report)
        last = read_metrics(c.run_dir)[-1]
        dropped = last["total/late_samples"] + last["total/stale_groups"] * GROUP_SIZE
        report.details |= {
            "late_samples_dropped": last["total/late_samples"],
            "stale_groups_dropped": last["total/stale_groups"],
            "expired_groups": last["data/expired_groups"],
        }
        report.check(
            "the slow worker's leases expired and went to the other worker",
            last["data/expired_groups"] > 0,
            last["data/expired_groups"],
        )
        report.check("its late samples were dropped and counted", dropped > 0, dropped)
        learner_log = c.log("learner", tail=0)
        report.check(
            "and logged",
            ("dropping samples of" in learner_log) == (last["total/late_samples"] > 0)
            and ("too stale" in learner_log) == (last["total/stale_groups"] > 0),
            "",
        )
    finally:
        c.stop()
    return report


# -- 6. hosts that really are separate ----------------------------------------------------------


def separate_hosts(
    work_dir: Path, model_dir: Path, seed: int = 0, resend_after: float = 2.0
) -> FaultReport:
    """The learner and two workers each on a host of its own (`asyncfp8.chaos.hosts`), started
    with docs/running.md's multi-host commands and CurveZMQ on. A worker's link is cut past
    `sync.resend_after` while it pushes (the learner must train on with the other), then the
    learner's while it publishes; each comes back, and the audit must find nothing lost or
    trained twice. `seed` varies when the cuts fall."""
    reason = hosts_unavailable()
    if reason:
        raise RuntimeError(f"separate hosts cannot be made here: {reason}")
    rng = random.Random(seed)
    work_dir = Path(work_dir)
    keys = make_keys(work_dir / "keys")
    outage = 3 * resend_after
    report = FaultReport("separate hosts: links cut and restored", injected=0)
    with Hosts(["learner", "w0", "w1"]) as hosts:
        c = _hosts_cluster(work_dir, model_dir, hosts, keys, resend_after)
        try:
            learner = c.learner("sync.bind=0.0.0.0", host=hosts.command("learner", []))
            for index in (0, 1):
                c.worker(index, host=hosts.command(f"w{index}", []))
            c.wait_for_step(5)
            _check_curve_workers(c, report)
            _cut_worker_link(c, hosts, report, rng, outage)
            _cut_learner_link(c, hosts, report, rng, outage)
            alive(learner, c)
            finish(c, learner, report)
        finally:
            c.stop()
    return report


def _hosts_cluster(
    work_dir: Path, model_dir: Path, hosts: Hosts, keys: Path, resend_after: float
) -> Cluster:
    """Two workers that reach the learner at its host's address, over CurveZMQ."""
    return Cluster(
        work_dir / "run",
        model_dir,
        *OPEN_ENDED,
        "run.workers=2",
        "run.lease_timeout=4",
        f"sync.resend_after={resend_after}",
        f"sync.host={hosts.address('learner')}",
        "sync.curve.enabled=true",
        f"sync.curve.keys_dir={keys}",
    )


def _check_curve_workers(c: Cluster, report: FaultReport) -> None:
    """Each worker says it takes versions over ZeroMQ with CURVE, as from another host."""
    for index in (0, 1):
        started = c.log(f"worker-{index}", tail=0)
        report.check(
            f"worker {index} takes versions over ZeroMQ with CURVE (another host)",
            "versions over ZeroMQ, CurveZMQ on" in started,
            started[-300:],
        )


def _cut_worker_link(
    c: Cluster, hosts: Hosts, report: FaultReport, rng: random.Random, outage: float
) -> None:
    """Cuts worker 0's link while it pushes trajectories: the learner must train on with
    worker 1, and worker 0's samples be trained again once its link is back."""
    time.sleep(rng.uniform(0.2, 1.0))
    step = c.last_step()
    hosts.cut("w0")
    report.injected += 1
    time.sleep(outage)
    trained_meanwhile = c.last_step() - step
    report.check(
        "the learner trained on with the worker it could reach",
        trained_meanwhile >= 2,
        f"{trained_meanwhile} steps in {outage:.0f} s",
    )
    restored = time.time()
    hosts.restore("w0")
    back = wait_for(
        lambda: _trained_from_after(c.run_dir, "0/", restored),
        120,
        "worker 0 trained on after its link came back",
    )
    report.recovery_s.append(back - restored)


def _cut_learner_link(
    c: Cluster, hosts: Hosts, report: FaultReport, rng: random.Random, outage: float
) -> None:
    """Cuts the learner's link while it publishes (a version every step): once it is back,
    both workers' samples are trained again and both apply versions newer than the outage."""
    time.sleep(rng.uniform(0.2, 1.0))
    hosts.cut("learner")
    report.injected += 1
    time.sleep(outage)
    restored, latest = time.time(), latest_version(c)
    hosts.restore("learner")
    for prefix in ("0/", "1/"):
        back = wait_for(
            lambda p=prefix, r=restored: _trained_from_after(c.run_dir, p, r),
            120,
            f"worker {prefix[0]} trained on after the learner's link came back",
        )
        report.recovery_s.append(back - restored)
    c.wait_for_step(c.last_step() + 3)
    for index in (0, 1):
        applied = applied_versions(c.log(f"worker-{index}", tail=0))
        report.check(
            f"worker {index} applied versions published after the outage (> {latest})",
            bool(applied) and applied[-1] > latest,
            applied[-3:],
        )


def _trained_from_after(run_dir: Path, sender_prefix: str, after: float) -> float | None:
    """When a step recorded after `after` first trained a sample of that sender."""
    for record in read_ledger(run_dir):
        if record["time"] <= after:
            continue
        for _, _, members in record["groups"]:
            if any(sender.startswith(sender_prefix) for sender, _, _ in members):
                return record["time"]
    return None


SCENARIOS = {
    "worker_kills": worker_kills,
    "learner_kills": learner_kills,
    "corrupt_flood": corrupt_flood,
    "impersonation": impersonation,
    "slow_worker": slow_worker,
    "separate_hosts": separate_hosts,
    "torn_writes": torn_writes,
}
