import json
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncfp8.tasks import ArithmeticTask, GSM8KJsonlTask, build_task, get_task, registered_tasks
from asyncfp8.tasks.answers import final_number, number_after_marker, parse_number
from asyncfp8.tasks.arithmetic import evaluate, exact_match_reward
from asyncfp8.tasks.gsm8k import bundled_sample_path, final_number_reward, read_gsm8k_jsonl


def reward_always_half(completion, answer):
    return 0.5


def reward_with_bonus(completion, answer, bonus):
    return bonus


@given(st.lists(st.integers(0, 50), min_size=2, max_size=5), st.data())
def test_evaluate_matches_python_precedence(operands, data):
    ops = data.draw(
        st.lists(
            st.sampled_from(["+", "*"]), min_size=len(operands) - 1, max_size=len(operands) - 1
        )
    )
    expression = str(operands[0]) + "".join(
        f"{op}{x}" for op, x in zip(ops, operands[1:], strict=True)
    )
    assert evaluate(operands, ops) == eval(expression)  # Python's own precedence as the reference


def test_arithmetic_prompts_are_a_pure_function_of_seed_and_index():
    task = ArithmeticTask(seed=3, max_terms=3)
    backwards = [task.prompt(i) for i in reversed(range(50))][::-1]
    assert backwards == [ArithmeticTask(seed=3, max_terms=3).prompt(i) for i in range(50)]
    assert [p.text for p in backwards] != [
        ArithmeticTask(seed=4, max_terms=3).prompt(i).text for i in range(50)
    ]
    for prompt in backwards:
        assert prompt.text == f"Q: {prompt.meta['expression']}\nA:"
        assert int(prompt.answer) == eval(prompt.meta["expression"])
        assert task.score(task.completion(prompt), prompt) == 1.0


def test_arithmetic_stream_resumes_at_a_data_position():
    task = ArithmeticTask()
    stream = task.prompts(start=10)
    assert [next(stream) for _ in range(3)] == [task.prompt(10), task.prompt(11), task.prompt(12)]


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        (" 59", 1.0),
        ("59", 1.0),
        (" 59 because", 1.0),
        (" 58", 0.0),
        (" 590", 0.0),
        (" x 59", 0.0),
        ("", 0.0),
        (" A: 12 A: 59", 1.0),
        (" 59.0", 1.0),
        (" -59", 0.0),
    ],
)
def test_exact_match_reward(completion, reward):
    assert exact_match_reward(completion, "59") == reward


def test_arithmetic_rejects_bad_parameters():
    with pytest.raises(ValueError, match="ops must be"):
        ArithmeticTask(ops=["-"])
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticTask(max_operand=0)
    with pytest.raises(ValueError, match="min_terms"):
        ArithmeticTask(min_terms=3, max_terms=2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 3+4=7 apples.\n#### 7", "7"),
        ("#### 1,234", "1234"),
        ("#### $10.50", "10.5"),
        ("The answer is 42.", "42"),
        ("the answer is: -13 degrees", "-13"),
        ("we get \\boxed{96}", "96"),
        ("first 3 then 5 then 12.", "12"),
        ("It costs $1,000,000 in total", "1000000"),
        ("#### 5\nThe answer is 6", "5"),
        ("no numbers here", None),
    ],
)
def test_final_number(text, expected):
    assert final_number(text) == (Decimal(expected) if expected is not None else None)


def test_number_parsing_is_exact():
    assert parse_number("1,000.00") == parse_number("1000") == Decimal(1000)
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3")
    assert parse_number("abc") is None
    assert number_after_marker("#### 12", "####") == Decimal(12)


def test_bundled_gsm8k_sample_is_consistent():
    records = read_gsm8k_jsonl(bundled_sample_path())
    assert len(records) == 300
    task = GSM8KJsonlTask()
    for i in range(len(records)):
        prompt = task.prompt(i)
        # The reference solution must earn full reward under the task's own reward.
        assert task.score(task.completion(prompt), prompt) == 1.0
        assert task.score(" I do not know", prompt) == 0.0


def test_gsm8k_epochs_cover_every_record_in_a_new_order(tmp_path):
    path = tmp_path / "four.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(4))
    )
    task = GSM8KJsonlTask(path=str(path), seed=1, heldout_fraction=0.0)
    epoch0 = [task.prompt(i).answer for i in range(4)]
    epoch1 = [task.prompt(i).answer for i in range(4, 8)]
    assert sorted(epoch0) == sorted(epoch1) == ["0", "1", "2", "3"]
    assert [task.prompt(i).answer for i in range(8)] == epoch0 + epoch1  # indexable, not stateful


def test_arithmetic_heldout_prompts_never_appear_in_the_stream_of_any_seed():
    heldout = ArithmeticTask().heldout_prompts(64)
    expressions = {p.meta["expression"] for p in heldout}
    assert len(expressions) == len(heldout) == 64  # distinct
    assert [p.text for p in ArithmeticTask(seed=5).heldout_prompts(64)] == [
        p.text for p in heldout
    ]  # the same set whatever the seed
    for seed in (0, 1):
        stream = {ArithmeticTask(seed=seed).prompt(i).meta["expression"] for i in range(5000)}
        assert len(stream) > 200 and not stream & expressions
    for prompt in heldout:
        assert int(prompt.answer) == eval(prompt.meta["expression"])
    # All 338 two-term expressions of 0..12 are either in the stream or held out.
    stream = {ArithmeticTask().prompt(i).meta["expression"] for i in range(20_000)}
    everything = ArithmeticTask().heldout_prompts(1000)
    assert len(stream) + len(everything) == 13 * 13 * 2
    with pytest.raises(ValueError, match="heldout_fraction is 0"):
        ArithmeticTask(heldout_fraction=0.0).heldout_prompts(8)
    with pytest.raises(ValueError, match="heldout_fraction must be in"):
        ArithmeticTask(heldout_fraction=1.0)


def test_gsm8k_heldout_records_are_left_out_of_every_epoch():
    task = GSM8KJsonlTask()
    heldout = {p.meta["record"] for p in task.heldout_prompts(1000)}
    stream = [task.prompt(i).meta["record"] for i in range(2 * len(task))]
    assert heldout and not heldout & set(stream)
    assert len(heldout) + len(set(stream)) == 300
    assert len(task.heldout_prompts(10)) == 10


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad\.jsonl:2: not valid JSON"),
        ('["a list"]', r"bad\.jsonl:2: expected a JSON object"),
        ('{"question": "q"}', r"bad\.jsonl:2: expected a non-empty string field 'answer'"),
        ('{"question": "q", "answer": "7"}', r"bad\.jsonl:2: answer has no '#### N'"),
        ('{"question": "q", "answer": "#### seven"}', r"bad\.jsonl:2: .*'seven', not a number"),
    ],
)
def test_malformed_gsm8k_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "ok", "answer": "#### 1"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_gsm8k_jsonl(path)


def test_missing_gsm8k_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        get_task("gsm8k_jsonl", path=str(tmp_path / "nope.jsonl"))


def test_unknown_task_lists_the_registered_ones():
    with pytest.raises(
        ValueError, match=r"unknown task 'arithmatic'.*arithmetic, dataset, gsm8k_jsonl"
    ):
        get_task("arithmatic")
    assert {"arithmetic", "gsm8k_jsonl"} <= set(registered_tasks())


def test_task_config_reward_target_is_user_replaceable():
    task = build_task(
        {"name": "arithmetic", "seed": 1, "reward": {"_target_": f"{__name__}.reward_always_half"}}
    )
    prompt = task.prompt(0)
    assert task.score("anything", prompt) == 0.5
    task = build_task(
        {"name": "gsm8k_jsonl", "reward": {"_target_": f"{__name__}.reward_with_bonus", "bonus": 2}}
    )
    assert task.score("x", task.prompt(0)) == 2.0


def test_hydra_config_group_builds_each_bundled_task():
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="asyncfp8.conf"):
        for name in ("arithmetic", "gsm8k_jsonl"):
            cfg = compose(config_name="demo", overrides=[f"task={name}", "task.seed=5"])
            task = build_task(cfg.task)
            assert task.name == name and task.seed == 5
    assert build_task({"name": "gsm8k_jsonl"}).reward_fn is not None
    assert final_number_reward("#### 3", "3") == 1.0


def test_bad_reward_target_and_bad_reward_values_are_clear():
    with pytest.raises(ValueError, match=r"cannot load reward 'no\.such\.module\.fn'"):
        build_task({"name": "arithmetic", "reward": {"_target_": "no.such.module.fn"}})
    task = get_task("arithmetic", reward=lambda completion, answer: "high")
    with pytest.raises(TypeError, match="returned 'high'; expected a number"):
        task.score("1", task.prompt(0))
    with pytest.raises(ValueError, match="needs a 'name'"):
        build_task({"seed": 1})
