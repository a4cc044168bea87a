"""Continuous batching for the built-in engine: a fixed number of sequence slots over one
static KV cache, each refilled with the next request as soon as its sequence ends.

- `SlotDecoder`: the cache of `slots` rows × `max_tokens` positions; each row has its own
  write position, RoPE position and mask row, so the rows hold sequences of different
  lengths that started at different steps. `fill` prefills new prompts (once per distinct
  prompt) and copies their keys and values into the chosen rows, resetting those rows'
  masks and positions; `step` appends one token to every row. Shapes and addresses never
  change (idle rows compute and record nothing), the decode step takes only device
  tensors, so it is capturable as a CUDA graph like `StaticDecoder`'s (not captured yet:
  the slot step runs eagerly).
- `run_slots`: the scheduler loop. Each request draws its tokens from its own random
  stream (`request_sampling`), so its tokens do not depend on the slot, the batch or the
  order it runs in. Between two steps it calls `between_steps` (a worker applies the
  newest version there: in-flight updates); every token is tagged with the version whose
  forward produced its logits, and nothing sampled is recomputed (the KV cache written
  under the old version is kept).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .base import SamplingParams
from .decode import LAYER_KINDS, StaticDecoder
from .kv_cache import StaticKVCache
from .request_sampling import sample_per_request


@dataclass(frozen=True)
class Request:
    """One sequence to generate: its prompt, its own budget and its random stream's key
    (`request_sampling.request_seed`)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int


@dataclass
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class SlotStats:
    """What a `run_slots` call did: decode steps (one forward of every slot each), refill
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


class SlotDecoder:
    """`slots` sequences of at most `max_tokens` positions each (prompt + new tokens) of
    `model`, a transformers causal LM whose attention implementation is
    `decode.ATTENTION`. `kv_scales` as for `StaticDecoder` (None: a cache in the model
    dtype)."""

    def __init__(
        self,
        model: torch.nn.Module,
        slots: int,
        max_tokens: int,
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        if slots < 1 or max_tokens < 1:
            raise ValueError(f"need slots >= 1 and max_tokens >= 1, got {slots}, {max_tokens}")
        config = model.config
        self.model, self.kv_scales = model, kv_scales
        self.device = model.get_input_embeddings().weight.device
        self.cache = StaticKVCache.for_model(model, slots, max_tokens, kv_scales)
        self.slots, self.max_tokens = slots, max_tokens
        self.kinds = sorted(set(getattr(config, "layer_types", None) or LAYER_KINDS))
        long = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(slots, **long)
        self.positions = torch.zeros(slots, **long)  # RoPE position of each row's next token
        self.write_pos = torch.zeros(slots, **long)  # cache position it is written at
        #: rows whose position advances at the next step (idle rows rewrite one position)
        self.advance = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.kv_valid = torch.zeros(slots, max_tokens, dtype=torch.bool, device=self.device)
        self.rows = torch.arange(slots, device=self.device)
        self.advancing = [False] * slots  # the host's copy of `advance`
        #: the host's copy of each row's write position: a full row is refused, and an
        #: eager step reads only the positions some row has reached, without a sync
        self.lengths = [0] * slots

    @torch.no_grad()
    def fill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Starts sequence `prompts[i]` in row `slots[i]` (identical prompts prefilled
        once): returns the logits of each one's first new token [len(slots), V]."""
        if len(slots) != len(prompts) or len(set(slots)) != len(slots):
            raise ValueError(f"fill needs one prompt per distinct slot: {slots}, {len(prompts)}")
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompts]
        width = max(len(ids) for ids in distinct)
        if width >= self.max_tokens:
            raise ValueError(
                f"a prompt of {width} tokens leaves no room in {self.max_tokens} positions"
            )
        pad = 0  # masked out: any id will do
        input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in distinct])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in distinct])
        # The prompts' own small static decoder runs the prefill (the same code as the
        # static path); its rows are then copied into the slots' rows.
        prefill = StaticDecoder(self.model, len(distinct), width, self.kv_scales)
        logits = prefill.prefill(input_ids, mask, list(range(len(distinct))))
        target = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        source = torch.tensor(rows, dtype=torch.long, device=self.device)
        for mine, theirs in zip(
            (*self.cache.keys, *self.cache.values),
            (*prefill.cache.keys, *prefill.cache.values),
            strict=True,
        ):
            mine_bytes = mine.view(torch.uint8) if self.cache.fp8 else mine
            theirs_bytes = theirs.view(torch.uint8) if self.cache.fp8 else theirs
            mine_bytes[target, :, :width] = theirs_bytes.index_select(0, source)
        valid = mask.to(self.device).bool().index_select(0, source)
        self.kv_valid[target] = False
        self.kv_valid[target, :width] = valid
        self.positions[target] = valid.long().sum(-1)
        self.write_pos[target] = width
        self.advance[target] = True
        for slot in slots:
            self.lengths[slot], self.advancing[slot] = width, True
        return logits.index_select(0, source)

    def release(self, slot: int) -> None:
        """Row `slot` holds no sequence: its position stops advancing until it is filled."""
        self.advance[slot] = False
        self.advancing[slot] = False

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Appends token i [slots] to row i (idle rows: anything, recorded nowhere);
        returns the logits of every row's next token [slots, V]."""
        for slot in range(self.slots):
            if self.lengths[slot] >= self.max_tokens:
                raise ValueError(
                    f"slot {slot} has filled its {self.max_tokens} positions (a budget "
                    "longer than the decoder was sized for)"
                )
        self.tokens.copy_(tokens)
        visible = max(self.lengths) + 1
        self.kv_valid[self.rows, self.write_pos] = True
        self.cache.write_rows(self.write_pos, visible)
        self.cache.kv_len = self.write_pos + 1
        out = self.model(
            input_ids=self.tokens[:, None],
            attention_mask=dict.fromkeys(self.kinds, self.kv_valid[:, None, None, :visible]),
            position_ids=self.positions[:, None],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
            static_cache=self.cache,
        )
        step = self.advance.long()
        self.write_pos.add_(step)
        self.positions.add_(step)
        for slot in range(self.slots):
            self.lengths[slot] += self.advancing[slot]
        return out.logits[:, -1]


def run_slots(
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
) -> list[Generated]:
    """Generates every request through the decoder's slots, refilling a slot as soon as
    its sequence ends; returns one `Generated` per request, in order.

    A sequence ends at `eos` (unless `sampling.ignore_eos`) or at its `max_new_tokens`.
    Whether a row sampled eos is asked every `check_every` steps (a device sync); a
    finished row idles until then, recording nothing, and its sample is the same.
    `between_steps` runs after each step's tokens are recorded and before the next
    forward; `version()` is read after it: that version's forward (and any prefill
    then) produces the next step's logits, and the tokens sampled from them carry it."""
    if not requests:
        return []
    stats = stats if stats is not None else SlotStats()
    slots, device = decoder.slots, decoder.device
    longest = max(r.max_new_tokens for r in requests)
    out_tokens = torch.full((slots, longest), pad, dtype=torch.long, device=device)
    out_logp = torch.zeros(slots, longest, device=device)
    seeds = torch.zeros(slots, dtype=torch.long, device=device)
    counters = torch.zeros(slots, dtype=torch.long, device=device)  # tokens recorded per row
    live = torch.zeros(slots, dtype=torch.bool, device=device)  # holds an unfinished sequence
    stops = not sampling.ignore_eos
    queue = deque(range(len(requests)))
    owner: list[int | None] = [None] * slots
    drawn = [0] * slots  # steps each row has sampled for its request (>= its tokens)
    started = [0] * slots  # the step of each row's first token
    step_versions: list[int] = []  # the version that produced each step's logits
    results: list[Generated | None] = [None] * len(requests)
    logits: torch.Tensor | None = None
    forwards = torch.zeros((), dtype=torch.long, device=device)  # live rows fed to steps

    def refill() -> None:
        nonlocal logits
        free = [s for s in range(slots) if owner[s] is None][: len(queue)]
        if not free:
            return
        taken = [queue.popleft() for _ in free]
        fresh = decoder.fill(free, [requests[i].prompt_ids for i in taken])
        stats.prefills += 1
        stats.useful_forwards += len(free)
        if logits is None:
            logits = torch.zeros(slots, fresh.shape[-1], dtype=fresh.dtype, device=device)
        index = torch.tensor(free, dtype=torch.long, device=device)
        logits.index_copy_(0, index, fresh.to(logits.dtype))
        seeds.index_copy_(0, index, torch.tensor([requests[i].seed for i in taken], device=device))
        counters.index_fill_(0, index, 0)
        live.index_fill_(0, index, True)
        out_tokens.index_fill_(0, index, pad)
        out_logp.index_fill_(0, index, 0.0)
        for slot, request in zip(free, taken, strict=True):
            owner[slot], drawn[slot], started[slot] = request, 0, len(step_versions)

    def harvest(slot: int) -> None:
        request = owner[slot]
        n = int(counters[slot])
        results[request] = Generated(
            token_ids=out_tokens[slot, :n].tolist(),
            logprobs=out_logp[slot, :n].tolist(),
            versions=step_versions[started[slot] : started[slot] + n],
        )
        stats.tokens += n
        owner[slot] = None
        live[slot] = False
        decoder.release(slot)

    refill()
    logits_version = version()  # the version whose forward produced `logits`
    while True:
        step_versions.append(logits_version)
        chosen, chosen_logp = sample_per_request(logits, sampling, seeds, counters)
        column = counters.clamp_max(longest - 1)[:, None]
        kept_tokens = torch.where(live, chosen, out_tokens.gather(1, column)[:, 0])
        kept_logp = torch.where(live, chosen_logp, out_logp.gather(1, column)[:, 0])
        out_tokens.scatter_(1, column, kept_tokens[:, None])
        out_logp.scatter_(1, column, kept_logp[:, None])
        counters.add_(live.long())
        if stops:
            live &= chosen != eos
        checking = stops and (len(step_versions) % check_every == 0)
        still = live.tolist() if checking else None
        for slot in range(slots):
            if owner[slot] is None:
                continue
            drawn[slot] += 1
            budget = requests[owner[slot]].max_new_tokens
            if drawn[slot] >= budget or (still is not None and not still[slot]):
                harvest(slot)
        if not queue and all(o is None for o in owner):
            break
        if between_steps is not None:
            between_steps()
        logits_version = version()
        if logits_version != step_versions[-1]:
            stats.versions_applied.append(logits_version)
        # The next step's logits: one forward of every row, then the prefills of freed
        # rows (which overwrite those rows' logits), all under `logits_version`.
        if any(o is not None for o in owner):  # else every row is refilled: no step needed
            fed = torch.where(live, chosen, torch.full_like(chosen, pad))
            forwards += live.sum()
            logits = decoder.step(fed)
            stats.steps += 1
            stats.row_steps += slots
        refill()
    stats.useful_forwards += int(forwards)
    return results
