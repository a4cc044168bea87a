"""The launcher's progress bar reads the learner's metrics file while the learner writes it,
and a resumed learner replaces that file with one cut back to its checkpoint (issue 28:
the launcher died at once with `JSONDecodeError: Extra data`, its offset into the old file
falling in the middle of a line of the new one)."""

import json
import os

from asyncfp8.launch.progress import Progress
from asyncfp8.run.records import METRICS_FILE


def record(step: int, **extra) -> str:
    return json.dumps({"step": step, "reward/mean": 0.5, **extra}) + "\n"


def test_a_half_written_line_waits_for_its_end(tmp_path):
    path = tmp_path / METRICS_FILE
    progress = Progress(tmp_path, steps=10)
    progress.update()  # no file yet: nothing to read, no error
    path.write_text(record(0, **{"eval/pass1_greedy": 0.25}) + record(1)[:7])
    progress.update()
    assert progress.bar.n == 0 and progress.eval_start == 0.25
    with path.open("a") as f:
        f.write(record(1)[7:])
    progress.update()
    assert progress.bar.n == 1 and progress.last["step"] == 1
    progress.close()


def test_a_file_a_resumed_learner_replaced_is_read_again_from_its_start(tmp_path):
    path = tmp_path / METRICS_FILE
    progress = Progress(tmp_path, steps=300)
    evaluation = {"eval/pass1_greedy": 0.3}
    path.write_text(
        record(0, **evaluation) + "".join(record(s, pad="x" * 40) for s in range(1, 255))
    )
    progress.update()
    assert progress.bar.n == 254
    # What MetricsLog(resumed_step=240) does: the records up to the checkpoint, renamed over
    # the file; then the resumed learner appends longer lines, past the reader's old offset.
    kept = record(0, **evaluation) + "".join(record(s) for s in range(1, 241))
    temporary = path.with_suffix(".tmp")
    temporary.write_text(kept)
    os.replace(temporary, path)
    with path.open("a") as f:
        f.write("".join(record(s, pad="y" * 1000) for s in range(241, 260)))
    assert path.stat().st_size > progress.offset  # the case that crashed
    progress.update()
    assert progress.bar.n == 259 and progress.last["step"] == 259
    assert (progress.eval_start, progress.eval) == (0.3, 0.3)
    # A replacement shorter than what was read is noticed the same way.
    temporary.write_text(record(0, **evaluation) + record(1))
    os.replace(temporary, path)
    progress.update()
    assert progress.bar.n == 1 and progress.last["step"] == 1
    progress.close()


def test_a_line_torn_by_a_kill_and_then_written_past_is_skipped(tmp_path):
    path = tmp_path / METRICS_FILE
    progress = Progress(tmp_path, steps=10)
    path.write_text(record(0) + record(1)[:9] + "\n" + record(2))
    progress.update()
    assert progress.bar.n == 2 and progress.last["step"] == 2
    progress.close()
