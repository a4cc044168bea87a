"""π_prox scored ahead (`correction.proximal_thread`): as each group arrives, a thread of its
own scores its tokens under the learner's weights of the version that sampled them, on a
copy of the model, so the training step reads those log-probs instead of swapping each stale
version into its model for a forward on its critical path (train/versions.py)."""

from __future__ import annotations

import logging
import queue
import threading

import torch

from asyncfp8.run.distributed import local_shard
from asyncfp8.sync import Trajectory
from asyncfp8.train.batches import Group, TrainBatch, batch_tensors
from asyncfp8.train.logprobs import completion_logprobs
from asyncfp8.train.versions import VersionWeights

log = logging.getLogger(__name__)


class ProximalThread:
    """Scores submitted groups with `scorer` (the learner's model, unsharded, in its compute
    dtype, on its device) loaded with each kept version's weights; each trajectory gets
    `proximal_logprobs`, NaN where its version was not kept. `wait` blocks the step until
    the trajectories it trains on are scored, and raises what the thread raised."""

    def __init__(
        self,
        scorer: torch.nn.Module,
        versions: VersionWeights,
        temperature: float,
        chunk_tokens: int,
        pad_token_id: int,
    ):
        self.scorer = scorer.eval().requires_grad_(False)
        self.params = list(self.scorer.parameters())
        shapes = [tuple(local_shard(p).shape) for p in versions.model.parameters()]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError("the proximal scorer's parameters are not the learner model's")
        self.versions, self.temperature = versions, temperature
        self.chunk_tokens, self.pad_token_id = chunk_tokens, pad_token_id
        self.loaded: int | None = None  # the version the scorer's weights are
        self.pending: set[int] = set()  # ids of the trajectories not scored yet
        self.done = threading.Condition()
        self.error: BaseException | None = None
        self.scored_tokens = 0
        self.queue: queue.Queue[Group | None] = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name="asyncfp8-proximal", daemon=True)
        self.thread.start()

    def submit(self, group: Group) -> None:
        """Queues a group that just arrived (called on the inbox's side, never blocks)."""
        with self.done:
            self.pending.update(id(t) for t in group.trajectories)
        self.queue.put(group)

    def wait(self, trajectories: list[Trajectory], timeout: float = 600.0) -> None:
        with self.done:
            ready = self.done.wait_for(
                lambda: (
                    self.error is not None or not any(id(t) in self.pending for t in trajectories)
                ),
                timeout,
            )
            if self.error is not None:
                raise RuntimeError(f"the proximal thread failed: {self.error!r}") from self.error
            if not ready:
                raise TimeoutError(f"the proximal thread scored nothing for {timeout:.0f} s")

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=60)

    def _serve(self) -> None:
        while (group := self.queue.get()) is not None:
            try:
                self._score(group.trajectories)
            except BaseException as err:  # the step raises it: nothing trains on a guess
                log.exception("the proximal thread failed")
                with self.done:
                    self.error = err
                    self.done.notify_all()
                return
            with self.done:
                self.pending.difference_update(id(t) for t in group.trajectories)
                self.done.notify_all()

    @torch.no_grad()
    def _score(self, trajectories: list[Trajectory]) -> None:
        device = self.params[0].device
        batch = batch_tensors(trajectories, self.pad_token_id).to(device)
        values = torch.full(batch.mask.shape, float("nan"))
        for version in sorted({int(v) for t in trajectories for v in t.versions}):
            with self.versions.lock:
                if not self.versions.has(version):
                    continue  # the step falls back to the current weights and counts it
                if self.loaded != version:
                    for param, saved in zip(
                        self.params, self.versions.weights[version], strict=True
                    ):
                        param.copy_(saved)
                    self.loaded = version
            logp = completion_logprobs(self.scorer, batch, self.temperature, self.chunk_tokens)[0]
            where = (batch.versions == version) & batch.mask
            values = torch.where(where.cpu(), logp.float().cpu(), values)
            self.scored_tokens += int(where.sum())
        for row, trajectory in enumerate(trajectories):
            trajectory.proximal_logprobs = values[row, : len(trajectory.token_ids)].tolist()


def ahead_scored(batch: TrainBatch, where: torch.Tensor) -> bool:
    """Every token at `where` has its π_prox scored ahead (by the thread above)."""
    scored = batch.proximal_logp
    return scored is not None and bool(scored.to(where.device)[where].isfinite().all())


def merged(
    previous: tuple[torch.Tensor, torch.Tensor] | None, logp: torch.Tensor, where: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(π_prox values, where known) of a micro-batch with `logp` taken at `where`."""
    values, known = previous or (torch.zeros_like(logp), torch.zeros_like(where))
    return torch.where(where, logp, values), known | where
