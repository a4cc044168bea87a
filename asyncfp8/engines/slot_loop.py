"""The built-in engine's one decode loop: requests through a `SlotDecoder`'s slots, a
slot refilled as soon as its sequence ends (a static batch: one slot per sequence). Each
request samples from its own stream; `between_steps` may apply a version between steps,
every token tagged with its forward's version. Steps are made by a `StepStrategy`
(docs/engines.md, "Slots: continuous batching and in-flight updates")."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from asyncfp8.moe.routes import RouteRecorder

from .base import SamplingParams
from .request_sampling import (
    FINAL,
    SAMPLE,
    draw,
    request_seed,
    sample_per_request,
    step_sampler,
    stream_keys,
)
from .slot_routes import SlotRoutes
from .slots import SlotDecoder
from .stepping import Kept, RecordingDecoder, SlotSteps, StepStrategy


@dataclass(frozen=True)
class Request:
    """One sequence to generate: its prompt, its own budget and its random stream's key
    (`request_sampling.request_seed`)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int


def seeded_requests(
    prompts: Sequence[Sequence[int]],
    budgets: Sequence[int],
    seed: int,
    indices: Sequence[int] | None = None,
) -> list[Request]:
    """Request i: prompt i with budget i, its stream keyed by (`seed`, `indices[i]`)
    (default: i), so that a request moved to another call, batch or rank keeps its
    tokens."""
    indices = range(len(prompts)) if indices is None else indices
    if not len(prompts) == len(budgets) == len(indices):
        raise ValueError(
            f"{len(prompts)} prompts, {len(budgets)} budgets and {len(indices)} indices"
        )
    return [
        Request(tuple(ids), budget, request_seed(seed, index))
        for ids, budget, index in zip(prompts, budgets, indices, strict=True)
    ]


@dataclass
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routes: bytes | None = None  # an MoE's, where the loop recorded them (slot_routes.py)


@dataclass
class SlotStats:
    """What a `SlotLoop` run did: decode steps (one forward of every slot each), refill
    prefills (one forward each), the rows the steps computed, the forwards whose output
    a sequence kept, the tokens generated and the versions applied between steps."""

    steps: int = 0
    prefills: int = 0
    row_steps: int = 0  # slots × steps: what the static shapes computed
    #: per sequence: its prefill, plus each step it was fed to while unfinished (each
    #: gives one token: without speculation, one per token)
    useful_forwards: int = 0
    tokens: int = 0
    versions_applied: list[int] = field(default_factory=list)


class PlainStep:
    """One decode step, one token per row: the loop's own step."""

    overshoot = 1
    needs_hidden = False

    def started(self, slots: Sequence[int]) -> None:
        pass

    def finished(self, slot: int, decoder: RecordingDecoder) -> None:
        pass

    def step(self, loop: SlotSteps, current: int) -> None:
        loop.plain_step(current)


class SlotLoop:
    """Generates `requests` through `decoder`'s slots (`run`): one `Generated` per request,
    in order; a sequence ends at `eos` (unless ignored, asked every `check_every` plain
    steps) or its budget. `between_steps` runs before each forward, then `version()` tags
    the tokens it produces. `all_done` (ranks of one sharded model step together): called
    each iteration with whether this loop is done; needs a slot per request."""

    def __init__(
        self,
        decoder: SlotDecoder,
        requests: Sequence[Request],
        sampling: SamplingParams,
        eos: int,
        pad: int,
        *,
        check_every: int = 1,
        version: Callable[[], int] = lambda: -1,
        between_steps: Callable[[], None] | None = None,
        stats: SlotStats | None = None,
        strategy: StepStrategy | None = None,
        all_done: Callable[[bool], bool] | None = None,
        routes: RouteRecorder | None = None,
    ):
        if all_done is not None and not 0 < len(requests) <= decoder.slots:
            raise ValueError(
                f"a loop stepping with other processes (all_done) needs 1 to {decoder.slots} "
                f"requests (one slot each), got {len(requests)}"
            )
        self.all_done = all_done
        self.strategy = PlainStep() if strategy is None else strategy
        if self.strategy.needs_hidden and not decoder.record_hidden:
            raise ValueError("this step strategy needs a SlotDecoder built with record_hidden=True")
        self.decoder, self.requests, self.sampling = decoder, list(requests), sampling
        self.eos, self.pad, self.check_every = eos, pad, check_every
        self.version, self.between_steps = version, between_steps
        self.stats = SlotStats() if stats is None else stats
        self.stops = not sampling.ignore_eos
        slots, device = decoder.slots, decoder.device
        self.slots = slots
        self.long = dict(dtype=torch.long, device=device)
        longest = max((r.max_new_tokens for r in self.requests), default=0)
        # Room past the longest budget for what a step writes beyond a row's end.
        self.room = longest + self.strategy.overshoot
        self.out_tokens = torch.full((slots, self.room), pad, **self.long)
        self.out_logp = torch.zeros(slots, self.room, device=device)
        self.out_version = torch.zeros(slots, self.room, **self.long)
        # Each row's stream keys (SAMPLE, DRAFT, COIN, FINAL), hashed from its request's
        # seed once at refill rather than at every draw.
        self.keys = torch.zeros(slots, FINAL + 1, **self.long)
        self.budgets = torch.zeros(slots, **self.long)
        self.counters = torch.zeros(slots, **self.long)  # tokens recorded per row
        #: holds an unfinished sequence
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)
        self.last = torch.full((slots,), pad, **self.long)  # each row's newest token, not fed
        self.queue = deque(range(len(self.requests)))
        self.owner: list[int | None] = [None] * slots
        self.drawn = [0] * slots  # an upper bound of each row's tokens, known to the host
        self.results: list[Generated | None] = [None] * len(self.requests)
        self.forwards = torch.zeros((), **self.long)  # live rows fed to forwards
        self.plain_steps = 0
        self.recorder = routes
        self.routes = None if routes is None else SlotRoutes(routes, slots, self.room, device)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> list[Generated]:
        if not self.requests:
            return []
        recording = self.recorder.recording() if self.recorder else contextlib.nullcontext()
        with recording:
            return self._run()

    def _run(self) -> list[Generated]:
        current = self.version()
        self.refill(current)
        still: list[bool] | None = None  # each row's liveness, when the host knows it
        while True:
            if still is None and self.stops and self.plain_steps % self.check_every == 0:
                still = self.live.tolist()
            self.harvest(self.finished_rows(still))
            done = not self.queue and all(o is None for o in self.owner)
            if self.all_done is not None:
                done = self.all_done(done)
            if done:
                break
            if self.between_steps is not None:
                self.between_steps()
            previous, current = current, self.version()
            if current != previous:
                self.stats.versions_applied.append(current)
            self.refill(current)
            still = self.strategy.step(self, current)
            self.stats.steps += 1
            self.stats.row_steps += self.slots
        self.stats.useful_forwards += int(self.forwards)
        return self.results

    def finished_rows(self, still: list[bool] | None) -> list[int]:
        """The rows whose sequence is done: its budget drawn, or (when the host knows
        each row's liveness, `still`) its eos sampled."""
        return [
            slot
            for slot, owner in enumerate(self.owner)
            if owner is not None
            and (
                self.drawn[slot] >= self.requests[owner].max_new_tokens
                or (still is not None and not still[slot])
            )
        ]

    def refill(self, current: int) -> None:
        """Fills every free slot it can; a sequence its first token ends is harvested at
        once and its slot filled again (no forward is spent on it)."""
        while self._fill_free(current):
            pass

    def _fill_free(self, current: int) -> bool:
        """Fills the free slots; whether a sequence ended at its first token."""
        free = [s for s in range(self.slots) if self.owner[s] is None][: len(self.queue)]
        if not free:
            return False
        taken = [self.queue.popleft() for _ in free]
        requests = [self.requests[i] for i in taken]
        if self.routes is not None:
            self.routes.before_forward()
        logits = self.decoder.fill(free, [r.prompt_ids for r in requests])
        if self.routes is not None:
            self.routes.filled(free, [r.prompt_ids for r in requests], *self.decoder.filled)
        self.stats.prefills += 1
        self.stats.useful_forwards += len(free)
        index = torch.tensor(free, **self.long)
        seeds = torch.tensor([r.seed for r in requests], **self.long)
        keys = torch.stack([stream_keys(seeds, s) for s in range(FINAL + 1)], 1)
        self.keys.index_copy_(0, index, keys)
        budgets = torch.tensor([r.max_new_tokens for r in requests], **self.long)
        self.budgets.index_copy_(0, index, budgets)
        zero = torch.zeros(len(free), **self.long)
        first, first_logp = sample_per_request(logits, self.sampling, keys[:, SAMPLE], zero)
        self.out_tokens[index, 0] = first
        self.out_logp[index, 0] = first_logp.to(self.out_logp.dtype)
        self.out_version[index, 0] = current
        self.counters.index_fill_(0, index, 1)
        # A sequence its first token ends (eos, a budget of 1) is never fed.
        done = budgets <= 1
        if self.stops:
            done |= first == self.eos
        self.live.index_copy_(0, index, ~done)
        self.last.index_copy_(0, index, first)
        for slot, request in zip(free, taken, strict=True):
            self.owner[slot], self.drawn[slot] = request, 1
        self.strategy.started(free)
        # Which first tokens were eos only the device knows (a read); budgets the host does.
        over = done.tolist() if self.stops else [r.max_new_tokens <= 1 for r in requests]
        ended = [slot for slot, end in zip(free, over, strict=True) if end]
        self.harvest(ended)
        return bool(ended)

    def harvest(self, finished: list[int]) -> None:
        """Collects the sequences of the `finished` rows and frees the rows. Their counts,
        tokens, versions and log-probs come to the host in one copy (each read from a
        GPU waits for it: one per harvest, not four per sequence); float64 holds each
        exactly (ids and versions are integers below 2^53, the log-probs float32)."""
        if not finished:
            return
        index = torch.tensor(finished, **self.long)
        parts = (self.counters[:, None], self.out_tokens, self.out_version, self.out_logp)
        rows = torch.cat([p.index_select(0, index).double() for p in parts], 1).tolist()
        room = self.room
        routes = None
        if self.routes is not None:
            routes = self.routes.harvest(finished, [int(row[0]) for row in rows])
        for i, (slot, row) in enumerate(zip(finished, rows, strict=True)):
            n = int(row[0])
            tokens, versions = row[1 : 1 + room], row[1 + room : 1 + 2 * room]
            self.results[self.owner[slot]] = Generated(
                token_ids=[int(t) for t in tokens[:n]],
                logprobs=row[1 + 2 * room :][:n],
                versions=[int(v) for v in versions[:n]],
                routes=None if routes is None else routes[i],
            )
            self.stats.tokens += n
            self.strategy.finished(slot, self.decoder)
            self.owner[slot] = None
            self.decoder.release(slot)
        self.live.index_fill_(0, index, False)

    def _record(self, columns: torch.Tensor, tokens, logp, current: int) -> None:
        self.out_tokens.scatter_(1, columns, tokens)
        self.out_logp.scatter_(1, columns, logp.to(self.out_logp.dtype))
        self.out_version.scatter_(1, columns, torch.full_like(columns, current))

    # -- what a step strategy reads and asks (stepping.SlotSteps) ------------------------------

    def occupied(self) -> list[bool]:
        return [owner is not None for owner in self.owner]

    def active(self) -> int:
        return sum(owner is not None for owner in self.owner)

    def fed(self) -> torch.Tensor:
        return torch.where(self.live, self.last, self.pad)

    def pending(self) -> torch.Tensor:
        return self.last

    def uniforms(self, stream: int, offsets: torch.Tensor) -> torch.Tensor:
        return draw(self.keys[:, stream, None], self.counters[:, None] + offsets)

    def plain_step(self, current: int) -> None:
        if self.routes is not None:
            self.routes.before_step()
        logits = self.decoder.step(self.fed())
        if self.routes is not None:  # the fed token is each live row's newest, not counted
            self.routes.stepped((self.counters - 1).clamp_min(0), self.live)
        sample = step_sampler(getattr(self.decoder, "compiled", False))  # compiled with the step
        chosen, chosen_logp = sample(logits, self.sampling, self.keys[:, SAMPLE], self.counters)
        # A finished row's column is past its count: what lands there is never read.
        self._record(self.counters[:, None], chosen[:, None], chosen_logp[:, None], current)
        self.forwards.add_(self.live.sum())
        self.counters.add_(self.live.long())
        self.last.copy_(torch.where(self.live, chosen, self.last))
        if self.stops:
            self.live.logical_and_(chosen != self.eos)
        self.plain_steps += 1
        for slot in range(self.slots):
            self.drawn[slot] += self.owner[slot] is not None

    def keep(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        emitted: torch.Tensor,
        current: int,
        counts: torch.Tensor,
    ) -> Kept:
        live = self.live
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        # Kept: emitted, within the budget, not past an eos; a prefix of a sample of the
        # target's sequence distribution is a sample of that prefix's.
        kept_mask = (
            (offsets < emitted[:, None])
            & (offsets < (self.budgets - self.counters)[:, None])
            & live[:, None]
        )
        new_live = live.clone()
        if self.stops:
            ends = (tokens == self.eos) & kept_mask
            kept_mask &= (ends.long().cumsum(1) - ends.long()) == 0
            new_live &= ~(ends & kept_mask).any(1)
        kept = kept_mask.sum(1)
        self._record(self.counters[:, None] + offsets, tokens.clamp_min(0), logprobs, current)
        new_counters = self.counters + kept
        # What the host needs of this step, read in one copy (a sync on a GPU): each
        # row's kept tokens, count and liveness, and the counted sum.
        summed = torch.stack([(counts * live).sum(), live.sum()])
        host = torch.cat([kept, new_counters, new_live.long(), summed]).tolist()
        slots = self.slots
        kept_host, counts_host = host[:slots], host[slots : 2 * slots]
        live_host, (counted, rows) = host[2 * slots : 3 * slots], host[3 * slots :]
        self.decoder.commit(kept, kept_host)
        self.forwards.add_(live.sum())
        index = torch.arange(slots, device=tokens.device)
        newest = tokens[index, (kept - 1).clamp_min(0)]
        self.last.copy_(torch.where(kept > 0, newest, self.last))
        self.counters.copy_(new_counters)
        self.live.copy_(new_live)
        for slot in range(slots):
            if self.owner[slot] is not None:
                self.drawn[slot] = counts_host[slot]
        return Kept(
            per_row=kept_host, live=[bool(x) for x in live_host], counted=counted, rows=rows
        )
