"""Whether a run collapsed, or slid late, from its stream reward and its held-out curve (the
definitions and why: docs/correction.md, "Collapse" and "Late slide"). Collapsed: the last
held-out greedy pass@1 below HELDOUT_FRACTION of the best, or the stream reward dead after
it had learned. Slid late: the end more than SLIDE_DROP below the best of the last
SLIDE_STEPS steps. Pure; `asyncfp8.report` counts both per group with a Wilson interval."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Below this best, "half of it" is within one evaluation's noise (0.05 ± 0.02 on 128
# prompts): a run that never learned cannot collapse.
HELDOUT_FLOOR = 0.1
HELDOUT_FRACTION = 0.5  # the last held-out pass@1 below this share of the best
# A batch whose samples almost all score 0 has almost only zero advantages: nothing
# trains, the next batch is as bad. 0.05 of a 64-sample batch is 3 samples.
REWARD_DEAD = 0.05
REWARD_WINDOW = 20  # steps: long enough that a bad batch or two is not a collapse
# The stream must first have learned: a task too hard from the start is not a collapse.
REWARD_LEARNED = 0.2
# A late slide: the end below the best of the run's last SLIDE_STEPS steps by more than
# SLIDE_DROP, ten times the end's own binomial noise on 256 prompts near 0.95 (~0.014).
SLIDE_DROP = 0.1
SLIDE_STEPS = 50


@dataclass(frozen=True)
class Collapse:
    """`collapsed`: by either rule; `signal`: "held-out" or "reward" (the first that
    fired, by step), None if neither; `step`: the first evaluation below half the best,
    or the first step of the dead reward window; `fell_and_recovered`: a held-out
    evaluation fell below half the best but the run ended above it (a dip, not counted)."""

    collapsed: bool
    signal: str | None = None
    step: int | None = None
    reason: str = ""
    fell_and_recovered: bool = False


def heldout_collapse(heldout: Sequence[tuple[int, float]]) -> Collapse:
    """The held-out rule over (step, greedy pass@1) in step order (step 0 included)."""
    if not heldout:
        return Collapse(False)
    best_step, best = max(heldout, key=lambda point: point[1])
    if best < HELDOUT_FLOOR:
        return Collapse(False)
    bound = HELDOUT_FRACTION * best
    fell = [(step, value) for step, value in heldout if step > best_step and value < bound]
    if not fell:
        return Collapse(False)
    end = heldout[-1][1]
    if end >= bound:
        return Collapse(False, fell_and_recovered=True)
    step, value = fell[0]
    return Collapse(
        True,
        "held-out",
        step,
        f"held-out greedy {best:.3f} at step {best_step}, {value:.3f} at step {step}, "
        f"{end:.3f} at the end (< {HELDOUT_FRACTION:g} x best)",
    )


def reward_collapse(rewards: Sequence[tuple[int, float]]) -> Collapse:
    """The reward rule over (step, mean stream reward) in step order."""
    values = [value for _, value in rewards]
    learned = False
    for start in range(len(values) - REWARD_WINDOW + 1):
        window = values[start : start + REWARD_WINDOW]
        if learned and all(value < REWARD_DEAD for value in window):
            step = rewards[start][0]
            return Collapse(
                True,
                "reward",
                step,
                f"stream reward < {REWARD_DEAD:g} for {REWARD_WINDOW} steps from step {step}, "
                f"after a {REWARD_WINDOW}-step mean >= {REWARD_LEARNED:g}",
            )
        learned = learned or sum(window) / REWARD_WINDOW >= REWARD_LEARNED
    return Collapse(False)


def collapse_of(
    rewards: Sequence[tuple[int, float]], heldout: Sequence[tuple[int, float]]
) -> Collapse:
    """Both rules; the one that fired first (by step) names the collapse."""
    by_heldout, by_reward = heldout_collapse(heldout), reward_collapse(rewards)
    fired = [c for c in (by_heldout, by_reward) if c.collapsed]
    if not fired:
        return by_heldout  # carries fell_and_recovered
    first = min(fired, key=lambda c: c.step)
    recovered = by_heldout.fell_and_recovered
    return Collapse(True, first.signal, first.step, first.reason, recovered)


@dataclass(frozen=True)
class Slide:
    """`slid`: the end more than SLIDE_DROP below the best of the last SLIDE_STEPS steps;
    `drop`: best minus end (0 without two evaluations in that window); `best_step`."""

    slid: bool
    drop: float = 0.0
    best_step: int | None = None


def late_slide(heldout: Sequence[tuple[int, float]]) -> Slide:
    """The late-slide rule over (step, greedy pass@1) in step order. Where the held-out
    guard undid the last evaluation, the end is the value it undid: the run slid, and
    what put it back is counted apart."""
    if not heldout:
        return Slide(False)
    end_step = heldout[-1][0]
    window = [(step, value) for step, value in heldout if step >= end_step - SLIDE_STEPS]
    end = min(value for step, value in window if step == end_step)
    best_step, best = max(window, key=lambda point: point[1])
    drop = max(0.0, best - end)
    return Slide(drop > SLIDE_DROP + 1e-9, drop, best_step)  # 0.8 - 0.7 is 0.1 plus rounding


def heldout_curve(evaluated: Sequence[dict]) -> list[tuple[int, float]]:
    """(step, greedy pass@1) of a run's evaluations; one the held-out guard undid is a
    point too, before the restored weights' own at the same step (the run fell)."""
    heldout = []
    for r in evaluated:
        if r.get("guard/heldout_undone_greedy") is not None:
            heldout.append((r["step"], r["guard/heldout_undone_greedy"]))
        if r.get("eval/pass1_greedy") is not None:
            heldout.append((r["step"], r["eval/pass1_greedy"]))
    return heldout


def run_collapse(records: Sequence[dict], evaluated: Sequence[dict]) -> Collapse:
    """`collapse_of` over a run's per-step records and held-out evaluations, as
    `asyncfp8.report.summary.per_step` and `evaluations` read them from metrics.jsonl."""
    rewards = [(r["step"], r["reward/mean"]) for r in records if r.get("reward/mean") is not None]
    return collapse_of(rewards, heldout_curve(evaluated))
