"""What the launcher shows of a failed learner's log."""

from asyncfp8.launch_processes import indented_tail

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
