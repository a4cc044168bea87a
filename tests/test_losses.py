import math

import pytest
import torch

from asyncfp8.correction import get_correction
from asyncfp8.train.batches import TrainBatch
from asyncfp8.train.losses import (
    PolicyLoss,
    aggregate,
    aggregate_parts,
    corrected_policy_loss,
    group_advantages,
    kl_penalty,
    per_token_policy_loss,
)


def batch(rollout_logp, advantages, mask):
    """A `TrainBatch` with what the policy loss reads (no token ids: it takes log-probs)."""
    rows = rollout_logp.shape[0]
    no_ids = torch.zeros(rows, 1, dtype=torch.long)
    return TrainBatch(
        no_ids,
        no_ids,
        torch.zeros_like(rollout_logp, dtype=torch.long),
        rollout_logp,
        torch.zeros_like(rollout_logp, dtype=torch.long),
        mask.bool(),
        advantages,
    )


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 7, 3, 3])
    advantages = group_advantages(rewards, groups)
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 7 is alone; group 3 has no spread
    z = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(
        advantages, torch.tensor([z, -z, -z, z, 0.0, 0.0, 0.0]), rtol=1e-5, atol=1e-5
    )
    dr = group_advantages(rewards, groups, scale="none")
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="unknown advantage scale"):
        group_advantages(rewards, groups, scale="mad")


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean_token_sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(loss, mask, "sum")


def test_ppo_clip_is_pessimistic_and_asymmetric():
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.1]]))
    proximal = torch.zeros_like(logp)
    advantages = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    loss, clipped = per_token_policy_loss(logp, proximal, advantages, clip_low=0.2, clip_high=0.28)
    # r=1.5, A=1 -> -1.28 (clipped); r=.5, A=1 -> -0.5; r=.5, A=-1 -> 0.8 (clipped); r=1.1 -> -1.1
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5, 0.8, -1.1]]))
    assert clipped.tolist() == [[True, False, True, False]]
    reinforce, _ = per_token_policy_loss(logp, proximal, advantages, kind="reinforce")
    # −A·r·log π with r = π/π_prox held constant: its gradient is −A·r·∇log π
    ratio = torch.exp(logp - proximal).detach().clamp(max=2.0)
    torch.testing.assert_close(reinforce, -advantages * ratio * logp)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    ratios = torch.tensor([[5.0, 2.0, 5.0, 0.5]])
    advantages = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    logp = torch.log(ratios).requires_grad_()
    loss, clipped = per_token_policy_loss(
        logp, torch.zeros_like(logp), advantages, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0
    )
    # A=-1, r=5: max(5, 1.28) = 5, capped at c·|A| = 3; A=-1, r=2: 2 < 3, not capped;
    # A=+1, r=5: ordinary clip -1.28; A=-2, r=0.5: max(1, 1.6) = 1.6 (the low clip).
    torch.testing.assert_close(loss.detach(), torch.tensor([[3.0, 2.0, -1.28, 1.6]]))
    assert clipped.tolist() == [[True, False, True, True]]
    loss.sum().backward()
    # Capped or clipped tokens pass no gradient; the unclipped one passes -A·r = 2.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0, 0.0]]))
    no_dual, _ = per_token_policy_loss(logp, torch.zeros_like(logp), advantages)
    assert no_dual[0, 0].item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        per_token_policy_loss(logp, logp, advantages, clip_ratio_c=1.0)


def test_kl_estimators_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.2, 1e-9]))
    reference = torch.log(torch.tensor([0.25, 0.2, 0.5]))
    for estimator in ("k1", "k3", "low_var_kl"):
        got = kl_penalty(logp, reference, estimator)
        for value, p, q in zip(got.tolist(), [0.5, 0.2, 1e-9], [0.25, 0.2, 0.5], strict=True):
            k1 = math.log(p) - math.log(q)
            clamped = max(-20.0, min(20.0, k1))  # before the exp, as veRL clamps it
            k3 = math.exp(-clamped) - 1 + clamped
            expected = {"k1": k1, "k3": k3, "low_var_kl": min(k3, 10.0)}[estimator]
            assert value == pytest.approx(expected, rel=1e-4)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, reference, "k2")


@pytest.mark.parametrize("how", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_aggregation_over_parts_equals_the_whole(how):
    generator = torch.Generator().manual_seed(0)
    loss = torch.randn(10, 7, generator=generator)
    mask = torch.rand(10, 7, generator=generator) > 0.3
    mask[4] = False  # a sequence with no real token
    parts = [aggregate_parts(loss[rows], mask[rows], how) for rows in (slice(0, 3), slice(3, 10))]
    numerator = sum(n for n, _ in parts)
    denominator = sum(d for _, d in parts)
    torch.testing.assert_close(numerator / denominator, aggregate(loss, mask, how))


def test_correction_weights_scale_the_gradient_and_carry_none():
    torch.manual_seed(0)
    rollout = -torch.rand(3, 5) - 4.0
    proximal = rollout + 0.8 * torch.randn(3, 5)  # a large mismatch, so TIS truncates some
    logp = (proximal + 0.05 * torch.randn(3, 5)).requires_grad_()
    mask = torch.rand(3, 5) > 0.2
    advantages = torch.tensor([1.0, -0.5, 2.0])

    def grad_of(correction):
        logp.grad = None
        loss, _ = corrected_policy_loss(
            PolicyLoss(), correction, logp, batch(rollout, advantages, mask), proximal
        )
        loss.backward()
        return logp.grad.clone()

    tis = get_correction("token_tis", threshold=1.5)
    weights = tis(proximal, rollout, mask).weights
    assert (
        not weights.requires_grad and (weights < torch.exp(proximal - rollout) - 1e-6)[mask].any()
    )
    torch.testing.assert_close(grad_of(tis), grad_of(get_correction("none")) * weights)
    assert not tis(logp, rollout, mask).weights.requires_grad  # detached even from a grad input


def test_bypass_uses_only_the_rejection_mask_with_ppo_and_the_weights_with_reinforce():
    rollout = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.75, 0.4]])).requires_grad_()  # ratios 1.5, 0.8
    mask = torch.ones(1, 2, dtype=torch.bool)
    advantages = torch.tensor([1.0])
    tis = get_correction("token_tis", threshold=1.2)
    tokens = batch(rollout, advantages, mask)
    ppo, _ = corrected_policy_loss(PolicyLoss(mode="bypass", clip_high=1.0), tis, logp, tokens)
    # PPO ratio π_θ/π_rollout = 1.5, 0.8 is the IS itself: no extra weights
    assert ppo.item() == pytest.approx(-(1.5 + 0.8) / 2, rel=1e-5)
    reinforce, _ = corrected_policy_loss(
        PolicyLoss(mode="bypass", kind="reinforce"), tis, logp, tokens
    )
    expected = -(1.2 * math.log(0.75) + 0.8 * math.log(0.4)) / 2
    assert reinforce.item() == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="decoupled mode needs proximal_logp"):
        corrected_policy_loss(PolicyLoss(mode="decoupled"), tis, logp, tokens)
    with pytest.raises(ValueError, match="unknown correction mode"):
        PolicyLoss(mode="sideways")
    with pytest.raises(ValueError, match="unknown aggregation"):
        PolicyLoss(aggregation="per_token")
    with pytest.raises(ValueError, match="unknown policy loss"):
        PolicyLoss(kind="ppo")
    with pytest.raises(ValueError, match="dual-clip needs clip_ratio_c > 1"):
        PolicyLoss(clip_ratio_c=0.5)


def test_rejected_tokens_leave_the_loss_denominator():
    rollout = torch.full((1, 4), -8.0)
    proximal = rollout + torch.tensor([[0.0, 0.0, 0.0, 5.0]])  # last token: ratio e^5, rejected
    logp = proximal.clone().requires_grad_()
    loss, metrics = corrected_policy_loss(
        PolicyLoss(),
        get_correction("token_mis", upper=5.0),
        logp,
        batch(rollout, torch.tensor([1.0]), torch.ones(1, 4, dtype=torch.bool)),
        proximal,
    )
    assert loss.item() == pytest.approx(-1.0)  # mean over the 3 kept tokens of -A·r with r = 1
    assert metrics["correction/frac_masked"] == pytest.approx(0.25)


def test_the_loss_settings_come_from_the_runs_optim_and_correction_mode():
    from omegaconf import OmegaConf

    optim = OmegaConf.create(
        {
            "loss": "reinforce",
            "clip_low": 0.1,
            "clip_high": 0.3,
            "clip_ratio_c": 3.0,
            "aggregation": "seq_mean_token_sum",
        }
    )
    assert PolicyLoss.from_config(optim, "bypass") == PolicyLoss(
        kind="reinforce",
        clip_low=0.1,
        clip_high=0.3,
        clip_ratio_c=3.0,
        mode="bypass",
        aggregation="seq_mean_token_sum",
    )
