"""Quick options are quick: every documented value of the groups that decide which model a
run loads before its first step (`model=`, `task=`, each with the other groups' defaults)
starts from a model shipped with the package, so no warm-start runs at start (one took
more than 7 minutes for `model=tiny` with the default task, and then failed); and
`model=tiny`, tried as a new user would, trains its first step within a minute."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from asyncfp8.models import run_model_dir
from asyncfp8.models import tiny as tiny_factory

CONF = Path(tiny_factory.__file__).resolve().parents[1] / "conf"


def values_of(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


def composed(*overrides: str):
    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_the_docs_document_exactly_the_model_and_task_values():
    """docs/your-model-and-data.md: its table of tasks, and `model=` for each made model."""
    page = (CONF.parents[1] / "docs" / "your-model-and-data.md").read_text()
    table = page.split("## Tasks", 1)[1].split("\n## ", 1)[0]
    tasks = re.findall(r"^\| `([a-z0-9_]+)`", table, re.M)
    assert sorted(tasks) == values_of("task")
    models = set(re.findall(r"`model=([a-z0-9_]+)`", page))
    assert sorted(models) == values_of("model")


@pytest.mark.parametrize(
    "override",
    [*(f"model={v}" for v in values_of("model")), *(f"task={v}" for v in values_of("task"))],
)
def test_every_model_and_task_value_starts_from_a_shipped_model(override, tmp_path, monkeypatch):
    # A model found in a cache would hide a missing one; a warm-start fails at once.
    monkeypatch.setenv("ASYNCFP8_CACHE", str(tmp_path / "cache"))

    def no_warm_start(*args, **kwargs):
        raise AssertionError(f"{override} warm-starts a model at start")

    monkeypatch.setattr(tiny_factory, "warm_start", no_warm_start)
    model_dir = run_model_dir(composed(override))
    assert model_dir.parent == tiny_factory.SHIPPED_DIR, model_dir
    meta = tiny_factory.read_metadata(model_dir)
    low, high = tiny_factory.REWARD_WINDOW
    assert low <= meta["mean_reward_t1"] <= high


def test_the_tiny_addition_recipe_is_its_own_and_the_small_one_is_unchanged():
    task = {"name": "addition", "digits": 3}
    assert tiny_factory.recipe_for(task, "tiny").carry_drop == 0.0
    assert tiny_factory.recipe_for(task, "small") == tiny_factory.recipe_for(task)
    assert tiny_factory.recipe_for(task, "small").carry_drop == 0.65


@pytest.mark.slow
def test_model_tiny_as_a_new_user_tries_it_trains_its_first_step_within_a_minute(tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncfp8.launch",
            "model=tiny",
            "run.steps=2",
            f"run.dir={run_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    first_step_s = None
    try:
        while process.poll() is None and time.monotonic() - started < 60:
            # Step 0 is the first held-out evaluation; a step >= 1 was trained.
            if metrics.exists() and '"step": 1' in metrics.read_text():
                first_step_s = time.monotonic() - started
                break
            time.sleep(0.2)
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, out[-3000:]
    assert first_step_s is not None and first_step_s < 60, (first_step_s, out[-3000:])
    assert str(tiny_factory.SHIPPED_DIR) in (run_dir / "learner.log").read_text()
