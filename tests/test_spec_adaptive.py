"""Adaptive speculation control (asyncfp8/engines/speculative/adaptive.py): the batch-size switch
and the per-bucket bandit over draft lengths, on synthetic tokens/s."""

from __future__ import annotations

import random

import pytest

from asyncfp8.engines.speculative.adaptive import SpeculationController


def test_switches_on_after_patience_checks_at_or_below_threshold_and_off_above():
    control = SpeculationController(threshold=32, patience=10)
    assert [control.check(32) for _ in range(9)] == [False] * 9
    assert control.check(30) is True  # the 10th consecutive check <= 32
    assert control.check(1) is True
    assert control.check(33) is False  # off at once above the threshold
    # ... and the streak starts over.
    assert [control.check(8) for _ in range(10)] == [False] * 9 + [True]
    metrics = control.metrics()
    assert metrics["spec/on"] == 1.0
    assert metrics["spec/fraction_speculating"] == pytest.approx(3 / 22)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 0}, "threshold"),
        ({"threshold": -4}, "threshold"),
        ({"ks": ()}, "empty"),
        ({"ks": (-1, 2)}, "draft lengths"),
        ({"ks": (2, 2)}, "distinct"),
        ({"patience": 0}, "patience"),
        ({"buckets": (4, 2)}, "buckets"),
        ({"buckets": ()}, "buckets"),
        ({"epsilon": 1.5}, "epsilon"),
        ({"window": 0}, "window"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculationController(**kwargs)


def test_bad_reports_are_refused():
    control = SpeculationController(ks=(1, 2))
    with pytest.raises(ValueError, match="not one of"):
        control.report(4, 3, tokens=10, seconds=1.0)
    with pytest.raises(ValueError, match="seconds"):
        control.report(4, 2, tokens=10, seconds=0.0)
    with pytest.raises(ValueError, match="active batch"):
        control.check(-1)


def tokens_per_s(batch: int, k: int, rng: random.Random) -> float:
    """Synthetic: small batches gain from long drafts (best k = 6), larger ones from short
    drafts (best k = 2); ±10% noise."""
    best = 6 if batch <= 4 else 2
    return (100.0 - 8.0 * abs(k - best)) * rng.uniform(0.9, 1.1)


def play(control: SpeculationController, batches, steps, seed=1):
    rng = random.Random(seed)
    chosen = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        k = control.choose_k(batch)
        control.report(batch, k, tokens=int(tokens_per_s(batch, k, rng) * 10), seconds=10.0)
        chosen.append((control.bucket(batch), k))
    return chosen


def test_bandit_finds_the_best_draft_length_per_bucket():
    control = SpeculationController(buckets=(4, 32), seed=0)
    chosen = play(control, batches=[2, 20], steps=800)
    late = chosen[-200:]
    for bucket, best in [(4, 6), (32, 2)]:
        picks = [k for b, k in late if b == bucket]
        assert sum(k == best for k in picks) / len(picks) >= 0.85
        assert max(control.pulls[bucket], key=control.pulls[bucket].get) == best
    metrics = control.metrics()
    assert metrics["spec/best_k/batch<=4"] == 6 and metrics["spec/best_k/batch<=32"] == 2
    assert metrics["spec/k/batch<=4"] in control.ks


def test_bandit_follows_a_moving_best_arm():
    """The drafter improves: long drafts become best. The window forgets the old values."""
    control = SpeculationController(buckets=(8,), ks=(1, 4), window=20, seed=0)
    for _ in range(200):
        k = control.choose_k(4)
        control.report(4, k, tokens=100 if k == 1 else 60, seconds=1.0)
    assert control.pulls[8][1] > 3 * control.pulls[8][4]
    for _ in range(300):
        k = control.choose_k(4)
        control.report(4, k, tokens=60 if k == 1 else 150, seconds=1.0)
    recent = [control.choose_k(4) for _ in range(50)]
    assert recent.count(4) >= 45


def test_seeded_and_checkpointed_choices_are_reproducible():
    def fresh(seed):
        return SpeculationController(buckets=(4, 32), seed=seed)

    a, b, c = fresh(0), fresh(0), fresh(1)
    assert play(a, [2, 20], 300) == play(b, [2, 20], 300)
    assert play(fresh(0), [2, 20], 300) != play(c, [2, 20], 300)
    state = a.state_dict()
    resumed = fresh(5)
    resumed.load_state_dict(state)
    assert play(a, [3, 9], 100, seed=7) == play(resumed, [3, 9], 100, seed=7)
    with pytest.raises(ValueError, match="other buckets"):
        SpeculationController(buckets=(8,)).load_state_dict(state)


def test_a_zero_draft_length_lets_a_bucket_learn_to_skip_speculation():
    """k = 0 is a plain step: where every draft length is slower, the bandit picks it."""
    control = SpeculationController(buckets=(32,), ks=(0, 2, 4), seed=0)
    rng = random.Random(0)
    for _ in range(300):
        k = control.choose_k(16)
        speed = {0: 100.0, 2: 80.0, 4: 70.0}[k] * rng.uniform(0.9, 1.1)
        control.report(16, k, tokens=int(speed), seconds=1.0)
    assert max(control.pulls[32], key=control.pulls[32].get) == 0
    assert control.metrics()["spec/best_k/batch<=32"] == 0
