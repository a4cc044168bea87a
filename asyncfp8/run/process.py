"""What the learner and every worker set up the same way: logging, torch threads, the
counts they refuse at start, and stopping cleanly on SIGTERM / Ctrl-C."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from typing import Any

import torch


def check_counts(cfg: Any) -> None:
    """Settings that must be positive integers, refused now rather than misbehaving later."""
    counts = {
        f"run.{key}": cfg.run[key]
        for key in (
            "steps",
            "groups_per_step",
            "lease_groups",
            "max_new_tokens",
            "checkpoint_every",
            "keep_checkpoints",
        )
    } | {"sync.every": cfg.sync.every}
    export_every = cfg.run.export_every
    if not isinstance(export_every, int) or export_every < 0:
        raise ValueError(
            "run.export_every must be 0 (only at the end) or a positive integer, "
            f"got {export_every!r}"
        )
    for key, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies (even by SIGKILL): no orphans."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no such guard
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


#: `run.workers=null` starts at most this many workers: what the separate placement was
#: measured with on machines of 3 or more cores (docs/results.md).
MAX_AUTO_WORKERS = 2


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (what `taskset`, a container's
    cpuset or Slurm grants it), not every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def worker_count(run: Any) -> int:
    """`run.workers`, or for null one worker per core the learner ranks leave, between 1
    and MAX_AUTO_WORKERS. On the 2-core dev VM one worker beside the learner trained 112.6
    samples/s where two (three processes on two cores) trained 105.1, means of two seeds
    (bench/peers.py, docs/results.md): oversubscribed processes slow each other down."""
    if run.workers is not None:
        return int(run.workers)
    spare = usable_cores() - int(run.learner_procs)
    return min(MAX_AUTO_WORKERS, max(1, spare))


def sharing_processes(processes: int) -> int:
    """How many of the run's `processes` share this process's cores: all of them when
    they inherited one CPU affinity (the launcher's children, a taskset), only this one
    when Slurm bound each of several tasks to cores of its own (srun --cpu-bind: the
    affinity is a part of the machine)."""
    tasks = int(os.environ.get("SLURM_NTASKS") or 1)
    bound = usable_cores() < (os.cpu_count() or 1)
    return 1 if tasks > 1 and bound else processes


def thread_count(requested: int | None, processes: int) -> int:
    """`requested`, or this process's share of its usable cores (oversubscribed threads
    spin and slow every process down)."""
    return requested or max(1, usable_cores() // sharing_processes(processes))


def set_threads(requested: int | None, processes: int) -> int:
    """Sets and returns torch's threads for this process, one of `processes` the run
    has here (`thread_count`)."""
    threads = thread_count(requested, processes)
    torch.set_num_threads(threads)
    return threads


def setup_logging(name: str) -> logging.Logger:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    return logging.getLogger(f"asyncfp8.{name.split('-')[0]}")


@contextlib.contextmanager
def interrupt_requests():
    """Ctrl-C (SIGINT) kept as a flag while the launcher watches its processes; its loop
    raises KeyboardInterrupt at the next check. Python's own KeyboardInterrupt is raised
    wherever the main thread is when the signal lands, and a finalizer running at that
    moment drops it ("Exception ignored in ..."): a run would ignore its Ctrl-C. The
    previous handler is back on exit, so a second Ctrl-C while stopping acts at once."""
    requested = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda _sig, _frame: requested.set())
    try:
        yield requested
    finally:
        signal.signal(signal.SIGINT, previous)


class StopFlag:
    """Set by SIGTERM or SIGINT: the loop finishes what it is doing (a step, a
    generation), checkpoints or flushes, and exits. A second signal exits at once."""

    def __init__(self):
        self.event = threading.Event()
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, sig, _frame):
        if self.event.is_set():
            raise SystemExit(128 + sig)
        self.signal = sig
        self.event.set()

    def __bool__(self) -> bool:
        return self.event.is_set()
