"""Four learner defects a review reproduced (issue 66, item 3), each shown by the smallest
case that went wrong: an unclamped KL estimate, REINFORCE without the staleness ratio
under correction.proximal=version, a starved skip that broke FP16 loss scaling's streak,
and a second rollback that put back the same weights."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from asyncfp8.conf.schemas import OptimConfig
from asyncfp8.correction import get_correction
from asyncfp8.train.batches import TrainBatch
from asyncfp8.train.guard import Evidence, GuardSettings
from asyncfp8.train.loss_scale import LossScaleOverflow, LossScaler, LossScaleSettings
from asyncfp8.train.losses import PolicyLoss, aggregate_parts, kl_penalty, policy_loss_terms
from asyncfp8.train.rollback import StepGuard
from asyncfp8.train.step import TrainStep
from asyncfp8.train.sums import StepTotals, UpdateSums


def batch_of(rollout_logp: torch.Tensor, advantages: torch.Tensor) -> TrainBatch:
    rows, tokens = rollout_logp.shape
    no_ids = torch.zeros(rows, 1, dtype=torch.long)
    zeros = torch.zeros(rows, tokens, dtype=torch.long)
    mask = torch.ones(rows, tokens, dtype=torch.bool)
    return TrainBatch(no_ids, no_ids, zeros, rollout_logp, zeros, mask, advantages)


@pytest.mark.parametrize("estimator", ["k3", "low_var_kl"])
def test_a_token_far_below_the_reference_gives_a_finite_kl_and_gradient(estimator):
    """log π = -95 against a reference's -0.1: e^94.9 overflows FP32. veRL clamps the
    log-ratio to ±20 before exp (and low_var_kl's estimate to ±10)."""
    logp = torch.tensor([[-95.0, -1.0]], requires_grad=True)
    reference = torch.tensor([[-0.1, -1.2]])
    kl = kl_penalty(logp, reference, estimator)
    assert torch.isfinite(kl).all()
    mask = torch.tensor([[0.0, 1.0]])  # the far token masked: it must not poison the rest
    (kl * mask).sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0] == 0.0
    # the kept token's estimate and gradient are the plain k3's
    k1 = -1.0 - -1.2
    assert kl[0, 1].item() == pytest.approx(math.expm1(-k1) + k1, rel=1e-5)
    assert logp.grad[0, 1].item() == pytest.approx(1 - math.exp(-k1), rel=1e-5)
    if estimator == "low_var_kl":
        assert kl[0, 0].item() == 10.0


def test_reinforce_weighs_each_token_by_pi_theta_over_its_versions_pi():
    """correction.proximal=version gives π_prox = the learner's weights of the version that
    sampled each token; the correction sees π_prox against the rollout (precision alone),
    so the loss must carry π_θ/π_prox (staleness), truncated at 2 as token TIS does."""
    logp = torch.log(torch.tensor([[0.075, 0.59, 0.13, 0.67]])).requires_grad_()
    proximal = torch.log(torch.tensor([[0.5, 0.06, 0.25, 0.25]]))  # π_θ/π_prox: 0.15 .. 9.83
    ratio = torch.exp(logp.detach() - proximal).clamp(max=2.0)  # truncated, as token TIS
    batch = batch_of(proximal.clone(), torch.tensor([1.0]))
    loss = PolicyLoss(kind="reinforce", mode="decoupled")
    terms = policy_loss_terms(loss, get_correction("none"), logp, batch, proximal)
    aggregate_parts(terms.per_token, terms.mask, "token_mean")[0].backward()
    torch.testing.assert_close(-logp.grad, ratio, rtol=1e-6, atol=1e-7)
    # with π_prox = π_θ (correction.proximal=current) the weights are 1, as before
    logp.grad = None
    terms = policy_loss_terms(loss, get_correction("none"), logp, batch, logp.detach())
    aggregate_parts(terms.per_token, terms.mask, "token_mean")[0].backward()
    torch.testing.assert_close(-logp.grad, torch.ones_like(ratio))


def starving_step(settings: LossScaleSettings) -> TrainStep:
    """A TrainStep over one linear layer whose updates are applied from sums the test
    makes: a kept share under min_kept skips the update (correction.starved=skip)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    optim = OmegaConf.structured(OptimConfig)
    return TrainStep(
        model,
        optimizer,
        scheduler,
        get_correction("none"),
        optim,
        "decoupled",
        1.0,
        0,
        torch.device("cpu"),
        loss_scaler=LossScaler(settings),
        min_kept=0.5,
        starved="skip",
    )


def test_a_starved_skip_of_finite_gradients_ends_the_overflow_streak():
    """Overflow, a starved skip (finite gradients), overflow, overflow: not three
    overflows in a row, so max_skipped=3 must not stop the run."""
    step = starving_step(LossScaleSettings(init=1024.0, growth_interval=100, max_skipped=3))
    totals = StepTotals()

    def update(gradient: float, kept: float) -> None:
        for p in step.model.parameters():
            p.grad = torch.full_like(p, gradient)
        step._apply(UpdateSums(denominator=10.0, kept=kept, real_tokens=10.0), 1.0, 0, totals)

    update(math.inf, 10.0)
    update(1.0, 1.0)  # starved: 1 of 10 tokens kept, under min_kept=0.5
    assert totals.starved_skipped == 1 and step.loss_scaler.skipped_in_row == 0
    update(math.inf, 10.0)
    update(math.inf, 10.0)
    assert totals.loss_scale_skipped == 3 and step.loss_scaler.skipped_in_row == 2
    with pytest.raises(LossScaleOverflow, match="3 updates in a row"):
        update(math.inf, 10.0)


def test_a_second_rollback_goes_one_state_further_back_when_a_batch_passed_between():
    """keep_states=2: W0 and W1 kept; a batch fails and W1 comes back; the next batch passes
    on W1 itself; the one after fails: the guard must put back W0, not W1 again."""
    model = torch.nn.Linear(2, 2, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    guard = StepGuard(GuardSettings(keep_states=2, max_rollbacks=5), model, optimizer)
    clean = Evidence(tokens=10.0, samples=4.0, rewarded=2.0)
    far = Evidence(tokens=10.0, far_tokens=50.0, samples=4.0, rewarded=2.0)

    def weights(value: float) -> None:  # an update, as the training step applies it
        with torch.no_grad():
            model.weight.fill_(value)
        guard.updated()

    weights(0.0)
    assert guard.check(clean, 0, 0) is None  # W0 kept
    weights(1.0)
    assert guard.check(clean, 1, 1) is None  # W1 kept
    weights(2.0)
    assert guard.check(far, 2, 2) is not None
    assert model.weight[0, 0].item() == 1.0  # W1 back
    assert guard.check(clean, 3, 3) is None  # passes on W1 itself
    weights(3.0)
    assert guard.check(far, 4, 4) is not None
    assert model.weight[0, 0].item() == 0.0  # one state further back: W0


def test_a_state_kept_after_a_rollback_is_the_one_the_next_rollback_puts_back():
    """keep_states=2: W1 put back, a batch passes on it, W3 passes and is kept, W4 fails:
    W3 comes back (the newest good state), not W1 again."""
    model = torch.nn.Linear(2, 2, bias=False)
    guard = StepGuard(
        GuardSettings(keep_states=2, max_rollbacks=5), model, torch.optim.AdamW(model.parameters())
    )
    clean = Evidence(tokens=10.0, samples=4.0, rewarded=2.0)
    far = Evidence(tokens=10.0, far_tokens=50.0, samples=4.0, rewarded=2.0)

    def weights(value: float) -> None:
        with torch.no_grad():
            model.weight.fill_(value)
        guard.updated()

    weights(0.0)
    assert guard.check(clean, 0, 0) is None
    weights(1.0)
    assert guard.check(clean, 1, 1) is None
    weights(2.0)
    assert guard.check(far, 2, 2) is not None and model.weight[0, 0].item() == 1.0
    assert guard.check(clean, 3, 3) is None  # on W1 itself
    weights(3.0)
    assert guard.check(clean, 4, 4) is None  # W3 kept
    weights(4.0)
    assert guard.check(far, 5, 5) is not None
    assert model.weight[0, 0].item() == 3.0


def test_a_step_whose_updates_were_all_skipped_keeps_no_second_copy():
    """After a rollback the next step trains nothing (every update skipped): its weights
    are still the state put back, and the batch after passes on them without a copy."""
    model = torch.nn.Linear(2, 2, bias=False)
    guard = StepGuard(
        GuardSettings(keep_states=2, max_rollbacks=5), model, torch.optim.AdamW(model.parameters())
    )
    clean = Evidence(tokens=10.0, samples=4.0, rewarded=2.0)
    far = Evidence(tokens=10.0, far_tokens=50.0, samples=4.0, rewarded=2.0)
    for step in range(2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        guard.updated()
        assert guard.check(clean, step, step) is None
    assert guard.check(far, 2, 2) is not None  # W1 back
    assert guard.check(clean, 3, 3) is None  # no update applied after it
    assert guard.check(clean, 4, 4) is None  # still none: still W1
    assert [state.step for state in guard.states] == [0, 1]
