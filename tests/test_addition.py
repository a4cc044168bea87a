"""The `addition` task: a problem space no run can memorize, a held-out split that the
prompt stream and the warm-start never touch, worked answers that are right digit by
digit, and bad settings refused at start."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncfp8.models.tiny import recipe_for, warm_start_task
from asyncfp8.tasks import build_task, get_task
from asyncfp8.tasks.addition import read_sum, sum_reward
from asyncfp8.tasks.base import is_heldout

STEP = re.compile(r"(\d)\+(\d)\+(\d)=(\d\d)")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), start=st.integers(0, 10**9))
def test_the_stream_never_yields_a_heldout_problem_for_any_seed(seed, start):
    task = get_task("addition", seed=seed, digits=3)
    heldout = {p.meta["expression"] for p in task.heldout_prompts(256)}
    for index in range(start, start + 200):
        expression = task.prompt(index).meta["expression"]
        assert not is_heldout(expression, task.heldout_fraction)
        assert expression not in heldout


def test_the_heldout_split_is_the_same_for_every_seed_and_format():
    splits = [
        [p.text for p in get_task("addition", seed=s, answer_format=f).heldout_prompts(300)]
        for s in (0, 1, 99)
        for f in ("worked", "reversed")
    ]
    assert all(split == splits[0] for split in splits)
    assert len(set(splits[0])) == 300
    assert all(is_heldout(text.split()[1], 0.1) for text in splits[0])


def test_the_warm_start_trains_on_the_stream_so_never_on_a_heldout_problem():
    """The factory warm-starts on the run's own task (its stream, other seeds): the same
    split, so the held-out problems are out of the warm-start too."""
    recipe = recipe_for(warm_start_task({"name": "addition", "digits": 3, "seed": 5}))
    assert recipe.task == {"name": "addition", "digits": 3}
    heldout = {p.text for p in get_task(**recipe.task).heldout_prompts(512)}
    for seed in (0, 10_000, 20_000):  # the warm-start's training, check and final prompts
        stream = get_task(**recipe.task, seed=seed)
        assert not heldout & {stream.prompt(i).text for i in range(5000)}


def test_the_space_is_far_larger_than_a_run():
    task = get_task("addition", digits=3)
    assert task.space == 10**6
    stream = {task.prompt(i).meta["expression"] for i in range(4000)}  # 500 steps × 8
    assert len(stream) > 3900  # i.i.d. draws: a run almost never sees a problem twice


@pytest.mark.parametrize("digits", [2, 3, 5])
def test_worked_answers_are_right_digit_by_digit(digits):
    task = get_task("addition", digits=digits, seed=3)
    for index in range(200):
        prompt = task.prompt(index)
        a, b = prompt.meta["a"], prompt.meta["b"]
        assert prompt.text == f"Q: {a:0{digits}d}+{b:0{digits}d}\nA:"
        completion = task.completion(prompt)
        steps = STEP.findall(completion)
        assert len(steps) == digits
        carry = 0
        for position, (x, y, c, total) in enumerate(steps):
            assert int(x) == a // 10**position % 10 and int(y) == b // 10**position % 10
            assert int(c) == carry and int(total) == int(x) + int(y) + carry
            carry = int(total) // 10
        assert completion.endswith(f" #{a + b:0{digits + 1}d}")
        assert task.score(completion, prompt) == 1.0
        assert int(prompt.answer) == a + b


def test_reversed_answers_and_rewards():
    task = get_task("addition", digits=3, answer_format="reversed")
    prompt = next(p for i in range(100) if (p := task.prompt(i)).meta["a"] + p.meta["b"] > 99)
    completion = task.completion(prompt)
    assert completion == " " + f"{int(prompt.answer):04d}"[::-1]
    assert task.score(completion, prompt) == 1.0
    assert task.score(" " + f"{int(prompt.answer):04d}", prompt) == 0.0  # not reversed


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        (" 2+6+0=08 8+9+0=17 4+3+1=08 0+7+0=07 #07878", "7878", 1.0),
        (" 2+6+0=08 #07878 and then #7879", "7878", 0.0),  # the last # counts
        (" 2+6+0=08 8+9+0=17 4+3+1=08 0+7+0=07", "7878", 0.0),  # no final sum
        (" #7878", "7878", 1.0),  # the steps are not graded, only the sum
        (" # 7878", "7878", 0.0),  # the sum follows # directly
        ("", "7878", 0.0),
    ],
)
def test_the_worked_reward_reads_the_sum_after_the_last_marker(completion, answer, reward):
    assert sum_reward(completion, answer, "worked") == reward


def test_read_sum_of_a_completion_with_nothing_to_read():
    assert read_sum("   ", "reversed") is None
    assert read_sum("x12", "reversed") is None
    assert read_sum(" 8787 trailing", "reversed") == 7878


def test_the_config_group_builds_the_task_with_its_reward():
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="asyncfp8.conf", version_base="1.3"):
        cfg = compose("config", overrides=["task=addition", "task.answer_format=reversed"])
    task = build_task(cfg.task)
    prompt = task.prompt(0)
    assert task.score(task.completion(prompt), prompt) == 1.0
    assert task.score(" 0", prompt) == 0.0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"digits": 1}, r"task\.digits=1 with task\.heldout_fraction=0\.1 holds out about 10"),
        ({"digits": 0}, r"task\.digits must be in 1\.\.9, got 0"),
        ({"answer_format": "plain"}, r"task\.answer_format must be one of worked, reversed"),
        ({"heldout_fraction": 1.0}, r"heldout_fraction must be in \[0, 1\)"),
    ],
)
def test_bad_settings_are_refused_naming_them(params, message):
    with pytest.raises(ValueError, match=message):
        get_task("addition", **params)


def test_no_heldout_split_is_refused_when_evaluation_asks_for_one():
    task = get_task("addition", heldout_fraction=0.0)
    with pytest.raises(ValueError, match="heldout_fraction is 0"):
        task.heldout_prompts(256)


def test_the_sloppy_teacher_drops_carries_at_its_rate_and_stays_consistent():
    """The warm-start's teacher forgets a carry with probability `carry_drop`; its steps
    still add up (a + b + the carry it wrote), and its final sum is the one its steps make,
    so its answer is right exactly when it dropped no carry."""
    task = get_task("addition", digits=3, seed=2)
    due = dropped = 0
    for index in range(2000):
        prompt = task.prompt(index)
        a, b = prompt.meta["a"], prompt.meta["b"]
        sloppy = task.sloppy_completion(prompt, 0.65, seed=0)
        assert sloppy == task.sloppy_completion(prompt, 0.65, seed=0)  # reproducible
        assert task.sloppy_completion(prompt, 0.0, seed=0) == task.completion(prompt)
        carry, stated = 0, []
        for position, (x, y, c, total) in enumerate(STEP.findall(sloppy)):
            assert int(x) == a // 10**position % 10 and int(y) == b // 10**position % 10
            assert int(total) == int(x) + int(y) + int(c) and int(c) <= carry
            due += carry
            dropped += carry - int(c)
            carry = int(total) // 10
            stated.insert(0, total[1])
        assert sloppy.endswith(f"#{carry}{''.join(stated)}")
        forgot = sloppy != task.completion(prompt)
        assert task.score(sloppy, prompt) == (0.0 if forgot else 1.0)
    assert due > 1000 and abs(dropped / due - 0.65) < 0.05
