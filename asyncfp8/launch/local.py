"""One command for a run on this machine: the learner and its workers as processes (or,
colocated, the learner alone with its own engine), with the same Hydra overrides, one
progress bar, and a summary with plots; under srun or with run.ray=true, the same run on
Slurm or Ray. Ctrl-C stops the workers and lets the learner checkpoint; a worker that dies
is restarted (docs/running.md#what-each-process-does)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import asyncfp8.conf  # noqa: F401  (stores the config schemas before Hydra composes)
from asyncfp8.checks import auto_placement, check_config, placement_of
from asyncfp8.launch.ending import report_end, report_guard_stop, resume_hint
from asyncfp8.launch.processes import CONFIG_ERROR, PORTS, Process, free_ports, stop_all
from asyncfp8.launch.progress import Progress
from asyncfp8.launch.slurm import SlurmTask, role_of, slurm_task
from asyncfp8.models import run_model_dir
from asyncfp8.precision import PrecisionPolicy
from asyncfp8.report.metrics import loggers_of
from asyncfp8.run.failpoints import worker_environment
from asyncfp8.run.files import CHECKPOINT_DIR, GUARD_STOPPED, LEARNER_STATE
from asyncfp8.run.process import interrupt_requests, usable_cores, worker_count
from asyncfp8.run.resume import restore_on_resume


def check_start(cfg: DictConfig) -> PrecisionPolicy:
    """What can be checked before any process starts: the model (built or found once
    here, so that N+1 processes do not wait on its lock), the whole config as every
    process will check it (a user's policy class and reward imported here too), and, on
    resume, that there is a checkpoint to continue from."""
    loggers_of(cfg.run)  # first: a tracker not installed is named before the model is made
    model_dir = run_model_dir(cfg)
    checked = check_config(cfg, model_dir, "launcher")
    if cfg.run.resume and not any(
        (Path(cfg.run.dir) / CHECKPOINT_DIR).glob(f"step_*/{LEARNER_STATE}")
    ):
        raise ValueError(
            f"run.resume=true but {Path(cfg.run.dir) / CHECKPOINT_DIR} holds no checkpoint: the "
            "run stopped before its first one; start it again without run.resume"
        )
    return checked.policy


def settle_layout(
    cfg: DictConfig, overrides: list[str], policy: PrecisionPolicy, slurm: bool
) -> tuple[DictConfig, PrecisionPolicy]:
    """precision=mixed without precision.keep: the layout measured here, once, and added
    to `overrides`, so that the learner and every worker start with the same one (Slurm
    starts one launcher per task, each would measure: it must be given the layout)."""
    from asyncfp8.plan.layout import measure_for_run
    from asyncfp8.precision.sensitivity import keep_override, unmeasured_mixed

    if unmeasured_mixed(policy) is None:
        return cfg, policy
    if slurm:
        raise ValueError(
            "precision=mixed under srun needs its layout given (every task would measure its "
            "own): run `python -m asyncfp8.plan.layout` once with the same model, "
            "task and precision settings, and add the precision.keep=[...] it prints"
        )
    layout = measure_for_run(cfg, run_model_dir(cfg), cfg.run.dir)
    overrides.append(keep_override(layout))
    with open_dict(cfg):
        cfg.precision.keep = sorted(layout.keep)
    return cfg, check_start(cfg)


def chosen_ports(cfg: DictConfig, overrides: list[str]) -> list[int]:
    """The ports given on the command line (sync.version_port=... etc.), free ones for the rest."""
    free = iter(free_ports(len(PORTS)))
    given = {o.split("=", 1)[0] for o in overrides}
    return [
        cfg.sync[f"{name}_port"] if f"sync.{name}_port" in given else next(free) for name in PORTS
    ]


def launch(cfg: DictConfig, overrides: list[str], policy: PrecisionPolicy) -> int:
    run = cfg.run
    run_dir = Path(run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    placement, common = process_overrides(cfg, overrides, run_dir)
    learner = Process("learner", "asyncfp8.learner", common, run_dir, ranks=run.learner_procs)
    colocated = placement == "colocated"
    workers = [
        Process(
            f"worker-{i}",
            "asyncfp8.worker",
            [*common, f"run.worker_id={i}"],
            run_dir,
            env=worker_environment(),  # learner-only fail points are not theirs
        )
        for i in range(0 if colocated else worker_count(run))
    ]
    print(
        f"[launch] {run_shape(run, colocated, len(workers))} ({cfg.engine.name} engine, "
        f"{policy.spec}, correction {cfg.correction.name}, {run.mode}); logs and metrics in "
        f"{run_dir}",
        flush=True,
    )
    started = time.perf_counter()
    learner.start()
    for worker in workers:
        worker.start()
    progress = Progress(run_dir, run.steps)
    try:
        with interrupt_requests() as interrupted:
            failed = watch(learner, workers, progress, run.worker_restarts, interrupted)
    except KeyboardInterrupt:
        progress.bar.write("[launch] stopping: the learner checkpoints, the workers exit")
        stop_all(learner, workers)
        progress.close()
        print(resume_hint(run_dir))
        return 130
    progress.update()
    progress.close()
    if failed is not None:
        return report_failure(*failed, learner, workers, run_dir, started)
    for worker in workers:  # the learner told them the run is over
        if worker.wait(30) is None:
            print(f"[launch] {worker.name} had not exited 30 s after the run ended; stopping it")
            worker.signal(signal.SIGTERM)
    stop_all(learner, workers)
    return report_end(run_dir, started, [e for worker in workers for e in worker.exits])


def process_overrides(
    cfg: DictConfig, overrides: list[str], run_dir: Path
) -> tuple[str, list[str]]:
    """(the placement, the overrides every process of the run starts with). A fresh run's
    auto placement is resolved here and handed to the processes, so the run saves (and a
    resume keeps) what ran; a resumed run runs as it ran (auto read as separate)."""
    run = cfg.run
    ports = chosen_ports(cfg, overrides)
    placement, resolved = placement_of(run), []
    if run.placement == "auto" and not run.resume:
        gpus = 0 if run.device == "cpu" else torch.cuda.device_count()
        placement, why = auto_placement(cfg, gpus)
        resolved = [f"run.placement={placement}"]
        print(f"[launch] run.placement=auto: {placement} ({why})", flush=True)
    own = ("run.dir=", "run.worker_id=", "sync.host=", *(f"sync.{p}_port=" for p in PORTS))
    kept = [
        o
        for o in overrides
        if not o.startswith(own) and not (resolved and o.startswith("run.placement="))
    ]
    return placement, [
        *kept,
        f"run.dir={run_dir}",
        *resolved,
        "sync.host=127.0.0.1",
        *(f"sync.{name}_port={port}" for name, port in zip(PORTS, ports, strict=True)),
    ]


def run_shape(run: DictConfig, colocated: bool, workers: int) -> str:
    """The processes of the run, in words, for its first line."""
    ranks = f"{run.learner_procs} rank{'s' if run.learner_procs > 1 else ''}"
    if colocated:
        return (
            f"learner ({ranks}) generating with its own engine (run.placement=colocated; "
            "no worker processes)"
        )
    cores = "" if run.workers is not None else f" (run.workers=null: {usable_cores()} cores)"
    return f"learner ({ranks}) + {workers} worker{'s' if workers > 1 else ''}{cores}"


def report_failure(
    process: Process, code: int, learner: Process, workers: list[Process], run_dir, started
) -> int:
    """A process of the run failed: the others stopped, and what happened said."""
    stop_all(learner, workers)
    if process is learner and code == GUARD_STOPPED:
        return report_guard_stop(run_dir, started)
    why = "a configuration error: restarting cannot help" if code == CONFIG_ERROR else "failed"
    print(
        f"[launch] {process.name} exited with {code} ({why}); "
        f"stopped the other processes. {process.name}.log ends:\n{process.tail(20)}"
    )
    if code != CONFIG_ERROR:
        print(resume_hint(run_dir))
    return code if code > 0 else 1


def launch_under_slurm(
    cfg: DictConfig, overrides: list[str], policy: PrecisionPolicy, task: SlurmTask
) -> int:
    """`srun python -m asyncfp8.launch`: this task starts one process, its role
    (asyncfp8.launch.slurm: the first `run.learner_procs` tasks are the learner's ranks, the others
    workers); the learner's rank 0 task also shows the progress bar and writes the summary.
    `run.dir` must be on storage every node sees (default: runs/slurm-<job id>)."""
    run = cfg.run
    if placement_of(run) == "colocated":
        raise ValueError(
            "run.placement=colocated runs in one process on one machine; under srun each "
            "task is a process of its own: run.placement=separate"
        )
    role = role_of(task, run.learner_procs)
    given = {o.split("=", 1)[0] for o in overrides}
    if "run.workers" in given and run.workers != role.workers:
        raise ValueError(
            f"run.workers={run.workers}, but the Slurm job step has {task.ntasks} tasks for "
            f"{run.learner_procs} learner rank(s): {role.workers} workers (drop run.workers)"
        )
    # Every task must agree on the directory: a timestamp would differ between nodes.
    run_dir = Path(run.dir if "run.dir" in given else f"runs/slurm-{task.job_id}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    own = ("run.dir=", "run.worker_id=", "run.workers=", "sync.host=", "sync.bind=")
    common = [
        *(o for o in overrides if not o.startswith(own)),
        f"run.dir={run_dir}",
        f"run.workers={role.workers}",
        f"sync.host={role.learner_host}",
    ]
    if role.kind == "learner":
        name = "learner" if role.index == 0 else f"learner-rank{role.index}"
        args = [*common, "sync.bind=0.0.0.0"]
        process = Process(name, "asyncfp8.learner", args, run_dir, env=role.env)
    else:
        name = f"worker-{role.index}"
        args = [*common, f"run.worker_id=slurm-{task.procid}"]
        process = Process(name, "asyncfp8.worker", args, run_dir)
    print(
        f"[launch] Slurm task {task.procid} of {task.ntasks} on {task.node}: {name} (the "
        f"learner is on {role.learner_host}; {policy.spec}); log {process.log_path}",
        flush=True,
    )
    started, wall_started = time.perf_counter(), time.time()
    process.start()
    main_task = role.kind == "learner" and role.index == 0
    try:
        if main_task:
            progress = Progress(run_dir, run.steps)
            with interrupt_requests() as interrupted:
                failed = watch(process, [], progress, 0, interrupted)
            progress.update()
            progress.close()
        else:
            restarts = run.worker_restarts if role.kind == "worker" else 0
            failed = wait_for(process, restarts, ended=lambda: run_ended(run_dir, wall_started))
    except KeyboardInterrupt:
        stop_all(process, [])
        print(resume_hint(run_dir))
        return 130
    if failed is not None:
        _, code = failed
        if main_task and code == GUARD_STOPPED:
            return report_guard_stop(run_dir, started)
        print(f"[launch] {name} exited with {code}; {name}.log ends:\n{process.tail(20)}")
        if main_task and code != CONFIG_ERROR:
            print(resume_hint(run_dir))
        return code if code > 0 else 1
    return report_end(run_dir, started) if main_task else 0


def run_ended(run_dir: Path, since: float) -> bool:
    """Task 0 wrote the run's summary since `since` (time.time()): the learner finished."""
    summary = run_dir / "summary.json"
    return summary.is_file() and summary.stat().st_mtime >= since


def wait_for(
    process: Process, restarts: int, ended: Callable[[], bool] = lambda: False
) -> tuple[Process, int] | None:
    """Waits for one process (a worker restarted up to `restarts` times): None when it
    finished, or exited after the run `ended` (a worker that started late under load
    waits for a learner that is gone), else the process and its exit code."""
    while True:
        code = process.popen.wait()
        if code == 0:
            return None
        if code != CONFIG_ERROR and ended():
            print(f"[launch] {process.name} exited with {code} after the run ended: done")
            return None
        if code == CONFIG_ERROR or process.restarts >= restarts:
            return process, code
        print(
            f"[launch] {process.name} exited with {code}; restart {process.restarts + 1}/{restarts}"
        )
        process.restart(code)


def watch(
    learner: Process,
    workers: list[Process],
    progress: Progress,
    restarts: int,
    interrupted: threading.Event,
    poll_s: float = 0.5,
) -> tuple[Process, int] | None:
    """Runs until the learner exits: None when it finished, else the first process whose
    failure ends the run (the learner, a worker with a configuration error, a worker
    that used up its restarts) and its exit code. Checked twice a second, so a failure
    is reported within a second of the process's exit; KeyboardInterrupt once
    `interrupted` is set (Ctrl-C, `interrupt_requests`)."""
    while True:
        time.sleep(poll_s)
        if interrupted.is_set():
            raise KeyboardInterrupt
        progress.update()
        code = learner.poll()
        if code is not None:
            return None if code == 0 else (learner, code)
        for worker in workers:
            code = worker.poll()
            if code in (None, 0):
                continue
            if code == CONFIG_ERROR or worker.restarts >= restarts:
                return worker, code
            progress.bar.write(
                f"[launch] {worker.name} exited with {code}; restart "
                f"{worker.restarts + 1}/{restarts}. Its log ends:\n{worker.tail(5)}"
            )
            worker.restart(code)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    overrides = list(HydraConfig.get().overrides.task)
    try:
        cfg, changes = restore_on_resume(cfg, overrides)
        if cfg.run.resume:
            print(
                f"[launch] resuming {cfg.run.dir} with its saved settings"
                + ("; changed: " + "; ".join(changes) if changes else ""),
                flush=True,
            )
        policy = check_start(cfg)
        task = slurm_task(cfg.run.slurm, os.environ)
        cfg, policy = settle_layout(cfg, overrides, policy, slurm=task is not None)
        if cfg.run.ray:
            if task is not None:
                raise ValueError(
                    f"run.ray=true and srun (Slurm task {task.procid} of {task.ntasks}, "
                    f"run.slurm={cfg.run.slurm}) both place the processes: drop run.ray, or "
                    "start one driver (srun --ntasks=1, or run.slurm=false)"
                )
            from asyncfp8.launch.ray_cluster import launch_on_ray

            sys.exit(launch_on_ray(cfg, overrides, policy))
        if task is not None:
            sys.exit(launch_under_slurm(cfg, overrides, policy, task))
    except (ValueError, FileNotFoundError) as err:
        print(f"[launch] {err}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
    sys.exit(launch(cfg, overrides, policy))
