"""`asyncfp8.report --tables`: a study run in parts, its saved tables pooled group by group,
gives what one report over all its run directories gives; tables that cannot be pooled
are refused, naming the files."""

import json

import pytest

from asyncfp8.report.compare import main
from tests.test_report import fake_run, parity_runs

BASELINE = "bf16 · token_tis · async"


def report(tmp_path, name, *args):
    table = tmp_path / f"{name}.json"
    main([*map(str, args), "--out", str(tmp_path / f"{name}.png"), "--json", str(table)])
    return table


@pytest.mark.slow  # three reports, each drawing its plots
def test_pooled_tables_give_the_groups_one_report_over_all_runs_gives(tmp_path, capsys):
    runs = parity_runs(tmp_path / "runs")
    # bf16 seeds 0-2 with fp8 seed 0 in one part, the rest in another
    first = [runs[0], runs[1], runs[2], runs[5]]
    second = [r for r in runs if r not in first]
    whole = report(tmp_path, "whole", *runs, "--paired-with", BASELINE)
    parts = [report(tmp_path, "a", *first), report(tmp_path, "b", *second)]
    capsys.readouterr()
    pooled = report(tmp_path, "pooled", "--tables", *parts, "--paired-with", BASELINE)
    printed = capsys.readouterr().out
    expected = {g["label"]: g for g in json.loads(whole.read_text())["groups"]}
    got = {g["label"]: g for g in json.loads(pooled.read_text())["groups"]}
    assert set(got) == set(expected)
    for label, group in expected.items():
        mine = got[label]
        order = sorted(range(group["n"]), key=lambda i: group["runs"][i])
        again = sorted(range(mine["n"]), key=lambda i: mine["runs"][i])
        assert [group["seeds"][i] for i in order] == [mine["seeds"][i] for i in again]
        for key, value in group.items():
            if key in ("runs", "seeds", "eval_prompts", "final_eval_steps"):
                continue  # the same runs, pooled in the parts' order
            assert mine[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    bf16 = got[BASELINE]
    assert bf16["n"] == 5 and sorted(bf16["seeds"]) == [0, 1, 2, 3, 4]
    assert "fp8 · none · async: 2 runs" in printed and "paired over 2 seeds (0 1)" in printed
    assert "plot:" not in printed  # the tables hold no curves


def test_a_run_in_two_tables_is_refused_naming_both(tmp_path, capsys):
    runs = parity_runs(tmp_path / "runs")
    a, b = report(tmp_path, "a", *runs[:3]), report(tmp_path, "b", *runs[2:5])
    with pytest.raises(SystemExit) as ended:
        main(["--tables", str(a), str(b)])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and f"is in both {a} and {b}" in err and runs[2] in err


def test_one_label_with_other_settings_in_another_table_is_refused(tmp_path, capsys):
    run = fake_run(tmp_path / "runs" / "x", "precision=fp8", "correction=token_tis")
    table = report(tmp_path, "a", run)
    other = json.loads(table.read_text())
    other["groups"][0]["guard"] = "off"  # a hand-edited or older table
    other["groups"][0]["runs"] = ["elsewhere/x"]
    other["runs"][0]["run"] = "elsewhere/x"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(other))
    with pytest.raises(SystemExit) as ended:
        main(["--tables", str(table), str(edited)])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and f"other settings in {edited} than in {table}" in err


def test_a_file_that_is_no_table_and_runs_beside_tables_are_refused(tmp_path, capsys):
    stray = tmp_path / "metrics.json"
    stray.write_text(json.dumps({"step": 1}))
    with pytest.raises(SystemExit) as ended:
        main(["--tables", str(stray)])
    assert ended.value.code == 2
    assert f"{stray} is not a table that `python -m asyncfp8.report --json` wrote" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as ended:
        main([str(tmp_path), "--tables", str(stray)])
    assert ended.value.code == 2 and "one of the two" in capsys.readouterr().err
