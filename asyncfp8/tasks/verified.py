"""Rewards checked by math-verify, the answer checker TRL, veRL and Open-R1 use.

math-verify bounds its work with SIGALRM, which Python allows only in the main thread (and
without a bound `\\boxed{2^{2^{100}}}` makes sympy compute without end): the main thread
checks in-process, any other hands the check to a helper process killed when it overruns.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 3
# One parse of the gold, one of the completion, and the (gold, prediction) pairs that
# `verify` compares: each of these is one math-verify timeout at most.
_TIMEOUTS_PER_CHECK = 8
_HELPER_START_S = 60.0
# The GSM8K final-answer line ("#### 72"): math-verify has no pattern for it, and its
# plain-expression fallback takes the *last* number of the text, which is not the marked
# answer when anything follows the marker.
_GSM8K_MARKER = re.compile(r"####\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")


def math_verify_reward(completion: str, answer: str, timeout_s: int = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if math-verify finds in `completion` an answer equal to `answer` (a number such
    as "1,000", or LaTeX such as "\\frac{1}{2}"), else 0.0. In the main thread math-verify's
    SIGALRM timeouts bound it (`timeout_s` whole seconds per parse and per comparison, 8 ×
    `timeout_s` in all; a pending host alarm is cancelled); elsewhere a helper process is
    killed after 8 × `timeout_s` (0.0 then; its first start may take a minute more)."""
    # math-verify hands the timeout to signal.alarm, which takes whole seconds; anything
    # else would fail inside its parse, caught there, and every reward would be 0.
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
        raise ValueError(
            f"math_verify_reward: timeout_s must be whole seconds ≥ 1, got {timeout_s!r}"
        )
    if threading.current_thread() is threading.main_thread():
        return check(completion, answer, timeout_s)
    return _helper.check(completion, answer, timeout_s)


def check(completion: str, answer: str, timeout_s: int = DEFAULT_TIMEOUT_S) -> float:
    """The check itself, in this thread: the main thread only (math-verify's signals)."""
    from math_verify.errors import TimeoutException

    try:
        return _check(completion, answer, timeout_s)
    except TimeoutException:  # an alarm that fired just as math-verify was cancelling it
        return 0.0


def _check(completion: str, answer: str, timeout_s: int) -> float:
    from math_verify import verify

    gold = _parse_gold(answer, timeout_s)
    if not gold:
        return 0.0
    marked = _GSM8K_MARKER.findall(completion)
    # The GSM8K answer line, when there is one, is the answer, as for the hand parser
    # (answers.final_number). math-verify alone takes the last number of the text: on the
    # bundled sample's reference solutions followed by the next question (a base model
    # running on), it rewarded 1 of 300, the hand parser 300 (docs/results.md).
    text = f"${marked[-1]}$" if marked else completion
    predicted = _parse(text, timeout_s)
    if not predicted:
        return 0.0
    return 1.0 if verify(list(gold), predicted, timeout_seconds=timeout_s) else 0.0


def _parse(text: str, timeout_s: int) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(
        text,
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=timeout_s,
    )


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout_s: int) -> tuple:
    """The gold answer parsed once per process (every sample of a group shares it; a
    tuple, so no caller can change the cached value). A bare LaTeX expression
    ("\\frac{1}{2}") is wrapped in $...$ so that math-verify reads it as LaTeX."""
    stripped = answer.strip()
    text = stripped if stripped.startswith("$") or "\\boxed" in stripped else f"${stripped}$"
    return tuple(_parse(text, timeout_s))


class _Helper:
    """A child process running `check` in its main thread, one request at a time, over
    JSON lines; started on first use, killed (and restarted on the next call) when a
    check overruns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._pending = b""

    def check(self, completion: str, answer: str, timeout_s: int) -> float:
        request = json.dumps({"completion": completion, "answer": answer, "timeout_s": timeout_s})
        with self._lock:
            try:
                process = self._running()
                process.stdin.write(request.encode() + b"\n")
                process.stdin.flush()
                reply = self._read_line(process, timeout_s * _TIMEOUTS_PER_CHECK)
            except (OSError, TimeoutError) as err:
                logger.warning("math-verify helper: %s; reward 0, helper restarted", err)
                self.close()
                return 0.0
        return float(json.loads(reply)["reward"])

    def _running(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            package_root = str(Path(__file__).resolve().parents[2])
            path = os.environ.get("PYTHONPATH")
            env = {**os.environ, "PYTHONPATH": package_root + (os.pathsep + path if path else "")}
            self._pending = b""
            self._process = subprocess.Popen(
                [sys.executable, "-m", "asyncfp8.tasks.verified"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            if self._read_line(self._process, _HELPER_START_S) != b"ready":
                raise OSError("the helper process did not start")
        return self._process

    def _read_line(self, process: subprocess.Popen, limit_s: float) -> bytes:
        deadline = time.monotonic() + limit_s
        fd = process.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no answer within {limit_s:.0f} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise OSError("the helper process exited")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None


def _serve() -> None:
    """The helper's loop: one JSON request per line in, one reward per line out."""
    from math_verify.errors import TimeoutException  # before "ready": no check waits on it

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reward = _check(request["completion"], request["answer"], request["timeout_s"])
        except (Exception, TimeoutException):  # TimeoutException is a BaseException
            logger.exception("math-verify failed")
            reward = 0.0
        print(json.dumps({"reward": reward}), flush=True)


_helper = _Helper()
atexit.register(_helper.close)

if __name__ == "__main__":
    _serve()
