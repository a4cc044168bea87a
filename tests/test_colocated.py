"""run.placement=colocated (asyncfp8/learner/colocated.py): the learner generates with its
own engine, in turns (run.mode=sync) or on a rollout thread while it trains (async). The
same books as the separate placement (leases, ledger, audit), the same samples for the
same seed, the version's tensors as a worker would have received them, the overlap kept
within the staleness bound, a failed rollout thread reported, and a killed run resumes."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from threading import Event, Thread, current_thread

import pytest
import torch
from omegaconf import OmegaConf

from asyncfp8.chaos.audit import audit
from asyncfp8.chaos.cluster import SMALL_RUN
from asyncfp8.checks import auto_placement, placement_of, release_engine_memory
from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.learner.colocated import (
    Colocated,
    EngineVersions,
    RefitFailed,
    RolloutThreadJobs,
    kept_random_state,
)
from asyncfp8.learner.inbox import Inbox
from asyncfp8.learner.leases import LeaseBook
from asyncfp8.learner.ledger import read_ledger
from asyncfp8.models import load_model
from asyncfp8.precision import extra_roles, get_policy, version_weights
from asyncfp8.precision.manifest import decoder_layers
from asyncfp8.report.summary import evaluations, per_step
from asyncfp8.sync import (
    BackgroundPublisher,
    PublishFailed,
    VersionPublisher,
    VersionSubscriber,
)
from asyncfp8.tasks import build_task
from asyncfp8.worker.rollout import roll_out, split_lease
from tests.config import compose
from tests.conftest import TURNS, VLLM_TURNS
from tests.launched import launch, refusal, two_ranks

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "tcp://127.0.0.1:*"
SYNC = (*TURNS, "run.workers=1")


def trained_samples(run_dir):
    """Per step: each trained group's prompt and its samples' sequence numbers."""
    return [
        [(prompt, sorted(seq for _, seq, _ in members)) for _, prompt, members in r["groups"]]
        for r in read_ledger(run_dir)
    ]


def trained_prompts(run_dir):
    """Per step: each trained group's prompt and how many samples it had."""
    return [
        [(prompt, len(members)) for _, prompt, members in r["groups"]] for r in read_ledger(run_dir)
    ]


@pytest.fixture(scope="module")
def colocated_turns(tmp_path_factory, tiny_model_dir):
    """One colocated run in turns (SYNC), read by the tests that compare it with another
    placement or setting: (run directory, the launcher's output)."""
    return launch(
        tmp_path_factory.mktemp("colocated"), tiny_model_dir, *SYNC, "run.placement=colocated"
    )


@pytest.mark.slow
def test_colocated_trains_on_the_samples_the_separate_placement_trains_on(
    separate_turns, colocated_turns
):
    # Sync mode: leases, their seeds and the versions they are generated with are fixed by
    # the books, so both placements (two worker processes, the learner's own engine) make
    # the same samples and the same steps.
    separate, _ = separate_turns
    colocated, out = colocated_turns
    assert "run.placement=colocated; no worker processes" in out
    assert not list(colocated.glob("worker-*.log"))
    a, b = per_step(separate), per_step(colocated)
    assert [r["total/samples"] for r in a] == [r["total/samples"] for r in b] == [16, 32, 48, 64]
    for key in ("reward/mean", "optim/grad_norm", "mismatch/kl_k3"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-6), key
    # The same prompts in the same groups; sequence numbers count per process, so the two
    # workers' differ from the one engine's (the equal metrics above are the same tokens).
    assert trained_prompts(separate) == trained_prompts(colocated)
    for run_dir in (separate, colocated):
        result = audit(run_dir, group_size=4, max_staleness=0)
        assert result.lost == 0 and not result.duplicate_samples and result.stale_samples == 0
    assert {s.split("/")[0] for s in audit(colocated, 4, 0).senders} == {"colocated"}


@pytest.mark.slow
def test_turns_that_release_the_engines_memory_train_on_the_same_samples(
    tmp_path, tiny_model_dir, colocated_turns
):
    # run.release_engine_memory=true: after each turn the engine drops its KV cache while
    # the learner trains, and builds it again for the next turn; nothing it generates moves.
    kept, _ = colocated_turns
    released, _ = launch(
        tmp_path / "released",
        tiny_model_dir,
        *SYNC,
        "run.placement=colocated",
        "run.release_engine_memory=true",
    )
    assert "its memory released while the learner trains" in (released / "learner.log").read_text()
    a, b = per_step(kept), per_step(released)
    for key in ("reward/mean", "optim/grad_norm", "mismatch/kl_k3", "total/samples"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert trained_samples(kept) == trained_samples(released)
    # One release per turn (the metrics of step k count the turns before it), each of a
    # cache of the tiny model's size; none where the memory was kept.
    assert [r["worker/colocated/memory/releases"] for r in b] == [1, 2, 3, 4]
    assert all(r["worker/colocated/memory/released_gib"] > 0 for r in b)
    assert all(r["worker/colocated/memory/releases"] == 0 for r in a)


@pytest.mark.vllm
@pytest.mark.slow
def test_colocated_vllm_trains_on_the_samples_a_vllm_worker_makes(
    tmp_path, tiny_model_dir, vllm_worker_turns
):
    # vLLM in the learner's process, versions applied in memory (layerwise reload), the
    # refit probe checked: in turns, the same samples and steps as a vLLM worker process.
    separate, _ = vllm_worker_turns  # the same job with a vLLM worker process
    colocated, out = launch(
        tmp_path / "colocated",
        tiny_model_dir,
        *VLLM_TURNS,
        "run.placement=colocated",
        timeout=500,
    )
    assert "run.placement=colocated; no worker processes" in out
    a, b = per_step(separate), per_step(colocated)
    for key in ("reward/mean", "optim/grad_norm", "mismatch/kl_k3", "total/samples"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert trained_samples(separate) == trained_samples(colocated)
    assert all(r["worker/colocated/refit/probes"] >= r["step"] for r in b)
    # Overlapped: a rollout thread drives vLLM while the learner trains; nothing lost.
    overlapped, _ = launch(
        tmp_path / "overlapped",
        tiny_model_dir,
        "engine=vllm",
        "run.placement=colocated",
        "run.mode=async",
        "run.steps=6",
        "eval.every=0",
        timeout=500,
    )
    done = per_step(overlapped)
    assert [r["step"] for r in done] == list(range(1, 7))
    assert max(r["staleness/max"] for r in done) == 1
    result = audit(overlapped, group_size=4, max_staleness=1)
    assert result.lost == 0 and not result.duplicate_samples and not result.duplicate_prompts


@pytest.mark.parametrize(
    ("setting", "placement", "mode", "on_gpu", "released"),
    [
        ("auto", "colocated", "sync", True, True),  # turns on a GPU: the learner reuses it
        ("auto", "colocated", "sync", False, False),  # a CPU has no device memory to share
        ("auto", "colocated", "async", True, False),  # overlapped: never idle
        ("auto", "separate", "sync", True, False),
        (True, "colocated", "sync", False, True),
        (False, "colocated", "sync", True, False),
    ],
)
def test_release_engine_memory_resolves_auto_for_turns_on_a_gpu(
    setting, placement, mode, on_gpu, released
):
    run = OmegaConf.create({"release_engine_memory": setting, "placement": placement, "mode": mode})
    assert release_engine_memory(run, on_gpu) is released


@pytest.mark.parametrize(
    ("placement", "mode", "setting", "message"),
    [
        ("colocated", "async", True, r"run.mode=async the colocated engine generates while"),
        ("separate", "sync", True, r"needs run.placement=colocated"),
        ("colocated", "sync", "yes", r"must be auto, true or false, got 'yes'"),
    ],
)
def test_releasing_memory_that_is_never_idle_is_refused_naming_why(
    placement, mode, setting, message
):
    run = OmegaConf.create({"release_engine_memory": setting, "placement": placement, "mode": mode})
    with pytest.raises(ValueError, match=message):
        release_engine_memory(run, on_gpu=True)


def test_an_engine_started_in_the_learners_process_leaves_its_random_state_alone():
    import random

    import numpy as np

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    with kept_random_state():  # as vLLM does with engine.seed at start
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        torch.rand(5)
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


def test_a_colocated_fp8_version_is_what_a_worker_would_have_received(tiny_model_dir):
    policy = get_policy("fp8")
    model = load_model(tiny_model_dir, dtype=torch.float32)
    policy.bind_model(model.config)
    g = torch.Generator().manual_seed(0)
    masters = [
        (n, p.detach() + 0.01 * torch.randn(p.shape, generator=g))
        for n, p in model.named_parameters()
    ]
    layers = decoder_layers(model)

    def version():
        roles = extra_roles(policy, {})
        return version_weights(policy, masters, roles=roles, layers=layers), roles

    colocated = TorchEngine(str(tiny_model_dir), policy)
    weights, roles = version()
    EngineVersions(colocated, None, dict.fromkeys(("update_s", "updates"), 0.0)).publish(
        3, weights, {}, roles=roles
    )
    # The separate placement: encoded, sent over ZeroMQ, decoded by a worker's subscriber.
    publisher = VersionPublisher(LOOPBACK, LOOPBACK, transport="tcp")
    subscriber = VersionSubscriber(
        publisher.publish_address, publisher.snapshot_address, transport="tcp"
    )
    try:
        time.sleep(0.3)  # the SUB connects before the first publish (PUB drops until then)
        weights, roles = version()
        publisher.publish(3, weights, {}, policy=policy.spec, roles=roles)
        received = None
        deadline = time.monotonic() + 30
        while received is None and time.monotonic() < deadline:
            received = subscriber.poll(timeout_ms=200)
        assert received is not None and received.number == 3
    finally:
        subscriber.close()
        publisher.close()
    separate = TorchEngine(str(tiny_model_dir), policy)
    separate.update_weights(3, received.weights, received.extra, received.manifest)

    def held(engine):  # parameters and buffers (the FP8 weights and scales are buffers)
        return dict(engine.model.named_parameters()) | dict(engine.model.named_buffers())

    mine, theirs = held(colocated), held(separate)
    assert mine.keys() == theirs.keys()
    quantized = [name for name, t in mine.items() if t.dtype == torch.float8_e4m3fn]
    assert quantized  # FP8 weights, bit for bit
    for name, tensor in mine.items():
        assert tensor.dtype == theirs[name].dtype, name
        assert torch.equal(tensor.view(torch.uint8), theirs[name].view(torch.uint8)), name


@pytest.mark.slow
def test_auto_on_one_device_is_colocated_and_generates_the_next_step_while_the_learner_trains(
    tmp_path, tiny_model_dir
):
    # run.placement=auto (the default) with run.mode=async (the default) on a CPU or one GPU.
    run_dir, out = launch(
        tmp_path, tiny_model_dir, "run.max_staleness=1", "run.steps=8", "eval.every=0"
    )
    assert "run.placement=auto: colocated (one device (" in out
    assert not list(run_dir.glob("worker-*.log"))
    # The learner ran (and saved) what the launcher resolved: a resume keeps it.
    assert "placement: colocated" in (run_dir / "config.yaml").read_text()
    done = per_step(run_dir)
    assert [r["step"] for r in done] == list(range(1, 9))
    # Overlapped: some step trained on groups generated with the version before its own
    # (made while the previous step trained), and none on older ones.
    assert max(r["staleness/max"] for r in done) == 1
    assert sum(r["staleness/mean"] for r in done[1:]) > 0
    result = audit(run_dir, group_size=4, max_staleness=1)
    assert result.lost == 0 and not result.duplicate_samples and not result.duplicate_prompts
    assert {s.split("/")[0] for s in result.senders} == {"colocated"}
    assert done[-1]["worker/colocated/tokens_per_s"] > 0


@pytest.mark.parametrize(
    ("overrides", "gpus", "expected", "why"),
    [
        ([], 0, "colocated", "one device (the CPU, no GPU)"),
        ([], 1, "colocated", "one device (one GPU)"),
        ([], 2, "separate", "2 GPUs"),
        (["run.mode=sync"], 0, "separate", "run.mode=sync on a CPU"),
        (["run.mode=sync"], 1, "colocated", "one device (one GPU)"),
        (["run.workers=2"], 0, "separate", "run.workers=2 asks for worker processes"),
        (["run.learner_procs=2"], 0, "separate", "run.learner_procs=2: colocated ranks"),
        (["engine=vllm"], 0, "separate", "engine=vllm on a CPU: colocated measured slower"),
        (["engine=vllm"], 1, "colocated", "one device (one GPU)"),
        (["engine=sglang"], 1, "separate", "engine=sglang runs in worker processes"),
        (["engine.slots=4", "run.inflight_updates=true"], 0, "separate", "inflight_updates"),
    ],
)
def test_auto_placement_is_colocated_on_one_device_unless_the_run_asks_for_workers(
    overrides, gpus, expected, why
):
    cfg = compose(*overrides)
    assert cfg.run.placement == "auto"
    placement, reason = auto_placement(cfg, gpus)
    assert placement == expected and why in reason
    # A learner or worker started by hand is a separate process whatever auto would pick.
    assert placement_of(cfg.run) == "separate"


class FailingEngine:
    version = 1

    def generate(self, prompts, sampling):
        raise ValueError("the engine broke")

    def close(self):
        pass


def test_a_failed_colocated_rollout_thread_stops_the_learner_naming_why(tiny_model_dir):
    cfg = compose(f"model.path={tiny_model_dir}", "run.mode=async", "sync.probe.enabled=false")
    task = build_task(cfg.task, tiny_model_dir)
    colocated = Colocated(cfg, FailingEngine(), task, policy=get_policy("bf16"))
    sampling = {"n": 2, "temperature": 1.0, "max_new_tokens": 4}
    inbox = Inbox(None, LeaseBook(capacity=4, timeout=60), 2, sampling, 0, None)
    inbox.trained(0, 1)  # version 1 is out: work may be leased
    colocated.start(inbox)
    deadline = time.monotonic() + 30
    while colocated.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match=r"rollout thread failed.*the engine broke"):
        colocated.fill(inbox, 2)
    colocated.close()  # the thread has ended; close joins it at once


def test_rollout_thread_jobs_run_in_order_there_and_inline_once_it_has_ended():
    jobs = RolloutThreadJobs()
    woken = []
    jobs.wake = lambda: woken.append(True)
    ran = []
    first, second = (
        jobs.submit(lambda n: ran.append((n, current_thread().name)), n) for n in (1, 2)
    )
    assert woken == [True, True] and not first.done()  # queued until the thread runs them
    worker = Thread(target=jobs.run_pending, name="rollout")
    worker.start()
    worker.join()
    assert ran == [(1, "rollout"), (2, "rollout")] and first.done() and second.done()
    worker = Thread(target=jobs.end, args=(None,), name="rollout")
    worker.start()
    worker.join()
    jobs.submit(lambda: ran.append((3, current_thread().name))).result(timeout=1)
    assert ran[-1] == (3, current_thread().name)  # nobody left to queue it for


def test_run_until_runs_jobs_in_order_up_to_the_target_waiting_for_the_next():
    jobs = RolloutThreadJobs()
    held = []
    for version in (1, 2):
        jobs.submit(held.append, version)
    jobs.run_until(lambda: bool(held) and held[-1] >= 1, timeout=5)
    assert held == [1]  # not past the target: version 2 stays queued
    later = Thread(target=lambda: (time.sleep(0.2), jobs.submit(held.append, 3)))
    later.start()
    jobs.run_until(lambda: held[-1] >= 3, timeout=30)  # 2 now, then 3 once submitted
    later.join()
    assert held == [1, 2, 3]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no version job came within"):
        jobs.run_until(lambda: held[-1] >= 4, timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 5


def test_after_the_rollout_thread_failed_its_jobs_fail_and_new_ones_are_refused():
    jobs = RolloutThreadJobs()
    pending = jobs.submit(lambda: None)
    jobs.end(ValueError("the engine broke"))
    with pytest.raises(ValueError, match="the engine broke"):
        pending.result(timeout=1)
    with pytest.raises(RuntimeError, match=r"rollout thread failed.*the engine broke"):
        jobs.submit(lambda: None)
    # A job that raises on the thread stops it (run_pending raises after failing it).
    jobs = RolloutThreadJobs()
    broken = jobs.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        jobs.run_pending()
    assert isinstance(broken.exception(timeout=1), ZeroDivisionError)


def test_a_stopped_rollout_thread_cancels_its_pending_version_and_the_learner_goes_on():
    jobs = RolloutThreadJobs()
    sender = BackgroundPublisher(FailingVersions(), background=False, executor=jobs)
    sender.submit(7, [("w", torch.ones(2))], lambda snapshot: iter(snapshot), roles={})
    jobs.end(None, drain=False)  # stopped: nobody will use version 7
    assert sender.wait() >= 0  # returns: nothing was published, nothing failed


def test_a_version_that_fails_after_the_learners_last_wait_still_fails_its_wait():
    # The last version of a run: the thread drains it as it ends; the learner's final
    # wait (Hub.finish) raises what went wrong, as for any other version.
    jobs = RolloutThreadJobs()
    sender = BackgroundPublisher(FailingVersions(), background=False, executor=jobs)
    sender.submit(9, [("w", torch.ones(2))], lambda snapshot: iter(snapshot), roles={})
    jobs.end(None)
    with pytest.raises(PublishFailed, match="version 9"):
        sender.wait()
    # A version the failed thread never ran fails the wait too, naming the thread's error.
    jobs = RolloutThreadJobs()
    sender = BackgroundPublisher(FailingVersions(), background=False, executor=jobs)
    sender.submit(10, [("w", torch.ones(2))], lambda snapshot: iter(snapshot), roles={})
    jobs.end(ValueError("the engine broke"))
    with pytest.raises(PublishFailed, match="version 10") as failed:
        sender.wait()
    assert "the engine broke" in repr(failed.value.__cause__)


class FailingVersions:
    in_flight = Event()

    def publish(self, version, weights, extra, **_):
        list(weights)
        raise RefitFailed(f"version {version}: the probe failed")


class RecordingEngine:
    """Records the thread each version is applied on."""

    def __init__(self):
        self.version, self.applied = None, []

    def update_weights(self, version, tensors, extra, roles):
        self.version = version
        self.applied.append((version, current_thread().name))

    def close(self):
        pass


def test_overlapped_versions_are_applied_on_the_rollout_thread_not_the_learners(tiny_model_dir):
    cfg = compose(f"model.path={tiny_model_dir}", "run.mode=async", "sync.probe.enabled=false")
    engine = RecordingEngine()
    colocated = Colocated(cfg, engine, build_task(cfg.task, tiny_model_dir), get_policy("bf16"))
    sampling = {"n": 2, "temperature": 1.0, "max_new_tokens": 4}
    inbox = Inbox(None, LeaseBook(capacity=4, timeout=60), 2, sampling, 0, None)
    sender = BackgroundPublisher(colocated.versions, background=False, executor=colocated.jobs)
    colocated.start(inbox)  # no version out yet: the thread waits on the lease book
    weights = [("w", torch.ones(3))]
    try:
        for version in (0, 1):
            sender.submit(version, weights, lambda snapshot: iter(snapshot), roles={})
            sender.wait()  # woken by the submit, the thread applies it
        assert engine.applied == [(0, "asyncfp8-rollout"), (1, "asyncfp8-rollout")]
        assert sender.last.version == 1
    finally:
        colocated.close()
    # The thread has ended: a last version is applied on the learner's thread.
    sender.submit(2, weights, lambda snapshot: iter(snapshot), roles={})
    sender.wait()
    assert engine.applied[-1] == (2, current_thread().name)


@pytest.mark.slow
def test_a_killed_colocated_run_resumes_and_loses_nothing(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "asyncfp8.learner",
        f"model.path={tiny_model_dir}",
        f"run.dir={run_dir}",
        *SMALL_RUN,
        "run.placement=colocated",
        "run.steps=30",
        "run.checkpoint_every=3",
        "eval.every=0",
    ]
    log = (tmp_path / "learner.log").open("w")
    learner = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(per_step(run_dir)) < 8:
            time.sleep(0.05)
        assert len(per_step(run_dir)) >= 8, (tmp_path / "learner.log").read_text()[-3000:]
        learner.send_signal(signal.SIGKILL)
        learner.wait()
    finally:
        learner.kill()
    resumed = subprocess.run(
        [*command, "run.resume=true"], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    done = per_step(run_dir)
    assert [r["step"] for r in done] == list(range(1, 31))
    versions = [r["sync/version"] for r in done]
    assert versions == sorted(set(versions))
    result = audit(run_dir, group_size=4, max_staleness=1)
    assert result.lost == 0 and not result.duplicate_samples and not result.duplicate_prompts
    assert len(result.senders) == 2  # the killed process and the resumed one
    # The leases the killed rollout thread held are handed out again, and trained.
    expired = re.search(
        r"expired \d+ lease\(s\).*prompts \[([\d, ]+)\]", resumed.stdout + resumed.stderr
    )
    if expired:  # the checkpoint almost always finds the thread a step ahead, holding one
        trained = {prompt for step in trained_samples(run_dir) for prompt, _ in step}
        assert {int(p) for p in expired.group(1).split(",")} <= trained


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["run.learner_procs=2", "engine.device=cuda:0"],
            r"engine.device=cuda:0 would put every colocated rank's engine on one GPU",
        ),
        (["engine=sglang"], r"engine=torch or engine=vllm in the learner's.*engine=sglang"),
        (
            ["engine=vllm", "run.learner_procs=2"],
            r"engine=vllm with run.learner_procs=2: vLLM in a learner rank's process",
        ),
        (
            ["run.mode=async", "run.release_engine_memory=true"],
            r"run.mode=async the colocated engine generates while the learner trains",
        ),
        (
            ["engine.slots=4", "run.inflight_updates=true"],
            r"run.inflight_updates=true applies versions during",
        ),
    ],
)
def test_what_colocated_cannot_do_is_refused_at_start_naming_the_setting(
    tmp_path, tiny_model_dir, overrides, message
):
    said = refusal(tiny_model_dir, tmp_path / "run", "run.placement=colocated", *overrides)
    assert re.search(message, said), said


@pytest.mark.slow
def test_a_placement_that_does_not_exist_is_refused_by_the_launchers_schema(
    tmp_path, tiny_model_dir
):
    # Hydra's schema check (exit 1, as for any mistyped setting)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncfp8.launch",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path / 'run'}",
            "run.placement=sideways",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert re.search(r"'sideways', expected one of \[auto, separate, colocated\]", said), said


# -- several learner ranks, each with its own engine (torchrun, gloo) ------------------------


def test_a_lease_split_over_ranks_makes_the_whole_leases_tokens(tiny_model_dir):
    engine = TorchEngine(str(tiny_model_dir), "bf16")
    task = build_task(compose(f"model.path={tiny_model_dir}").task, tiny_model_dir)
    lease = {
        "lease": 7,
        "prompts": [3, 4, 5, 6, 7],
        "min_version": 0,
        "sampling": {"n": 3, "temperature": 1.0, "max_new_tokens": 6, "seed": 11},
    }
    engine.version = 0
    whole = roll_out(engine, task, lease)
    parts = split_lease(lease, 3)
    assert [p["prompts"] for p in parts] == [[3, 4], [5, 6], [7]]
    assert [p["first_request"] for p in parts] == [0, 6, 12]
    assert split_lease(lease, 7)[5:] == [lease | {"prompts": [], "first_request": 15}] * 2
    joined = [t for part in parts for t in roll_out(engine, task, part)]
    assert [(t.prompt_index, t.token_ids, t.logprobs) for t in joined] == [
        (t.prompt_index, t.token_ids, t.logprobs) for t in whole
    ]
    # Not the same streams for every part: the samples differ between prompts' copies.
    assert len({tuple(t.token_ids) for t in whole}) > 3


@pytest.mark.slow
def test_two_colocated_ranks_in_turns_train_on_what_two_ranks_and_a_worker_train_on(
    tmp_path, tiny_model_dir
):
    # FP8 rollouts, a two-rank learner in both: each rank's engine generates its part of
    # every lease with the version as it applied it, and the steps equal the separate
    # placement's to the bit (the behaviour log-probs of rank 1's samples included).
    common = (*SYNC, "run.learner_procs=2", "precision=fp8")
    separate, _ = launch(tmp_path / "separate", tiny_model_dir, *common)
    colocated, out = launch(
        tmp_path / "colocated", tiny_model_dir, *common, "run.placement=colocated"
    )
    assert "learner (2 ranks) generating with its own engine" in out
    a, b = per_step(separate), per_step(colocated)
    assert [r["total/samples"] for r in b] == [16, 32, 48, 64]
    for key in ("reward/mean", "optim/grad_norm", "mismatch/kl_k3"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert trained_samples(separate) == trained_samples(colocated)
    log = (colocated / "learner.log").read_text()
    # 4 steps of 4 groups of 4, two prompts a rank: rank 1 made half the samples, and
    # checked each of the 5 versions' refit probe.
    assert "learner rank 1's engine generated 32 samples" in log
    assert re.search(r"applied 5 versions, 5 refit probes checked, 0 failed", log), log[-2000:]
    result = audit(colocated, group_size=4, max_staleness=0)
    assert result.lost == 0 and not result.duplicate_samples and result.stale_samples == 0


@pytest.mark.slow
def test_two_overlapped_colocated_ranks_stopped_and_resumed_lose_nothing(tmp_path, tiny_model_dir):
    # Two ranks overlapped (run.mode=async): each rank's rollout thread generates its part
    # of every lease while the learner trains, within one version of staleness, with an
    # evaluation every 4 steps. Ctrl-C: rank 0's rollout thread stops and tells rank 1's,
    # both ranks checkpoint and exit; the resumed run trains every step once and loses no
    # sample, and rank 1's engine generated its half and checked every version it applied.
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "asyncfp8.launch",
        f"model.path={tiny_model_dir}",
        f"run.dir={run_dir}",
        *SMALL_RUN,
        "run.placement=colocated",
        "run.learner_procs=2",
        "run.steps=400",
        "run.checkpoint_every=3",
        "eval.every=4",
        "eval.prompts=8",
    ]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(per_step(run_dir)) < 8:
            assert first.poll() is None, first.stdout.read()[-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGINT)
        out, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 130, out[-3000:]
    overlapped = per_step(run_dir)
    stopped_at = len(overlapped)
    assert max(r["staleness/max"] for r in overlapped) == 1
    assert sum(r["staleness/mean"] for r in overlapped[1:]) > 0
    assert "stopped by signal" in (run_dir / "learner.log").read_text()
    resumed = subprocess.run(
        [*command, "run.resume=true", "run.steps=" + str(stopped_at + 6)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    done = per_step(run_dir)
    assert [r["step"] for r in done] == list(range(1, stopped_at + 7))
    result = audit(run_dir, group_size=4, max_staleness=1)
    assert result.lost == 0 and not result.duplicate_samples and not result.duplicate_prompts
    assert len(result.senders) == 2  # the stopped process and the resumed one
    # The resumed run's 6 steps of 4 groups of 4, two prompts a rank: rank 1's engine made
    # at least half the samples, and applied and checked at least the 6 versions trained on.
    log = (run_dir / "learner.log").read_text()
    made = re.findall(r"learner rank 1's engine generated (\d+) samples", log)
    assert made and int(made[-1]) >= 6 * 16 // 2, log[-2000:]
    checked = re.findall(r"applied (\d+) versions, (\d+) refit probes checked, 0 failed", log)
    assert checked and int(checked[-1][0]) >= 6 and int(checked[-1][1]) >= 6, log[-2000:]
    assert {0, 4} <= {r["step"] for r in evaluations(run_dir)}  # every 4 steps, 2 ranks


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_rank_engine_stops_the_colocated_rollouts_naming_the_rank(mode, tiny_model_dir):
    out = two_ranks(
        REPO / "tests" / "colocated_ranks_check.py", str(tiny_model_dir), mode, timeout=180
    )
    assert "rank 0: no failure" not in out
    assert re.search(
        r"rank 0: .*learner rank 1's engine failed: ValueError\('the engine broke'\)", out
    )
    assert "rank 1: stopped (thread alive: False), error ValueError('the engine broke')" in out
