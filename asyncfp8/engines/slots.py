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

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from asyncfp8.speculative.acceptance import accept

from .base import SamplingParams
from .decode import LAYER_KINDS, StaticDecoder, forward_static, processed_logprobs
from .kv_cache import StaticKVCache
from .request_sampling import COIN, DRAFT, FINAL, SAMPLE, draw, sample_per_request, stream_keys

if TYPE_CHECKING:
    from asyncfp8.speculative.slots import SlotSpeculation


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
    dtype). `record_hidden`: every forward also keeps the target's last hidden states
    (the LM head's input), per row and position, in `hidden_states` with the token fed
    there in `fed_tokens`: what a speculative drafter reads and trains on."""

    def __init__(
        self,
        model: torch.nn.Module,
        slots: int,
        max_tokens: int,
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        record_hidden: bool = False,
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
        self.record_hidden = record_hidden
        if record_hidden:
            size = config.hidden_size
            dtype = model.get_input_embeddings().weight.dtype
            self.hidden_states = torch.zeros(
                slots, max_tokens, size, dtype=dtype, device=self.device
            )
            self.fed_tokens = torch.zeros(slots, max_tokens, **long)

    @torch.no_grad()
    def fill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Starts sequence `prompts[i]` in row `slots[i]` (identical prompts prefilled
        once): returns the logits of each one's first new token [len(slots), V]. With
        `record_hidden`, the prompts' hidden states and tokens are recorded at their
        positions (left padded to the longest)."""
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
        prefill.keep_hidden = self.record_hidden
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
        if self.record_hidden:
            hidden = prefill.hidden.index_select(0, source)
            self.hidden_states[target, :width] = hidden.to(self.hidden_states.dtype)
            self.fed_tokens[target, :width] = input_ids.to(self.device).index_select(0, source)
        return logits.index_select(0, source)

    def release(self, slot: int) -> None:
        """Row `slot` holds no sequence: its position stops advancing until it is filled."""
        self.advance[slot] = False
        self.advancing[slot] = False

    def sequence(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """With `record_hidden`: row `slot`'s real positions so far, (hidden states [T, H],
        tokens [T]), prompt padding and rejected drafts left out."""
        end = self.lengths[slot]
        real = self.kv_valid[slot, :end].nonzero().squeeze(1)  # the one read of the device
        return self.hidden_states[slot].index_select(0, real), self.fed_tokens[slot][real]

    def _run(self, tokens, positions, mask, keep: int, where: torch.Tensor) -> torch.Tensor:
        """The forward of tokens [slots, T] written at cache positions `where` [slots, T]
        (the hidden states are recorded there too)."""
        hidden, logits = forward_static(
            self.model, self.cache, self.kinds, tokens, mask, positions, keep, self.record_hidden
        )
        if self.record_hidden:
            self.hidden_states[self.rows[:, None], where] = hidden.to(self.hidden_states.dtype)
            self.fed_tokens[self.rows[:, None], where] = tokens
        return logits

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
        logits = self._run(
            self.tokens[:, None],
            self.positions[:, None],
            self.kv_valid[:, None, None, :visible],
            keep=1,
            where=self.write_pos[:, None],
        )
        step = self.advance.long()
        self.write_pos.add_(step)
        self.positions.add_(step)
        for slot in range(self.slots):
            self.lengths[slot] += self.advancing[slot]
        return logits[:, -1]

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """A speculative verify step: appends the T tokens of row i (tokens [slots, T]: the
        last sampled token, then the drafts) at its next T positions, each attending to
        the row and to the tokens before it; returns the logits after each [slots, T, V].
        Nothing advances until `commit` says how many of them each row keeps."""
        width = tokens.shape[1]
        for slot in range(self.slots):
            if self.advancing[slot] and self.lengths[slot] + width > self.max_tokens:
                raise ValueError(
                    f"slot {slot} has no room for {width} more positions in "
                    f"{self.max_tokens} (a budget longer than the decoder was sized for)"
                )
        offsets = torch.arange(width, device=self.device)
        # Idle rows write at their start: nothing reads them until a fill resets them.
        base = torch.where(self.advance, self.write_pos, 0)
        where = base[:, None] + offsets
        visible = (
            max(length for length, on in zip(self.lengths, self.advancing, strict=True) if on)
            + width
        )
        self.kv_valid[self.rows[:, None], where] = self.advance[:, None]
        keys = torch.arange(visible, device=self.device)
        mask = self.kv_valid[:, None, :visible] & (keys[None, None, :] <= where[:, :, None])
        self.cache.write_rows(where, visible)
        self.cache.kv_len = None
        logits = self._run(tokens, self.positions[:, None] + offsets, mask[:, None], width, where)
        self._verified = (where, width)
        return logits

    def commit(self, kept: torch.Tensor, kept_host: Sequence[int]) -> None:
        """After `verify`: row i keeps its first kept[i] positions (the last token and the
        drafts accepted before it), the rest become holes that the next step overwrites.
        `kept_host` is the host's copy of `kept`."""
        where, width = self._verified
        offsets = torch.arange(width, device=self.device)
        self.kv_valid[self.rows[:, None], where] &= offsets[None, :] < kept[:, None]
        self.write_pos.add_(kept)
        self.positions.add_(kept)
        for slot in range(self.slots):
            self.lengths[slot] += int(kept_host[slot])


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
    speculation: SlotSpeculation | None = None,
) -> list[Generated]:
    """Generates every request through the decoder's slots, refilling a slot as soon as
    its sequence ends; returns one `Generated` per request, in order.

    A sequence ends at `eos` (unless `sampling.ignore_eos`) or at its `max_new_tokens`.
    Whether a row sampled eos is asked every `check_every` plain steps (a device sync;
    a speculative step always knows); a finished row idles until then, recording
    nothing, and its sample is the same. `between_steps` runs before each forward;
    `version()` is read after it: that version's forward (and any prefill then) produces
    the next logits, and the tokens sampled from them carry it.

    `speculation` (a `SlotSpeculation`, built with a decoder that records hidden states)
    chooses per step between a plain step and drafting k tokens verified by one forward;
    accepted tokens follow the target's processed distribution exactly and carry its
    log-probabilities (`asyncfp8.speculative.acceptance`)."""
    if not requests:
        return []
    if speculation is not None and not decoder.record_hidden:
        raise ValueError("speculation needs a SlotDecoder built with record_hidden=True")
    stats = stats if stats is not None else SlotStats()
    slots, device = decoder.slots, decoder.device
    longest = max(r.max_new_tokens for r in requests)
    # Room past the longest budget for the drafts a verify step writes beyond a row's end.
    room = longest + (speculation.max_k + 1 if speculation is not None else 1)
    long = dict(dtype=torch.long, device=device)
    out_tokens = torch.full((slots, room), pad, **long)
    out_logp = torch.zeros(slots, room, device=device)
    out_version = torch.zeros(slots, room, **long)
    # Each row's stream keys (SAMPLE, DRAFT, COIN, FINAL), hashed from its request's seed
    # once at refill rather than at every draw.
    keys = torch.zeros(slots, FINAL + 1, **long)
    budgets = torch.zeros(slots, **long)
    counters = torch.zeros(slots, **long)  # tokens recorded per row
    live = torch.zeros(slots, dtype=torch.bool, device=device)  # holds an unfinished sequence
    last = torch.full((slots,), pad, **long)  # each row's newest token, not yet fed
    stops = not sampling.ignore_eos
    greedy = sampling.temperature == 0
    queue = deque(range(len(requests)))
    owner: list[int | None] = [None] * slots
    drawn = [0] * slots  # an upper bound of each row's tokens, known to the host
    results: list[Generated | None] = [None] * len(requests)
    forwards = torch.zeros((), **long)  # live rows fed to forwards
    plain_steps = 0

    def record(columns: torch.Tensor, tokens, logp, current: int) -> None:
        out_tokens.scatter_(1, columns, tokens)
        out_logp.scatter_(1, columns, logp.to(out_logp.dtype))
        out_version.scatter_(1, columns, torch.full_like(columns, current))

    def refill(current: int) -> None:
        """Fills every free slot it can; a sequence its first token ends is harvested at
        once and its slot filled again (no forward is spent on it)."""
        while fill_free(current):
            pass

    def fill_free(current: int) -> bool:
        """Fills the free slots; whether a sequence ended at its first token."""
        free = [s for s in range(slots) if owner[s] is None][: len(queue)]
        if not free:
            return False
        taken = [queue.popleft() for _ in free]
        logits = decoder.fill(free, [requests[i].prompt_ids for i in taken])
        stats.prefills += 1
        stats.useful_forwards += len(free)
        index = torch.tensor(free, **long)
        new_seeds = torch.tensor([requests[i].seed for i in taken], **long)
        new_keys = torch.stack([stream_keys(new_seeds, s) for s in range(FINAL + 1)], 1)
        keys.index_copy_(0, index, new_keys)
        budgets.index_copy_(
            0, index, torch.tensor([requests[i].max_new_tokens for i in taken], **long)
        )
        zero = torch.zeros(len(free), **long)
        first, first_logp = sample_per_request(logits, sampling, new_keys[:, SAMPLE], zero)
        out_tokens[index, 0] = first
        out_logp[index, 0] = first_logp.to(out_logp.dtype)
        out_version[index, 0] = current
        counters.index_fill_(0, index, 1)
        # A sequence its first token ends (eos, a budget of 1) is never fed.
        done = budgets.index_select(0, index) <= 1
        if stops:
            done |= first == eos
        live.index_copy_(0, index, ~done)
        last.index_copy_(0, index, first)
        for slot, request in zip(free, taken, strict=True):
            owner[slot], drawn[slot] = request, 1
        if speculation is not None:
            speculation.start_rows(free)
        # Which first tokens were eos only the device knows (a read); budgets the host does.
        over = done.tolist() if stops else [requests[i].max_new_tokens <= 1 for i in taken]
        ended = [slot for slot, end in zip(free, over, strict=True) if end]
        harvest(ended)
        return bool(ended)

    def harvest(finished: list[int]) -> None:
        """Collects the sequences of the `finished` rows and frees the rows. Their counts,
        tokens, versions and log-probs come to the host in one copy (each read from a
        GPU waits for it: one per harvest, not four per sequence); float64 holds each
        exactly (ids and versions are integers below 2^53, the log-probs float32)."""
        if not finished:
            return
        index = torch.tensor(finished, **long)
        parts = (counters[:, None], out_tokens, out_version, out_logp)
        rows = torch.cat([p.index_select(0, index).double() for p in parts], 1).tolist()
        for slot, row in zip(finished, rows, strict=True):
            n = int(row[0])
            tokens, versions, logps = (
                row[1 : 1 + room],
                row[1 + room : 1 + 2 * room],
                row[1 + 2 * room :],
            )
            results[owner[slot]] = Generated(
                token_ids=[int(t) for t in tokens[:n]],
                logprobs=logps[:n],
                versions=[int(v) for v in versions[:n]],
            )
            stats.tokens += n
            if speculation is not None:
                speculation.observe(*decoder.sequence(slot))
            owner[slot] = None
            decoder.release(slot)
        live.index_fill_(0, index, False)

    def plain_step(current: int) -> None:
        nonlocal plain_steps
        fed = torch.where(live, last, pad)
        logits = decoder.step(fed)
        chosen, chosen_logp = sample_per_request(logits, sampling, keys[:, SAMPLE], counters)
        # A finished row's column is past its count: what lands there is never read.
        record(counters[:, None], chosen[:, None], chosen_logp[:, None], current)
        forwards.add_(live.sum())
        counters.add_(live.long())
        last.copy_(torch.where(live, chosen, last))
        if stops:
            live.logical_and_(chosen != eos)
        plain_steps += 1
        for slot in range(slots):
            drawn[slot] += owner[slot] is not None

    def speculative_step(k: int, current: int) -> tuple[list[bool], int]:
        """One draft-and-verify step: (each row's liveness after it, tokens it kept)."""
        offsets = torch.arange(k + 1, device=device)
        positions = counters[:, None] + offsets
        # The k drafts' uniforms in one draw, as k draws of counters + i would give them.
        draft_u = None if greedy else draw(keys[:, DRAFT, None], positions[:, :k])
        drafts, draft_logp = speculation.draft(
            k, sampling, lambda i: draft_u[:, i], decoder, last, [o is not None for o in owner]
        )
        fed = torch.where(live, last, pad)
        logits = decoder.verify(torch.cat([fed[:, None], drafts], 1))
        target_logp = processed_logprobs(logits, sampling)
        result = accept(
            target_logp,
            draft_logp,
            drafts,
            greedy=greedy,
            uniforms=None
            if greedy
            else (
                draw(keys[:, COIN, None], positions[:, :k]),
                draw(keys[:, FINAL, None], positions),
            ),
        )
        # Kept: emitted, within the budget, not past an eos; a prefix of a sample of the
        # target's sequence distribution is a sample of that prefix's.
        kept_mask = (
            (offsets < result.num_emitted[:, None])
            & (offsets < (budgets - counters)[:, None])
            & live[:, None]
        )
        if stops:
            ends = (result.tokens == eos) & kept_mask
            kept_mask &= (ends.long().cumsum(1) - ends.long()) == 0
            ended = (ends & kept_mask).any(1)
        kept = kept_mask.sum(1)
        record(positions, result.tokens.clamp_min(0), result.logprobs, current)
        new_counters = counters + kept
        new_live = live & ~ended if stops else live.clone()
        # What the host needs of this step, read in one copy (a sync on a GPU): each
        # row's kept tokens, count and liveness, and the acceptance counts.
        accepted = torch.stack([(result.num_accepted * live).sum(), live.sum()])
        host = torch.cat([kept, new_counters, new_live.long(), accepted]).tolist()
        kept_host, counts_host = host[:slots], host[slots : 2 * slots]
        live_host, (accepted_host, rows_host) = host[2 * slots : 3 * slots], host[3 * slots :]
        decoder.commit(kept, kept_host)
        speculation.record(accepted_host, rows_host, k)
        forwards.add_(live.sum())
        rows = torch.arange(slots, device=device)
        last.copy_(torch.where(kept > 0, result.tokens[rows, (kept - 1).clamp_min(0)], last))
        counters.copy_(new_counters)
        live.copy_(new_live)
        for slot in range(slots):
            if owner[slot] is not None:
                drawn[slot] = counts_host[slot]
        return [bool(x) for x in live_host], sum(kept_host)

    current = version()
    refill(current)
    still: list[bool] | None = None  # each row's liveness, when the host knows it
    while True:
        if still is None and stops and plain_steps % check_every == 0:
            still = live.tolist()
        harvest(
            [
                slot
                for slot in range(slots)
                if owner[slot] is not None
                and (
                    drawn[slot] >= requests[owner[slot]].max_new_tokens
                    or (still is not None and not still[slot])
                )
            ]
        )
        if not queue and all(o is None for o in owner):
            break
        if between_steps is not None:
            between_steps()
        previous, current = current, version()
        if current != previous:
            stats.versions_applied.append(current)
        refill(current)
        active = sum(o is not None for o in owner)
        k = speculation.choose(active) if speculation is not None else 0
        started = time.perf_counter()
        if k:
            still, produced = speculative_step(k, current)
            speculation.report(active, k, produced, time.perf_counter() - started)
        else:
            plain_step(current)
            still = None
            if speculation is not None:
                speculation.report(active, 0, active, time.perf_counter() - started)
        stats.steps += 1
        stats.row_steps += slots
    stats.useful_forwards += int(forwards)
    return results
