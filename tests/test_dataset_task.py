"""task=dataset: users' JSONL / parquet / CSV / save_to_disk files, their chat templates,
the held-out split and the messages for bad rows."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from asyncfp8.tasks import DatasetTask, build_task
from asyncfp8.tasks.dataset import read_rows

REWARD = {"_target_": "asyncfp8.tasks.gsm8k.final_number_reward"}


def rows(count=60):
    return [{"prompt": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(count)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build(path, model_dir=None, **params):
    return build_task({"name": "dataset", "path": str(path), "reward": REWARD, **params}, model_dir)


@pytest.fixture
def plain_model_dir(tiny_model_dir, tmp_path):
    """The tiny model without a chat template (a base model, as most are)."""
    copy = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "chat_template.jinja").unlink()
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


def test_every_row_lands_in_exactly_one_split_by_a_hash_of_its_prompt(tmp_path):
    task = build(write_jsonl(tmp_path / "d.jsonl", rows(200)), heldout_fraction=0.2)
    stream = {task.prompt(i).text for i in range(len(task))}
    heldout = {p.text for p in task.heldout_prompts(200)}
    assert len(stream) + len(heldout) == 200 and not stream & heldout
    assert 20 <= len(heldout) <= 60  # about 20%
    # the split follows the prompt, not its place in the file or the seed
    reordered = build(
        write_jsonl(tmp_path / "r.jsonl", rows(200)[::-1]), heldout_fraction=0.2, seed=7
    )
    assert {p.text for p in reordered.heldout_prompts(200)} == heldout
    # every pass over the stream is a fresh order of the same rows
    first = [task.prompt(i).text for i in range(len(task))]
    second = [task.prompt(len(task) + i).text for i in range(len(task))]
    assert set(first) == set(second) and first != second


def test_parquet_csv_and_save_to_disk_give_the_jsonl_rows(tmp_path):
    import datasets

    records = rows(20)
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "dict"))
    for path in ("d.parquet", "d.csv", "saved", "dict"):
        read = read_rows(tmp_path / path)
        # CSV reads the answers back as numbers; the task turns them into text again
        assert [(r["prompt"], str(r["answer"])) for r in read] == [
            (r["prompt"], r["answer"]) for r in records
        ], path
        task = build(tmp_path / path)
        assert task.prompt(0).answer == str(int(task.prompt(0).text.split()[2]) + 1)


def test_chat_messages_render_through_the_models_template_with_the_system_prompt(
    tmp_path, tiny_model_dir
):
    from asyncfp8.hf.loading import load_tokenizer

    records = [
        {
            "conversation": [
                {"role": "user", "content": f"Add 1 to {i}."},
                {"role": "assistant", "content": f"#### {i + 1}"},  # SFT data's reference turn
            ],
            "solution": f"{i} + 1 = {i + 1} #### {i + 1}",
        }
        for i in range(30)
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    task = build(
        path,
        tiny_model_dir,
        fields={"messages": "conversation", "answer": "solution"},
        system_prompt="Answer with the number.",
        heldout_fraction=0.0,
    )
    prompt = task.prompt(0)
    number = int(re.search(r"Add 1 to (\d+)", prompt.text).group(1))
    expected = load_tokenizer(tiny_model_dir).apply_chat_template(
        [
            {"role": "system", "content": "Answer with the number."},
            {"role": "user", "content": f"Add 1 to {number}."},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.text == expected
    assert prompt.text.endswith("assistant:")  # the tiny models' minimal template
    assert prompt.answer == str(number + 1)  # the part after the GSM8K marker
    assert task.score(f" so it is {number + 1}", prompt) == 1.0


def test_without_a_chat_template_prompts_are_text(tmp_path, plain_model_dir):
    path = write_jsonl(tmp_path / "d.jsonl", rows(10))
    task = build(path, plain_model_dir, text_template="Q: {prompt}\nA:", system_prompt="Be exact.")
    assert re.fullmatch(r"Be exact\.\n\nQ: What is \d+ plus 1\?\nA:", task.prompt(0).text)
    with pytest.raises(
        ValueError, match=r"chat_template=true but the model's tokenizer .* has no chat"
    ):
        build(path, plain_model_dir, chat_template=True)
    conversation = [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "2+2?"},
            ],
            "answer": "4",
        }
    ]
    with pytest.raises(
        ValueError, match=r"c\.jsonl:1: a conversation of 3 turns needs a chat template"
    ):
        build(write_jsonl(tmp_path / "c.jsonl", conversation), plain_model_dir)


BAD_ROWS = [
    (
        {"question": "1+1?", "answer": "2"},
        r"bad\.jsonl:3: neither a prompt column 'prompt' nor a messages column",
    ),
    ({"prompt": "1+1?"}, r"bad\.jsonl:3: no answer column 'answer' \(the row has prompt\)"),
    (
        {"prompt": "", "answer": "2"},
        r"bad\.jsonl:3: prompt column 'prompt' is not a non-empty string",
    ),
    (
        {"prompt": "1+1?", "answer": ["2"]},
        r"bad\.jsonl:3: answer column 'answer' must be a string or a number",
    ),
    (
        {"messages": [{"role": "robot", "content": "hi"}], "answer": "2"},
        r"bad\.jsonl:3: messages\[0\] has role 'robot'",
    ),
    ({"messages": "1+1?", "answer": "2"}, r"bad\.jsonl:3: 'messages' must be a non-empty list"),
    (
        {"messages": [{"role": "assistant", "content": "2"}], "answer": "2"},
        r"bad\.jsonl:3: 'messages' has no user message",
    ),
]


@pytest.mark.parametrize(("row", "message"), BAD_ROWS)
def test_a_bad_row_is_named_by_file_and_row_at_start(tmp_path, row, message):
    good = rows(2)
    # every row needs a prompt or messages column; a mixed file keeps them consistent
    path = write_jsonl(tmp_path / "bad.jsonl", [*good, row])
    with pytest.raises(ValueError, match=message):
        build(path)


def test_bad_files_and_settings_are_named(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"task=dataset needs task\.path"):
        build_task({"name": "dataset", "reward": REWARD})
    with pytest.raises(FileNotFoundError, match=r"task\.path=.*nope\.jsonl: no such file"):
        build(tmp_path / "nope.jsonl")
    (tmp_path / "d.txt").write_text("hello\n")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match=r"folder is a directory, but not one written by datasets"):
        build(tmp_path / "folder")
    with pytest.raises(ValueError, match=r"cannot tell the format from the suffix '\.txt'"):
        build(tmp_path / "d.txt")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: not valid JSON"):
        build(tmp_path / "broken.jsonl")
    (tmp_path / "nested.json").write_text('{"prompt": [1, 2}')
    with pytest.raises(ValueError, match=r"nested\.json: cannot be read as json"):
        build(tmp_path / "nested.json")
    path = write_jsonl(tmp_path / "d.jsonl", rows(5))
    with pytest.raises(ValueError, match=r"task\.fields: unknown key\(s\) \['question'\]"):
        build(path, fields={"question": "q"})
    with pytest.raises(ValueError, match=r"task\.chat_template must be auto, true or false"):
        build(path, chat_template="yes")


def test_a_template_that_cannot_render_a_row_names_the_row(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['content'] == 'What is 3 plus 1?' %}"
        "{{ raise_exception('no threes') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(
        ValueError,
        match=r"d\.jsonl:4: the model's chat template cannot render this row: .*no threes",
    ):
        build(write_jsonl(tmp_path / "d.jsonl", rows(10)), model)


def test_dataset_class_is_the_registered_task(tmp_path):
    assert isinstance(build(write_jsonl(tmp_path / "d.jsonl", rows(5))), DatasetTask)


@pytest.mark.slow
def test_a_run_trains_on_a_chat_dataset_and_says_it_used_the_template(chat_dataset_run):
    run_dir, _ = chat_dataset_run  # 64 rows of messages (tests/conftest.py)
    log = (run_dir / "learner.log").read_text()
    assert "rendered with the model's chat template" in log
    assert re.search(r"task dataset: 64 rows of .*chat\.jsonl \(\d+ training, \d+ held out\)", log)
    assert (run_dir / "model" / "chat_template.jinja").is_file()  # the export keeps it


@pytest.mark.slow
def test_the_launcher_stops_at_start_on_a_bad_row(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [*rows(3), {"prompt": "x"}])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncfp8.launch",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path / 'run'}",
            "task=dataset",
            f"task.path={data}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "d.jsonl:4: no answer column 'answer'" in result.stdout + result.stderr
