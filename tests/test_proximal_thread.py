"""correction.proximal_thread: stale tokens' π_prox scored ahead, on a thread of its own, as
their groups arrive. The step then reads them instead of swapping versions in: the same
π_prox (and so the same loss) within float tolerance, tokens of an unkept version still
falling back and counted; a thread that fails stops the step; bad settings are refused."""

import copy
import threading
from types import SimpleNamespace

import pytest
import torch

from asyncfp8.learner import build
from asyncfp8.train.batches import Group
from asyncfp8.train.proximal_thread import ProximalThread
from asyncfp8.train.versions import VersionWeights
from tests.config import compose


def stale_batch(groups):
    """The second step's groups: half sampled by version 0, one by version 7 (never kept),
    the rest by version 1 (the live weights)."""
    batch = copy.deepcopy(groups)
    samples = [t for g in batch for t in g.trajectories]
    for i, t in enumerate(samples):
        version = 7 if i == len(samples) - 1 else 0 if i < len(samples) // 2 else 1
        t.versions = [version] * len(t.token_ids)
    return batch, samples


def second_step(tiny_model_dir, run_dir, groups, ahead: bool):
    from asyncfp8.learner import Learner
    from tests.recorded import learner_config, train

    learner = Learner(learner_config(tiny_model_dir, run_dir))
    try:
        assert learner.proximal_thread is not None  # null: on, for a CPU learner
        learner.version = 0
        learner.version_weights.record(0)
        train(learner, groups[0])
        learner.version = 1
        learner.version_weights.record(1)
        batch, samples = stale_batch(groups[1])
        if ahead:
            for group in batch:  # what the inbox does as each group arrives
                learner.proximal_thread.submit(group)
        share = learner.shares(batch)[0]
        sums = learner.train_step(share, learner.step, learner.version)
        grads = [p.grad.clone() for p in learner.model.parameters() if p.grad is not None]
        return sums, samples, grads
    finally:
        learner.close()


@pytest.mark.slow
def test_scored_ahead_the_step_sees_the_swapped_versions_log_probs(tiny_model_dir, tmp_path):
    from tests.recorded import record_groups

    groups = record_groups(tiny_model_dir, steps=2, groups=4, group_size=4, seed=2)
    swapped, samples, _ = second_step(tiny_model_dir, tmp_path / "a", groups, ahead=False)
    ahead, _, _ = second_step(tiny_model_dir, tmp_path / "b", groups, ahead=True)
    for a, b in zip(swapped.seen[0], ahead.seen[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    stale = sum(len(t.token_ids) for t in samples if t.versions[0] == 0)
    unkept = len(samples[-1].token_ids)
    assert swapped.totals.proximal_ahead_tokens == 0
    assert ahead.totals.proximal_ahead_tokens == ahead.totals.proximal_version_tokens == stale
    assert ahead.totals.proximal_fallback_tokens == unkept
    assert ahead.totals.total_loss == pytest.approx(swapped.totals.total_loss, abs=1e-5)
    assert ahead.totals.policy_loss == pytest.approx(swapped.totals.policy_loss, abs=1e-5)


def test_a_thread_that_fails_stops_the_step_naming_the_cause():
    model = torch.nn.Linear(3, 2)
    versions = VersionWeights(model, keep=2)
    versions.record(0)
    thread = ProximalThread(torch.nn.Linear(3, 2), versions, 1.0, 64, 0)
    trajectory = SimpleNamespace(token_ids=[1], versions=[0])
    thread._score = lambda trajectories: (_ for _ in ()).throw(OSError("disk gone"))
    thread.submit(Group(0, 0, [trajectory]))
    with pytest.raises(RuntimeError, match="proximal thread failed: OSError"):
        thread.wait([trajectory], timeout=30)
    assert not any(t.name == "asyncfp8-proximal" and t.is_alive() for t in threading.enumerate())


def test_bad_settings_are_refused_naming_the_keys(tmp_path):
    ranks = SimpleNamespace(device=torch.device("cpu"), world=1)
    versions = VersionWeights(torch.nn.Linear(3, 2), keep=2)
    master = SimpleNamespace(learner_forward="master")
    quantized = SimpleNamespace(learner_forward="quantized")

    def made(policy, *overrides):
        cfg = compose(*overrides)
        return build.proximal_thread(cfg, policy, tmp_path, versions, ranks, torch.float32, 0)

    with pytest.raises(Exception, match=r"correction\.proximal_thread"):
        compose("correction.proximal_thread=sometimes")  # the schema's type refuses it
    with pytest.raises(ValueError, match=r"precision\.learner_forward=quantized"):
        made(quantized, "correction.proximal_thread=true")
    assert made(quantized) is None  # null: off where it cannot run
    assert made(master, "correction.proximal_thread=false") is None
    gpu = SimpleNamespace(device=torch.device("cuda"), world=1)
    assert (
        build.proximal_thread(compose(), master, tmp_path, versions, gpu, torch.float32, 0) is None
    )
