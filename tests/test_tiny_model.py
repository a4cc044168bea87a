import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncfp8.models import SIZES, WarmStart, make_tiny_model, read_metadata
from asyncfp8.models.sampling import mean_reward
from asyncfp8.tasks import ArithmeticTask


def test_tiny_model_loads_with_transformers_and_scores_inside_the_window(tiny_model_dir):
    meta = read_metadata(tiny_model_dir)
    assert 0.1 <= meta["mean_reward_t1"] <= 0.7
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size == SIZES["tiny"].hidden_size
    # Re-measure independently of the factory, on prompts from another seed.
    task = ArithmeticTask(seed=777)
    prompts = [task.prompt(i) for i in range(256)]
    tokenizer.padding_side = "left"
    reward = mean_reward(model, tokenizer, task, prompts, max_new_tokens=8, seed=5)
    assert 0.1 <= reward <= 0.7


@pytest.mark.slow
def test_same_seed_gives_identical_weights_and_cache_is_reused(tmp_path):
    # Two builds on this CPU (the shipped model was built on another: float results
    # differ between CPUs' kernels)
    once = make_tiny_model("tiny", out_dir=tmp_path / "once", progress=False)
    again = make_tiny_model("tiny", out_dir=tmp_path / "again", progress=False)
    first = load_file(once / "model.safetensors")
    second = load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)

    weights = again / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert make_tiny_model("tiny", out_dir=again, progress=False) == again
    assert weights.stat().st_mtime_ns == stamp  # found in the cache, not rebuilt


def test_a_changed_recipe_rebuilds_and_a_foreign_directory_is_not_overwritten(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an asyncfp8 tiny model"):
        make_tiny_model("tiny", out_dir=foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_unknown_size_is_a_clear_error():
    with pytest.raises(
        ValueError,
        match="unknown tiny model size 'huge'; choose one of tiny, tiny_moe, small, small_moe",
    ):
        make_tiny_model("huge")


def test_warm_start_that_cannot_reach_the_window_says_so(tmp_path):
    hopeless = WarmStart(learning_rate=1e-6, max_steps=4, steps_per_check=2, check_prompts=16)
    with pytest.raises(
        RuntimeError,
        match=r"warm-start on addition \(digits=2\) reached reward .* < stop_at_reward 0.3 "
        r"after 4 steps; raise max_steps",
    ):
        make_tiny_model(
            "tiny",
            out_dir=tmp_path / "m",
            recipe=hopeless,
            task={"name": "addition", "digits": 2},
            progress=False,
        )
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    ("window", "message"),
    [
        ({"stop_at_reward": 0.6, "overshoot_reward": 0.5}, "need 0 < stop_at_reward < overshoot"),
        ({"stop_at_reward": 0.9, "overshoot_reward": 0.95}, r"outside the window \[0.05, 0.7\]"),
        ({"carry_drop": 0.5}, "carry_drop is for the addition task, not 'arithmetic'"),
        ({"carry_drop": 1.0, "task": {"name": "addition"}}, r"carry_drop must be in \[0, 1\)"),
    ],
)
def test_a_warm_start_target_it_could_never_keep_is_refused_at_once(window, message):
    with pytest.raises(ValueError, match=message):
        WarmStart(**window)


def test_the_warm_start_task_is_the_runs_task_where_there_is_a_recipe():
    from asyncfp8.models.tiny import warm_start_task

    run_task = {"name": "addition", "digits": 4, "seed": 3, "reward": {"_target_": "x.y"}}
    assert warm_start_task(run_task) == {"name": "addition", "digits": 4}
    assert warm_start_task({"name": "gsm8k_jsonl", "path": None}) == {"name": "arithmetic"}


def test_small_model_exercises_whole_and_padded_fp8_blocks():
    spec = SIZES["small"]
    q_rows = spec.num_attention_heads * spec.head_dim
    kv_rows = spec.num_key_value_heads * spec.head_dim
    dims = {spec.hidden_size, spec.intermediate_size, q_rows, kv_rows}
    assert any(d % 128 == 0 for d in dims) and any(d % 128 for d in dims)


def test_cli_writes_a_model_and_reports_its_reward(tiny_model_dir, capsys):
    from asyncfp8.models.tiny import main

    main(["--size", "tiny", "--out", str(tiny_model_dir)])  # cached: returns at once
    out = capsys.readouterr().out
    reward = json.loads((tiny_model_dir / "asyncfp8_model.json").read_text())["mean_reward_t1"]
    assert str(tiny_model_dir) in out and f"{reward:.3f}" in out


def test_the_model_make_run_uses_ships_with_the_package():
    """`make run` (the default config) finds its model shipped, warm-started on its own
    task, so every CPU starts from the same weights; a change of the default task or of
    its recipe that would make each machine build its own model fails here."""
    from hydra import compose, initialize_config_module

    from asyncfp8.models import run_model_dir
    from asyncfp8.models.tiny import SHIPPED_DIR

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("config")
    model_dir = run_model_dir(cfg)
    assert model_dir.parent == SHIPPED_DIR
    meta = read_metadata(model_dir)
    assert meta["task"]["name"] == cfg.task.name == "addition"
    assert meta["task"]["digits"] == cfg.task.digits
    assert 0.05 <= meta["mean_reward_t1"] <= 0.7
    assert (model_dir / "model.safetensors").stat().st_size < 4_000_000
