"""`python -m asyncfp8.launch run.ray=true ...`: the run on a Ray cluster that is already
running (`RAY_ADDRESS` or `run.ray_address`; neither: the cluster of this node). The
learner's ranks and the workers are Ray actors, each holding one process of the usual kind,
so Ray places, watches and restarts them while ZeroMQ stays the data plane; `run.dir` must
be on storage every node sees (docs/clusters.md#on-a-ray-cluster)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from asyncfp8.checks import placement_of
from asyncfp8.launch.ending import report_end, report_guard_stop, resume_hint
from asyncfp8.launch.processes import CONFIG_ERROR, PORTS, log_tail
from asyncfp8.launch.progress import Progress
from asyncfp8.launch.ray_actors import (
    RayProcess,
    actor_options,
    bundle,
    connect,
    curve_keys,
    has_checkpoint,
    shortfall,
)
from asyncfp8.precision import PrecisionPolicy
from asyncfp8.run.files import CHECKPOINT_DIR, GUARD_STOPPED
from asyncfp8.run.process import worker_count

POLL_S = 0.5  # how often the driver looks at every actor (a local run's watch does the same)
# s a poll may stay unanswered before the driver sends another: a poll sent while Ray was
# restarting the actor can stay pending for good once the actor lives elsewhere.
POLL_RESEND_S = 2.0
# s an actor may take to start once placed: it imports torch and asyncfp8 (seconds on an
# idle node, a minute or more on a loaded one).
ACTOR_START_TIMEOUT = 300.0
WORKER_EXIT_WAIT = 30.0


def reclaim_ctrl_c() -> bool:
    """Puts Python's own SIGINT handler back when something replaced it; True if it had
    to. Ray's DeferSigint (ray/_private/utils.py), entered twice on the driver's main
    thread, leaves its deferring handler installed for good, and Ctrl-C then only sets a
    flag inside Ray: a CI run of a Ray job whose worker node had come back ran on for
    4 minutes after SIGINT. The driver calls this at every poll."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True


class RayRun:
    """One incarnation of the run on the cluster: the learner's placement group and rank
    actors, then the worker actors. A resumed learner gets a new incarnation."""

    def __init__(self, ray, cfg: DictConfig, common: list[str], run_dir: Path, workers: int):
        self.ray, self.cfg, self.common, self.run_dir = ray, cfg, common, run_dir
        self.workers_wanted = workers
        self.keys = curve_keys(cfg)
        self.remote = ray.remote(RayProcess)
        self.group = None
        self.ranks: list = []
        self.workers: list = []
        self.restarts: list[int] = []

    def place_learner(self) -> dict[str, Any]:
        """The placement group of the ranks, ready within run.ray_timeout or refused;
        the rank actors in it; rank 0's node (its IP and free ports)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        run = self.cfg.run
        spec = run.ray_learner
        self.group = placement_group([bundle(spec)] * run.learner_procs, strategy=spec.strategy)
        ready, _ = self.ray.wait([self.group.ready()], timeout=run.ray_timeout)
        if not ready:
            raise ValueError(
                f"run.ray=true: the learner's {run.learner_procs} rank(s) ({bundle(spec)} each, "
                f"{spec.strategy}) could not be placed within run.ray_timeout={run.ray_timeout} s; "
                f"free now: {self.free()}"
            )
        keys = self.keys["learner"] if self.keys else None
        for rank in range(run.learner_procs):
            name = "learner" if rank == 0 else f"learner-rank{rank}"
            strategy = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=rank
            )
            self.ranks.append(
                self.remote.options(
                    **actor_options(spec), max_restarts=0, scheduling_strategy=strategy
                ).remote(name, "asyncfp8.learner", self.common, str(self.run_dir), keys)
            )
        return self.ray.get(self.ranks[0].where.remote(), timeout=ACTOR_START_TIMEOUT)

    def free(self) -> dict[str, float]:
        return {k: v for k, v in self.ray.available_resources().items() if "group" not in k}

    def start(self) -> None:
        run = self.cfg.run
        where = self.place_learner()
        *ports, _ = where["ports"]
        address = [
            f"sync.host={where['ip']}",
            *(f"sync.{name}_port={port}" for name, port in zip(PORTS, ports, strict=True)),
        ]
        start_ranks(self.ray, self.ranks, where, [*address, "sync.bind=0.0.0.0"])
        keys = self.keys["worker"] if self.keys else None
        spec = run.ray_worker
        for index in range(self.workers_wanted):
            args = [*self.common, *address, f"run.worker_id=ray-{index}"]
            self.workers.append(
                self.remote.options(
                    **actor_options(spec),
                    max_restarts=run.worker_restarts,
                    scheduling_strategy=spec.strategy,
                ).remote(
                    f"worker-{index}",
                    "asyncfp8.worker",
                    args,
                    str(self.run_dir),
                    keys,
                    where["node"],
                )
            )
        self.restarts = [0] * len(self.workers)
        self.exits: list[dict] = []  # each restart, for summary.json's process_restarts
        print(
            f"[launch] on Ray: learner ({run.learner_procs} rank(s)) on {where['ip']}, "
            f"{len(self.workers)} worker actor(s); logs and metrics in {self.run_dir}",
            flush=True,
        )

    def watch(self, progress: Progress) -> tuple[str, int | str] | None:
        """Runs until the learner's rank 0 exits: None when it finished, else (who, the
        exit code or what happened). A worker actor that dies is Ray's to restart (it
        counts them: max_restarts); one it will not restart ends the run."""
        ray = self.ray
        actors = [*self.ranks, *self.workers]
        pids: dict[int, int] = {}
        polls = {i: actor.poll.remote() for i, actor in enumerate(actors)}
        sent = dict.fromkeys(polls, time.monotonic())
        while True:
            reclaim_ctrl_c()
            time.sleep(POLL_S)
            progress.update()
            done, _ = ray.wait(list(polls.values()), num_returns=len(polls), timeout=0)
            now = time.monotonic()
            for i in [i for i, ref in polls.items() if ref not in done]:
                if now - sent[i] > POLL_RESEND_S:
                    polls[i], sent[i] = actors[i].poll.remote(), now
            for i in [i for i, ref in polls.items() if ref in done]:
                worker = i - len(self.ranks)
                name = f"worker-{worker}" if worker >= 0 else f"learner rank {i}"
                try:
                    code, pid = ray.get(polls.pop(i))
                except ray.exceptions.ActorUnavailableError:
                    # Its node is not answering, or Ray is starting it again: ask again.
                    polls[i], sent[i] = actors[i].poll.remote(), now
                    continue
                except ray.exceptions.RayActorError as err:
                    if worker < 0:
                        return "learner", f"its actor (rank {i}) died: {first_line(err)}"
                    return name, (
                        f"its actor died and Ray starts it no more (run.worker_restarts="
                        f"{self.cfg.run.worker_restarts}): {first_line(err)}"
                    )
                if pids.setdefault(i, pid) != pid:
                    pids[i] = pid
                    self.restarts[worker] += 1
                    self.exits.append(
                        {"process": name, "exit_code": None, "error": "its actor died"}
                    )
                    progress.bar.write(
                        f"[launch] {name}'s actor died and Ray started it again "
                        f"({self.restarts[worker]}/{self.cfg.run.worker_restarts})"
                    )
                if code is None:
                    polls[i], sent[i] = actors[i].poll.remote(), now
                elif worker < 0 and code == 0:
                    if i == 0:
                        return None
                elif code != 0:
                    return ("learner" if worker < 0 else name), code

    def finish(self) -> None:
        """After the learner finished: the workers exit on their own (it told them)."""
        deadline = time.monotonic() + WORKER_EXIT_WAIT
        for index, actor in enumerate(self.workers):
            while time.monotonic() < deadline:
                try:
                    if self.ray.get(actor.poll.remote(), timeout=WORKER_EXIT_WAIT)[0] is not None:
                        break
                except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
                    break
                time.sleep(POLL_S)
            else:
                print(
                    f"[launch] worker-{index} had not exited 30 s after the run ended; stopping it"
                )

    def teardown(self, learner_grace: float) -> None:
        """Workers first (they flush), then the learner's ranks (rank 0 checkpoints),
        then the actors and the placement group go."""
        ray = self.ray
        for group, grace in ((self.workers, 10.0), (self.ranks, learner_grace)):
            stops = [actor.stop.remote(grace) for actor in group]
            for stop in stops:
                # its node is gone, or it is stuck: ray.kill below
                with contextlib.suppress(
                    ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError
                ):
                    ray.get(stop, timeout=grace + 10)
        for actor in [*self.workers, *self.ranks]:
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        self.workers, self.ranks, self.group = [], [], None


def rendezvous(rank: int, world: int, where: dict[str, Any]) -> dict[str, str]:
    """torch.distributed's environment rendezvous for one rank, at rank 0's node (its IP
    and a port its actor found free there). Each rank sees only its own GPU (Ray sets
    CUDA_VISIBLE_DEVICES per actor), so every rank's local rank is 0."""
    if world == 1:
        return {}  # one rank makes its own process group, as without Ray
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": where["ip"],
        "MASTER_PORT": str(where["ports"][-1]),
    }


def start_ranks(ray, ranks: list, where: dict[str, Any], extra: list[str]) -> None:
    """Starts every rank's process with its rendezvous; they meet at rank 0's node."""
    ray.get(
        [
            actor.start.remote(extra, rendezvous(rank, len(ranks), where))
            for rank, actor in enumerate(ranks)
        ]
    )


def first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__


def common_overrides(overrides: list[str], run_dir: Path, workers: int) -> list[str]:
    """The user's overrides for every process, less what each actor sets itself."""
    own = (
        "run.dir=",
        "run.worker_id=",
        "run.workers=",
        "run.placement=",
        "sync.host=",
        "sync.bind=",
        "sync.curve.keys_dir=",
        *(f"sync.{p}_port=" for p in PORTS),
    )
    return [
        *(o for o in overrides if not o.startswith(own)),
        f"run.dir={run_dir}",
        f"run.workers={workers}",
        "run.placement=separate",
    ]


def launch_on_ray(cfg: DictConfig, overrides: list[str], policy: PrecisionPolicy) -> int:
    """The run as Ray actors; the progress bar and the summary as a local run's."""
    run = cfg.run
    if placement_of(run) == "colocated":
        raise ValueError(
            "run.placement=colocated runs in one process; run.ray=true places the learner "
            "and the workers as actors: run.placement=separate (or auto)"
        )
    workers = worker_count(run)
    ray = connect(run, dict(os.environ))
    try:
        return run_on_ray(ray, cfg, overrides, policy, workers)
    finally:
        ray.shutdown()


def run_on_ray(ray, cfg: DictConfig, overrides: list[str], policy, workers: int) -> int:
    run = cfg.run
    missing = shortfall(
        bundle(run.ray_learner),
        run.learner_procs,
        bundle(run.ray_worker),
        workers,
        ray.available_resources(),
        ray.cluster_resources(),
    )
    if missing:
        raise ValueError(missing)
    run_dir = Path(run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    common = common_overrides(overrides, run_dir, workers)
    print(
        f"[launch] Ray cluster {ray.get_runtime_context().gcs_address}: learner "
        f"({run.learner_procs} rank(s)) + {workers} worker(s) ({cfg.engine.name} engine, "
        f"{policy.spec}, correction {cfg.correction.name}, {run.mode})",
        flush=True,
    )
    started = time.perf_counter()
    progress = Progress(run_dir, run.steps)
    resumes = 0
    while True:
        incarnation = RayRun(ray, cfg, common, run_dir, workers)
        try:
            incarnation.start()
            failed = incarnation.watch(progress)
        except KeyboardInterrupt:
            progress.bar.write("[launch] stopping: the learner checkpoints, the workers exit")
            incarnation.teardown(learner_grace=60.0)
            progress.close()
            print(resume_hint(run_dir))
            return 130
        except BaseException:
            incarnation.teardown(learner_grace=10.0)
            progress.close()
            raise
        if failed is None:
            incarnation.finish()
            incarnation.teardown(learner_grace=10.0)
            progress.update()
            progress.close()
            return report_end(run_dir, started, incarnation.exits)
        who, why = failed
        incarnation.teardown(learner_grace=60.0)
        if who == "learner" and why == GUARD_STOPPED:  # an outcome: resuming would undo it
            progress.close()
            return report_guard_stop(run_dir, started)
        if who == "learner" and why != CONFIG_ERROR and resumes < run.ray_learner_restarts:
            if has_checkpoint(run_dir):
                resumes += 1
                progress.bar.write(
                    f"[launch] the learner failed ({why}); resuming from its last checkpoint "
                    f"on the nodes left ({resumes}/{run.ray_learner_restarts})"
                )
                if "run.resume=true" not in common:
                    common.append("run.resume=true")
                continue
            progress.close()
            print(
                f"[launch] the learner failed ({why}) and {run_dir / CHECKPOINT_DIR} holds no "
                "checkpoint to resume from (is run.dir on storage every node sees?); stopped. "
                f"learner.log ends:\n{log_tail(run_dir / 'learner.log', 20)}"
            )
            return 1
        progress.close()
        log = run_dir / f"{who}.log"
        print(
            f"[launch] {who} failed ({why}); stopped the run. {log.name} ends:\n{log_tail(log, 20)}"
        )
        if why != CONFIG_ERROR:
            print(resume_hint(run_dir))
        return why if isinstance(why, int) and why > 0 else 1
