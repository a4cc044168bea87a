"""The five faults of docs/reliability.md, each against a real learner and real
workers on loopback (tiny model). A scenario injects its fault a bounded number of
times, lets the run go on, stops the learner (SIGTERM: it checkpoints), audits the run
and returns a `FaultReport`: what was injected, what was lost (must be 0), how long
recovery took, and every check with what it saw."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from asyncfp8.failpoints import ENV as FAILPOINTS_ENV
from asyncfp8.ledger import read_ledger
from asyncfp8.metrics import read_metrics
from asyncfp8.report import per_step, summarize
from asyncfp8.run_files import LATEST_VERSION_FILE
from asyncfp8.sync import Curve, TrajectorySender, VersionPublisher, VersionSubscriber
from asyncfp8.sync.keys import make_keys
from asyncfp8.sync.security import stop_authenticators

from .attacks import (
    CorruptingRelay,
    Flood,
    genuine_trajectory,
    lease_request,
    steps_per_second,
)
from .audit import Audit, applied_versions, audit, logged_rejections
from .cluster import Cluster
from .hosts import Hosts
from .hosts import unavailable as hosts_unavailable

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


def _finish(c: Cluster, learner: subprocess.Popen, report: FaultReport, max_staleness: int = 1):
    """Stops the learner with SIGTERM (it checkpoints), then audits the whole run."""
    learner.send_signal(signal.SIGTERM)
    code = learner.wait(timeout=120)
    report.check("learner stops cleanly on SIGTERM (checkpoint written)", code == PREEMPTED, code)
    c.stop()
    result = _audit(c, report, max_staleness)
    report.details |= {
        "dropped_stale_groups": result.dropped_stale_groups,
        "max_step_gap_s": round(max(result.step_gaps_s, default=0.0), 2),
    }
    report.check(
        "staleness bound held at every step", result.stale_samples == 0, result.stale_samples
    )
    return result


def _audit(c: Cluster, report: FaultReport, max_staleness: int) -> Audit:
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


def _wait(predicate, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what} within {timeout} s")


def _kill_after_a_step(c: Cluster, learner: subprocess.Popen, delay_s: float) -> None:
    """SIGKILLs `learner` `delay_s` after it has trained its first step (a random moment of
    the scenario's choosing, once the incarnation is up and training)."""
    started = time.time()
    _wait(
        lambda: (
            _alive(learner, c) and any(r["time"] > started for r in read_ledger(c.run_dir)[-1:])
        ),
        120,
        "the resumed learner to train a step",
    )
    time.sleep(delay_s)
    learner.kill()


def _alive(process: subprocess.Popen, c: Cluster) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"the learner exited with {process.returncode}:\n{c.log('learner')}")
    return True


def _senders(run_dir: Path) -> set[str]:
    return {m[0] for r in read_ledger(run_dir) for _, _, members in r["groups"] for m in members}


def _first_trained_at(run_dir: Path, sender_prefix: str, exclude: set[str]) -> float | None:
    for record in read_ledger(run_dir):
        for _, _, members in record["groups"]:
            if any(s.startswith(sender_prefix) and s not in exclude for s, _, _ in members):
                return record["time"]
    return None


def _latest_version(c: Cluster) -> int:
    return int((c.run_dir / LATEST_VERSION_FILE).read_text())


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
            before = {s for s in _senders(c.run_dir) if s.startswith(f"{index}/")}
            workers[index].kill()
            workers[index].wait()
            killed_at, latest = time.time(), _latest_version(c)
            name = f"worker-{index}.{kill + 1}"
            workers[index] = c.worker(index, log_name=name)
            replacements.append((index, name, killed_at, latest, before))
            # The replacement must be trained on before the next kill (else a kill could
            # hit a worker that never rejoined, and prove nothing).
            back = _wait(
                lambda i=index, b=before: _first_trained_at(c.run_dir, f"{i}/", b),
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
        result = _finish(c, learner, report)
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


# -- 2. learner killed --------------------------------------------------------------------------


def learner_kills(
    work_dir: Path, model_dir: Path, random_kills: int = 1, seed: int = 0, steps: int = 80
) -> FaultReport:
    """Kills the learner mid-step and mid-publish (fail points: a version half sent),
    plus at random moments; resumes it each time from its last checkpoint."""
    rng = random.Random(seed)
    cycles = ["learner.mid_step", "publish.between_chunks"] + ["random"] * random_kills
    c = Cluster(
        work_dir,
        model_dir,
        f"run.steps={steps}",
        "run.workers=2",
        "run.checkpoint_every=4",
        "sync.chunk_mb=0.02",  # several chunks per version, so one can be half sent
        "run.lease_timeout=4",
        "sync.resend_after=2",
    )
    report = FaultReport("learner SIGKILL mid-step / mid-publish / random + resume", len(cycles))
    try:
        deaths, half_sent, workers = [], [], []
        for cycle, kind in enumerate(cycles):
            resume = ["run.resume=true"] if cycle else []
            if kind == "random":
                learner = c.learner(*resume)
                _kill_after_a_step(c, learner, rng.uniform(0.2, 1.5))
            else:  # a fail point, armed for this incarnation only (counts are per process)
                # Past the first versions of the incarnation (about 15 chunks each here),
                # so that the workers have reconnected and receive part of the version.
                hit = rng.randint(3, 12) if kind == "learner.mid_step" else rng.randint(35, 40)
                learner = c.learner(*resume, env={FAILPOINTS_ENV: f"{kind}={hit}"})
            if not workers:
                workers = [c.worker(i) for i in (0, 1)]
            code = learner.wait(timeout=240)
            deaths.append(time.time())
            report.check(f"cycle {cycle} ({kind}): the learner died by SIGKILL", code == -9, code)
            if kind == "publish.between_chunks":
                half_sent.append(_latest_version(c))  # or the one before: see below
        learner = c.learner("run.resume=true")
        code = learner.wait(timeout=300)
        report.check("the resumed learner finished the run", code == 0, code)
        for i, worker in enumerate(workers):
            report.check(
                f"worker {i} was never restarted and finished when told",
                worker.wait(timeout=60) == 0,
                worker.returncode,
            )
        records = read_ledger(c.run_dir)
        report.recovery_s = [
            min((r["time"] for r in records if r["time"] > died), default=float("nan")) - died
            for died in deaths
        ]
        versions = [r["version"] for r in records]
        report.check("trained versions never go back", versions == sorted(versions), versions)
        worker_logs = [c.log(f"worker-{i}", tail=0) for i in (0, 1)]

        def dropped(version: int) -> bool:
            return any(f"dropped incomplete version {version} " in log for log in worker_logs)

        # The learner reserves a version's number before its first chunk leaves and
        # publishes in the background, so when it died the next number may already have
        # been reserved while the version half sent was the one before it.
        half_sent = [latest - 1 if dropped(latest - 1) else latest for latest in half_sent]
        for i in (0, 1):
            log = worker_logs[i]
            applied = applied_versions(log)
            report.check(
                f"worker {i} applied increasing versions only",
                applied == sorted(set(applied)),
                applied,
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
        report.check(
            "a resumed learner said where it resumed, data position included",
            c.log("learner", tail=0).count("next prompt") == len(cycles),
            c.log("learner", tail=0).count("next prompt"),
        )
        result = _audit(c, report, max_staleness=1)
        report.check("all steps trained", result.steps == steps, result.steps)
    finally:
        c.stop()
    return report


# -- 3. corrupted and flooded frames ------------------------------------------------------------


def corrupt_flood(
    work_dir: Path,
    model_dir: Path,
    frames: int = 400,
    seed: int = 0,
    window: float = 4.0,
    limit_mb: float = 0.25,
) -> FaultReport:
    """Bad frames at the learner's trajectory and snapshot sockets (random, truncated,
    bit-flipped, oversized, wrong schema, extra frames, bad lease requests, replays,
    huge frames, raw TCP), and a relay spoiling the weights on their way to a worker."""
    limit = int(limit_mb * (1 << 20))
    c = Cluster(
        work_dir,
        model_dir,
        *OPEN_ENDED,
        "run.workers=2",
        f"sync.max_trajectory_mb={limit_mb}",
    )
    report = FaultReport("corrupt / truncated / oversized / replayed frames", injected=0)
    relay = flood = None
    try:
        learner = c.learner()
        relay = CorruptingRelay(f"tcp://127.0.0.1:{c.ports['version']}", seed=seed)
        c.worker(0)
        relayed = c.worker(1, f"sync.version_port={relay.port}")
        c.wait_for_step(5)
        before_start = time.time()
        time.sleep(window)
        flood_start = time.time()
        relay.spoil.set()
        flood = Flood("127.0.0.1", c.ports["trajectory"], c.ports["snapshot"], seed=seed)
        flood.trajectories(frames, limit, seconds=window / 2)
        trained = [
            (sender, seq, lease)
            for r in read_ledger(c.run_dir)[-5:]
            for lease, _, members in r["groups"]
            for sender, seq, _ in members
        ]
        flood.replay(trained)
        flood.snapshot_requests(frames // 4, valid=2)
        flood.huge(2, limit)
        flood.raw_tcp(4)
        time.sleep(window / 2)
        relay.spoil.clear()
        flood_end = time.time()
        time.sleep(window)
        after_end = time.time()
        report.check("the relayed worker is still running", relayed.poll() is None, relayed.poll())
        records = read_ledger(c.run_dir)
        rates = {
            "before": steps_per_second(records, before_start, flood_start),
            "during": steps_per_second(records, flood_start, flood_end),
            "after": steps_per_second(records, flood_end, after_end),
        }
        report.details["steps_per_s"] = {k: round(v, 1) for k, v in rates.items()}
        report.check(
            "good traffic recovers: steps/s after the flood >= half of before",
            rates["after"] >= 0.5 * rates["before"] > 0,
            rates,
        )
        next_step = min((r["time"] for r in records if r["time"] > flood_end), default=None)
        report.recovery_s = [next_step - flood_end] if next_step else []
        _finish(c, learner, report)
        last = read_metrics(c.run_dir)[-1]
        counted = {
            "trajectory message": last.get("total/rejected/trajectory_message", 0),
            "lease request": last.get("total/rejected/lease_request", 0),
            "snapshot request": last.get("total/rejected/snapshot_request", 0),
        }
        # Raw TCP garbage can parse as ZeroMQ 1.0 frames and reach the sockets as
        # messages: a few more rejections than frames sent, never fewer.
        report.check(
            "every bad frame was rejected and counted",
            all(counted[source] >= n for source, n in flood.sent.items()),
            (counted, dict(flood.sent)),
        )
        logged = logged_rejections(c.log("learner", tail=0))
        report.check(
            "every rejection was logged with its reason (or summed up in a capped log)",
            all(logged[source] == n for source, n in counted.items()),
            dict(logged),
        )
        report.check(
            "every replay was a duplicate, acknowledged and not trained",
            last["total/duplicate_messages"] == flood.replays_acknowledged == flood.replayed,
            (last["total/duplicate_messages"], flood.replays_acknowledged, flood.replayed),
        )
        handshakes = sum(n for source, n in logged.items() if source.endswith("handshake"))
        report.check(
            "raw TCP connections failed the handshake and were logged",
            handshakes >= 1,
            handshakes,
        )
        worker_rejected = last["worker/1/rejected_versions"]  # sent with its lease requests
        report.check(
            "the relayed worker rejected every spoiled weights message it could not ignore",
            relay.always_rejected <= worker_rejected <= relay.spoiled,
            (worker_rejected, dict(relay.counts)),
        )
        applied = applied_versions(c.log("worker-1", tail=0))
        report.check(
            "the relayed worker applied increasing versions only",
            applied == sorted(set(applied)),
            applied[-5:],
        )
        report.injected = sum(flood.sent.values()) + flood.replayed + flood.cut_by_zeromq
        report.injected += flood.raw_connections + relay.spoiled + relay.counts["replayed"]
        report.details |= {
            "learner_frames": dict(flood.sent),
            "replayed": flood.replayed,
            "huge_cut_by_zeromq": flood.cut_by_zeromq,
            "raw_tcp": flood.raw_connections,
            "relay": dict(relay.counts),
            "relayed_worker_rejected": worker_rejected,
            "learner_rejections": counted,
            "snapshots_downloaded_without_curve": flood.snapshots_received,
        }
    finally:
        c.stop()
        for endpoint in (relay, flood):
            if endpoint is not None:
                endpoint.close()
    return report


# -- 4. impersonation with CURVE on -------------------------------------------------------------


def impersonation(
    work_dir: Path, model_dir: Path, seconds: float = 5.0, seed: int = 0
) -> FaultReport:
    """With CurveZMQ on: a rogue publisher without the learner's secret key, senders
    without an allowed client key, and eavesdroppers on the weights."""
    work_dir = Path(work_dir)
    keys = make_keys(work_dir / "keys")
    intruder = make_keys(work_dir / "intruder")
    stranger = work_dir / "stranger"  # knows the server's public key; its own key is not allowed
    stranger.mkdir()
    for name, source in (("server.key", keys), ("client.key_secret", intruder)):
        (stranger / name).write_bytes((source / name).read_bytes())
    c = Cluster(
        work_dir / "run",
        model_dir,
        *OPEN_ENDED,
        "run.workers=1",
        "sync.curve.enabled=true",
        f"sync.curve.keys_dir={keys}",
    )
    report = FaultReport("impersonation (CURVE on)", injected=0)
    rogue = None
    attackers: list = []
    try:
        learner = c.learner()
        c.worker(0)
        c.wait_for_step(3)
        rogue = VersionPublisher(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=Curve(True, str(intruder))
        )
        rogue.publish(0, [("model.embed_tokens.weight", torch.zeros(8))])
        fooled = c.worker(
            9,
            f"sync.version_port={rogue.publish_address.rsplit(':', 1)[1]}",
            f"sync.snapshot_port={rogue.snapshot_address.rsplit(':', 1)[1]}",
            "sync.connect_timeout=6",
        )
        address = f"tcp://127.0.0.1:{c.ports['trajectory']}"
        senders = {
            "plain": TrajectorySender(address, "plain"),
            "foreign keys": TrajectorySender(address, "foreign", curve=Curve(True, str(intruder))),
            "unlisted client key": TrajectorySender(
                address, "stranger", curve=Curve(True, str(stranger))
            ),
        }
        eavesdroppers = {
            "plain": VersionSubscriber(
                f"tcp://127.0.0.1:{c.ports['version']}", f"tcp://127.0.0.1:{c.ports['snapshot']}"
            ),
            "unlisted client key": VersionSubscriber(
                f"tcp://127.0.0.1:{c.ports['version']}",
                f"tcp://127.0.0.1:{c.ports['snapshot']}",
                curve=Curve(True, str(stranger)),
            ),
        }
        attackers = [*senders.values(), *eavesdroppers.values()]
        step_before = c.last_step()
        deadline = time.monotonic() + seconds
        sent = 0
        while time.monotonic() < deadline:
            for sender in senders.values():
                for frames in (
                    [genuine_trajectory(sender.sender, sent, lease=0)],
                    lease_request(sender.sender),
                ):
                    # zmq.Again: no connection came up to queue it on (the handshake failed)
                    with contextlib.suppress(zmq.Again):
                        sender.socket.send_multipart(frames, zmq.NOBLOCK)
                    sent += 1
            for eavesdropper in eavesdroppers.values():
                eavesdropper.poll(timeout_ms=10)
            time.sleep(0.05)
        report.injected = sent + 1 + len(eavesdroppers)  # + the rogue publisher
        report.check(
            "the learner kept training during the attack",
            c.last_step() > step_before,
            c.last_step(),
        )
        for name, eavesdropper in eavesdroppers.items():
            report.check(
                f"an eavesdropper ({name}) received no weights",
                eavesdropper.version is None,
                eavesdropper.version,
            )
        code = fooled.wait(timeout=60)
        fooled_log = c.log("worker-9", tail=0)
        report.check(
            "a worker pointed at a rogue publisher took nothing from it and gave up (exit 3)",
            code == 3 and not applied_versions(fooled_log),
            (code, applied_versions(fooled_log)),
        )
        report.check(
            "it logged that the publisher failed the handshake",
            "handshake" in fooled_log,
            fooled_log[-300:],
        )
        result = _finish(c, learner, report)
        learner_log = c.log("learner", tail=0)
        report.check(
            "only the real worker was trained on",
            all(s.startswith("0/") for s in result.senders),
            sorted(result.senders),
        )
        last = read_metrics(c.run_dir)[-1]
        report.check(
            "nothing from the intruders reached the application",
            last["total/rejected_messages"] == 0,
            last["total/rejected_messages"],
        )
        report.check(
            "the unlisted client key was refused and logged",
            "refused a CURVE client" in learner_log,
            "",
        )
        handshakes = sum(
            n
            for source, n in logged_rejections(learner_log).items()
            if source.endswith("handshake")
        )
        report.check(
            "failed handshakes (no keys, wrong server key) were logged", handshakes >= 1, handshakes
        )
        report.details |= {
            "messages_sent_by_intruders": sent,
            "failed_handshakes_logged": handshakes,
        }
    finally:
        c.stop()
        for endpoint in [*attackers, rogue]:
            if endpoint is not None:
                endpoint.close()
        stop_authenticators()
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
        _finish(c, learner, report)
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
    """The learner and two workers each on a host of its own (network namespaces on one
    bridge, `asyncfp8.chaos.hosts`), started with the multi-host commands of
    docs/running.md and CurveZMQ on. A worker's link is cut for longer than
    `sync.resend_after` while it pushes trajectories (the learner must train on with the
    other), then the learner's own link while it publishes versions; each comes back, and
    the audit must find nothing lost or trained twice. `seed` varies when the cuts fall."""
    reason = hosts_unavailable()
    if reason:
        raise RuntimeError(f"separate hosts cannot be made here: {reason}")
    rng = random.Random(seed)
    work_dir = Path(work_dir)
    keys = make_keys(work_dir / "keys")
    outage = 3 * resend_after
    report = FaultReport("separate hosts: links cut and restored", injected=0)
    with Hosts(["learner", "w0", "w1"]) as hosts:
        c = Cluster(
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
        try:
            learner = c.learner("sync.bind=0.0.0.0", host=hosts.command("learner", []))
            for index in (0, 1):
                c.worker(index, host=hosts.command(f"w{index}", []))
            c.wait_for_step(5)
            for index in (0, 1):
                started = c.log(f"worker-{index}", tail=0)
                report.check(
                    f"worker {index} takes versions over ZeroMQ with CURVE (another host)",
                    "versions over ZeroMQ, CurveZMQ on" in started,
                    started[-300:],
                )
            # 1. a worker's link, while it pushes trajectories
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
            back = _wait(
                lambda: _trained_from_after(c.run_dir, "0/", restored),
                120,
                "worker 0 trained on after its link came back",
            )
            report.recovery_s.append(back - restored)
            # 2. the learner's link, while it publishes (a version every step)
            time.sleep(rng.uniform(0.2, 1.0))
            hosts.cut("learner")
            report.injected += 1
            time.sleep(outage)
            restored, latest = time.time(), _latest_version(c)
            hosts.restore("learner")
            for prefix in ("0/", "1/"):
                back = _wait(
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
            _alive(learner, c)
            _finish(c, learner, report)
        finally:
            c.stop()
    return report


def _trained_from_after(run_dir: Path, sender_prefix: str, after: float) -> float | None:
    """When a step recorded after `after` first trained a sample of that sender."""
    for record in read_ledger(run_dir):
        if record["time"] <= after:
            continue
        for _, _, members in record["groups"]:
            if any(sender.startswith(sender_prefix) for sender, _, _ in members):
                return record["time"]
    return None


# -- 7. kills that tear the run's own files, resumed again and again ----------------------------


def torn_writes(
    work_dir: Path, model_dir: Path, kills: int = 20, seed: int = 0, steps: int = 150
) -> FaultReport:
    """SIGKILLs the learner `kills` times in a row, resuming it each time: in the middle
    of writing a line of metrics.jsonl, in the middle of a line of ledger.jsonl (fail
    points that leave the line torn), and at random moments; meanwhile this process
    follows the files as the launcher's progress bar, the report and the audit read them.
    Nothing may crash, every step must be in each file once, and the audit be clean."""
    rng = random.Random(seed)
    kinds = ["metrics.mid_line", "ledger.mid_line", "random"]
    c = Cluster(
        work_dir,
        model_dir,
        f"run.steps={steps}",
        "run.workers=2",
        "run.checkpoint_every=2",
        "run.lease_timeout=4",
        "sync.resend_after=2",
    )
    report = FaultReport("learner SIGKILL mid-write (torn lines) + resume, again and again", kills)
    reader = _Follower(c.run_dir, steps)
    try:
        reader.start()
        workers: list[subprocess.Popen] = []
        for cycle in range(kills):
            kind = kinds[cycle % len(kinds)]
            resume = ["run.resume=true"] if cycle else []
            if kind == "random":
                learner = c.learner(*resume)
                _kill_after_a_step(c, learner, rng.uniform(0.05, 1.0))
            else:  # the 2nd to 5th line this incarnation writes to that file, torn
                learner = c.learner(*resume, env={FAILPOINTS_ENV: f"{kind}={rng.randint(2, 5)}"})
            if not workers:
                workers = [c.worker(i) for i in (0, 1)]
            code = learner.wait(timeout=240)
            report.check(f"cycle {cycle} ({kind}): the learner died by SIGKILL", code == -9, code)
            if kind != "random":
                name = "metrics.jsonl" if kind.startswith("metrics") else "ledger.jsonl"
                text = (c.run_dir / name).read_bytes()
                report.check(
                    f"cycle {cycle}: {name} was left with a torn last line",
                    bool(text) and not text.endswith(b"\n"),
                    text[-80:],
                )
        learner = c.learner("run.resume=true")
        code = learner.wait(timeout=300)
        report.check("the last resumed learner finished the run", code == 0, code)
        for i, worker in enumerate(workers):
            report.check(f"worker {i} finished when told", worker.wait(timeout=60) == 0, i)
    finally:
        reader.stop()
        c.stop()
    report.check("the readers never failed", not reader.errors, reader.errors[:3])
    report.check("the readers read throughout", reader.reads > kills, reader.reads)
    report.check(
        "the progress bar ended at the last step",
        reader.progress_step == steps,
        reader.progress_step,
    )
    for name, records in (("metrics", read_metrics(c.run_dir)), ("ledger", read_ledger(c.run_dir))):
        trained = [r["step"] for r in records if r["step"] > 0]  # step 0: the first evaluation
        report.check(
            f"{name}.jsonl holds every step once", trained == list(range(1, steps + 1)), ""
        )
        lines = (c.run_dir / f"{name}.jsonl").read_text().splitlines()
        report.check(f"{name}.jsonl has no torn line left", len(lines) == len(records), len(lines))
    report.details["resumes"] = kills
    _audit(c, report, max_staleness=1)
    return report


class _Follower:
    """Reads a run's files the way its readers do (the launcher's progress bar, the
    report's summary, the audit's ledger) every 50 ms on a thread, keeping any error."""

    def __init__(self, run_dir: Path, steps: int):
        from asyncfp8.launch import Progress

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


SCENARIOS = {
    "worker_kills": worker_kills,
    "learner_kills": learner_kills,
    "corrupt_flood": corrupt_flood,
    "impersonation": impersonation,
    "slow_worker": slow_worker,
    "separate_hosts": separate_hosts,
    "torn_writes": torn_writes,
}
