"""The learner's pieces that can be checked without processes: the logprob recompute
(against an independent per-sequence computation), the staleness and mode settings."""

import pytest
import torch
from omegaconf import OmegaConf

from asyncfp8.learner import (
    batch_tensors,
    completion_logprobs,
    lr_lambda,
    max_staleness_of,
)
from asyncfp8.models import load_model
from asyncfp8.sync import Trajectory


def one_by_one(model, trajectories, temperature):
    """Each sequence alone, unpadded: log_softmax(logits / T) at the completion tokens."""
    out = []
    for t in trajectories:
        ids = torch.tensor([list(t.prompt_ids) + list(t.token_ids)])
        logits = model(ids).logits[0].double() / temperature
        logp = torch.log_softmax(logits, -1)
        start = len(t.prompt_ids)
        out.append([logp[start - 1 + k, tok].item() for k, tok in enumerate(t.token_ids)])
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recompute_matches_each_sequence_alone(tiny_model_dir, temperature):
    model = load_model(tiny_model_dir).eval()
    generator = torch.Generator().manual_seed(0)
    trajectories = []
    for i, (p, c) in enumerate([(3, 5), (9, 1), (5, 8), (12, 4)]):
        ids = torch.randint(0, 256, (p + c,), generator=generator).tolist()
        trajectories.append(Trajectory(ids[:p], ids[p:], [-1.0] * c, [i] * c, 0.0, group_id="g"))
    batch = batch_tensors(trajectories, pad=257)
    with torch.no_grad():
        got = completion_logprobs(model, batch, temperature)
    expected = one_by_one(model, trajectories, temperature)
    for row, values in enumerate(expected):
        n = len(values)
        assert batch["mask"][row].sum() == n and not batch["mask"][row, n:].any()
        torch.testing.assert_close(
            got[row, :n].double(), torch.tensor(values, dtype=torch.float64), atol=2e-5, rtol=0
        )
        assert batch["versions"][row, :n].tolist() == [row] * n


def test_sync_mode_means_no_staleness_and_bad_modes_are_refused():
    run = OmegaConf.create({"mode": "sync", "max_staleness": 4})
    assert max_staleness_of(run) == 0
    run.mode = "async"
    assert max_staleness_of(run) == 4
    run.mode = "asynch"
    with pytest.raises(ValueError, match=r"run\.mode"):
        max_staleness_of(run)


def test_learning_rate_schedule():
    optim = OmegaConf.create({"warmup_steps": 4, "schedule": "cosine"})
    factor = lr_lambda(optim, steps=104)
    assert factor(0) == pytest.approx(0.25) and factor(3) == pytest.approx(1.0)
    assert factor(54) == pytest.approx(0.55) and factor(104) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="schedule"):
        lr_lambda(OmegaConf.create({"warmup_steps": 0, "schedule": "linear"}), 10)(5)


def test_counts_must_be_positive_integers():
    from hydra import compose, initialize_config_module

    from asyncfp8.process import check_counts

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("config")
    check_counts(cfg)  # the defaults pass
    for key, bad in (("run.lease_groups", 0), ("run.steps", -1), ("sync.every", 1.5)):
        broken = cfg.copy()
        section, name = key.split(".")
        broken[section][name] = bad
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            check_counts(broken)
