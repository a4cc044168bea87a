"""A Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`: a GCS and
one raylet per node, each node with resources of its own), and a run of the launcher
against it, as `python -m asyncfp8.launch run.ray=true` runs on a real cluster."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from asyncfp8.chaos.cluster import SMALL_RUN
from asyncfp8.learner.ledger import read_ledger

# A node that stops answering is declared dead after about 2 s (Ray's default: 15 s), so
# that a test waits seconds, not a quarter of a minute, for Ray to restart its actors.
HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}

# Each learner rank asks for one `learner`, each worker for one `rollout`: the test says
# which node may hold what by giving nodes these resources.
PLACED = (
    "run.ray_learner.resources={learner:1}",
    "run.ray_worker.resources={rollout:1}",
    "run.ray_timeout=30",
)


class RayNodes:
    """The head holds no CPU (nothing is placed there, as on a KubeRay head); the
    nodes added are the ones the run uses and the test removes. `remove_all` leaves the
    head alone again, so that a failed test's nodes cannot hold the next test's run
    (in one CI run they did: the next test's learner started on the failed test's
    learner node, and removing the node the test had added removed nothing in use)."""

    def __init__(self):
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "_system_config": HEALTH_CHECKS,
            },
        )
        self.address = self.cluster.address
        self.added: list = []

    def add(self, **resources: float):
        node = self.cluster.add_node(num_cpus=1, resources=resources)
        self.cluster.wait_for_nodes()
        self.added.append(node)
        return node

    def remove(self, node) -> None:
        """The node as a power cut leaves it: its raylet and every process under it
        (actors and the asyncfp8 processes they hold) killed at once."""
        raylet = node.all_processes["raylet"][0].process.pid
        for pid in descendants(raylet):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.cluster.remove_node(node, allow_graceful=False)
        self.added.remove(node)

    def remove_all(self) -> None:
        """Every node added and not yet removed, then until the cluster counts the head
        alone (a removed node's resources are gone from what the next run sees)."""
        for node in list(self.added):
            self.remove(node)
        self.cluster.wait_for_nodes()

    def shutdown(self) -> None:
        self.cluster.shutdown()


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def processes_under(node, module: str) -> list[int]:
    """The `python -m <module>` processes a node runs (under its raylet)."""
    raylet = node.all_processes["raylet"][0].process.pid
    found = []
    for pid in descendants(raylet):
        with contextlib.suppress(OSError):
            if module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(pid)
    return found


def wait_until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.2)


class Driver(subprocess.Popen):
    """The launcher's process, its output read as it comes by a thread of its own: a test
    can wait for a line the driver prints, and the driver never blocks on a full pipe
    (Ray forwards its daemons' logs to the driver: more than a pipe holds)."""

    def __init__(self, command: list[str], env: dict[str, str]):
        super().__init__(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.chunks: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.stdout:
            self.chunks.append(line)

    def output(self) -> str:
        return "".join(self.chunks)

    def wait_for_output(self, text: str, timeout: float = 120) -> None:
        """Until the driver has printed `text`."""
        wait_until(lambda: text in self.output(), f"the driver printing {text!r}", timeout)


def ray_launch(run_dir: Path, model_dir: Path, address: str, *overrides: str) -> Driver:
    """The driver, as a user starts it: RAY_ADDRESS names the cluster."""
    return Driver(
        [
            sys.executable,
            "-m",
            "asyncfp8.launch",
            "run.ray=true",
            f"model.path={model_dir}",
            f"run.dir={run_dir}",
            *SMALL_RUN,
            "eval.every=0",
            *PLACED,
            *overrides,
        ],
        env={**os.environ, "RAY_ADDRESS": address},
    )


def wait_for_step(run_dir: Path, step: int, driver: Driver, timeout: float = 400) -> None:
    """Until the learner's ledger holds `step` (the driver still running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_ledger(run_dir) if (run_dir / "ledger.jsonl").exists() else []
        if records and records[-1]["step"] >= step:
            return
        if driver.poll() is not None:
            raise AssertionError(
                f"the driver exited with {driver.returncode}:\n{finish(driver)[-3000:]}"
            )
        time.sleep(0.1)
    raise TimeoutError(f"step {step} not reached in {timeout} s")


def finish(driver: Driver, timeout: float = 240) -> str:
    """Everything the driver printed, once it has exited; a driver still running after
    `timeout` s is killed and the test fails with the end of what it printed (a Ray run
    that would not stop on Ctrl-C once failed so in CI, with nothing to read)."""
    exited = False
    try:
        driver.wait(timeout=timeout)
        exited = True
    except subprocess.TimeoutExpired:
        pass
    finally:
        driver.kill()
        driver.reader.join(timeout=10)
    assert exited, (
        f"the driver had not exited {timeout:.0f} s later; it printed:\n" + driver.output()[-4000:]
    )
    return driver.output()
