"""End to end: the real learner, workers and launcher as processes on loopback, on the
tiny model, for a few steps each."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncfp8.chaos.audit import audit
from asyncfp8.chaos.cluster import Cluster
from asyncfp8.launch.processes import free_ports
from asyncfp8.learner.ledger import read_ledger
from asyncfp8.report.summary import evaluations, per_step
from tests.conftest import REPORTING_STEPS
from tests.launched import launch


@pytest.fixture
def cluster(tmp_path, tiny_model_dir):
    made = []

    def make(*overrides):
        made.append(Cluster(tmp_path / f"run{len(made)}", tiny_model_dir, *overrides))
        return made[-1]

    yield make
    for c in made:
        c.stop()


def check_run(run_dir, steps, max_staleness):
    done = per_step(run_dir)
    assert [r["step"] for r in done] == list(range(1, steps + 1))
    # Held-out pass@1 before the first step (recorded as step 0) and after the last.
    evaluated = [r["step"] for r in evaluations(run_dir)]
    assert evaluated[0] == 0 and evaluated[-1] == steps
    versions = [r["sync/version"] for r in done]
    assert versions == sorted(set(versions))  # one new version per step, increasing
    for r in done:
        # The staleness bound: no trained token older than max_staleness versions.
        assert r["staleness/max"] <= max_staleness, r
        assert r["reward/mean"] is not None and r["optim/grad_norm"] >= 0
    return done


@pytest.mark.slow
def test_launcher_runs_an_asynchronous_fp8_kv_run_and_reports(reporting_run):
    run_dir, out, _ = reporting_run  # REPORTING_RUN: FP8 weights and an FP8 KV cache
    done = check_run(run_dir, REPORTING_STEPS, max_staleness=1)
    assert any(r["staleness/max"] == 1 for r in done)  # asynchronous: it did run ahead
    # FP8 rollouts differ from the FP32 learner: the mismatch is there, and bounded.
    fresh = [r["fresh/kl_k3"] for r in done if r.get("fresh/kl_k3") is not None]
    assert fresh and 0 < max(fresh) < 0.1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == REPORTING_STEPS and summary["samples"] >= REPORTING_STEPS * 16
    assert (run_dir / "plots.png").stat().st_size > 10_000
    assert "reward" in out and "done in" in out
    # The trained policy, out: a Hugging Face model the launcher names.
    assert f"[launch] the trained model (Hugging Face, BF16): {run_dir / 'model'}\n" in out
    export = json.loads((run_dir / "model" / "asyncfp8_export.json").read_text())
    assert export["step"] == REPORTING_STEPS
    learner_log = (run_dir / "learner.log").read_text()
    assert "exported the step-4 policy" in learner_log  # run.export_every
    assert f"exported the step-{REPORTING_STEPS} policy" in learner_log  # and at the end
    last = done[-1]
    # Workers report their rates with their next lease request: one that started late
    # and got a single lease before the end (seen under CI load) reports nothing, so the
    # check is on the workers whose samples were trained.
    trained_by = {
        sender.split("/")[0]
        for record in read_ledger(run_dir)
        for _lease, _prompt, samples in record["groups"]
        for sender, *_ in samples
    }
    assert trained_by and {f"worker/{w}/tokens_per_s" for w in trained_by} <= set(last)
    assert last["total/rejected_messages"] == 0 and last["sync/bytes"] > 0


@pytest.mark.slow
def test_launcher_with_a_two_rank_learner_and_dynamic_sampling(tmp_path, tiny_model_dir):
    run_dir, _ = launch(
        tmp_path,
        tiny_model_dir,
        "run.steps=6",
        "run.workers=2",
        "run.learner_procs=2",
        # FSDP's mixed precision, as on a GPU: held-out evaluation decodes the sharded
        # model in BF16 over FP32 masters (its KV cache in the compute dtype)
        "run.compute_dtype=bfloat16",
        "run.group_size=2",  # groups of 2 often agree: dynamic sampling has work to do
        "run.dynamic_sampling=true",
        "eval.every=3",
        "eval.prompts=16",
    )
    done = check_run(run_dir, 6, max_staleness=1)
    assert "2 rank(s)" in (run_dir / "learner.log").read_text()
    # Exported from the two ranks' shards, gathered.
    assert (run_dir / "model" / "model.safetensors").stat().st_size > 0
    # Every trained group had a reward spread; the skipped ones were counted and recorded.
    assert all(r["groups/frac_zero_advantage"] == 0 for r in done)
    skipped = sum(len(r["skipped"]) for r in read_ledger(run_dir))
    assert done[-1]["total/skipped_groups"] == skipped > 0
    result = audit(run_dir, group_size=2, max_staleness=1)
    assert result.lost == 0 and result.skipped_groups == skipped
    # Held-out pass@1 before training, at step 3 and after the last step.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_steps"] == [0, 3, 6]
    for key in ("greedy", "sampled"):
        for end in ("start", "end"):
            assert 0 <= summary[f"eval_pass1_{key}_{end}"] <= 1


@pytest.mark.slow
def test_sync_mode_trains_only_on_the_current_version(separate_turns):
    # TURNS with two workers: the session's shared run in turns (tests/conftest.py).
    run_dir, _ = separate_turns
    done = per_step(run_dir)
    assert [r["step"] for r in done] == [1, 2, 3, 4]
    assert [r["sync/version"] for r in done] == [1, 2, 3, 4]
    for r in done:
        assert r["staleness/max"] == r["staleness/mean"] == 0 and r["fresh/frac_tokens"] == 1.0
        assert r["total/stale_groups"] == 0 and r["optim/grad_norm"] >= 0
    assert audit(run_dir, group_size=4, max_staleness=0).lost == 0


@pytest.mark.slow
def test_vllm_engine_run_in_turns(vllm_worker_turns):
    # BF16, run.mode=sync: the session's shared vLLM worker run (tests/conftest.py).
    run_dir, _ = vllm_worker_turns
    done = check_run(run_dir, 4, max_staleness=0)
    # vLLM's logprobs of what it sampled reach the learner: finite, and close to its own.
    assert all(0 <= r["mismatch/kl_k3"] < 0.05 for r in done), [r["mismatch/kl_k3"] for r in done]


@pytest.mark.slow
def test_vllm_engine_run_int8_overlapped(vllm_user_policy_run):
    # INT8 (a user's subclass of the built-in policy, its first layer in BF16) in a vLLM
    # worker, overlapped: the session's shared run (tests/conftest.py).
    run_dir, _ = vllm_user_policy_run
    done = check_run(run_dir, 3, max_staleness=1)
    assert all(0 <= r["mismatch/kl_k3"] < 0.05 for r in done), [r["mismatch/kl_k3"] for r in done]


@pytest.mark.slow
def test_a_two_rank_learner_killed_resumes_on_one_rank(cluster):
    c = cluster(
        "run.steps=30", "run.checkpoint_every=3", "run.lease_timeout=8", "sync.resend_after=2"
    )
    learner = c.learner(procs=2)
    c.worker(0)
    c.wait_for_step(5)
    Cluster.kill(learner)  # every rank, at once (SIGKILL to torchrun's process group)
    highest = int((c.run_dir / "latest_version").read_text())
    resumed = c.learner("run.resume=true")  # one process now
    assert resumed.wait(timeout=240) == 0, c.log("learner")
    log = c.log("learner", tail=0)
    assert "saved by 2 rank(s), resumed on 1" in log
    after = per_step(c.run_dir)
    assert after[-1]["step"] == 30
    resumed_at = int(log.split("resumed from")[1].split("step ")[1].split(",")[0])
    new_versions = [r["sync/version"] for r in after if r["step"] > resumed_at]
    assert min(new_versions) > highest and new_versions == sorted(new_versions)
    # The data position, lease book and received groups came back with the checkpoint:
    # nothing trained twice, nothing lost, the staleness bound kept.
    assert audit(c.run_dir, group_size=4, max_staleness=1).lost == 0


# --- bad input: say what is wrong and exit non-zero within seconds ------------------------------


def run_module(module, *overrides, timeout=120):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", f"asyncfp8.{module}", *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


@pytest.mark.slow
def test_a_worker_without_a_learner_gives_up_with_a_reason(tmp_path, tiny_model_dir):
    ports = free_ports(3)
    code, out, seconds = run_module(
        "worker",
        f"model.path={tiny_model_dir}",
        f"run.dir={tmp_path}",
        f"sync.version_port={ports[0]}",
        f"sync.snapshot_port={ports[1]}",
        f"sync.trajectory_port={ports[2]}",
        "sync.connect_timeout=2",
    )
    assert code == 3 and "no version from a learner" in out
    assert seconds < 90  # startup (imports, the engine) + the 2 s timeout


@pytest.mark.slow
def test_a_typo_in_an_override_is_named(tmp_path):
    code, out, seconds = run_module("learner", "run.stepz=3", f"run.dir={tmp_path}")
    assert code != 0 and "stepz" in out
    assert seconds < 60  # Hydra refuses it before anything heavy is loaded


@pytest.mark.slow
def test_a_bad_address_is_refused(tmp_path, tiny_model_dir):
    code, out, _ = run_module(
        "worker", f"model.path={tiny_model_dir}", "sync.host=no such host", f"run.dir={tmp_path}"
    )
    assert code == 2 and "cannot connect" in out


@pytest.mark.slow
def test_a_taken_port_is_reported(tmp_path, tiny_model_dir):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        code, out, _ = run_module(
            "learner",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path}",
            f"sync.version_port={taken.getsockname()[1]}",
        )
    finally:
        taken.close()
    assert code != 0 and "cannot listen" in out and "Address already in use" in out


@pytest.mark.slow
def test_a_worker_with_another_model_is_refused(cluster, tmp_path, tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    other = tmp_path / "other-model"
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.intermediate_size = 2 * config.intermediate_size
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    for name in os.listdir(tiny_model_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            (other / name).write_bytes((Path(tiny_model_dir) / name).read_bytes())
    c = cluster("run.steps=3")
    c.learner()
    worker = c.worker(0, f"model.path={other}")
    assert worker.wait(timeout=120) != 0
    assert "does not fit this worker's" in c.log("worker-0") and "mlp" in c.log("worker-0")


@pytest.mark.slow
def test_inflight_updates_run_loses_nothing(tmp_path, tiny_model_dir):
    """Workers with slots apply versions between decode steps: samples mixing two versions
    reach the learner, and the audit finds nothing lost, trained twice or too stale. With
    adaptive speculation on too, the drafter trains in each worker, its acceptance reaches
    the learner's metrics and its state is saved under the run directory. One run holds
    both: the slot loop applies a version between steps whatever the step strategy (plain
    or speculative), and the plain strategy's tagging and cache under an in-flight update
    is checked without a run (tests/test_inflight.py); a second, plain run cost 22 s."""
    run_dir, _ = launch(
        tmp_path,
        tiny_model_dir,
        "run.steps=8",
        "run.workers=2",
        "engine.slots=2",  # 2 groups of 4 per lease: slots are refilled
        "run.inflight_updates=true",
        "engine.speculative.mode=adaptive",
        "engine.speculative.threshold=2",
        "engine.speculative.patience=1",
    )
    check_run(run_dir, 8, max_staleness=1)
    result = audit(run_dir, group_size=4, max_staleness=1)
    assert result.lost == 0 and result.trained_groups == 8 * 4
    logs = [p.read_text() for p in run_dir.glob("worker*.log")]
    assert logs and all("between decode steps" in log for log in logs)
    inflight = [
        int(line.split("(")[-1].split()[0])
        for log in logs
        for line in log.splitlines()
        if "between decode steps)" in line
    ]
    # The learner publishes a version per step while the workers decode: some land
    # between two decode steps.
    assert sum(inflight) > 0, inflight
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speculating = [
        value
        for record in records
        for key, value in record.items()
        if key.endswith("spec/fraction_steps_speculating")
    ]
    assert speculating and max(speculating) > 0
    assert any(key.endswith("drafter/steps") for record in records for key in record)
    for worker in (0, 1):
        saved = torch.load(run_dir / "drafters" / f"worker-{worker}.pt", weights_only=False)
        assert saved["trainer"]["steps"] > 0
        acceptance = json.loads(
            (run_dir / "drafters" / f"worker-{worker}.acceptance.json").read_text()
        )
        assert sum(r["verify_steps"] for r in acceptance.values()) > 0
