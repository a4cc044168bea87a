"""What the launcher shows of a failed process's log, and of the processes it restarted."""

import json
from pathlib import Path

from asyncfp8.launch.processes import indented_tail

RANK_OUTPUT = [
    "08:43:20 learner INFO held-out pass@1 after 6 steps: greedy 0.125",
    "terminate called after throwing an instance of 'gloo::IoException'",
    "  what():  [gloo/transport/tcp/pair.cc:534] Connection closed by peer",
]
TORCHRUN_REPORT = [
    "Traceback (most recent call last):",
    '  File "/venv/bin/torchrun", line 8, in <module>',
    "    sys.exit(main())",
    *[f"  frame {i}" for i in range(30)],
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "asyncfp8.learner FAILED",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-11-24_08:43:24",
    "  host      : localhost",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : -6 (pid: 505)  (SIGABRT)",
    "  error_file: <N/A>",
    "  traceback : Signal 6 (SIGABRT) received by PID 505",
    "============================================================",
]


def test_a_torchrun_failure_shows_the_failing_ranks_own_lines_and_which_rank():
    shown = indented_tail(RANK_OUTPUT + TORCHRUN_REPORT, lines=20).splitlines()
    assert [line.removeprefix("    ") for line in shown[:3]] == RANK_OUTPUT
    assert any("rank      : 1" in line for line in shown)
    assert any("SIGABRT" in line and "exitcode" in line for line in shown)
    assert not any("frame" in line for line in shown)  # torchrun's own stack is left out


def test_a_plain_log_shows_its_last_lines():
    text = [f"line {i}" for i in range(50)]
    assert indented_tail(text, lines=3) == "    line 47\n    line 48\n    line 49"


def test_a_rank_traceback_before_torchruns_report_is_kept():
    rank_traceback = ["Traceback (most recent call last):", '  File "x.py"', "ValueError: bad"]
    shown = indented_tail(rank_traceback + TORCHRUN_REPORT, lines=20)
    assert "ValueError: bad" in shown and "frame 3" not in shown


def test_a_worker_restart_is_in_the_summary_with_the_error_its_log_ended_on(tmp_path, capsys):
    """A worker that exits and is started again loses its counters (a refit failure, say)
    with its process: the launcher notes each restart (exit code, the log's last error
    line) and the summary lists them, each said in a warning."""
    import time

    from asyncfp8.launch.ending import report_end
    from asyncfp8.launch.processes import Process
    from tests.test_collapse import synthetic_run

    run_dir = Path(synthetic_run(tmp_path / "run", 0, {0: 0.2}, [0.5] * 12))
    worker = Process("worker-0", "asyncfp8.no_such_module", [], run_dir)
    worker.start()
    code = worker.popen.wait()
    assert code != 0
    worker.restart(code)
    worker.popen.wait()
    assert worker.restarts == 1
    assert report_end(run_dir, time.perf_counter(), worker.exits) == 0
    [restarted] = json.loads((run_dir / "summary.json").read_text())["process_restarts"]
    assert restarted["process"] == "worker-0" and restarted["exit_code"] == code
    assert "No module named asyncfp8.no_such_module" in restarted["error"]
    printed = capsys.readouterr().out
    assert f"warning: worker-0 exited with {code} and was started again" in printed


def test_the_last_error_line_of_a_log(tmp_path):
    from asyncfp8.launch.processes import last_error_line

    log = tmp_path / "worker-0.log"
    assert last_error_line(log) == ""
    log.write_text("w INFO applied version 3\nw ERROR version 4: the probe differs\nw INFO bye\n")
    assert last_error_line(log) == "w ERROR version 4: the probe differs"
    log.write_text("Traceback (most recent call last):\n  File x\nValueError: bad\n\n")
    assert last_error_line(log) == "ValueError: bad"
    log.write_text("killed quietly\n")
    assert last_error_line(log) == "killed quietly"
    # an earlier start's error is not this one's: only what was written since `start`
    log.write_text("w ERROR old\n")
    start = log.stat().st_size
    with log.open("a") as f:
        f.write("w INFO up\nTraceback (most recent call last):\ntorch.OutOfMemoryError: CUDA\n")
    assert last_error_line(log, start) == "torch.OutOfMemoryError: CUDA"
