"""A learner and workers started as separate processes on loopback, as they would run
on several hosts, with the handles to kill, pause and restart them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncfp8.launch.processes import free_ports
from asyncfp8.learner.ledger import read_ledger

# A few small steps: the tiny model trains one in about 50 ms on a CPU core.
SMALL_RUN = (
    "task=arithmetic",  # what the tiny test model was warm-started on
    "run.groups_per_step=4",
    "run.group_size=4",
    "run.lease_groups=2",
    "run.max_new_tokens=6",
    "run.threads=1",
    "run.tensorboard=false",
)


class Cluster:
    def __init__(self, run_dir: Path, model_dir: Path, *overrides: str):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(("version", "snapshot", "trajectory"), free_ports(3), strict=True))
        self.common = [
            f"model.path={model_dir}",
            f"run.dir={self.run_dir}",
            f"sync.version_port={self.ports['version']}",
            f"sync.snapshot_port={self.ports['snapshot']}",
            f"sync.trajectory_port={self.ports['trajectory']}",
            *SMALL_RUN,
            *overrides,
        ]
        self.processes: list[subprocess.Popen] = []

    def start(
        self,
        module: str,
        name: str,
        *overrides: str,
        env: dict[str, str] | None = None,
        procs: int = 1,
        host: list[str] | None = None,
    ) -> subprocess.Popen:
        """`python -m asyncfp8.<module>`, or with `procs` > 1 that many ranks under torchrun
        (in a process group of their own: `kill` takes them all). `host` runs it on another
        host: the command prefix that enters it (`asyncfp8.chaos.hosts.Hosts.command`)."""
        log = (self.run_dir / f"{name}.log").open("a")
        runner = [sys.executable, "-m"]
        if procs > 1:
            runner += ["torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", "-m"]
        process = subprocess.Popen(
            [*(host or []), *runner, f"asyncfp8.{module}", *self.common, *overrides],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ | (env or {}),
            start_new_session=procs > 1,
        )
        log.close()
        self.processes.append(process)
        return process

    def learner(
        self,
        *overrides: str,
        env: dict[str, str] | None = None,
        procs: int = 1,
        host: list[str] | None = None,
    ) -> subprocess.Popen:
        return self.start("learner", "learner", *overrides, env=env, procs=procs, host=host)

    @staticmethod
    def kill(process: subprocess.Popen) -> None:
        """SIGKILL to the process and, when it leads a group (torchrun), to all of it."""
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
        try:
            # SIGKILL cannot be caught: a process still there after a minute is stuck in
            # the kernel, and the suite should say so rather than hang to its timeout.
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"pid {process.pid} ({' '.join(map(str, process.args))[:200]}) is still "
                "running 60 s after SIGKILL"
            ) from None

    def worker(
        self,
        index: int,
        *overrides: str,
        log_name: str | None = None,
        host: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        return self.start(
            "worker",
            log_name or f"worker-{index}",
            f"run.worker_id={index}",
            *overrides,
            host=host,
            env=env,
        )

    def last_step(self) -> int:
        records = read_ledger(self.run_dir)
        return records[-1]["step"] if records else 0

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.last_step() >= step:
                return
            time.sleep(0.05)
        raise TimeoutError(f"step {step} not reached in {timeout} s:\n{self.log('learner')}")

    def log(self, name: str, tail: int = 3000) -> str:
        path = self.run_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text[-tail:] if tail else text

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                self.kill(process)  # SIGKILL also ends a process paused with SIGSTOP
