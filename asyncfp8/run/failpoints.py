"""Fail points: `name=N` SIGKILLs the process the N-th time it reaches `failpoint(name)`, a
place a random kill rarely hits (mid-version); `learner.poison_update=N` instead makes the
learner's N-th step POISON_FACTOR times too large, for the guard (docs/reliability.md).

    ASYNCFP8_FAILPOINTS="publish.between_chunks=3,learner.mid_step=7" python -m asyncfp8.learner
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections import Counter

ENV = "ASYNCFP8_FAILPOINTS"
# Before dying, let what was handed to ZeroMQ leave the process (it sends from its own
# thread): the point is a peer that received part of something.
GRACE_S = 0.5
POISON_UPDATE = "learner.poison_update"
POISON_FACTOR = 1000.0
# Fail points that act on the learner's training rather than kill a process.
LEARNER_ONLY = frozenset({POISON_UPDATE})
log = logging.getLogger("asyncfp8.run.failpoints")


def parse(spec: str) -> dict[str, int]:
    armed = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition("=")
        if not name or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{ENV}: expected name=N (N >= 1) items, got {item!r}")
        armed[name] = int(count)
    return armed


_armed = parse(os.environ.get(ENV, ""))
_hits: Counter[str] = Counter()


def write_line(file, line: str, name: str) -> None:
    """`file.write(line)`, except where fail point `name` is armed: then the first half is
    written and flushed before the fail point, so that a kill there leaves a torn last
    line, as a SIGKILL during a write can (the reliability suite's resume test)."""
    if name in _armed:
        half = len(line) // 2
        file.write(line[:half])
        file.flush()
        failpoint(name)
        line = line[half:]
    file.write(line)


def reached(name: str) -> bool:
    """Counts a pass by fail point `name`: True on its N-th (for points that act rather
    than kill, such as POISON_UPDATE)."""
    if name not in _armed:
        return False
    _hits[name] += 1
    if _hits[name] == _armed[name]:
        log.warning("fail point %s reached (hit %d)", name, _hits[name])
        return True
    return False


def install_poison(optimizer) -> None:
    """Where POISON_UPDATE is armed, `optimizer`'s N-th step moves every parameter
    POISON_FACTOR times as far as the optimizer asked (hooks on its step, so the training
    step has no test code in it)."""
    if POISON_UPDATE not in _armed:
        return
    import torch  # here: the launcher imports this module and must stay light

    before: list = []

    def keep_before(opt, args, kwargs) -> None:
        before[:] = []
        if reached(POISON_UPDATE):
            params = [p for group in opt.param_groups for p in group["params"]]
            before[:] = [(p, p.detach().clone()) for p in params]

    def poison_after(opt, args, kwargs) -> None:
        with torch.no_grad():
            for p, old in before:
                p.copy_(old + POISON_FACTOR * (p - old))
        before[:] = []

    optimizer.register_step_pre_hook(keep_before)
    optimizer.register_step_post_hook(poison_after)


def check_process(process: str) -> None:
    """A ValueError when this `process` ("worker", "launcher", ...) is not the learner
    and a fail point that only the learner acts on is armed in it."""
    misplaced = sorted(LEARNER_ONLY & _armed.keys())
    if process != "learner" and misplaced:
        raise ValueError(
            f"{ENV}: {', '.join(misplaced)} acts on the learner's optimizer steps and is "
            f"refused in a {process} process; arm it in the learner's environment only "
            "(the launcher hands it to the learner and not to its workers)"
        )


def worker_environment() -> dict[str, str] | None:
    """What a launcher sets in its workers' environment: the armed fail points less the
    learner-only ones (None when none is armed: they inherit the launcher's)."""
    if not LEARNER_ONLY & _armed.keys():
        return None
    return {ENV: ",".join(f"{name}={n}" for name, n in _armed.items() if name not in LEARNER_ONLY)}


def failpoint(name: str) -> None:
    if name not in _armed:
        return
    _hits[name] += 1
    if _hits[name] == _armed[name]:
        log.warning("fail point %s reached (hit %d): killing this process", name, _hits[name])
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        time.sleep(GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)
