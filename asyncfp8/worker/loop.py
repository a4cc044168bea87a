"""A rollout worker (`python -m asyncfp8.worker engine=vllm sync.host=10.0.0.5`): one engine,
fed versions by the learner. The loop applies the newest complete version (between
generations, or between decode steps with `run.inflight_updates`), leases prompts, generates
and scores `n` samples of each and pushes them back; when the learner says wait (the
staleness bound), it waits for the next version rather than make samples to be dropped."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import hydra
import torch
import zmq
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import asyncfp8.conf  # noqa: F401  (stores the config schemas before Hydra composes)
from asyncfp8.checks import check_config
from asyncfp8.engines import EngineUnsupported, build_engine
from asyncfp8.engines.base import InflightUpdates, KVCacheReset, SpeculativeDrafts
from asyncfp8.models import run_model_dir
from asyncfp8.precision.registry import plain
from asyncfp8.refit.probe import Probe, RefitChecker
from asyncfp8.run.failpoints import check_process
from asyncfp8.run.process import StopFlag, set_threads, setup_logging, worker_count
from asyncfp8.run.refit_faults import RefitFault
from asyncfp8.run.resume import CONFIG_FILE, restore_on_resume
from asyncfp8.sync import HandshakeWatch, TrajectorySender, VersionSubscriber
from asyncfp8.sync.endpoints import curve, endpoints
from asyncfp8.worker.rollout import ROLLOUT_STATS, roll_out

REQUEST_AGAIN_AFTER = 5.0  # s without an answer to a lease request: ask again
SNAPSHOT_AFTER = 2.0  # s waiting for a leased version before asking for a snapshot
DRAFTER_SAVE_EVERY = 60.0  # s between saves of the online drafter's state


class LearnerGone(RuntimeError):
    pass


class RefitFailed(RuntimeError):
    """A version's refit probe failed twice (as received, then from a full snapshot): the
    engine does not run what the learner sent. Exit code 4 (the launcher may restart the
    worker: a fresh engine)."""


class WorkerMisconfigured(RuntimeError):
    """The learner's versions do not fit this worker (another model or precision):
    restarting it cannot help, so it exits with the configuration-error code, 2."""


class Worker:
    def __init__(self, cfg: DictConfig):
        self.cfg, run = cfg, cfg.run
        self.id = (
            str(run.worker_id)
            if run.worker_id is not None
            else f"{socket.gethostname()}-{os.getpid()}"
        )
        self.log = setup_logging(f"worker-{self.id}")
        self.stop = StopFlag()
        threads = set_threads(run.threads, worker_count(run) + 1)
        model_dir = run_model_dir(cfg)
        checked = check_config(cfg, model_dir, "worker")  # before the engine loads anything
        self.task, self.policy = checked.task, checked.policy
        self.engine = build_engine(cfg.engine, str(model_dir), self.policy)
        if run.inflight_updates:
            engine = self.engine
            if not (isinstance(engine, InflightUpdates) and engine.supports_inflight_updates):
                raise EngineUnsupported(
                    f"run.inflight_updates=true: engine {self.engine.name} cannot apply a "
                    "version between decode steps (engine=torch with engine.slots=N can)"
                )
            # Between two decode steps the engine asks for the newest complete version;
            # it is applied whole there (update_weights checks it first).
            self.engine.between_steps = self._apply_between_steps
        # What every version's header must say: a learner with another precision (or
        # other parameters of it) makes tensors this engine was not built for.
        self.expected_header = (self.policy.spec, plain(self.policy.engine_config()))
        addresses, secure = endpoints(cfg.sync, "connect"), curve(cfg.sync)
        self.watch = HandshakeWatch()  # logs a learner that fails to authenticate
        self.subscriber = VersionSubscriber(
            addresses.versions,
            addresses.snapshots,
            curve=secure,
            watch=self.watch,
            transport=cfg.sync.transport,
        )
        self.sender = TrajectorySender(
            addresses.trajectories,
            self.id,
            curve=secure,
            resend_after=cfg.sync.resend_after,
            watch=self.watch,
        )
        self.stats = dict.fromkeys(ROLLOUT_STATS, 0.0)
        self.probe = RefitChecker.for_worker(cfg.sync.probe, self.engine, self.policy)
        self.fault = RefitFault.from_env()  # None outside the reliability suite
        # The online drafter (engine.speculative): its state is this worker's checkpoint,
        # saved under the run directory and taken up again by a worker of the same id.
        self.drafter_path = Path(run.dir) / "drafters" / f"worker-{self.id}.pt"
        self.drafter_saved = time.monotonic()
        if self._speculating() and self.drafter_path.is_file():
            self.engine.load_drafter_state(torch.load(self.drafter_path, weights_only=False))
            self.log.info("drafter restored from %s", self.drafter_path)
        self.log.info(
            "engine %s, precision %s (%s), %d torch threads; learner at %s, versions over %s%s",
            self.engine.name,
            self.policy.spec,
            self.policy.engine_config() or "no engine options",
            threads,
            addresses.trajectories,
            "shared memory" if self.subscriber.shm else "ZeroMQ",
            ", CurveZMQ on" if secure is not None else "",
        )

    def run(self) -> int:
        sync = self.cfg.sync
        self.log.info("waiting up to %d s for the learner's first version", sync.connect_timeout)
        if not self._apply_newest(timeout=sync.connect_timeout):
            if self.stop:  # stopped while waiting (the launcher, after the learner failed)
                self.log.info(
                    "stopping on signal %s before the learner's first version", self.stop.signal
                )
                self.close()
                return 0
            failed = self.watch.failures
            raise LearnerGone(
                f"no version from a learner at {endpoints(sync, 'connect').versions} within "
                f"{sync.connect_timeout} s (sync.connect_timeout): is it running, and are "
                "sync.host and the ports the learner's?"
                + (
                    f" {failed} handshakes with it failed: with CURVE on, it must hold the "
                    f"server key of {sync.curve.keys_dir}, and this worker's key must be in "
                    "its clients/."
                    if failed
                    else ""
                )
            )
        finished = False  # the learner said the run is over
        while not self.stop:
            self._apply_newest(timeout=0)
            reply = self._ask_for_work()
            if reply.get("done"):
                finished = not self.stop
                self.log.info(
                    f"stopping on signal {self.stop.signal}"
                    if self.stop
                    else "the learner says the run is over"
                )
                break
            if "wait" in reply:
                paused = time.perf_counter()
                self._apply_newest(timeout=float(reply["wait"]))
                self.stats["paused_s"] += time.perf_counter() - paused
                continue
            self._wait_for_version(int(reply["min_version"]))
            self._generate(reply)
        flushed = self.sender.flush(timeout=5 if finished else 30)
        if not flushed and finished:
            # Everything sent before the request that "done" answered was acknowledged
            # before that answer (one ordered connection); these went out afterwards, for
            # a lease granted before the end, and the learner no longer takes any.
            self.log.info(
                "%d trajectories sent after the run ended were not needed",
                len(self.sender.outbox),
            )
            flushed = True
        elif not flushed:
            self.log.warning(
                "%d trajectories were never acknowledged by the learner (sequence numbers %s)",
                len(self.sender.outbox),
                sorted(self.sender.outbox)[:20],
            )
        self.log.info(
            "done: %d samples, %d tokens at %.0f tokens/s, %d versions applied "
            "(%d between decode steps)",
            self.stats["samples"],
            self.stats["tokens"],
            self.stats["tokens"] / max(self.stats["generate_s"], 1e-9),
            self.stats["updates"],
            self.stats["inflight_updates"],
        )
        self.close()
        return 0 if flushed else 1

    def _apply_newest(self, timeout: float) -> bool:
        """Applies the newest complete version that arrives within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            version = self.subscriber.poll(timeout_ms=int(min(left, 0.2) * 1000))
            if version is not None:
                self._apply(version)
                return True
            if time.monotonic() >= deadline or self.stop:
                return False

    def _apply(self, version, retry_of: int | None = None) -> None:
        """Applies a version and checks its refit probe before anything generates with it.
        A version the engine refuses, after one it took, or whose probe fails is answered
        by a full snapshot, applied and checked once more."""
        self._check_header(version)
        probe, sent = Probe.take(version.extra, version.manifest)
        weights, extra = version.weights, sent
        if self.fault is not None:  # the reliability suite's refit faults (run/refit_faults.py)
            weights, extra = self.fault.tamper(version.number, weights, extra, version.manifest)
        started = time.perf_counter()
        try:
            if self.fault is None or not self.fault.skips_update(version.number):
                self.engine.update_weights(version.number, weights, extra, version.manifest)
        except ValueError as err:
            refused = f"version {version.number} does not fit this worker's engine: {err}"
            if self.engine.version is None:  # the first version: the configuration
                raise WorkerMisconfigured(
                    f"worker {self.id}: {refused}. Do the learner and the worker use the same "
                    "model= and precision=?"
                ) from None
            if retry_of is not None:  # the snapshot too, after versions that fitted
                self.stats["refit/failures"] += 1
                raise RefitFailed(f"worker {self.id}: {refused}") from None
            self._refit_failed(version, f"{refused} (version {self.engine.version} fitted)")
            return
        self.stats["update_s"] += time.perf_counter() - started
        self.stats["updates"] += 1
        if probe is not None and self.probe is not None:
            check = self.probe.check(version.number, probe, sent)
            self.stats |= check.metrics()
            self.stats["refit/probe_s"] += self.probe.last_seconds
            self.stats["refit/probes"] += 1
            if not check.passed:
                if retry_of is not None:
                    self.stats["refit/failures"] += 1
                    raise RefitFailed(f"worker {self.id}: {check.describe()}")
                self._refit_failed(version, check.describe())
                return
        if retry_of is not None:
            self.stats["refit/recovered"] += 1
            self.log.warning(
                "version %d from a full snapshot passed its refit checks (version %d had not)",
                version.number,
                retry_of,
            )

    def _refit_failed(self, version, why: str) -> None:
        """Nothing generates with `version`: its KV cache is wiped (it may hold what the
        damaged version computed) and a full snapshot replaces it, checked again."""
        self.stats["refit/failures"] += 1
        self.log.warning("%s. Asking the learner for a full snapshot to apply again.", why)
        if isinstance(self.engine, KVCacheReset):
            try:
                self.engine.clear_kv_cache()
            except Exception as err:  # the snapshot may still repair it: its probe decides
                self.log.warning("could not wipe the engine's KV cache: %s", err)
        self._apply(self._snapshot(), retry_of=version.number)

    def _snapshot(self):
        """The learner's latest full version, asked for now, even if it is the version
        just applied (a newer version already on its way may come first: either does)."""
        self.subscriber.refetch()
        deadline = time.monotonic() + self.cfg.sync.learner_timeout
        while time.monotonic() < deadline and not self.stop:
            version = self.subscriber.poll(timeout_ms=200)
            if version is not None:
                return version
        raise LearnerGone(
            f"no snapshot from the learner within {self.cfg.sync.learner_timeout} s "
            "(sync.learner_timeout) after a failed refit probe"
        )

    def _apply_between_steps(self) -> None:
        """The engine's hook between two decode steps (run.inflight_updates)."""
        if self._apply_newest(timeout=0):
            self.stats["inflight_updates"] += 1

    def _check_header(self, version) -> None:
        policy, engine_config = self.expected_header
        if (version.policy, plain(version.engine_config)) != (policy, engine_config):
            raise WorkerMisconfigured(
                f"worker {self.id}: version {version.number} is for precision {version.policy!r} "
                f"(engine config {version.engine_config}), but this worker's {self.engine.name} "
                f"engine runs {policy!r} ({engine_config}). Start the learner and the workers "
                "with the same precision= overrides."
            )

    def _wait_for_version(self, wanted: int) -> None:
        started = time.monotonic()
        asked = started
        while self.engine.version is None or self.engine.version < wanted:
            if time.monotonic() - started > self.cfg.sync.learner_timeout:
                raise LearnerGone(
                    f"the learner leased work for version {wanted} but it did not arrive within "
                    f"{self.cfg.sync.learner_timeout} s (have {self.engine.version})"
                )
            if time.monotonic() - asked > SNAPSHOT_AFTER:
                # The version exists (the lease says so) but never came on the PUB socket,
                # e.g. published by a restarted learner before this worker reconnected.
                asked = time.monotonic()
                self.subscriber.request_snapshot()
            self._apply_newest(timeout=0.5)

    def _ask_for_work(self) -> dict:
        self.sender.pump()
        if any(reply.get("done") for reply in self.sender.replies):
            return {"done": True}  # leases queued before it are no longer needed
        if self.sender.replies:  # an extra answer to a request sent twice: use it
            return self.sender.replies.popleft()
        want = self.cfg.run.lease_groups
        self.stats["rejected_versions"] = float(self.subscriber.rejected)
        asked = time.monotonic()
        self.sender.request_lease(want, self.engine.version, self.stats)
        while not self.sender.replies:
            self.sender.pump(timeout_ms=100)
            if self.stop:
                return {"done": True}
            silent = time.monotonic() - self.sender.last_heard
            if silent > self.cfg.sync.learner_timeout:
                raise LearnerGone(
                    f"no answer from the learner for {silent:.0f} s (sync.learner_timeout)"
                )
            if time.monotonic() - asked > REQUEST_AGAIN_AFTER:
                # A request sent while the learner was restarting can be lost; an extra
                # lease is not: it is used next.
                asked = time.monotonic()
                self.sender.request_lease(want, self.engine.version, self.stats)
            self._apply_newest(timeout=0)
        return self.sender.replies.popleft()

    def _generate(self, lease: dict) -> None:
        started = time.perf_counter()
        trajectories = roll_out(self.engine, self.task, lease)
        self.stats["generate_s"] += time.perf_counter() - started
        for trajectory in trajectories:
            self.sender.send(trajectory, timeout=self.cfg.sync.learner_timeout)
            self.stats["tokens"] += len(trajectory.token_ids)
        self.stats["samples"] += len(trajectories)
        self._drafter_checkpoint()
        self.sender.pump()

    def _speculating(self) -> bool:
        """Whether the engine runs an online drafter, whose state this worker keeps."""
        return isinstance(self.engine, SpeculativeDrafts) and self.engine.speculating

    def _drafter_checkpoint(self, force: bool = False) -> None:
        """The drafter's metrics go out with the next lease request; its state is saved
        at most every DRAFTER_SAVE_EVERY s (and at the end), written whole then renamed."""
        if not self._speculating():
            return
        self.stats |= self.engine.speculation_metrics()
        if not force and time.monotonic() - self.drafter_saved < DRAFTER_SAVE_EVERY:
            return
        self.drafter_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.drafter_path.with_suffix(".tmp")
        torch.save(self.engine.drafter_state(), partial)
        partial.replace(self.drafter_path)
        acceptance = self.engine.acceptance_by_version()
        self.drafter_path.with_suffix(".acceptance.json").write_text(
            json.dumps({str(v): record for v, record in acceptance.items()}, indent=1)
        )
        self.drafter_saved = time.monotonic()

    def close(self) -> None:
        self._drafter_checkpoint(force=True)
        self.subscriber.close()
        self.sender.close()
        self.watch.close()
        self.engine.close()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        if cfg.run.resume and (Path(cfg.run.dir) / CONFIG_FILE).is_file():
            # Started with a resuming learner on this host (the launcher): the saved run.
            cfg, _ = restore_on_resume(cfg, list(HydraConfig.get().overrides.task))
        check_process("worker")
        worker = Worker(cfg)
    except (ValueError, FileNotFoundError, EngineUnsupported) as err:
        print(f"worker: {err}", file=sys.stderr)
        sys.exit(2)
    except zmq.ZMQError as err:
        print(f"worker: cannot connect to the learner at {cfg.sync.host}: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(worker.run())
    except LearnerGone as err:
        worker.log.error("%s", err)
        worker.close()
        sys.exit(3)
    except WorkerMisconfigured as err:
        worker.log.error("%s", err)
        worker.close()
        sys.exit(2)
    except RefitFailed as err:
        worker.log.error("%s", err)
        worker.close()
        sys.exit(4)
