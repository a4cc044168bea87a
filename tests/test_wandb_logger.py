"""Weights & Biases as a tracker (`run.loggers=[jsonl,wandb]`), offline as it runs without
an API key: the run folder under `<run.dir>/wandb/` holds the metrics, the config, the
summary and the plots; a resumed run continues the same W&B run; a tracker that is not
installed, or an unknown logger, is refused at start with `run.loggers` named. Nothing
here reaches the network (WANDB_MODE=offline, no key) or writes to the home directory."""

import json
import struct
import subprocess
import sys
import time

import pytest

from asyncfp8.report.metrics import WANDB_DIR, WANDB_ID_FILE, MetricsLog, loggers_of, wandb_mode
from asyncfp8.report.summary import per_step
from tests.config import compose
from tests.conftest import REPORTING_STEPS, wandb_offline_env

# A mark, not importorskip: a module that skips when imported fails the GPU machine's
# check that every test module loads with its packages (tests/gpu_machine_check.py).
try:
    import wandb
except ImportError:
    wandb = None
pytestmark = pytest.mark.skipif(
    wandb is None, reason="wandb is not installed (pip install asyncfp8[wandb])"
)


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, its caches and settings in tmp_path, no key anywhere."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name, value in wandb_offline_env(tmp_path / "wandb-home").items():
        monkeypatch.setenv(name, value)  # NETRC names none: no `wandb login` key either
    yield
    wandb.teardown()  # stops this process's W&B service: the next test starts its own


# --- reading an offline run back -------------------------------------------------------------

BLOCK = 32 * 1024  # the .wandb file is a LevelDB log: 32 KiB blocks of framed chunks
HEADER = 7  # the file's own header (":W&B", magic, version); then each chunk's (crc, len, type)
FULL, LAST = 1, 4


def records(path):
    """The protobuf records of an offline run's .wandb file, in order (what `wandb sync`
    uploads)."""
    from wandb.proto import wandb_internal_pb2

    data, position, parts = path.read_bytes(), HEADER, []
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            position += left
            continue
        parts.append(data[position + HEADER : position + HEADER + length])
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def offline_run(folder):
    """One offline run folder as W&B would upload it: its id, config, history by step,
    summary and attached files."""
    (path,) = folder.glob("run-*.wandb")
    run = {"id": None, "config": {}, "history": {}, "summary": {}, "files": [], "exit": False}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"] = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            row = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                for i in record.history.item
            }
            run["history"][row["_step"]] = row
        elif kind == "summary":
            for u in record.summary.update:
                run["summary"]["/".join(u.nested_key) or u.key] = json.loads(u.value_json)
        elif kind == "files":
            run["files"] += [f.path for f in record.files.files]
        elif kind == "exit":
            run["exit"] = True
    assert run["exit"], f"{path}: no exit record (the run was not finished, or not flushed yet)"
    return run


def offline_runs(run_dir):
    return sorted((run_dir / WANDB_DIR).glob("offline-run-*"))


# --- the logger ------------------------------------------------------------------------------


def test_metrics_go_to_an_offline_wandb_run_that_a_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose(
        f"run.dir={run_dir}",
        "run.loggers=[jsonl,wandb]",
        "run.tensorboard=false",
        "run.wandb.tags=[smoke]",
        "run.wandb.group=g",
    )
    metrics = MetricsLog.for_run(cfg)
    metrics.write(0, {"eval/pass1_greedy": 0.25, "eval/pass1_sampled": 0.2, "version": 0})
    for step in (1, 2, 3):
        metrics.write(step, {"reward/mean": step / 10, "mismatch/kl_k3": float("nan")})
    metrics.close()
    wandb.teardown()  # W&B's service writes the run's file out in the background; done here

    (folder,) = offline_runs(run_dir)
    run = offline_run(folder)
    assert (run_dir / WANDB_DIR / WANDB_ID_FILE).read_text().strip() == run["id"]
    assert run["history"][0]["eval/pass1_greedy"] == 0.25
    assert [run["history"][s]["reward/mean"] for s in (1, 2, 3)] == [0.1, 0.2, 0.3]
    assert "mismatch/kl_k3" not in run["history"][1]  # NaN: null in the JSONL, left out here
    # The resolved config, as the learner saves it in config.yaml.
    assert run["config"]["run"]["loggers"] == ["jsonl", "wandb"]
    assert run["config"]["run"]["dir"] == str(run_dir) and "precision" in run["config"]
    # The summary and plots, attached at the end.
    assert run["summary"]["summary/steps"] == 3 and run["summary"]["summary/reward_end"] == 0.3
    assert run["summary"]["plots"]["_type"] == "image-file"
    assert {"summary.json", "plots.png"} <= set(run["files"])
    assert (folder / "files" / "plots.png").stat().st_size > 0

    # run.resume=true: the learner cuts back to its checkpoint (step 2) and goes on in the
    # same W&B run (a second offline folder with the same id; `wandb sync` joins them).
    resumed = MetricsLog.for_run(cfg, resumed_step=2)
    resumed.write(3, {"reward/mean": 0.35})
    resumed.close()
    wandb.teardown()
    first, second = offline_runs(run_dir)
    again = offline_run(second if first == folder else first)
    assert again["id"] == run["id"] and again["history"][3]["reward/mean"] == 0.35


def test_offline_unless_a_key_is_there_and_wandb_mode_wins(tmp_path):
    netrc = tmp_path / "netrc"
    assert wandb_mode("auto", {"NETRC": str(netrc)}) == "offline"
    assert wandb_mode("auto", {"NETRC": str(netrc), "WANDB_API_KEY": "k" * 40}) == "online"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_mode("auto", {"NETRC": str(netrc)}) == "online"
    assert wandb_mode("auto", {"NETRC": str(netrc), "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode("offline", {"WANDB_API_KEY": "k" * 40}) == "offline"


def test_a_run_saved_before_run_loggers_keeps_its_tensorboard_setting(tmp_path):
    """No run.loggers, no run.wandb (a config saved before they existed): resumed, the run
    takes their defaults from the schema and run.tensorboard decides, as it did."""
    from omegaconf import OmegaConf

    from asyncfp8.run.resume import CONFIG_FILE, restore_on_resume

    for tensorboard in ("auto", False):
        saved = OmegaConf.to_container(compose(f"run.dir={tmp_path}"), resolve=False)
        del saved["run"]["loggers"], saved["run"]["wandb"]
        saved["run"]["tensorboard"] = tensorboard
        OmegaConf.save(OmegaConf.create(saved), tmp_path / CONFIG_FILE)
        resumed, _ = restore_on_resume(compose("run.resume=true", f"run.dir={tmp_path}"), [])
        loggers = loggers_of(resumed.run)
        assert loggers.tensorboard == tensorboard and not loggers.wandb
        assert resumed.run.wandb.project == "asyncfp8"
    with pytest.raises(
        ValueError, match=r"run\.loggers names tensorboard but run\.tensorboard=false"
    ):
        run = compose("run.tensorboard=false", "run.loggers=[tensorboard]").run
        loggers_of(run)


# --- a real run through the launcher -----------------------------------------------------------


@pytest.mark.slow
def test_launcher_run_logs_metrics_summary_and_plots_to_wandb(reporting_run):
    """test_e2e's reporting run (tests/conftest.py), launched with run.loggers=[jsonl,wandb]
    where wandb is installed, as here."""
    run_dir, out, logged = reporting_run
    assert logged
    assert f"wandb sync {run_dir / WANDB_DIR}/offline-run-*" in out
    assert "wandb sync" in (run_dir / "learner.log").read_text()  # said at start too

    (folder,) = offline_runs(run_dir)
    run = offline_run(folder)
    steps = per_step(run_dir)
    assert [r["step"] for r in steps] == list(range(1, REPORTING_STEPS + 1))
    for record in steps:
        assert run["history"][record["step"]]["reward/mean"] == record["reward/mean"]
    # The learner's summary is the launcher's summary.json, less the launcher's wall time.
    launcher_summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("steps", "samples", "reward_end", "eval_pass1_greedy_end"):
        assert run["summary"][f"summary/{key}"] == launcher_summary[key], key
    assert {"summary.json", "plots.png"} <= set(run["files"])
    assert (folder / "files" / "plots.png").stat().st_size > 0
    assert run["config"]["run"]["steps"] == REPORTING_STEPS


# --- refused at start ------------------------------------------------------------------------

# The launcher with `wandb` unimportable, as where it is not installed.
WITHOUT_WANDB = (
    "import runpy, sys; sys.modules['wandb'] = None; "
    "runpy.run_module('asyncfp8.launch', run_name='__main__', alter_sys=True)"
)


@pytest.mark.parametrize(
    ("runner", "logger", "message"),
    [
        (["-m", "asyncfp8.launch"], "mlflow", "run.loggers: unknown logger 'mlflow'"),
        (
            ["-c", WITHOUT_WANDB],
            "wandb",
            'run.loggers names wandb, which is not installed: pip install "asyncfp8[wandb]"',
        ),
    ],
    ids=["unknown", "not-installed"],
)
@pytest.mark.slow
def test_bad_loggers_are_refused_at_start(runner, logger, message, tmp_path, tiny_model_dir):
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            *runner,
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path / 'run'}",
            f"run.loggers=[jsonl,{logger}]",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 2 and message in out, out[-2000:]
    assert "Traceback" not in out and not (tmp_path / "run" / "learner.log").exists()
    assert time.monotonic() - started < 60


def test_the_learner_refuses_a_missing_tracker_too(tmp_path, monkeypatch):
    """The learner builds its loggers with MetricsLog.for_run: the same ValueError (exit 2)."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = compose(f"run.dir={tmp_path / 'run'}", "run.loggers=[jsonl,wandb]")
    with pytest.raises(ValueError, match=r"run\.loggers names wandb, which is not installed"):
        MetricsLog.for_run(cfg)
