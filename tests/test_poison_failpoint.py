"""The fail point learner.poison_update=N (issue 45): the N-th optimizer step's update is
made POISON_FACTOR times as large instead of a kill, and any process other than the
learner refuses it, naming it."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from asyncfp8.learner.build import optimizer_and_schedule
from asyncfp8.run import failpoints
from asyncfp8.run.failpoints import ENV, POISON_FACTOR, POISON_UPDATE


def adam_steps(poisoned: bool, armed, steps: int = 3) -> list[torch.Tensor]:
    """The weight of a small layer after each of `steps` AdamW steps on fixed gradients,
    the optimizer made as the learner makes it (the fail point installed on it)."""
    armed(f"{POISON_UPDATE}=2" if poisoned else "")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = SimpleNamespace(
        lr=1e-3,
        betas=[0.9, 0.999],
        eps=1e-8,
        weight_decay=0.01,
        warmup_steps=0,
        schedule="constant",
    )
    optimizer, _ = optimizer_and_schedule(model, optim, steps)
    weights = [model.weight.detach().clone()]
    for step in range(steps):
        gradient = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        model.weight.grad, model.bias.grad = gradient, gradient[:, 0].clone()
        optimizer.step()
        weights.append(model.weight.detach().clone())
    return weights


def test_the_nth_update_is_poison_factor_times_the_clean_one_and_only_it(armed):
    clean, poisoned = adam_steps(False, armed), adam_steps(True, armed)
    assert torch.equal(clean[1], poisoned[1])  # the first step is untouched
    clean_update, poisoned_update = clean[2] - clean[1], poisoned[2] - poisoned[1]
    assert clean_update.abs().min() > 0
    torch.testing.assert_close(poisoned_update, POISON_FACTOR * clean_update, rtol=1e-3, atol=0)
    # the third update is AdamW's ordinary one again (its size, not 1000 times it)
    third = (poisoned[3] - poisoned[2]).abs().max()
    assert third < 10 * (clean[3] - clean[2]).abs().max()


@pytest.mark.parametrize("process", ["worker", "launcher"])
def test_refused_outside_the_learner_naming_it(armed, process):
    armed(f"publish.between_chunks=2,{POISON_UPDATE}=3")
    with pytest.raises(ValueError, match=rf"{POISON_UPDATE} .*refused in a {process} process"):
        failpoints.check_process(process)
    failpoints.check_process("learner")
    # a launcher hands its workers the other fail points only
    assert failpoints.worker_environment() == {ENV: "publish.between_chunks=2"}
    armed("publish.between_chunks=2")
    failpoints.check_process(process)
    assert failpoints.worker_environment() is None


@pytest.mark.slow
def test_a_worker_started_with_it_exits_with_the_reason(tmp_path):
    env = {**os.environ, ENV: f"{POISON_UPDATE}=1"}
    done = subprocess.run(
        [sys.executable, "-m", "asyncfp8.worker", f"run.dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"{POISON_UPDATE} acts on the learner's optimizer steps" in done.stderr
