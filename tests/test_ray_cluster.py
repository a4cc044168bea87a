"""`python -m asyncfp8.launch run.ray=true` on a Ray cluster of several nodes on this
machine (issue 47): the learner on one node, workers on others; a worker's node removed
mid-run, then the learner's; nothing lost. Marked `cluster`: run on CI's own line."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from asyncfp8.chaos.audit import audit  # noqa: E402
from asyncfp8.launch.ray_actors import RayProcess  # noqa: E402
from asyncfp8.launch.ray_cluster import start_ranks  # noqa: E402
from asyncfp8.learner.ledger import read_ledger  # noqa: E402
from tests.cluster.ray_nodes import (  # noqa: E402
    RayNodes,
    finish,
    processes_under,
    ray_launch,
    wait_for_step,
    wait_until,
)
from tests.recorded import record_groups, save_groups  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    """One head for the module (a cluster takes seconds to start)."""
    cluster = RayNodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def nodes(cluster):
    """The module's cluster, left with its head alone after each test, passed or not."""
    try:
        yield cluster
    finally:
        cluster.remove_all()


def test_a_worker_node_removed_mid_run_loses_nothing(nodes, tmp_path, tiny_model_dir):
    """The learner on its node, two workers on two others. At step 8 a spare node joins
    and one worker's node is removed: Ray starts that worker again on the spare, the
    learner re-leases what it held, and the run trains on with both. It is then stopped
    as Ctrl-C stops it: every prompt handed out was trained once or is still open in the
    checkpoint. (A run of a fixed 30 steps once ended, on the one worker left, before
    the restarted actor had answered the driver: the test must wait for the restart.)"""
    nodes.add(learner=1)
    worker_nodes = [nodes.add(rollout=1) for _ in range(2)]
    run_dir = tmp_path / "run"
    driver = ray_launch(run_dir, tiny_model_dir, nodes.address, "run.steps=100000", "run.workers=2")
    try:
        wait_for_step(run_dir, 8, driver)
        spare = nodes.add(rollout=1)
        nodes.remove(worker_nodes[0])
        driver.wait_for_output("actor died and Ray started it again (1/3)", timeout=180)
        assert len(processes_under(spare, "asyncfp8.worker")) == 1  # restarted there
        # The new copy's process exists; its engine may still be loading (once, in CI,
        # the run's next 5 steps came from the other worker before it logged a start).
        wait_until(lambda: worker_starts(run_dir) == [1, 2], "the restarted worker's engine")
        step = read_ledger(run_dir)[-1]["step"]
        wait_for_step(run_dir, step + 5, driver)  # the run goes on with the new copy
        driver.send_signal(signal.SIGINT)
        output = finish(driver)
    finally:
        driver.kill()
    assert driver.returncode == 130, output[-3000:]
    result = audit(run_dir, group_size=4, max_staleness=1)
    assert result.steps >= step + 5 and result.lost == 0, result
    # the worker that lost its node started twice (its log is appended to), the other once
    assert worker_starts(run_dir) == [1, 2]


def worker_starts(run_dir: Path) -> list[int]:
    """How often each worker's engine started, fewest first (each start logs one line)."""
    return sorted((run_dir / f"worker-{i}.log").read_text().count("engine torch") for i in range(2))


def test_the_learner_node_killed_the_run_resumes_on_another(nodes, tmp_path, tiny_model_dir):
    """The learner's node dies after step 12 (a checkpoint every 5 steps; a spare
    learner node joins first): the driver resumes the learner from its last checkpoint
    on the spare, starts the workers again at its address, and the run ends with every
    prompt trained once."""
    first = nodes.add(learner=1)
    nodes.add(rollout=1)
    nodes.add(rollout=1)
    run_dir = tmp_path / "run"
    driver = ray_launch(
        run_dir,
        tiny_model_dir,
        nodes.address,
        "run.steps=60",
        "run.workers=2",
        "run.checkpoint_every=5",
    )
    try:
        wait_for_step(run_dir, 12, driver)
        nodes.add(learner=1)  # the spare
        nodes.remove(first)
        output = finish(driver)
    finally:
        driver.kill()
    assert driver.returncode == 0, output[-3000:]
    assert "resuming from its last checkpoint on the nodes left (1/1)" in output, output[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [r["run/resumed_from_step"] for r in records if "run/resumed_from_step" in r]
    assert len(resumed) == 1 and resumed[0] % 5 == 0 and 10 <= resumed[0] < 60, resumed
    result = audit(run_dir, group_size=4, max_staleness=1)
    assert result.steps == 60 and result.lost == 0, result


def test_two_ranks_on_two_nodes_train_like_two_torchrun_ranks(nodes, tmp_path, tiny_model_dir):
    """The same recorded groups trained by a two-rank learner whose ranks are Ray actors
    on two nodes (a STRICT_SPREAD placement group; the rendezvous from rank 0's actor, as
    run.ray=true forms it) and by two ranks under torchrun on one host: the same
    weights, bit for bit (the same world size splits the batch the same way)."""
    groups = tmp_path / "groups.json"
    save_groups(record_groups(tiny_model_dir, steps=2, groups=4, group_size=4), groups)
    settings = ["optim.micro_batch_tokens=40", "optim.mini_batches=2"]

    def args(name: str) -> list[str]:
        out = tmp_path / f"{name}.pt"
        return [str(tiny_model_dir), str(groups), str(tmp_path / name), str(out), *settings]

    torchrun = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "train_recorded.py"),
            *args("torchrun"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert torchrun.returncode == 0, torchrun.stdout[-3000:] + torchrun.stderr[-3000:]

    nodes.add(learner=1)
    nodes.add(learner=1)
    # the actors run `python -m tests.train_recorded` from this checkout
    ray.init(
        address=nodes.address,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    try:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = placement_group([{"CPU": 1, "learner": 1}] * 2, strategy="STRICT_SPREAD")
        ray.get(group.ready(), timeout=60)
        remote = ray.remote(RayProcess)
        ranks = [
            remote.options(
                num_cpus=1,
                resources={"learner": 1},
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank),
            ).remote(f"rank{rank}", "tests.train_recorded", args("ray"), str(tmp_path))
            for rank in range(2)
        ]
        where = ray.get(ranks[0].where.remote())
        assert ray.get(ranks[1].where.remote())["node"] != where["node"]  # two nodes
        start_ranks(ray, ranks, where, [])
        codes = ray.get([rank.wait.remote(300) for rank in ranks])
    finally:
        ray.shutdown()
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    on_ray = torch.load(tmp_path / "ray.pt", weights_only=False)
    on_torchrun = torch.load(tmp_path / "torchrun.pt", weights_only=False)
    for name, value in on_torchrun["parameters"].items():
        assert torch.equal(on_ray["parameters"][name], value), name
    keys = ("optim/grad_norm", "loss/policy", "mismatch/kl_k3")
    for a, b in zip(on_ray["metrics"], on_torchrun["metrics"], strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys]


def test_more_than_the_cluster_has_is_refused_at_start(nodes, tmp_path, tiny_model_dir):
    """A GPU the cluster lacks: refused at once, naming asked and free. Resources free
    in sum that cannot be placed as asked (two ranks STRICT_PACK, one `learner` per
    node): refused after run.ray_timeout, naming what is free; nothing left pending."""
    for resources in ({"learner": 1}, {"learner": 1}, {"rollout": 1}):
        nodes.add(**resources)
    gpu = ray_launch(tmp_path / "gpu", tiny_model_dir, nodes.address, "run.ray_learner.num_gpus=1")
    output = finish(gpu, timeout=120)
    assert gpu.returncode == 2, output[-3000:]
    assert "the run asks for 1 GPU (1 learner rank(s) x 1 + 1 worker(s) x 0) but 0 free" in output
    packed = ray_launch(
        tmp_path / "packed",
        tiny_model_dir,
        nodes.address,
        "run.learner_procs=2",
        "run.workers=1",
        "run.ray_learner.strategy=STRICT_PACK",
        "run.ray_timeout=5",
    )
    output = finish(packed, timeout=180)
    assert packed.returncode == 2, output[-3000:]
    assert (
        "the learner's 2 rank(s)" in output
        and "could not be placed within run.ray_timeout=5" in output
    )
    ray.init(address=nodes.address, log_to_driver=False)
    try:  # the placement group the refused run made is gone
        assert ray.available_resources().get("learner") == 2
    finally:
        ray.shutdown()


def test_a_node_that_leaves_and_comes_back_brings_no_second_copy(nodes, tmp_path, tiny_model_dir):
    """A worker node stops answering (its raylet paused: the worker on it still runs)
    long enough for Ray to declare it dead and start the worker on a spare; when the
    node comes back, its old copy of the worker ends and one copy is left. The run is
    then stopped as Ctrl-C stops it (the learner checkpoints): every prompt handed out
    was trained once or is still open in the checkpoint."""
    nodes.add(learner=1)
    away, other = nodes.add(rollout=1), nodes.add(rollout=1)
    run_dir = tmp_path / "run"
    driver = ray_launch(run_dir, tiny_model_dir, nodes.address, "run.steps=100000", "run.workers=2")
    try:
        wait_for_step(run_dir, 5, driver)
        (old,) = processes_under(away, "asyncfp8.worker")
        spare = nodes.add(rollout=1)
        raylet = away.all_processes["raylet"][0].process.pid
        os.kill(raylet, signal.SIGSTOP)
        try:
            wait_until(lambda: processes_under(spare, "asyncfp8.worker"), "a worker on the spare")
        finally:
            os.kill(raylet, signal.SIGCONT)
        wait_until(lambda: not os.path.exists(f"/proc/{old}"), "the old copy's end", timeout=60)
        # the driver counts the restart (it sees the new copy's pid) before the run stops
        driver.wait_for_output("actor died and Ray started it again (1/3)", timeout=60)
        assert len(processes_under(spare, "asyncfp8.worker")) == 1
        assert len(processes_under(other, "asyncfp8.worker")) == 1
        step = read_ledger(run_dir)[-1]["step"]
        wait_for_step(run_dir, step + 5, driver)  # the run goes on with the new copy
        driver.send_signal(signal.SIGINT)
        output = finish(driver)
    finally:
        driver.kill()
    assert driver.returncode == 130, output[-3000:]
    assert "actor died and Ray started it again (1/3)" in output, output[-3000:]
    result = audit(run_dir, group_size=4, max_staleness=1)
    assert result.steps >= step + 5 and result.lost == 0, result
