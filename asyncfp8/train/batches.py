"""How a step's samples become tensors: which rank trains which sample in which
mini-batch, the micro-batches that bound memory, and the padded tensors of one. Every rank
gets as many samples of each mini-batch (longest first, to the rank with fewest tokens) and
runs as many micro-batches of at most `optim.micro_batch_tokens` padded tokens, since each
forward and backward of a sharded model is a collective (docs/running.md)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from asyncfp8.sync import Trajectory


@dataclass
class Group:
    """The `group_size` samples of one prompt, as one worker generated them."""

    lease: int
    prompt: int
    trajectories: list[Trajectory]

    @property
    def oldest_version(self) -> int:
        return min(min(t.versions, default=0) for t in self.trajectories)


Plan = list[list[list[list[int]]]]  # [mini-batch][rank][micro-batch] -> sample indices


def check_split(samples: int, mini_batches: int, world: int) -> None:
    """Refuses, at start, a step that cannot be split evenly over mini-batches and ranks."""
    if not isinstance(mini_batches, int) or mini_batches < 1:
        raise ValueError(f"optim.mini_batches must be a positive integer, got {mini_batches!r}")
    parts = mini_batches * world
    if samples % parts:
        raise ValueError(
            f"a step's {samples} samples (run.groups_per_step × run.group_size) cannot be split "
            f"evenly into optim.mini_batches={mini_batches} mini-batches over {world} learner "
            f"ranks (run.learner_procs / torchrun --nproc_per_node): change one of them so that "
            f"the samples are a multiple of {parts}"
        )


def _cost(rows: list[int], lengths: list[int]) -> int:
    return len(rows) * max(lengths[r] for r in rows)


def _greedy_micro_batches(rows: list[int], lengths: list[int], budget: int | None) -> list:
    """Rows (longest first) packed into consecutive micro-batches within `budget`
    padded tokens; a row longer than the budget gets a micro-batch of its own."""
    if budget is None:
        return [list(rows)]
    parts: list[list[int]] = []
    for row in rows:
        if parts and _cost([*parts[-1], row], lengths) <= budget:
            parts[-1].append(row)
        else:
            parts.append([row])
    return parts


def _split_to(parts: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """`parts` cut further until there are `count` (the costliest part with two rows or
    more is halved each time): subsets of a part within the budget stay within it."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        index = max(
            (i for i, p in enumerate(parts) if len(p) > 1), key=lambda i: _cost(parts[i], lengths)
        )
        part = parts.pop(index)
        half = len(part) // 2
        parts[index:index] = [part[:half], part[half:]]
    return parts


def plan_step(lengths: list[int], mini_batches: int, world: int, budget: int | None) -> Plan:
    """[mini-batch][rank][micro-batch] -> indices into `lengths` (the padded length of
    each sample). Every sample appears once; every rank has the same number of samples
    and of micro-batches in each mini-batch."""
    check_split(len(lengths), mini_batches, world)
    if budget is not None and budget < 1:
        raise ValueError(f"optim.micro_batch_tokens must be >= 1 or null, got {budget}")
    size = len(lengths) // mini_batches
    per_rank = size // world
    plan: Plan = []
    for start in range(0, len(lengths), size):
        rows = sorted(range(start, start + size), key=lambda r: (-lengths[r], r))
        shares: list[list[int]] = [[] for _ in range(world)]
        tokens = [0] * world
        for row in rows:
            rank = min(
                (r for r in range(world) if len(shares[r]) < per_rank), key=lambda r: tokens[r]
            )
            shares[rank].append(row)
            tokens[rank] += lengths[row]
        micro = [_greedy_micro_batches(share, lengths, budget) for share in shares]
        count = max(len(parts) for parts in micro)
        plan.append([_split_to(parts, count, lengths) for parts in micro])
    return plan


@dataclass
class TrainBatch:
    """Right-padded rows of prompt + completion, and per completion token [N, T] what the
    loss reads: the position of the token before it (its logits predict it), the rollout's
    log-prob, the version that sampled it and whether it is a real token. `advantages` and
    `index` (each row's sample in the step's batch) are set by the training step."""

    input_ids: torch.Tensor  # [N, W]
    attention_mask: torch.Tensor  # [N, W]

    positions: torch.Tensor  # [N, T]
    rollout_logp: torch.Tensor  # [N, T] fp32
    versions: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] bool
    advantages: torch.Tensor | None = None  # [N]
    index: list[int] = field(default_factory=list)
    #: [N, T] fp32 π_prox scored ahead under each token's version (NaN: not scored)
    proximal_logp: torch.Tensor | None = None
    #: MoE: each row's engine routes (Trajectory.routes); None when no row has any
    routes: list[bytes | None] | None = None

    def to(self, device: torch.device | str) -> TrainBatch:
        tensors = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **tensors)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, padded width) of the prompt + completion ids."""
        return tuple(self.input_ids.shape)


def batch_tensors(trajectories: list[Trajectory], pad: int) -> TrainBatch:
    """The `TrainBatch` of `trajectories`, padded with token `pad`."""
    width = max(len(t.prompt_ids) + len(t.token_ids) for t in trajectories)
    steps = max(len(t.token_ids) for t in trajectories)
    n = len(trajectories)
    input_ids = torch.full((n, width), pad, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    positions = torch.zeros(n, steps, dtype=torch.long)
    rollout = torch.zeros(n, steps)
    versions = torch.zeros(n, steps, dtype=torch.long)
    mask = torch.zeros(n, steps, dtype=torch.bool)
    scored = any(t.proximal_logprobs is not None for t in trajectories)
    proximal = torch.full((n, steps), float("nan")) if scored else None
    for row, t in enumerate(trajectories):
        ids = list(t.prompt_ids) + list(t.token_ids)
        k = len(t.token_ids)
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        positions[row, :k] = torch.arange(len(t.prompt_ids) - 1, len(ids) - 1)
        rollout[row, :k] = torch.tensor(t.logprobs)
        versions[row, :k] = torch.tensor(t.versions)
        mask[row, :k] = True
        if proximal is not None and t.proximal_logprobs is not None:
            proximal[row, :k] = torch.tensor(t.proximal_logprobs)
    batch = TrainBatch(input_ids, attention, positions, rollout, versions, mask)
    batch.proximal_logp = proximal
    if any(t.routes is not None for t in trajectories):
        batch.routes = [t.routes for t in trajectories]
    return batch
