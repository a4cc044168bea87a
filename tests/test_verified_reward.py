import threading
import time

import pytest

from asyncfp8.tasks import build_task, verified
from asyncfp8.tasks.verified import math_verify_reward

# sympy computes 2^(2^100) without end (and without bound on memory) unless interrupted.
HUGE_POWER = "The answer is $\\boxed{2^{2^{100}}}$"


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("The answer is 72.", "72", 1.0),
        ("The answer is 71.", "72", 0.0),
        ("So she paid $1,000 in all.", "1,000", 1.0),
        ("So she paid 1000 dollars.", "1,000", 1.0),
        ("The answer is 1,000", "1000", 1.0),
        ("That leaves 72.00", "72", 1.0),
        ("Half of it: $\\frac{1}{2}$", "0.5", 1.0),
        ("Half of it: 0.5", "\\frac{1}{2}", 1.0),
        ("Half of it: 0.25", "\\frac{1}{2}", 0.0),
        ("We get \\boxed{60735}.", "60,735", 1.0),
        ("We get \\boxed{60736}.", "60,735", 0.0),
        ("", "72", 0.0),
        ("no number here", "72", 0.0),
    ],
)
def test_numbers_fractions_and_boxes(completion, answer, reward):
    assert math_verify_reward(completion, answer) == reward


def test_the_gsm8k_marker_is_the_answer_even_when_text_follows():
    solution = " 14-9=<<14-9=5>>5 stamps.\n#### 5"
    assert math_verify_reward(solution, "5") == 1.0
    assert math_verify_reward(solution + "\n\nQ: Tom has 3 apples and 4 pears.", "5") == 1.0
    assert math_verify_reward(" 2*7=14 stamps.\n#### 14\n\nQ: 5 more", "5") == 0.0
    assert math_verify_reward("#### $1,360", "1360") == 1.0


@pytest.mark.parametrize("completion", [HUGE_POWER, "\\boxed{" + "(" * 2000 + "1", "9" * 20000])
def test_pathological_completions_score_zero_in_bounded_time(completion):
    started = time.monotonic()
    assert math_verify_reward(completion, "72", timeout_s=1) == 0.0
    assert time.monotonic() - started < 10


def in_a_thread(*args, **kwargs):
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(reward=math_verify_reward(*args, **kwargs))
    )
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    return result["reward"]


def test_a_worker_thread_gets_the_same_rewards():
    assert in_a_thread("The answer is $\\frac{3}{4}$", "0.75") == 1.0
    assert in_a_thread(" 2*7=14 stamps.\n#### 14", "14") == 1.0
    assert in_a_thread("The answer is 13.", "14") == 0.0
    started = time.monotonic()
    assert in_a_thread(HUGE_POWER, "72", timeout_s=1) == 0.0
    assert time.monotonic() - started < 10


def test_a_check_that_overruns_in_a_thread_kills_the_helper_and_the_next_starts_anew(
    monkeypatch, caplog
):
    # A deadline shorter than the helper's own timeout stands in for a computation that
    # no signal can interrupt (one long call into C).
    monkeypatch.setattr(verified, "_TIMEOUTS_PER_CHECK", 0.2)
    assert in_a_thread("The answer is 5.", "5") == 1.0  # helper started and ready
    assert in_a_thread(HUGE_POWER, "72", timeout_s=1) == 0.0
    assert "helper restarted" in caplog.text
    monkeypatch.setattr(verified, "_TIMEOUTS_PER_CHECK", 8)
    assert in_a_thread("The answer is 5.", "5") == 1.0


def test_gsm8k_task_uses_math_verify_by_default_and_the_hand_parser_on_request():
    task = build_task({"name": "gsm8k_jsonl"})
    prompt = task.prompt(0)
    assert task.reward_fn is math_verify_reward
    assert task.score(task.completion(prompt), prompt) == 1.0
    hand = build_task(
        {"name": "gsm8k_jsonl", "reward": {"_target_": "asyncfp8.tasks.gsm8k.final_number_reward"}}
    )
    assert hand.score(f"\\boxed{{{prompt.answer}}}", prompt) == 1.0


def test_math_verify_reward_is_selectable_by_target_with_its_settings():
    task = build_task(
        {
            "name": "gsm8k_jsonl",
            "reward": {"_target_": "asyncfp8.tasks.verified.math_verify_reward", "timeout_s": 2},
        }
    )
    prompt = task.prompt(0)
    assert task.score(f"The answer is ${prompt.answer}$.", prompt) == 1.0
    assert task.score("The answer is -1.", prompt) == 0.0


def test_a_timeout_that_is_not_whole_seconds_fails_at_build():
    with pytest.raises(ValueError, match=r"timeout_s must be whole seconds"):
        build_task(
            {
                "name": "gsm8k_jsonl",
                "reward": {
                    "_target_": "asyncfp8.tasks.verified.math_verify_reward",
                    "timeout_s": 2.5,
                },
            }
        )
