import pytest

from asyncfp8.learner.ledger import LEDGER_FILE, Ledger, read_ledger
from asyncfp8.run.failpoints import parse
from asyncfp8.sync import Trajectory
from asyncfp8.train.batches import Group


def group(lease, prompt, sender="w/1", first_seq=0, version=3):
    trajectories = [
        Trajectory([1], [2, 3], [-0.1, -0.2], [version, version + 1], 1.0, "g", prompt)
        for _ in range(2)
    ]
    for i, t in enumerate(trajectories):
        t.sender, t.seq = sender, first_seq + i
    return Group(lease, prompt, trajectories)


def test_a_resumed_ledger_forgets_the_steps_it_will_train_again(tmp_path):
    ledger = Ledger(tmp_path)
    for step in range(1, 6):
        ledger.write(step, step, [group(7, step, first_seq=2 * step)], dropped=[(7, 99, 0)])
    ledger.close()
    with (tmp_path / LEDGER_FILE).open("a") as f:
        f.write('{"step": 6, "groups": [')  # cut short by a kill
    records = read_ledger(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["groups"] == [[7, 1, [["w/1", 2, 3], ["w/1", 3, 3]]]]
    assert records[0]["dropped"] == [[7, 99, 0]]

    resumed = Ledger(tmp_path, resumed_step=3)  # checkpoint at step 3
    resumed.write(4, 9, [group(8, 4)], dropped=[])
    resumed.close()
    records = read_ledger(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["version"] == 9 and records[-1]["groups"][0][0] == 8


def test_failpoint_specs_are_checked():
    assert parse("") == {}
    assert parse("publish.between_chunks=3, learner.mid_step=1") == {
        "publish.between_chunks": 3,
        "learner.mid_step": 1,
    }
    for bad in ("x", "x=0", "x=-1", "=2", "x=two"):
        with pytest.raises(ValueError, match="name=N"):
            parse(bad)
