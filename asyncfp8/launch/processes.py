"""The launcher's child processes on this host (the learner, under torchrun where it has
several ranks, and the workers): started in their own session with their logs in
`run.dir`, the ends of those logs for a message, stopped in order; and the ports they
bind. The local launcher (asyncfp8.launch), the one under Slurm and the Ray driver
(asyncfp8.launch.ray_cluster) share them."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from asyncfp8.run.process import die_with_parent

PORTS = ("version", "snapshot", "trajectory")
CONFIG_ERROR = 2  # the exit code of a process that refused its configuration
STOP_GRACE = 60.0  # s the learner gets to checkpoint after SIGTERM before SIGKILL


def free_ports(count: int) -> list[int]:
    """Ports free on every address of this host now (the learner binds them a moment
    later; on Ray it binds 0.0.0.0), from `port_range()`, taken in turn from a random start
    so that one process does not hand out a port twice in a row."""
    global _cursor
    low, high = port_range()
    if _cursor is None or not low <= _cursor < high:
        _cursor = random.randrange(low, high)
    chosen: list[socket.socket] = []
    for _ in range(high - low):
        port, _cursor = _cursor, low + (_cursor + 1 - low) % (high - low)
        s = socket.socket()
        try:
            s.bind(("", port))
        except OSError:  # something holds it (on any address, or a connection in TIME_WAIT)
            s.close()
            continue
        chosen.append(s)
        if len(chosen) == count:
            break
    ports = [s.getsockname()[1] for s in chosen]
    for s in chosen:
        s.close()
    if len(ports) < count:
        raise RuntimeError(f"only {len(ports)} of {count} ports free in {low}-{high - 1}")
    return ports


_cursor: int | None = None
EPHEMERAL_FLOOR = 12000  # below: the well-known and registered services' ports
PORT_RANGE = "ASYNCFP8_PORT_RANGE"


def port_range() -> tuple[int, int]:
    """[low, high) the launcher draws ports from: $ASYNCFP8_PORT_RANGE ("low-high",
    inclusive), else from 12000 up to the kernel's ephemeral range. A port in that range,
    once its process dies, can become any outgoing connection's source port and block the
    resumed learner's bind; concurrent launchers on one host can be given disjoint ranges."""
    spec = os.environ.get(PORT_RANGE)
    if not spec:
        return EPHEMERAL_FLOOR, max(ephemeral_range()[0], EPHEMERAL_FLOOR + 1024)
    try:
        low, high = (int(part) for part in spec.split("-"))
    except ValueError:
        low = high = 0
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE} must be low-high within 1024-65535, got {spec!r}")
    return low, high + 1


def ephemeral_range() -> tuple[int, int]:
    """The range the kernel draws outgoing connections' source ports from."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


class Process:
    def __init__(
        self,
        name: str,
        module: str,
        overrides: list[str],
        run_dir: Path,
        ranks: int = 1,
        env: dict[str, str] | None = None,
    ):
        self.name, self.module, self.overrides = name, module, overrides
        self.env = {**os.environ, **env} if env else None  # None: this process's own
        # Several ranks: torchrun on this host starts them (and stops them all when one fails).
        self.runner = (
            ["torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m"]
            if ranks > 1
            else []
        )
        self.log_path = run_dir / f"{name}.log"
        self.log_start = 0  # where in the log the latest start began writing
        self.popen: subprocess.Popen | None = None
        self.restarts = 0
        # Each restart: the exit code, and the last error line of the log it left (a
        # run's summary.json lists them; a worker's counters die with it).
        self.exits: list[dict[str, object]] = []

    def start(self) -> None:
        self.log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("a")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *self.runner, self.module, *self.overrides],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops them in order
            preexec_fn=die_with_parent,  # no orphans if the launcher dies
        )
        log.close()

    def restart(self, code: int) -> None:
        """Starts the process again after it exited with `code`, noting why it exited."""
        self.restarts += 1
        self.exits.append(
            {
                "process": self.name,
                "exit_code": code,
                "error": last_error_line(self.log_path, self.log_start),
            }
        )
        self.start()

    def poll(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def signal(self, sig: int) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout) if self.popen else None
        except subprocess.TimeoutExpired:
            return None

    def tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)


def last_error_line(log: Path, start: int = 0) -> str:
    """Of what `log` holds from byte `start` on (one start of a process: the log is
    appended to), the last line that reports an error (a logged ERROR, or an exception's
    last line), else its last line; empty where it wrote nothing."""
    if not log.exists():
        return ""
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [
        line
        for line in lines
        if re.search(r"\bERROR\b", line) or re.match(r"[\w.]*(Error|Exception)\b", line)
    ]
    return (errors or lines or [""])[-1]


def log_tail(log: Path, lines: int = 15) -> str:
    """A process's log ends (`indented_tail`; empty where it wrote no log)."""
    if not log.exists():
        return ""
    return indented_tail(log.read_text(errors="replace").splitlines(), lines)


def indented_tail(text: list[str], lines: int) -> str:
    """The log's last `lines` lines, indented. When torchrun ends the log with its own
    report of a failed rank, that report says only which rank died and how: the failing
    rank's last lines come first, then the report's rank and exit-code lines."""
    failed = next((i for i in range(len(text) - 1, -1, -1) if "ChildFailedError" in text[i]), None)
    if failed is not None:
        starts = [i for i in range(failed) if text[i].startswith("Traceback (most recent")]
        if starts:
            summary = [
                line
                for line in text[failed:]
                if re.match(r"\s*(rank|exitcode|traceback)\s*:", line)
            ]
            text = [*text[: starts[-1]][-lines:], "[torchrun]", *summary]
            return "\n".join(f"    {line}" for line in text)
    return "\n".join(f"    {line}" for line in text[-lines:])


def stop_all(learner: Process, workers: list[Process]) -> None:
    """Workers first (they flush), then the learner (it checkpoints); SIGKILL whatever
    is still there after the grace period."""
    for worker in workers:
        worker.signal(signal.SIGTERM)
    learner.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for process in [*workers, learner]:
        if process.wait(max(0.0, deadline - time.monotonic())) is None:
            process.signal(signal.SIGKILL)
            process.wait(5)
