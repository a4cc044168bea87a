"""The held-out guard (`guard.heldout_below`, issue 45): an evaluation below that share of
the run's best puts back the weights and AdamW's state of the last evaluation that passed,
bit for bit; the step guard forgets its states of the undone weights; the collapse rule
counts the undone evaluation as a fall the run recovered from; and a launched run whose
last update is poisoned (no batch after it for the step guard to judge) ends collapsed
without it and with the kept weights, and their score, with it."""

import json
import os
from dataclasses import replace

import pytest
import torch

from asyncfp8.export import checkpoint_dir, checkpoint_state
from asyncfp8.report.collapse import run_collapse
from asyncfp8.run.failpoints import ENV, POISON_UPDATE
from asyncfp8.train.guard import Evidence, GuardSettings
from asyncfp8.train.rollback import HeldOutGuard, StepGuard


def trainable():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        model(torch.randn(3, 5)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step


def state(model, optimizer):
    return [(p.detach().clone(), optimizer.state[p]["exp_avg"].clone()) for p in model.parameters()]


def test_an_evaluation_below_the_line_puts_back_the_last_that_passed_bit_for_bit():
    model, optimizer, step = trainable()
    guard = HeldOutGuard(0.5, model, optimizer)
    assert guard.judge(0.30, 0, 0) is None  # the first evaluation always passes
    step()
    assert guard.judge(0.90, 1, 1) is None
    step()
    step()
    assert guard.judge(0.46, 3, 3) is None  # not below 0.5 x 0.90: kept, the newest
    kept = state(model, optimizer)
    step()
    why = guard.judge(0.44, 4, 4)
    assert why is not None and "guard.heldout_below=0.5" in why and "after step 3" in why
    for (p, moment), (want, want_moment) in zip(state(model, optimizer), kept, strict=True):
        assert torch.equal(p, want) and torch.equal(moment, want_moment)
    assert guard.rollbacks == 1 and guard.best == 0.90 and guard.kept.step == 3
    assert guard.judge(0.46, 4, 5) is None  # the restored weights' own evaluation passes


def test_after_a_held_out_rollback_the_step_guard_keeps_only_the_restored_weights():
    model, optimizer, _ = trainable()
    guard = StepGuard(GuardSettings(), model, optimizer)
    clean = Evidence(tokens=10.0, samples=4.0, rewarded=2.0)
    for step in range(3):
        guard.check(clean, step, step)
        with torch.no_grad():
            model.weight.add_(1.0)
        guard.updated()  # an update applied, as the training step says
    restored = model.weight.detach().clone()
    guard.restart_from(1, 1, newest=4)
    assert [s.step for s in guard.states] == [1] and guard.in_row == 0
    assert guard.ignored_versions == (1, 4)  # versions 2-4 came from undone weights
    with torch.no_grad():
        model.weight.add_(1.0)
    guard.updated()  # an update applied, as the training step says
    # a far token now rolls back to the restored weights, not to a state of the undone ones
    assert (
        guard.check(replace(clean, far_tokens=float(GuardSettings().far_tokens)), 5, 5).signal
        == "far_tokens"
    )
    assert torch.equal(model.weight, restored)


def test_an_undone_evaluation_is_a_fall_the_run_recovered_from():
    evaluated = [
        {"step": 0, "eval/pass1_greedy": 0.3},
        {"step": 50, "eval/pass1_greedy": 0.9},
        {"step": 100, "eval/pass1_greedy": 0.9, "guard/heldout_undone_greedy": 0.1},
    ]
    collapse = run_collapse([], evaluated)
    assert not collapse.collapsed and collapse.fell_and_recovered
    evaluated[-1] = {"step": 100, "eval/pass1_greedy": 0.1}  # the same fall, not undone
    assert run_collapse([], evaluated).collapsed


STEPS, EVERY = 6, 3


@pytest.mark.slow
def test_a_poisoned_last_update_collapses_without_it_and_is_undone_with_it(
    tmp_path, tiny_model_dir
):
    from tests.launched import launch

    env = {**os.environ, ENV: f"{POISON_UPDATE}={STEPS}"}
    for name in ("off", "on"):
        (tmp_path / name).mkdir()
    common = (f"run.steps={STEPS}", f"eval.every={EVERY}", "eval.prompts=64")
    off_dir, _ = launch(tmp_path / "off", tiny_model_dir, *common, "guard.heldout_below=0", env=env)
    off = json.loads((off_dir / "summary.json").read_text())
    # the positive control: the poison is after the last batch, so no batch can show it
    # to the step guard, and the run ends collapsed by the held-out rule
    assert off["guard_rollbacks"] == 0 and off["collapsed"] and off["collapse_signal"] == "held-out"
    assert off["guard_heldout_rollbacks"] == []

    on_dir, out = launch(
        tmp_path / "on", tiny_model_dir, *common, f"run.checkpoint_every={EVERY}", env=env
    )
    on = json.loads((on_dir / "summary.json").read_text())
    [undone] = on["guard_heldout_rollbacks"]
    assert undone["step"] == STEPS and undone["restored_step"] == EVERY
    before = greedy_curve(on_dir)[:-1]  # the evaluations at steps 0 and EVERY
    assert undone["undone"] < 0.5 * max(before)
    # the run ends with the weights of step EVERY: its held-out score is theirs, exactly
    assert on["eval_pass1_greedy_end"] == undone["restored"] == before[-1]
    assert not on["collapsed"] and on["fell_and_recovered"]
    # and trains, checkpoints and exports them: the last checkpoint holds step EVERY's
    # weights bit for bit (FSDP2 leaves the root unit unsharded after an evaluation, and
    # weights put back into that copy once reached the evaluation but not the checkpoint)
    last, kept = (
        checkpoint_state(checkpoint_dir(on_dir, s), tiny_model_dir) for s in (STEPS, EVERY)
    )
    assert last.keys() == kept.keys()
    assert all(torch.equal(last[name], kept[name]) for name in kept)
    assert f"put back the weights of step {EVERY}" in out
    log = (on_dir / "learner.log").read_text()
    assert "1 held-out rollback(s) (guard.heldout_below)" in log


def greedy_curve(run_dir):
    """The held-out greedy pass@1 of each evaluation, in step order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r["eval/pass1_greedy"] for r in records if "eval/pass1_greedy" in r]


@pytest.mark.slow
def test_a_run_put_back_in_its_middle_goes_on_from_the_kept_weights(tmp_path, tiny_model_dir):
    from tests.launched import launch

    # the poison at update 4, evaluated right after it (eval.every=2): the held-out guard
    # acts before any batch could show the step guard the broken weights
    env = {**os.environ, ENV: f"{POISON_UPDATE}=4"}
    run_dir, _ = launch(
        tmp_path, tiny_model_dir, "run.steps=6", "eval.every=2", "eval.prompts=64", env=env
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    # the first held-out rollback (what the two steps after it learn is this CPU's)
    undone = summary["guard_heldout_rollbacks"][0]
    assert (undone["step"], undone["restored_step"]) == (4, 2)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    evaluated = {r["step"]: r["eval/pass1_greedy"] for r in records if "eval/pass1_greedy" in r}
    assert evaluated[4] == evaluated[2]  # the kept weights, evaluated again
    # the restored weights went out at once as a version of their own, and the run trained
    # on from them: two more steps
    step_4 = next(r for r in records if r["step"] == 4 and "sync/version" in r)
    trained = [r for r in records if r["step"] in (5, 6) and "optim/updates" in r]
    assert len(trained) == 2 and all(r["optim/updates"] > 0 for r in trained)
    assert step_4["sync/version"] == 5  # versions 4 (poisoned) and 5 (restored) at step 4
    assert [r["sync/version"] for r in trained] == [6, 7]  # then one a step, as before
    # a checkpoint over the undone weights at once (run.checkpoint_every is 20), and the last
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000004",
        "step_00000006",
    ]
