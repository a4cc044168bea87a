import math

import pytest
import torch

from asyncfp8.correction import get_correction
from asyncfp8.losses import (
    aggregate,
    corrected_policy_loss,
    group_advantages,
    per_token_policy_loss,
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
    with pytest.raises(ValueError, match="scale must be"):
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
    torch.testing.assert_close(reinforce, -advantages * logp)


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
            correction, logp, rollout, advantages, mask, proximal_logp=proximal
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
    ppo, _ = corrected_policy_loss(
        tis, logp, rollout, advantages, mask, mode="bypass", clip_high=1.0
    )
    # PPO ratio π_θ/π_rollout = 1.5, 0.8 is the IS itself: no extra weights
    assert ppo.item() == pytest.approx(-(1.5 + 0.8) / 2, rel=1e-5)
    reinforce, _ = corrected_policy_loss(
        tis, logp, rollout, advantages, mask, mode="bypass", kind="reinforce"
    )
    expected = -(1.2 * math.log(0.75) + 0.8 * math.log(0.4)) / 2
    assert reinforce.item() == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="decoupled mode needs proximal_logp"):
        corrected_policy_loss(tis, logp, rollout, advantages, mask, mode="decoupled")
    with pytest.raises(ValueError, match="unknown mode"):
        corrected_policy_loss(tis, logp, rollout, advantages, mask, mode="sideways")


def test_rejected_tokens_leave_the_loss_denominator():
    rollout = torch.full((1, 4), -8.0)
    proximal = rollout + torch.tensor([[0.0, 0.0, 0.0, 5.0]])  # last token: ratio e^5, rejected
    logp = proximal.clone().requires_grad_()
    loss, metrics = corrected_policy_loss(
        get_correction("token_mis", upper=5.0),
        logp,
        rollout,
        torch.tensor([1.0]),
        torch.ones(1, 4, dtype=torch.bool),
        proximal_logp=proximal,
    )
    assert loss.item() == pytest.approx(-1.0)  # mean over the 3 kept tokens of -A·r with r = 1
    assert metrics["correction/frac_masked"] == pytest.approx(0.25)
