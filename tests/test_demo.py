import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_on_a_given_model_and_reports_reward(tiny_model_dir, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncfp8.demo",
            f"model.path={tiny_model_dir}",
            "task=arithmetic",  # what the tiny test model was warm-started on
            "max_new_tokens=8",
            "samples=2",
            "eval_prompts=32",
            "precision=fp8+fp8_kv",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mean reward at temperature 1.0 over 32 prompts" in result.stdout
    assert result.stdout.count("reward ") >= 3
    assert (
        "precision fp8+fp8_kv" in result.stdout
        and "mismatch engine vs learner: KL k1" in result.stdout
    )


@pytest.mark.slow
def test_demo_with_a_missing_model_fails_with_the_path(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncfp8.demo",
            f"model.path={tmp_path / 'absent'}",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "absent' does not exist" in result.stderr
