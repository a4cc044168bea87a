"""The attacks of docs/reliability.md (3: corrupted, flooded and replayed frames; 4:
impersonation with CURVE on), each against a real learner and real workers on loopback
(tiny model), injected for a bounded time, then audited into a `FaultReport`. scenarios.py
has the other faults and SCENARIOS; attacks.py the attackers themselves."""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from asyncfp8.learner.ledger import read_ledger
from asyncfp8.run.records import read_metrics
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
from .audit import applied_versions, logged_rejections
from .cluster import Cluster
from .fault_report import OPEN_ENDED, FaultReport, finish

# -- 3. corrupted and flooded frames ------------------------------------------------------------


@dataclass
class _Window:
    """When the flood began and ended, with a quiet window of the same length each side."""

    before: float
    start: float
    end: float
    after: float


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
        before = time.time()
        time.sleep(window)
        start = time.time()
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
        end = time.time()
        time.sleep(window)
        report.check("the relayed worker is still running", relayed.poll() is None, relayed.poll())
        _check_recovery(report, c, _Window(before, start, end, time.time()))
        finish(c, learner, report)
        _audit_flood(report, c, flood, relay)
    finally:
        c.stop()
        for endpoint in (relay, flood):
            if endpoint is not None:
                endpoint.close()
    return report


def _check_recovery(report: FaultReport, c: Cluster, window: _Window) -> None:
    """Training speed before, during and after the flood; the first step after it."""
    records = read_ledger(c.run_dir)
    rates = {
        "before": steps_per_second(records, window.before, window.start),
        "during": steps_per_second(records, window.start, window.end),
        "after": steps_per_second(records, window.end, window.after),
    }
    report.details["steps_per_s"] = {k: round(v, 1) for k, v in rates.items()}
    report.check(
        "good traffic recovers: steps/s after the flood >= half of before",
        rates["after"] >= 0.5 * rates["before"] > 0,
        rates,
    )
    next_step = min((r["time"] for r in records if r["time"] > window.end), default=None)
    report.recovery_s = [next_step - window.end] if next_step else []


def _audit_flood(report: FaultReport, c: Cluster, flood: Flood, relay: CorruptingRelay) -> None:
    """After the run stopped: every bad frame rejected, counted and logged, every replay
    a duplicate, every spoiled weights message refused; what was injected, counted."""
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


# -- 4. impersonation with CURVE on -------------------------------------------------------------


def impersonation(
    work_dir: Path, model_dir: Path, seconds: float = 5.0, seed: int = 0
) -> FaultReport:
    """With CurveZMQ on: a rogue publisher without the learner's secret key, senders
    without an allowed client key, and eavesdroppers on the weights."""
    work_dir = Path(work_dir)
    keys = make_keys(work_dir / "keys")
    intruder = make_keys(work_dir / "intruder")
    stranger = _stranger_keys(work_dir, keys, intruder)
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
        rogue = _rogue_publisher(intruder)
        fooled = _worker_of(c, rogue)
        senders, eavesdroppers = _intruders(c, intruder, stranger)
        attackers = [*senders.values(), *eavesdroppers.values()]
        sent = _attack_while_training(report, c, senders, eavesdroppers, seconds)
        _check_fooled_worker(report, c, fooled)
        _audit_impersonation(report, c, finish(c, learner, report).senders, sent)
    finally:
        c.stop()
        for endpoint in [*attackers, rogue]:
            if endpoint is not None:
                endpoint.close()
        stop_authenticators()
    return report


def _stranger_keys(work_dir: Path, keys: Path, intruder: Path) -> Path:
    """A keys folder that knows the server's public key but whose own client key is not
    among those allowed."""
    stranger = work_dir / "stranger"
    stranger.mkdir()
    for name, source in (("server.key", keys), ("client.key_secret", intruder)):
        (stranger / name).write_bytes((source / name).read_bytes())
    return stranger


def _rogue_publisher(intruder: Path) -> VersionPublisher:
    """A publisher with keys of its own, not the learner's, that offers a version."""
    rogue = VersionPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=Curve(True, str(intruder))
    )
    try:
        rogue.publish(0, [("model.embed_tokens.weight", torch.zeros(8))])
    except BaseException:
        rogue.close()
        raise
    return rogue


def _worker_of(c: Cluster, rogue: VersionPublisher) -> subprocess.Popen:
    """A worker (index 9) pointed at the rogue publisher instead of the learner."""
    return c.worker(
        9,
        f"sync.version_port={rogue.publish_address.rsplit(':', 1)[1]}",
        f"sync.snapshot_port={rogue.snapshot_address.rsplit(':', 1)[1]}",
        "sync.connect_timeout=6",
    )


def _intruders(
    c: Cluster, intruder: Path, stranger: Path
) -> tuple[dict[str, TrajectorySender], dict[str, VersionSubscriber]]:
    """Senders to the learner and eavesdroppers on its weights, by name: without keys, with
    keys of their own, or with a client key the learner does not list."""
    version, snapshot = (f"tcp://127.0.0.1:{c.ports[k]}" for k in ("version", "snapshot"))
    address = f"tcp://127.0.0.1:{c.ports['trajectory']}"
    senders = {
        "plain": TrajectorySender(address, "plain"),
        "foreign keys": TrajectorySender(address, "foreign", curve=Curve(True, str(intruder))),
        "unlisted client key": TrajectorySender(
            address, "stranger", curve=Curve(True, str(stranger))
        ),
    }
    eavesdroppers = {
        "plain": VersionSubscriber(version, snapshot),
        "unlisted client key": VersionSubscriber(
            version, snapshot, curve=Curve(True, str(stranger))
        ),
    }
    return senders, eavesdroppers


def _attack_while_training(
    report: FaultReport,
    c: Cluster,
    senders: dict[str, TrajectorySender],
    eavesdroppers: dict[str, VersionSubscriber],
    seconds: float,
) -> int:
    """Runs the attack: the learner must keep training and no eavesdropper receive weights;
    returns the messages the senders sent."""
    step_before = c.last_step()
    sent = _attack(senders, eavesdroppers, seconds)
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
    return sent


def _check_fooled_worker(report: FaultReport, c: Cluster, fooled: subprocess.Popen) -> None:
    """The worker pointed at the rogue publisher took nothing from it, gave up with exit
    status 3 and logged the failed handshake."""
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


def _attack(
    senders: dict[str, TrajectorySender],
    eavesdroppers: dict[str, VersionSubscriber],
    seconds: float,
) -> int:
    """Every sender sends a genuine-looking trajectory and a lease request, and every
    eavesdropper listens, 20 times a second for `seconds`; returns the messages sent."""
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
    return sent


def _audit_impersonation(
    report: FaultReport, c: Cluster, trained_senders: set[str], sent: int
) -> None:
    """After the run stopped: only the real worker trained on, nothing from the intruders
    reached the application, their handshakes refused and logged."""
    learner_log = c.log("learner", tail=0)
    report.check(
        "only the real worker was trained on",
        all(s.startswith("0/") for s in trained_senders),
        sorted(trained_senders),
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
        n for source, n in logged_rejections(learner_log).items() if source.endswith("handshake")
    )
    report.check(
        "failed handshakes (no keys, wrong server key) were logged", handshakes >= 1, handshakes
    )
    report.details |= {
        "messages_sent_by_intruders": sent,
        "failed_handshakes_logged": handshakes,
    }
