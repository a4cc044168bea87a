"""`run.ray=true` (issue 47): what is refused before any actor starts, and the pieces the
driver is made of, without a cluster (tests/test_ray_cluster.py runs on one)."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncfp8.launch.processes import CONFIG_ERROR, free_ports
from asyncfp8.launch.ray_actors import (
    bundle,
    cluster_address,
    curve_keys,
    import_ray,
    private_keys_dir,
    shortfall,
)
from asyncfp8.launch.ray_cluster import common_overrides, reclaim_ctrl_c
from asyncfp8.sync.keys import make_keys

ROOT = Path(__file__).resolve().parents[1]


def test_more_gpus_than_free_is_refused_naming_asked_and_free():
    learner = bundle(OmegaConf.create({"num_cpus": 1, "num_gpus": 1, "resources": None}))
    worker = bundle(OmegaConf.create({"num_cpus": 2, "num_gpus": 0, "resources": {"rollout": 1}}))
    assert learner == {"CPU": 1.0, "GPU": 1.0} and worker == {"CPU": 2.0, "rollout": 1.0}
    free = {"CPU": 16.0, "GPU": 3.0, "rollout": 4.0}
    assert shortfall(learner, 2, worker, 4, free, free) is None
    message = shortfall(learner, 4, worker, 4, free, {**free, "GPU": 8.0})
    assert message.startswith("run.ray=true: the run asks for 4 GPU")
    assert "(4 learner rank(s) x 1 + 4 worker(s) x 0) but 3 free (8 in the cluster)" in message
    assert "CPU" not in message  # 12 of 16 CPUs fit
    missing_custom = shortfall({}, 1, worker, 5, free, free)
    assert "5 rollout" in missing_custom and "4 free" in missing_custom


def test_the_cluster_is_named_by_run_ray_address_then_ray_address_then_auto():
    run = OmegaConf.create({"ray_address": None})
    assert cluster_address(run, {}) == ("auto", "run.ray_address=null and no RAY_ADDRESS: auto")
    assert cluster_address(run, {"RAY_ADDRESS": "h:6379"}) == ("h:6379", "RAY_ADDRESS=h:6379")
    run.ray_address = "10.0.0.1:6379"
    assert cluster_address(run, {"RAY_ADDRESS": "h:6379"})[1] == "run.ray_address=10.0.0.1:6379"


def test_no_ray_installed_is_refused_naming_run_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(
        ValueError, match=r"run\.ray=true \(RAY_ADDRESS=h:1\) but Ray is not installed: pip install"
    ):
        import_ray("RAY_ADDRESS=h:1")


def test_curve_keys_reach_each_role_in_a_directory_only_its_owner_reads(tmp_path):
    make_keys(tmp_path / "keys")
    cfg = OmegaConf.create(
        {"sync": {"curve": {"enabled": True, "keys_dir": str(tmp_path / "keys")}}}
    )
    keys = curve_keys(cfg)
    assert set(keys["learner"]) == {"server.key", "server.key_secret", "clients/client.key"}
    assert set(keys["worker"]) == {"client.key", "client.key_secret", "server.key"}
    directory = private_keys_dir(keys["learner"])
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        secret = Path(directory) / "server.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert secret.read_bytes() == (tmp_path / "keys" / "server.key_secret").read_bytes()
    finally:
        shutil.rmtree(directory)
    cfg.sync.curve.enabled = False
    assert curve_keys(cfg) is None


def test_each_actor_sets_its_own_addresses_and_id():
    given = [
        "run.steps=5",
        "sync.host=1.2.3.4",
        "sync.version_port=9",
        "run.worker_id=w",
        "run.workers=7",
        "run.placement=auto",
        "run.dir=x",
    ]
    common = common_overrides(given, run_dir="/shared/run", workers=3)
    assert common == [
        "run.steps=5",
        "run.dir=/shared/run",
        "run.workers=3",
        "run.placement=separate",
    ]


def launch(tiny_model_dir, tmp_path, *overrides, env=None):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncfp8.launch",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path / 'run'}",
            "task=arithmetic",
            "run.ray=true",
            *overrides,
        ],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # a launcher process: imports and the model check, 5-15 s
def test_no_cluster_at_the_address_is_refused_at_start(tmp_path, tiny_model_dir):
    pytest.importorskip("ray")  # without it the refusal is "Ray is not installed" (above)
    (port,) = free_ports(1)  # nothing listens there
    done = launch(tiny_model_dir, tmp_path, env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert done.returncode == CONFIG_ERROR, done.stderr[-2000:]
    assert (
        f"run.ray=true: no Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS=127.0.0.1:{port})"
        in done.stderr
    )


@pytest.mark.slow  # a launcher process
def test_run_ray_under_srun_is_refused_naming_both(tmp_path, tiny_model_dir):
    srun = {
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "n1",
        "SLURM_STEP_TASKS_PER_NODE": "4",
    }
    done = launch(tiny_model_dir, tmp_path, env=srun)
    assert done.returncode == CONFIG_ERROR, done.stderr[-2000:]
    assert "run.ray=true and srun (Slurm task 0 of 4, run.slurm=auto) both place" in done.stderr


def test_the_rayjob_example_composes_and_asks_what_its_groups_offer():
    """examples/ray/rayjob.yaml: its entrypoint is a launcher command whose overrides
    compose, and each worker group offers the custom resource the run asks for, as many
    as the ranks and workers it is to hold."""
    import shlex

    import yaml
    from hydra import compose, initialize_config_module

    spec = yaml.safe_load((ROOT / "examples" / "ray" / "rayjob.yaml").read_text())["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:4] == ["python", "-m", "asyncfp8.launch", "run.ray=true"]
    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        run = compose("config", overrides=argv[3:]).run
    offered = {}
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
        gpus = int(
            group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        )
        for name, count in resources.items():
            offered[name] = (
                offered.get(name, (0, 0))[0] + count * group["replicas"],
                gpus * group["replicas"],
            )
    assert offered["learner"] == (run.learner_procs, run.learner_procs * run.ray_learner.num_gpus)
    assert offered["rollout"] == (run.workers, run.workers * run.ray_worker.num_gpus)
    assert dict(run.ray_learner.resources) == {"learner": 1}
    assert dict(run.ray_worker.resources) == {"rollout": 1}


def test_ctrl_c_is_reclaimed_after_ray_leaves_its_deferring_handler_behind():
    """Ray's DeferSigint entered twice on the main thread (as nested deserialization on
    the driver can) leaves SIGINT deferred for good; the driver's poll loop puts Python's
    handler back, so Ctrl-C stops a Ray run again."""
    ray_utils = pytest.importorskip("ray._private.utils")
    before = signal.getsignal(signal.SIGINT)
    try:
        with ray_utils.DeferSigint(), ray_utils.DeferSigint():
            pass
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # Ray's bug
        assert reclaim_ctrl_c() is True
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert reclaim_ctrl_c() is False
    finally:
        signal.signal(signal.SIGINT, before)


def drive_on_a_fake_cluster(monkeypatch, cfg, failed) -> tuple[int, int]:
    """`run_on_ray` against a faked cluster whose every incarnation of the run ends with
    `failed` (who, why) as `RayRun.watch` returns it: the driver's exit code and how
    many incarnations it started. Only the driver's decisions are under test."""
    from types import SimpleNamespace

    from asyncfp8.launch import ray_cluster

    started = []

    class Incarnation:
        def __init__(self, *args):
            pass

        def start(self):
            started.append(1)

        def watch(self, progress):
            return failed

        def teardown(self, learner_grace):
            pass

    monkeypatch.setattr(ray_cluster, "RayRun", Incarnation)
    cluster = SimpleNamespace(
        available_resources=lambda: {"CPU": 8.0},
        cluster_resources=lambda: {"CPU": 8.0},
        get_runtime_context=lambda: SimpleNamespace(gcs_address="127.0.0.1:6379"),
    )
    code = ray_cluster.run_on_ray(cluster, cfg, [], SimpleNamespace(spec="bf16"), 2)
    return code, len(started)


def test_a_learner_the_guard_stopped_is_not_resumed_on_ray(monkeypatch, tmp_path, capsys):
    """The learner's exit status 3 on Ray is the guard's verdict, not a lost node: the
    driver writes the run's summary and ends with 3 instead of resuming the learner
    (a resume would take the guard's stop back and train into the same batches). The
    cluster is faked: only the driver's decision is under test."""
    from asyncfp8.run.files import CHECKPOINT_DIR, GUARD_STOP_FILE, GUARD_STOPPED, LEARNER_STATE
    from tests.test_collapse import compose, synthetic_run

    run_dir = Path(synthetic_run(tmp_path / "run", 0, {0: 0.2}, [0.5] * 12))
    (run_dir / GUARD_STOP_FILE).write_text(json.dumps({"step": 12, "signal": "far_tokens"}))
    (run_dir / CHECKPOINT_DIR / "step_00000012").mkdir(parents=True)
    (run_dir / CHECKPOINT_DIR / "step_00000012" / LEARNER_STATE).write_bytes(b"")
    (run_dir / "learner.log").write_text("learner ERROR guard: 3 rollbacks in a row\n")
    cfg = compose(
        f"run.dir={run_dir}", "run.ray=true", "run.steps=12", "run.ray_learner_restarts=2"
    )
    code, started = drive_on_a_fake_cluster(monkeypatch, cfg, ("learner", GUARD_STOPPED))
    assert code == GUARD_STOPPED and started == 1  # not resumed
    assert json.loads((run_dir / "summary.json").read_text())["guard_stopped"]["step"] == 12
    assert "the guard stopped the run" in capsys.readouterr().out


def test_a_learner_failed_before_its_first_checkpoint_is_shown_with_its_log(
    monkeypatch, tmp_path, capsys
):
    """A learner that fails on Ray before it wrote any checkpoint cannot be resumed: the
    driver stops with 1 and prints the end of learner.log, so the reason is on screen
    (it once printed only that no checkpoint was there). The cluster is faked."""
    from tests.test_collapse import compose

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "learner.log").write_text("Traceback (most recent call last):\nOSError: disk full\n")
    cfg = compose(f"run.dir={run_dir}", "run.ray=true", "run.steps=12")
    code, started = drive_on_a_fake_cluster(monkeypatch, cfg, ("learner", 1))
    out = capsys.readouterr().out
    assert code == 1 and started == 1, out
    assert "holds no checkpoint to resume from" in out and "OSError: disk full" in out, out
