"""The guard that undoes a fatal step (issue 45): its settings refused at start naming the
key, its rules on evidence built here, the last good state put back bit for bit, and on
the tiny model: a clean run never rolls back and trains exactly as without the guard; the
poison fail point breaks a run without the guard and is undone with it; rollbacks in a
row stop the run with a checkpoint that a resume continues from."""

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from asyncfp8.run.failpoints import POISON_UPDATE
from asyncfp8.train.batches import TrainBatch
from asyncfp8.train.guard import (
    DEAD_REWARD_CHANCE,
    MIN_HISTORY,
    Evidence,
    GuardRules,
    GuardSettings,
)
from asyncfp8.train.rollback import LastGood

# --- settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("max_rollbacks", 0, "guard.max_rollbacks must be >= 1"),
        ("max_rollbacks", 2.5, "guard.max_rollbacks must be a int"),
        ("enabled", "yes", "guard.enabled must be a bool"),
        ("log_ratio_bound", 0.5, "guard.log_ratio_bound must be > 1"),
        ("log_ratio_bound", float("nan"), "guard.log_ratio_bound must be > 1"),
        ("far_fraction", 0.0, r"guard.far_fraction must be in \(0, 1\]"),
        ("reward_good", 1.5, r"guard.reward_good must be in \(0, 1\]"),
        ("window", True, "guard.window must be a int"),
        ("dead_batches", 0, "guard.dead_batches must be >= 1"),
        ("reward_low", 1.0, r"guard.reward_low must be in \[0, 1\)"),
        ("shrink", 0.0, r"guard.shrink must be in \(0, 1\] \(1: off\)"),
        ("shrink_steps", 0, "guard.shrink_steps must be >= 1"),
        ("heldout_below", 1.0, r"guard.heldout_below must be in \[0, 1\) \(0: off\)"),
        ("heldout_below", "half", "guard.heldout_below must be a float"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        GuardSettings.from_config({key: value})


def test_a_mistyped_setting_fails_when_the_config_is_composed():
    from hydra import compose, initialize_config_module

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("config")
        assert GuardSettings.from_config(cfg.guard) == GuardSettings()  # yaml = defaults
        with pytest.raises(Exception, match=r"guard\.max_rollbacks"):
            compose("config", overrides=["guard.max_rollbacks=three"])


# --- rules ------------------------------------------------------------------------------


FAR_COUNT = float(GuardSettings().far_tokens)  # tokens beyond the bound that fail a batch


def micro_batch(mask, rollout_logp, versions) -> TrainBatch:
    """A micro-batch with what the guard's token evidence reads (no token ids)."""
    no_ids = torch.zeros(mask.shape[0], 1, dtype=torch.long)
    positions = torch.zeros_like(versions)
    return TrainBatch(no_ids, no_ids, positions, rollout_logp, versions, mask)


def evidence(tokens=100, far=0, far5=0, samples=16, rewarded=8):
    return Evidence(tokens, far, far5, 0.01 * tokens, samples, rewarded)


def test_tokens_beyond_the_bound_or_a_far_share_fail_a_batch_from_the_first():
    rules = GuardRules(GuardSettings())
    count = GuardSettings().far_tokens
    assert rules.judge(evidence(far=count)).signal == "far_tokens"
    # a few are no verdict: 9 is the most a clean batch of the stability study had
    assert rules.judge(evidence(far=9)) is None and count > 9
    assert GuardRules(GuardSettings(far_tokens=1)).judge(evidence(far=1)).signal == "far_tokens"
    assert rules.judge(evidence(far5=11)).setting == "guard.far_fraction"
    assert rules.judge(evidence(far5=10)) is None  # 10% is not more than 10%
    assert rules.judge(evidence()) is None


def test_a_dead_reward_fails_only_after_good_batches():
    rules = GuardRules(GuardSettings(dead_batches=1))
    assert rules.judge(evidence(rewarded=0)) is None  # no history: not judged
    for _ in range(MIN_HISTORY):
        assert rules.judge(evidence(rewarded=8)) is None
    verdict = rules.judge(evidence(rewarded=0))
    assert (verdict.signal, verdict.setting) == ("dead_reward", "guard.reward_good")
    poor = GuardRules(GuardSettings(dead_batches=1))
    for _ in range(MIN_HISTORY + 1):
        poor.judge(evidence(rewarded=1))  # a median of 1/16 rewarded: never good
    assert poor.judge(evidence(rewarded=0)) is None


def test_a_dead_reward_fails_only_after_dead_batches_in_a_row():
    """One dead batch can be the rounding of one version (FP8 seed 7): the verdict waits
    for guard.dead_batches in a row; a batch that scores ends the streak, one with no
    evidence leaves it; the streak's batches do not join the history."""
    rules = GuardRules(GuardSettings(dead_batches=3))
    for _ in range(MIN_HISTORY):
        rules.judge(evidence(samples=64, rewarded=32))
    history = list(rules.reward_history)
    for _ in range(2):
        assert rules.judge(evidence(samples=64, rewarded=0)) is None and rules.pending
    assert rules.judge(evidence(samples=64, rewarded=24)) is None and not rules.pending
    assert rules.judge(evidence(samples=64, rewarded=0)) is None and rules.dead_streak == 1
    assert rules.judge(evidence(samples=0, rewarded=0)) is None and rules.dead_streak == 1
    assert rules.judge(evidence(samples=64, rewarded=0)) is None and rules.dead_streak == 2
    verdict = rules.judge(evidence(samples=64, rewarded=0))
    assert verdict.signal == "dead_reward" and "3 batch(es) in a row" in verdict.detail
    assert not rules.pending
    assert list(rules.reward_history) == [*history, 24 / 64]  # only the batch that scored


def test_a_batch_that_scores_nothing_by_chance_is_not_a_dead_reward():
    # 5 of 16 rewarded (the tiny model's rate): 16 samples all unrewarded happen once in
    # (16/11)^16 ~ 400 clean batches, so such a batch proves nothing; 48 such samples do.
    rules = GuardRules(GuardSettings(dead_batches=1))
    for _ in range(MIN_HISTORY):
        assert rules.judge(evidence(rewarded=5)) is None
    assert (11 / 16) ** 16 > DEAD_REWARD_CHANCE >= (11 / 16) ** 48
    assert rules.judge(evidence(rewarded=0)) is None
    verdict = rules.judge(evidence(rewarded=0, samples=48))
    assert verdict is not None and verdict.signal == "dead_reward"


def test_a_batch_that_scores_next_to_nothing_counts_as_dead():
    """FP16 seed 3 (session 31): the broken policy scored 0-19% of 64 samples against a
    median of 0.72; such batches continue a dead streak instead of passing. A batch at
    0.36 of the median (the lowest a clean batch of the stability study scored) does
    not, nor does a small batch that chance alone would bring that low."""
    rules = GuardRules(GuardSettings(dead_batches=3))
    for _ in range(MIN_HISTORY):
        rules.judge(evidence(samples=64, rewarded=46))  # median 46/64 = 0.72
    assert rules.judge(evidence(samples=64, rewarded=0)) is None and rules.dead_streak == 1
    assert rules.judge(evidence(samples=64, rewarded=12)) is None and rules.dead_streak == 2
    verdict = rules.judge(evidence(samples=64, rewarded=4))
    assert verdict.signal == "dead_reward" and "the last: 4 of 64" in verdict.detail
    assert rules.judge(evidence(samples=64, rewarded=17)) is None and not rules.pending
    assert not rules.dead(evidence(samples=64, rewarded=17))  # 0.37 of the median
    # 1 of 8 is under 0.3 x 0.72, but 8 samples at 0.72 score at most 1 once in ~3,000
    assert not rules.dead(evidence(samples=8, rewarded=1))
    assert rules.dead(evidence(samples=64, rewarded=1))
    assert not GuardRules(GuardSettings(reward_low=0.0)).dead(evidence(samples=64, rewarded=1))


@pytest.mark.parametrize("k, n, p", [(0, 16, 0.31), (1, 16, 0.31), (12, 64, 0.72), (5, 9, 0.5)])
def test_the_binomial_tail_matches_an_exact_rational_sum(k, n, p):
    from fractions import Fraction
    from math import comb

    from asyncfp8.train.guard import binomial_at_most

    q = Fraction(p)
    exact = sum(comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(k + 1))
    assert binomial_at_most(k, n, p) == pytest.approx(float(exact), rel=1e-9)
    assert binomial_at_most(n, n, p) == 1.0 and binomial_at_most(0, 4, 1.0) == 0.0


def test_after_a_rollback_the_updates_shrink_and_grow_back():
    from asyncfp8.train.rollback import StepGuard

    model = torch.nn.Linear(2, 2)
    settings = GuardSettings(shrink=0.5, shrink_steps=10, max_rollbacks=5)
    guard = StepGuard(settings, model, torch.optim.AdamW(model.parameters()))
    clean = Evidence(tokens=10.0, samples=4.0, rewarded=2.0)
    far = Evidence(tokens=10.0, far_tokens=FAR_COUNT, samples=4.0, rewarded=2.0)
    assert guard.check(clean, 0, 0) is None and guard.update_scale(0) == 1.0
    assert guard.check(far, 1, 1) is not None
    assert guard.metrics["guard/update_scale"] == 0.5
    assert guard.update_scale(2) == 0.5
    assert guard.check(far, 3, 3) is not None and guard.update_scale(4) == 0.25
    assert guard.update_scale(11) == 0.25  # 10 updates after the first: still shrunk
    assert guard.update_scale(12) == 0.5  # the first has aged out, the second not yet
    assert guard.update_scale(14) == 1.0


def test_the_last_good_state_comes_back_bit_for_bit_with_adams_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = LastGood(model, optimizer)

    def step():
        model(torch.randn(3, 5)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    saved.keep(0)  # before AdamW's first step: no state
    step()
    saved.restore()
    assert not optimizer.state
    step()
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    saved.keep(1)
    step()
    step()
    saved.restore()
    for p, w, m in zip(model.parameters(), weights, moments, strict=True):
        assert torch.equal(p, w) and torch.equal(optimizer.state[p]["exp_avg_sq"], m)
    assert saved.nbytes == 3 * sum(p.numel() * 4 for p in model.parameters()) + 2 * 4


def test_a_token_the_rollout_put_far_but_its_own_version_did_not_is_excused():
    """With π_prox of the token's version, the guard judges what the update did to a
    token (learner against its version's weights), not how far the rollout's rounding
    put it; a token with no kept version is judged against the rollout as before."""
    from asyncfp8.train.evidence import add_token_evidence

    micro = micro_batch(
        torch.tensor([[True, True, True]]),
        torch.zeros(1, 3),
        torch.tensor([[4, 4, 5]]),
    )
    logp = torch.full((1, 3), -30.0)
    # token 0: its version gave it -29.5 (the engine's rounding put it at 0): excused;
    # token 1: its version gave it -1 (the update took it to -30): far; token 2: no kept
    # version (the live one): judged against the rollout, far
    own = (torch.tensor([[-29.5, -1.0, 0.0]]), torch.tensor([[True, True, False]]))
    sums = Evidence()
    add_token_evidence(logp, micro, 20.0, None, sums, own_version=own)
    assert (sums.far_tokens, sums.excused_tokens) == (2, 1)
    assert sums.far5_tokens == 2
    before = Evidence()  # without the versions: every token judged on the rollout
    add_token_evidence(logp, micro, 20.0, None, before)
    assert (before.far_tokens, before.excused_tokens) == (3, 0)
    # the k3 is the rollout's mismatch either way
    assert sums.k3_sum == pytest.approx(before.k3_sum)


def test_a_token_the_update_raised_far_above_its_version_is_not_far():
    """A break makes sampled tokens unlikely: a token the learner now gives e^20 times
    what its version gave it (the engine sampled it, so the engine disagreed with the
    version, and the update sided with the engine) is counted as raised, not far, and
    counts toward neither far signal; one the update lowered as far is far."""
    from asyncfp8.train.evidence import add_token_evidence

    micro = micro_batch(
        torch.tensor([[True, True, True, True]]),
        torch.tensor([[-1.0, -1.0, -0.5, -1.0]]),
        torch.tensor([[4, 4, 4, 4]]),
    )
    logp = torch.tensor([[-1.2, -1.0, -26.0, -float("inf")]])
    # tokens 0 and 1: their version gave them -30 and -40 (the engine sampled them at -1):
    # raised by 28.8 and 39; token 2: lowered from -0.6 to -26; token 3: to -inf
    own = (torch.tensor([[-30.0, -40.0, -0.6, -1.0]]), torch.ones(1, 4, dtype=torch.bool))
    sums = Evidence()
    add_token_evidence(logp, micro, 20.0, None, sums, own_version=own)
    assert (sums.far_tokens, sums.raised_tokens) == (2, 2)
    assert sums.far5_tokens == 2 and sums.excused_tokens == 0
    # judged on the rollout (no kept version, or a version log-prob that is not finite),
    # far either way: rollout log-probs 38 nats below the learner's are a fault themselves
    micro.rollout_logp = torch.tensor([[-40.0, -1.0, -0.5, -1.0]])
    logp = torch.tensor([[-2.0, -1.0, -0.5, -1.0]])
    own = (
        torch.tensor([[0.0, -float("inf"), -0.5, -1.0]]),
        torch.tensor([[False, True, True, True]]),
    )
    sums = Evidence()
    add_token_evidence(logp, micro, 20.0, None, sums, own_version=own)
    assert (sums.far_tokens, sums.raised_tokens) == (1, 0)


def test_tokens_and_samples_of_undone_versions_are_left_out_of_the_evidence():
    from types import SimpleNamespace

    from asyncfp8.train.evidence import add_reward_evidence, add_token_evidence

    micro = micro_batch(
        torch.tensor([[True, True, False], [True, True, True]]),
        torch.zeros(2, 3),
        torch.tensor([[3, 3, 0], [5, 5, 6]]),  # 4 and 5: from undone weights
    )
    logp = torch.tensor([[-30.0, -0.1, -50.0], [-30.0, -30.0, -6.0]])
    sums = Evidence()
    add_token_evidence(logp, micro, 20.0, (3, 5), sums)
    # the sample of version 3 is judged (one token at -30); version 5's two are left out;
    # the padding at -50 never counts
    assert (sums.tokens, sums.ignored_tokens) == (3, 2)
    assert (sums.far_tokens, sums.far5_tokens) == (1, 2)
    rows = [
        SimpleNamespace(reward=1.0, versions=[3, 3]),
        SimpleNamespace(reward=0.0, versions=[5, 6]),
    ]
    add_reward_evidence(rows, (3, 5), sums)
    assert (sums.samples, sums.rewarded) == (1, 1)
    # a batch left out whole is no evidence: it neither fails nor counts as good
    rules = GuardRules(GuardSettings())
    for _ in range(MIN_HISTORY):
        rules.judge(evidence())
    assert rules.judge(evidence(tokens=0, samples=0, rewarded=0)) is None
    assert len(rules.reward_history) == MIN_HISTORY


def test_a_run_stopped_by_the_guard_falls_back_to_the_oldest_good_state():
    from asyncfp8.train.rollback import StepGuard

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    guard = StepGuard(GuardSettings(max_rollbacks=1), model, optimizer)
    clean = Evidence(tokens=10.0, samples=4.0, rewarded=2.0)
    kept = []
    for step in range(3):  # three batches pass; the weights move between them
        assert guard.check(clean, step, step) is None
        kept.append(model.weight.detach().clone())
        with torch.no_grad():
            model.weight.add_(1.0)
        guard.updated()  # an update applied, as the training step says
    # in sync mode the last may have passed only because it could not see the break
    assert guard.check(replace(clean, far_tokens=FAR_COUNT), 3, 3).signal == "far_tokens"
    assert guard.exhausted and torch.equal(model.weight, kept[2])
    assert guard.fall_back() == 1  # keep_states=2: the states after steps 1 and 2
    assert torch.equal(model.weight, kept[1])


def guarded_steps(keep_states: int, steps: int, **settings):
    """A StepGuard over a small layer whose weights move by 1 between `steps` batches that
    pass (step and version alike), and the weights each kept state holds, by version."""
    from asyncfp8.train.rollback import StepGuard

    model = torch.nn.Linear(2, 2)
    settings = GuardSettings(keep_states=keep_states, **({"dead_batches": 1} | settings))
    guard = StepGuard(settings, model, torch.optim.AdamW(model.parameters()))
    held = {}
    for step in range(steps):
        assert guard.check(CLEAN, step, step) is None
        held[step] = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        guard.updated()  # an update applied, as the training step says
    return guard, model, held


CLEAN = Evidence(tokens=10.0, samples=48.0, rewarded=24.0)
DEAD = replace(CLEAN, rewarded=0.0)


def test_a_dead_batch_rolls_back_past_the_version_that_sampled_it():
    # overlapped async: the batch judged after step 6 was sampled by version 5, the
    # newest state kept; those weights go too, back to version 4's, in one rollback
    guard, model, held = guarded_steps(keep_states=2, steps=MIN_HISTORY + 1)
    newest = MIN_HISTORY
    verdict = guard.check(DEAD, newest + 1, newest + 1, sampled_from=newest)
    assert verdict.signal == "dead_reward"
    assert torch.equal(model.weight, held[newest - 1]) and guard.good_step == newest - 1
    # a far token speaks of the learner's weights: the newest state, as before
    guard, model, held = guarded_steps(keep_states=2, steps=MIN_HISTORY + 1)
    far = replace(CLEAN, far_tokens=FAR_COUNT)
    assert guard.check(far, newest + 1, newest + 1, sampled_from=newest).signal == "far_tokens"
    assert torch.equal(model.weight, held[newest])


def test_a_dead_batch_older_than_every_kept_state_puts_back_the_oldest_and_says_so(caplog):
    guard, model, held = guarded_steps(keep_states=2, steps=MIN_HISTORY + 1)
    newest = MIN_HISTORY
    with caplog.at_level(logging.WARNING, logger="asyncfp8.learner"):
        guard.check(DEAD, newest + 1, newest + 1, sampled_from=newest - 3)
    assert torch.equal(model.weight, held[newest - 1])
    assert "raise guard.keep_states" in caplog.text


def test_a_dead_streak_keeps_no_state_and_its_rollback_goes_past_its_oldest_sampler():
    # versions 0..5 pass; the streak's batches after steps 6, 7, 8 were sampled from
    # versions 5, 7, 8 on: their weights are not kept, and the rollback that ends the
    # streak goes back past version 5, to 4's weights
    guard, model, held = guarded_steps(keep_states=3, steps=MIN_HISTORY + 1, dead_batches=3)
    newest = MIN_HISTORY
    for step, sampled_from in ((newest + 1, newest), (newest + 2, newest + 2)):
        assert guard.check(DEAD, step, step, sampled_from=sampled_from) is None
        assert guard.good_step == newest and guard.metrics["guard/dead_streak"] > 0
        with torch.no_grad():
            model.weight.add_(1.0)  # a dead batch's update (momentum)
        guard.updated()  # an update applied, as the training step says
    verdict = guard.check(DEAD, newest + 3, newest + 3, sampled_from=newest + 3)
    assert verdict.signal == "dead_reward" and guard.metrics["guard/dead_streak"] == 0
    assert torch.equal(model.weight, held[newest - 1]) and guard.good_step == newest - 1


def test_rollbacks_to_one_state_count_in_a_row_though_batches_pass_between():
    """Put back, a batch passes, the next update's batch fails again, over and over.
    Rollbacks that do not get past the state last put back count in a row and stop the run
    at guard.max_rollbacks; once the run has kept keep_states states past it, the count
    starts again."""
    guard, model, _ = guarded_steps(keep_states=2, steps=MIN_HISTORY + 1, max_rollbacks=3)
    step = MIN_HISTORY + 1
    far = replace(CLEAN, far_tokens=FAR_COUNT)
    for expected in (1, 2, 3):
        assert guard.check(far, step, step).signal == "far_tokens"
        assert guard.in_row == expected
        assert guard.check(CLEAN, step + 1, step + 1) is None  # the state put back passes
        with torch.no_grad():
            model.weight.add_(1.0)
        guard.updated()  # an update applied, as the training step says
        step += 2
    assert guard.exhausted
    guard, _, _ = guarded_steps(keep_states=2, steps=MIN_HISTORY + 1, max_rollbacks=3)
    failed = MIN_HISTORY + 1
    assert guard.check(far, failed, failed).signal == "far_tokens"
    # the first batch passes on the state put back (kept already, no second copy); two
    # more are kept past it
    for step in (failed + 1, failed + 2, failed + 3):
        assert guard.check(CLEAN, step, step) is None
        assert guard.in_row == (0 if step == failed + 3 else 1)
        guard.updated()  # the step's update


# --- on the tiny model ------------------------------------------------------------------

STEPS, POISONED = 6, 3


@pytest.fixture(scope="module")
def recorded(tiny_model_dir):
    from tests.recorded import record_groups

    return record_groups(tiny_model_dir, steps=STEPS, groups=4, group_size=4, seed=1)


def weights(model):
    """Plain copies of the parameters (FSDP2 keeps them as DTensors, world size 1 here)."""
    return [
        (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()
    ]


def trained(model_dir, run_dir, groups, *overrides):
    """Per step: (metrics, parameters after it) of an in-process learner on `groups`."""
    from asyncfp8.learner import Learner
    from tests.recorded import learner_config, train

    learner = Learner(learner_config(model_dir, run_dir, *overrides))
    learner.version = 0
    out = []
    try:
        for batch in groups:
            metrics = train(learner, batch)
            out.append((metrics, weights(learner.model)))
    finally:
        learner.close()
    return out


@pytest.fixture(scope="module")
def clean(tiny_model_dir, recorded, tmp_path_factory):
    return trained(tiny_model_dir, tmp_path_factory.mktemp("clean"), recorded)


@pytest.mark.slow
def test_a_clean_run_never_rolls_back_and_trains_as_without_the_guard(
    tiny_model_dir, recorded, clean, tmp_path
):
    off = trained(tiny_model_dir, tmp_path, recorded, "guard.enabled=false")
    for (on_metrics, on_params), (off_metrics, off_params) in zip(clean, off, strict=True):
        assert on_metrics["guard/rolled_back"] == 0
        assert not any(key.startswith("guard/") for key in off_metrics)
        assert all(torch.equal(a, b) for a, b in zip(on_params, off_params, strict=True))
    assert clean[-1][0]["guard/rollbacks"] == 0


@pytest.mark.slow
def test_the_poisoned_step_breaks_a_run_without_the_guard_and_is_undone_with_it(
    tiny_model_dir, recorded, clean, tmp_path, armed
):
    armed(f"{POISON_UPDATE}={POISONED}")
    off = trained(tiny_model_dir, tmp_path / "off", recorded, "guard.enabled=false")
    armed(f"{POISON_UPDATE}={POISONED}")
    on = trained(tiny_model_dir, tmp_path / "on", recorded)
    clean_far = max(m["mismatch/frac_abs_log_ratio_gt5"] for m, _ in clean)
    # without the guard: from the step after the poison on, the share of the recorded
    # rollouts' tokens beyond |log ρ| = 5 for the learner is past the guard's own bound
    # (guard.far_fraction), where a clean run never goes, and it stays there. (How far
    # past depends on the samples, which differ between CPUs: 32% to over 50% seen.)
    bound = GuardSettings().far_fraction
    broken = [m["mismatch/frac_abs_log_ratio_gt5"] for m, _ in off[POISONED:]]
    assert clean_far <= bound < min(broken), (clean_far, broken)
    # with it: the next step rolls back to the weights after step POISONED - 1 ...
    rollback, weights = on[POISONED]
    assert rollback["guard/rolled_back"] == 1 and rollback["optim/updates"] == 0
    # on a signal of the broken policy's tokens: one beyond guard.log_ratio_bound, or a
    # share beyond 5 past guard.far_fraction (which fires first depends on the samples)
    assert rollback["guard/far_tokens"] >= 1 or rollback["guard/far_fraction"] > bound
    before_poison = clean[POISONED - 2][1]
    assert all(torch.equal(a, b) for a, b in zip(weights, before_poison, strict=True))
    # ... and trains on as a clean run does
    for metrics, _ in on[POISONED + 1 :]:
        assert metrics["guard/rolled_back"] == 0
        assert metrics["mismatch/frac_abs_log_ratio_gt5"] <= max(clean_far, 0.1)
    assert on[-1][0]["guard/rollbacks"] == 1


def corrupted(groups):
    """The groups with rollout log-probs of -40: every token 20+ nats from the learner's."""
    import copy

    broken = copy.deepcopy(groups)
    for group in broken:
        for t in group.trajectories:
            t.logprobs = [-40.0] * len(t.logprobs)
    return broken


@pytest.mark.slow
def test_rollbacks_in_a_row_stop_the_run_and_a_resume_continues(
    tiny_model_dir, recorded, tmp_path, caplog
):
    from asyncfp8.learner import Learner
    from asyncfp8.run.files import GUARD_STOP_FILE, GUARD_STOPPED
    from tests.recorded import learner_config, train

    caplog.set_level(logging.INFO, logger="asyncfp8.learner")
    overrides = ("guard.max_rollbacks=2",)
    learner = Learner(learner_config(tiny_model_dir, tmp_path, *overrides))
    learner.version = 0
    start = weights(learner.model)
    train(learner, corrupted(recorded[0]))  # the first batch: nothing to roll back to
    assert "no good state to roll back to yet" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(weights(learner.model), start, strict=True))
    # two that pass: the weights after steps 1 (those it started with) and 2 are good
    for batch in (recorded[1], recorded[2]):
        train(learner, batch)
    after_step_2 = learner.train_step.guard.states[-1].params
    train(learner, corrupted(recorded[3]))  # back to the weights after step 2
    assert all(torch.equal(a, b) for a, b in zip(weights(learner.model), after_step_2, strict=True))
    # failing again, those were not good after all: one state further back
    train(learner, corrupted(recorded[4]))
    assert learner.train_step.guard.exhausted
    assert learner._stop_by_guard() == GUARD_STOPPED
    message = caplog.records[-1].getMessage()
    assert "2 rollbacks in a row (guard.max_rollbacks=2)" in message
    assert "signal far_tokens" in message and "guard.log_ratio_bound" in message
    assert "the weights after step 1 (the oldest good state kept) in" in message
    assert "step_00000005" in message and "run.resume=true" in message
    # ... and the stop is in the run dir, for the summary and the study reports to count
    stop = json.loads((learner.dir / GUARD_STOP_FILE).read_text())
    assert stop["step"] == 5 and stop["signal"] == "far_tokens" and stop["good_step"] == 1
    assert stop["checkpoint"].endswith("step_00000005")
    # the checkpoint holds the last good weights; a resume continues from it
    resumed = Learner(learner_config(tiny_model_dir, tmp_path, *overrides, "run.resume=true"))
    try:
        assert resumed.step == 5
        assert not (learner.dir / GUARD_STOP_FILE).exists()  # going on: no longer stopped
        restored = weights(resumed.model)
        assert all(torch.equal(a, b) for a, b in zip(restored, start, strict=True))
        metrics = train(resumed, recorded[5])
        assert metrics["guard/rolled_back"] == 0 and metrics["optim/updates"] == 1
    finally:
        resumed.close()


def test_the_launcher_writes_the_summary_of_a_run_the_guard_stopped(tmp_path, capsys):
    """The learner's exit status 3 is an outcome, not a crash: the launcher writes the
    summary.json a study keeps and counts (a crash's run is run again), says why the run
    stopped, and how to go on."""
    import time

    from asyncfp8.launch.ending import report_guard_stop
    from asyncfp8.run.files import CHECKPOINT_DIR, GUARD_STOP_FILE, GUARD_STOPPED, LEARNER_STATE
    from tests.test_collapse import synthetic_run

    run_dir = Path(synthetic_run(tmp_path / "run", 0, {0: 0.2}, [0.5] * 12))
    stop = {"step": 12, "signal": "far_tokens", "detail": "3 of 900 tokens", "good_step": 9}
    (run_dir / GUARD_STOP_FILE).write_text(json.dumps(stop))
    (run_dir / CHECKPOINT_DIR / "step_00000012").mkdir(parents=True)
    (run_dir / CHECKPOINT_DIR / "step_00000012" / LEARNER_STATE).write_bytes(b"")
    reason = "learner ERROR guard: 3 rollbacks in a row (guard.max_rollbacks=3); ..."
    (run_dir / "learner.log").write_text(f"learner INFO step 11\n{reason}\n")
    assert report_guard_stop(run_dir, time.perf_counter()) == GUARD_STOPPED
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["guard_stopped"] == stop and summary["steps"] == 12
    printed = capsys.readouterr().out
    assert f"the guard stopped the run. learner.log ends:\n    {reason}" in printed
    assert f"continue with: run.resume=true run.dir={run_dir}" in printed
