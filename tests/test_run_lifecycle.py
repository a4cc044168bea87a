"""A run a user can trust, tried as a user would through the launcher: a resumed run keeps
its settings, bad settings and failing processes are reported within seconds with their
reason, the docs' reward example runs as written, and metrics hold each step once."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncfp8.chaos.cluster import SMALL_RUN
from asyncfp8.run import process
from asyncfp8.run.process import worker_count
from asyncfp8.run.records import read_metrics
from asyncfp8.run.resume import restore_on_resume
from tests.config import compose
from tests.launched import refusal


def launch_command(model_dir, run_dir, *overrides):
    return [
        sys.executable,
        "-m",
        "asyncfp8.launch",
        f"model.path={model_dir}",
        f"run.dir={run_dir}",
        *SMALL_RUN,
        *overrides,
    ]


def launch(model_dir, run_dir, *overrides, timeout=300, env=None):
    started = time.monotonic()
    result = subprocess.run(
        launch_command(model_dir, run_dir, *overrides),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


# --- resume restores the saved run ---------------------------------------------------------------


def saved_run(tmp_path, *overrides):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = compose(*overrides, f"run.dir={run_dir}")
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    return run_dir


def test_resume_takes_the_saved_settings_and_only_safe_changes(tmp_path):
    run_dir = saved_run(
        tmp_path, "precision=int8", "correction=token_mis", "correction.upper=4", "run.steps=200"
    )
    overrides = ["run.resume=true", f"run.dir={run_dir}", "run.steps=300", "run.workers=3"]
    cfg, changes = restore_on_resume(compose(*overrides), overrides)
    assert cfg.precision.name == "int8" and cfg.correction.name == "token_mis"
    assert cfg.correction.upper == 4 and cfg.run.steps == 300 and cfg.run.workers == 3
    assert changes == ["run.steps: 200 -> 300", "run.workers: None -> 3"]
    # The original command again, plus run.resume=true: nothing changes, nothing refused.
    again = ["precision=int8", "correction=token_mis", "correction.upper=4", *overrides[:2]]
    assert restore_on_resume(compose(*again), again)[1] == []


@pytest.mark.parametrize(
    "change",
    [
        "precision=fp8",
        "correction=seq_tis",
        "model=tiny",
        "task.seed=3",
        "run.seed=5",
        "optim.lr=1",
    ],
)
def test_resume_refuses_a_change_of_the_experiment_unless_forced(tmp_path, change):
    run_dir = saved_run(tmp_path, "precision=int8", "correction=token_mis", "correction.upper=4")
    overrides = ["run.resume=true", f"run.dir={run_dir}", change]
    key = change.split("=")[0]
    with pytest.raises(ValueError, match=rf"{key} would change the experiment.*force_resume"):
        restore_on_resume(compose(*overrides), overrides)
    forced = [*overrides, "run.force_resume=true"]
    _, changes = restore_on_resume(compose(*forced), forced)
    assert any(c.startswith(key) for c in changes)


@pytest.mark.slow
def test_resume_of_a_directory_that_is_not_a_run_creates_nothing(tmp_path, tiny_model_dir):
    missing = tmp_path / "runs" / "2026-11-21_13-00-0O"  # a typo: O for 0
    code, out, seconds = launch(tiny_model_dir, missing, "run.resume=true")
    assert code == 2 and "does not exist" in out and not missing.exists()
    assert "continue with" not in out
    assert seconds < 60


# --- end to end: stop, resume with the printed command ------------------------------------------


def wait_for_step(run_dir, step, process, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_metrics(run_dir)
        if records and records[-1]["step"] >= step:
            return
        if process.poll() is not None:
            raise AssertionError(f"the launcher exited with {process.returncode} early")
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


@pytest.mark.slow
def test_ctrl_c_then_the_printed_resume_command_continues_the_same_run(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        launch_command(
            tiny_model_dir,
            run_dir,
            "precision=int8",
            "correction=token_mis",
            "run.steps=400",
            "run.checkpoint_every=4",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_step(run_dir, 6, first)
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 130, out[-2000:]
    hint = next(line for line in out.splitlines() if "continue with:" in line)
    resume_overrides = hint.split("continue with:")[1].split()
    assert resume_overrides == ["run.resume=true", f"run.dir={run_dir.resolve()}"]

    code, out, _ = launch(tiny_model_dir, run_dir, *resume_overrides, "run.steps=20")
    assert code == 0, out[-3000:]
    assert "resuming" in out and "run.steps: 400 -> 20" in out
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert (saved.precision.name, saved.correction.name, saved.run.steps) == (
        "int8",
        "token_mis",
        20,
    )
    learner_log = (run_dir / "learner.log").read_text()
    assert "precision int8(profile=None)" in learner_log.split("resumed from")[-1]
    steps = [r["step"] for r in read_metrics(run_dir) if r["step"] >= 1]  # 0: held-out baseline
    assert steps == list(range(1, 21))  # each step once, resumes included
    summary = __import__("json").loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["resumes"] == 1
    assert summary["samples"] >= 20 * 16  # the whole run's samples, not only since the resume


@pytest.mark.parametrize(
    ("cores", "learner_procs", "workers", "expected"),
    [
        (2, 1, None, 1),  # a 2-core machine: one worker beside the learner, no oversubscription
        (1, 1, None, 1),  # at least one, or nothing would generate
        (3, 1, None, 2),
        (64, 1, None, 2),  # at most two: what the separate placement was measured with
        (3, 2, None, 1),  # the learner's ranks take their cores first
        (2, 1, 3, 3),  # a number is taken as given
    ],
)
def test_run_workers_null_leaves_each_process_a_core(
    monkeypatch, cores, learner_procs, workers, expected
):
    monkeypatch.setattr(process, "usable_cores", lambda: cores)
    run = compose(f"run.learner_procs={learner_procs}", f"run.workers={workers or 'null'}").run
    assert worker_count(run) == expected


@pytest.mark.parametrize(
    ("tasks", "affinity", "expected"),
    [
        (None, 8, 2),  # the launcher's 4 processes share the 8 cores they inherited
        ("1", 8, 2),  # one Slurm task that starts them itself: the same
        ("16", 8, 8),  # srun bound each of 16 tasks to 8 cores of its own
        ("16", 128, 8),  # 16 unbound tasks on a node: they share it
    ],
)
def test_each_process_takes_its_share_of_the_cores_it_shares(
    monkeypatch, tasks, affinity, expected
):
    monkeypatch.setattr(process, "usable_cores", lambda: affinity)
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    if tasks is None:
        monkeypatch.delenv("SLURM_NTASKS", raising=False)
    else:
        monkeypatch.setenv("SLURM_NTASKS", tasks)
    assert process.thread_count(None, 4 if affinity == 8 else 16) == expected
    assert process.thread_count(3, 16) == 3  # run.threads is taken as given


def test_threads_and_workers_count_the_cores_the_process_may_use_not_the_machines():
    # As under taskset, a container's cpuset or Slurm: one core of the machine's.
    probe = (
        "import torch; from asyncfp8.run.process import set_threads, usable_cores; "
        "print(usable_cores(), set_threads(None, 1), torch.get_num_threads())"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "1"]


# --- failures reach the user in seconds ----------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.workers=0"], "run.workers must be >= 1"),
        (
            ["correction=token_mis", "correction.lower=3", "correction.upper=2"],
            "token_mis: lower (3.0) must not exceed upper (2.0)",
        ),
        (
            ["run.inflight_updates=true"],
            "run.inflight_updates=true needs the torch engine's slots",
        ),
        (["engine.slots=0"], "engine.slots must be null (static batches) or an int >= 1"),
    ],
)
def test_bad_settings_fail_at_start_with_the_setting_named(
    overrides, message, tmp_path, tiny_model_dir
):
    assert message in refusal(tiny_model_dir, tmp_path / "run", *overrides)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_bad_setting_stops_the_launcher_at_start(tmp_path, tiny_model_dir):
    # What the launcher does with a refusal that tests check in their own process
    # (tests/launched.py: refusal): says it, exit 2, no traceback, nothing started.
    code, out, seconds = launch(tiny_model_dir, tmp_path / "run", "run.workers=0", timeout=120)
    assert code == 2 and "[launch] run.workers must be >= 1" in out, out[-2000:]
    assert "Traceback" not in out and "continue with" not in out
    assert seconds < 60  # before any learner or worker process starts
    assert not list((tmp_path / "run").glob("*.log"))


def test_the_launcher_imports_neither_the_learner_nor_the_engines():
    # The launcher checks the config and starts processes; each learner and worker
    # imports transformers, the decode loop and torch.distributed's FSDP and DTensor
    # itself. In the launcher they cost 2-3 s of CPU before a refusal or a start.
    heavy = ("transformers", "torch.distributed.tensor", "asyncfp8.learner.loop")
    probe = f"import sys, asyncfp8.launch; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_tensorboard_without_tensorboard_names_the_install_command(tmp_path, tiny_model_dir):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here: nothing to refuse")
    code, out, _ = launch(tiny_model_dir, tmp_path / "run", "run.tensorboard=true", timeout=120)
    assert code == 2 and '.[tensorboard]"' in out, out[-2000:]


@pytest.mark.slow
def test_a_learner_that_fails_at_start_is_reported_within_seconds(tmp_path, tiny_model_dir):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    run_dir = tmp_path / "run"
    try:
        code, out, _ = launch(  # separate: a colocated learner listens on no port
            tiny_model_dir,
            run_dir,
            "run.placement=separate",
            f"sync.version_port={taken.getsockname()[1]}",
            "sync.connect_timeout=120",
        )
        finished = time.time()
    finally:
        taken.close()
    assert code != 0 and "learner exited with" in out and "cannot listen" in out, out[-2000:]
    # From the learner's last log line to the launcher's exit: the report is immediate,
    # not a wait for the worker to give up on the learner (120 s). Under CI's load the
    # learner's, the worker's and the launcher's own exits took 11 s; alone, 3 s.
    assert finished - (run_dir / "learner.log").stat().st_mtime < 40
    assert "did not exit" not in out and "continue with" not in out
    worker_log = (run_dir / "worker-0.log").read_text()
    if "waiting up to" in worker_log:  # stopped while waiting: a stop, not "learner gone"
        assert "stopping on signal" in worker_log, worker_log[-2000:]
        assert "no version from a learner" not in worker_log, worker_log[-2000:]


# --- the docs' reward example (your-model-and-data.md), as written -----------------------------


@pytest.mark.slow
def test_the_docs_custom_reward_runs_as_written(tmp_path, tiny_model_dir):
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rewards.py").write_text(
        "def strict_match(completion, answer):\n"
        "    return 1.0 if completion.strip() == answer else 0.0\n"
        "\n"
        "def needs_more(completion):\n"
        "    return 0.0\n"
    )
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    }
    # The arithmetic task's own reward takes a `marker` option; strict_match does not, and
    # must not be handed one.
    code, out, _ = launch(
        tiny_model_dir,
        tmp_path / "run",
        "task.reward._target_=my_pkg.rewards.strict_match",
        "run.steps=3",
        "run.workers=1",
        env=env,
    )
    assert code == 0, out[-3000:]
    code, out, seconds = launch(
        tiny_model_dir,
        tmp_path / "bad",
        "task.reward._target_=my_pkg.rewards.needs_more",
        env=env,
        timeout=120,
    )
    assert code == 2 and "cannot be called as needs_more(completion, answer)" in out, out[-2000:]
    assert seconds < 60 and not (tmp_path / "bad" / "learner.log").exists()


def test_the_runs_config_is_replaced_whole_never_left_half_written(tmp_path, monkeypatch):
    # A resumed learner writes config.yaml again while the progress bar and the report
    # read it (the chaos suite's torn-write readers once met "Missing key precision").
    from omegaconf import OmegaConf

    from asyncfp8.run.resume import save_config, saved_config

    old = OmegaConf.create({"precision": {"name": "bf16"}, "run": {"steps": 3}})
    save_config(old, tmp_path)
    real_save = OmegaConf.save

    def dies_half_way(cfg, path, resolve=False):
        real_save(cfg, path, resolve=resolve)
        Path(path).write_text(Path(path).read_text()[:10])  # a torn file...
        raise OSError("killed mid-write")  # ...and the writer gone

    monkeypatch.setattr(OmegaConf, "save", dies_half_way)
    with pytest.raises(OSError, match="killed mid-write"):
        save_config(OmegaConf.create({"precision": {"name": "fp8"}}), tmp_path)
    monkeypatch.setattr(OmegaConf, "save", real_save)
    assert saved_config(tmp_path) == old  # the previous config, whole


def test_a_rank_ends_with_its_exit_handlers_run_and_no_finalization():
    """`distributed.exit_process`, how a learner rank ends: its exit handlers run (logs
    flushed, W&B finished), its code is the process's, and nothing of the interpreter's
    teardown runs after (a __del__ left to finalization never runs), so gloo's worker
    threads cannot outlive it (docs/testing.md)."""
    script = (
        "import atexit\n"
        "from asyncfp8.run import distributed\n"
        "atexit.register(lambda: print('handler ran', flush=True))\n"
        "class Late:\n"
        "    def __del__(self): print('finalized', flush=True)\n"
        "late = Late()\n"
        "print('partial line', end='')\n"
        "distributed.exit_process(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert "partial line" in done.stdout and "handler ran" in done.stdout
    assert "finalized" not in done.stdout


def test_a_resumed_run_saved_before_a_key_existed_takes_its_default_and_says_so(tmp_path):
    """Keys a newer asyncfp8 added, in groups of one option (run) and of several (engine,
    correction, precision), are filled from the schemas at resume and listed as changes,
    so the log says what the resumed run runs with that the first part did not."""
    from omegaconf import OmegaConf

    from asyncfp8.run.resume import CONFIG_FILE, restore_on_resume

    saved = OmegaConf.to_container(compose(f"run.dir={tmp_path}"), resolve=False)
    for group, key in (
        ("run", "export_every"),
        ("engine", "cache_block"),
        ("correction", "min_kept"),
        ("precision", "quantize_from"),
    ):
        del saved[group][key]
    OmegaConf.save(OmegaConf.create(saved), tmp_path / CONFIG_FILE)
    resumed, changes = restore_on_resume(compose("run.resume=true", f"run.dir={tmp_path}"), [])
    assert resumed.run.export_every == 0 and resumed.engine.cache_block == 256
    assert resumed.correction.min_kept == 0.5 and resumed.precision.quantize_from == "master"
    said = "; ".join(changes)
    for key in ("run.export_every", "engine.cache_block", "correction.min_kept"):
        assert f"{key}: absent from the saved run" in said, said
