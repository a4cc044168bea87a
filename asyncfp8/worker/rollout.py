"""A lease turned into scored trajectories: what a worker does with each lease it gets, and
what a colocated learner does in its rollout turn (`learner/colocated.py`). A lease (the
learner's `Inbox.lease` answer) names its prompts by index in the task's stream and the
sampling settings, seed included; each prompt gets `n` samples, scored by the task's
reward, each token tagged with the version that produced it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncfp8.engines import RolloutEngine, SamplingParams
from asyncfp8.sync import Trajectory
from asyncfp8.tasks import Task

#: What a rollout process counts, reported with each lease request (the learner's step
#: metrics read them per worker): a worker's, and a colocated learner's own engine's.
ROLLOUT_STATS = (
    "samples",
    "tokens",
    "generate_s",
    "update_s",
    "updates",
    "paused_s",
    "rejected_versions",  # bad weight messages this worker received
    "inflight_updates",  # versions applied between two decode steps
    # the refit probes (asyncfp8/refit/probe.py): time scoring them, versions checked,
    # probes beyond tolerance (each followed by a snapshot), failures the snapshot repaired
    "refit/probe_s",
    "refit/probes",
    "refit/failures",
    "refit/recovered",
)


def lease_sampling(lease: Mapping[str, Any]) -> SamplingParams:
    settings = lease["sampling"]
    return SamplingParams(
        n=settings["n"],
        temperature=settings["temperature"],
        max_new_tokens=settings["max_new_tokens"],
        seed=settings["seed"],
    )


def roll_out(engine: RolloutEngine, task: Task, lease: Mapping[str, Any]) -> list[Trajectory]:
    """The lease's samples from `engine`, scored, as trajectories of the lease."""
    prompts = [task.prompt(index) for index in lease["prompts"]]
    # A part of a lease split over a colocated run's ranks (`split_lease`) samples from
    # the whole lease's streams (the torch engine, the one colocated runs, takes it).
    first = lease.get("first_request", 0)
    extra = {"first_request": first} if first else {}
    samples = engine.generate([p.text for p in prompts], lease_sampling(lease), **extra)
    trajectories = []
    for sample in samples:
        prompt = prompts[sample.prompt_index]
        trajectories.append(
            Trajectory(
                prompt_ids=sample.prompt_ids,
                token_ids=sample.token_ids,
                logprobs=sample.logprobs,
                versions=sample.versions,
                reward=task.score(sample.text, prompt),
                group_id=f"{lease['lease']}:{prompt.index}",
                prompt_index=prompt.index,
                finish_reason=sample.finish_reason,
                meta={"lease": lease["lease"]},
                routes=sample.routes,
            )
        )
    return trajectories


def split_lease(lease: Mapping[str, Any], parts: int) -> list[dict[str, Any]]:
    """The lease's prompts in `parts` consecutive runs as even as can be (a colocated run's
    ranks each generate one; a part may have none), each keeping the lease's number,
    version and seed, and the streams its samples have in the whole lease
    (`first_request`): the parts together make the lease's trajectories, in its order."""
    prompts, n = list(lease["prompts"]), lease["sampling"]["n"]
    size, extra = divmod(len(prompts), parts)
    out, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        out.append(dict(lease) | {"prompts": prompts[start:end], "first_request": start * n})
        start = end
    return out
