"""A run under Slurm (`srun python -m asyncfp8.launch`): which process this task is, read
from Slurm's variables. Tasks 0 .. L-1 (L = `run.learner_procs`) are the learner's ranks,
the rest workers; the ranks rendezvous as torchrun would (variables set here), placed as
Slurm's block distribution places them (docs/clusters.md#under-slurm). Pure functions of
an environment mapping, so the tests set the variables themselves."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

# torch.distributed's rendezvous port: fixed per job so every rank computes the same one.
RENDEZVOUS_PORT_BASE, RENDEZVOUS_PORT_SPAN = 29500, 10000


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: "gpu[01-03,7],cpu5" ->
    gpu01 gpu02 gpu03 gpu7 cpu5 (zero padding kept, as Slurm writes it)."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", text):
        prefix, ranges, suffix = match.groups()
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            if not first.isdigit() or (last and not last.isdigit()):
                raise ValueError(f"Slurm host list {text!r}: cannot read the range {part!r}")
            width = len(first)
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{number:0{width}d}{suffix}")
    if not hosts:
        raise ValueError(f"Slurm host list {text!r} names no host")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE, expanded: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r}: cannot read {part!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


@dataclasses.dataclass(frozen=True)
class SlurmTask:
    """This task of a Slurm job step."""

    procid: int
    ntasks: int
    task_nodes: tuple[str, ...]  # the node of every task, by task id
    job_id: str
    rendezvous_port: int  # the learner ranks' MASTER_PORT

    @property
    def node(self) -> str:
        return self.task_nodes[self.procid]


def slurm_task(setting: bool | str, environ: Mapping[str, str]) -> SlurmTask | None:
    """This process's task when the run is under Slurm (`run.slurm`: auto, when srun
    started this process as one of several tasks; true: it must be; false: never)."""
    if setting not in (True, False, "auto"):
        raise ValueError(f"run.slurm must be auto, true or false, got {setting!r}")
    if setting is False:
        return None
    ntasks_text = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    under_srun = "SLURM_PROCID" in environ and ntasks_text is not None
    if not under_srun:
        if setting is True:
            raise ValueError(
                "run.slurm=true but this process was not started by srun (no SLURM_PROCID / "
                "SLURM_STEP_NUM_TASKS): run `srun python -m asyncfp8.launch ...`"
            )
        return None
    ntasks = int(ntasks_text)
    if setting == "auto" and ntasks < 2:
        return None  # one task: the launcher starts every process itself, as on a laptop
    distribution = environ.get("SLURM_DISTRIBUTION", "block")
    if not distribution.startswith("block"):
        raise ValueError(
            f"SLURM_DISTRIBUTION={distribution}: asyncfp8 places tasks as the default block "
            "distribution does; run srun with --distribution=block"
        )
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    per_node_text = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not per_node_text:
        raise ValueError(
            "under srun, but SLURM_STEP_NODELIST / SLURM_STEP_TASKS_PER_NODE are not set: "
            "cannot tell which node runs the learner"
        )
    nodes, per_node = expand_hostlist(nodelist), expand_tasks_per_node(per_node_text)
    if len(nodes) != len(per_node) or sum(per_node) != ntasks:
        raise ValueError(
            f"Slurm says {ntasks} tasks on nodes {nodes} with tasks per node {per_node}: "
            "they do not add up"
        )
    task_nodes = tuple(
        node for node, count in zip(nodes, per_node, strict=True) for _ in range(count)
    )
    job_id = environ.get("SLURM_JOB_ID", "0")
    # MASTER_PORT when the job sets one (many clusters do), else one derived from the job
    # id, so that two jobs sharing a node do not collide.
    derived = RENDEZVOUS_PORT_BASE + int(re.sub(r"\D", "", job_id) or 0) % RENDEZVOUS_PORT_SPAN
    return SlurmTask(
        procid=int(environ["SLURM_PROCID"]),
        ntasks=ntasks,
        task_nodes=task_nodes,
        job_id=job_id,
        rendezvous_port=int(environ.get("MASTER_PORT") or derived),
    )


@dataclasses.dataclass(frozen=True)
class Role:
    """What one task runs: a learner rank (`rank`) or a worker (`worker`), and where the
    learner is."""

    kind: str  # "learner" | "worker"
    index: int  # the learner rank, or the worker's number (0 ..)
    learner_host: str
    workers: int
    env: dict[str, str]  # torch.distributed's rendezvous, for a learner rank


def role_of(task: SlurmTask, learner_procs: int) -> Role:
    """Tasks 0 .. learner_procs-1 are the learner's ranks, the others workers."""
    workers = task.ntasks - learner_procs
    if workers < 1:
        raise ValueError(
            f"the Slurm job step has {task.ntasks} task(s): too few for run.learner_procs="
            f"{learner_procs} learner rank(s) and at least one worker (srun --ntasks="
            f"{learner_procs + 1} or more)"
        )
    learner_host = task.task_nodes[0]
    if task.procid >= learner_procs:
        return Role("worker", task.procid - learner_procs, learner_host, workers, {})
    rank = task.procid
    if learner_procs == 1:  # one rank makes its own process group, as without Slurm
        return Role("learner", 0, learner_host, workers, {})
    local_rank = sum(1 for r in range(rank) if task.task_nodes[r] == task.node)
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(learner_procs),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(
            sum(1 for r in range(learner_procs) if task.task_nodes[r] == task.node)
        ),
        "MASTER_ADDR": learner_host,
        "MASTER_PORT": str(task.rendezvous_port),
    }
    return Role("learner", rank, learner_host, workers, env)
