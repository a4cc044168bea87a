"""A minimal reference decode loop, with or without speculation: plain transformers
forwards over a DynamicCache, batched. It exists to check the speculative pieces end to
end and to measure target forwards per generated token before the torch engine's own
decode loop takes them over; it is not a rollout engine (no precision policy, no slots).

Rows accept different numbers of drafts, but a DynamicCache grows by the same number of
positions for every row: rejected drafts stay in the cache as holes, masked out of every
later attention by the 2D attention mask, and each row's position ids count only its
real tokens, so the target computes exactly what it would over the row's real sequence.

The loop records, for every position fed to the target, the token, the target's last
hidden state and whether the position is real (`Rollout.input_ids`, `.hidden`, `.mask`):
what `DrafterTrainer.observe` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.decode import processed_logprobs
from asyncfp8.engines.speculative.acceptance import accept
from asyncfp8.engines.speculative.drafter import Drafter


@dataclass
class Rollout:
    token_ids: list[list[int]]  # generated tokens per sequence
    logprobs: list[list[float]]  # the target's processed log-probs of them
    input_ids: torch.Tensor  # [B, L]: every position fed to the target, cache layout
    hidden: torch.Tensor  # [B, L, H]: the target's last hidden state there
    mask: torch.Tensor  # [B, L]: real positions (not padding, not rejected drafts)
    target_forwards: int  # batched target forward calls, prefill included
    sequence_forwards: int  # per row, the target forwards it was still generating in
    verify_steps: int = 0  # per row, as sequence_forwards, of the speculative steps
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens(self) -> int:
        return sum(map(len, self.token_ids))

    @property
    def forwards_per_token(self) -> float:
        """Target forwards per generated token, each sequence counted for itself (a
        static batch's stragglers do not inflate it): 1.0 without speculation."""
        return self.sequence_forwards / self.tokens

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify forward: accepted drafts + the target's own token."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


def target_forward(model, input_ids, attention_mask, position_ids, cache):
    """The target's last hidden states (the LM head's input) and float32 logits."""
    hidden = model.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    return hidden, model.lm_head(hidden).float()


def _left_padded(
    prompts: Sequence[Sequence[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch of ids, and where its tokens are real."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    return ids, mask


def _keep_emitted(
    tokens: list[list[int]],
    logprobs: list[list[float]],
    emitted: torch.Tensor,
    emitted_logp: torch.Tensor,
    counts: torch.Tensor,
    active: torch.Tensor,
    done: Callable[[int], bool],
) -> torch.Tensor:
    """Appends each active row's emitted tokens up to its budget and its first eos (a
    prefix of a sample is a sample of the prefix); the count each row kept (0: inactive)."""
    for row in torch.nonzero(active)[:, 0].tolist():
        kept = 0
        for j in range(int(counts[row])):
            tokens[row].append(int(emitted[row, j]))
            logprobs[row].append(float(emitted_logp[row, j]))
            kept += 1
            if done(row):
                break
        counts[row] = kept
    return torch.where(active, counts, 0)


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    *,
    drafter: Drafter | None = None,
    k: int = 4,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
) -> Rollout:
    """`sampling.max_new_tokens` tokens per prompt (fewer when eos ends a row and
    `sampling.ignore_eos` is off), by plain sampling or, with a drafter, by drafting k
    tokens and verifying them in one target forward per step (`accept`)."""
    if drafter is not None and k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    batch = len(prompts)
    greedy = sampling.temperature == 0
    ids, mask = _left_padded(prompts, pad_token_id)
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    hidden, logits = target_forward(model, ids, mask.long(), positions, cache)
    fed_ids, fed_hidden, fed_mask = [ids], [hidden], [mask]
    next_position = mask.sum(-1)

    def sample(logp):
        if greedy:
            return logp.argmax(-1)
        return torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]

    logp = processed_logprobs(logits[:, -1], sampling)
    last = sample(logp)
    tokens = [[int(t)] for t in last]
    logprobs = [[float(v)] for v in logp.gather(-1, last[:, None])[:, 0]]
    stats = {"target_forwards": 1, "sequence_forwards": batch, "verify_steps": 0}
    stats |= {"drafted": 0, "accepted": 0}

    def done(row: int) -> bool:
        ended = not sampling.ignore_eos and tokens[row][-1] == eos_token_id
        return ended or len(tokens[row]) >= sampling.max_new_tokens

    finished = torch.tensor([done(row) for row in range(batch)])
    if drafter is not None:
        drafter_cache = drafter.new_cache(batch)
        following = torch.cat([ids[:, 1:], last[:, None]], 1)  # the token after each position
        drafter.extend(drafter_cache, hidden, following, mask)

    while not bool(finished.all()):
        active = ~finished
        if drafter is None:
            inputs = last[:, None]
        else:
            drafts, logq = drafter.draft(drafter_cache, k, sampling, generator)
            inputs = torch.cat([last[:, None], drafts], 1)
        width = inputs.shape[1]
        step_positions = next_position[:, None] + torch.arange(width)
        # Tentatively every new position of an active row is real (the drafts must see
        # each other); the rejected ones become holes below.
        tentative = active[:, None].expand(-1, width)
        attention = torch.cat([*fed_mask, tentative], 1).long()
        hidden, logits = target_forward(model, inputs, attention, step_positions, cache)
        stats["target_forwards"] += 1
        stats["sequence_forwards"] += int(active.sum())
        logp = processed_logprobs(logits, sampling)
        if drafter is None:
            emitted = sample(logp[:, 0])[:, None]
            emitted_logp = logp[:, 0].gather(-1, emitted)
            counts = torch.ones(batch, dtype=torch.long)
        else:
            result = accept(logp, logq, drafts, greedy=greedy, generator=generator)
            emitted, emitted_logp, counts = result.tokens, result.logprobs, result.num_emitted
            stats["verify_steps"] += int(active.sum())
            stats["drafted"] += k * int(active.sum())
            stats["accepted"] += int(result.num_accepted[active].sum())
        counts = _keep_emitted(tokens, logprobs, emitted, emitted_logp, counts, active, done)
        # Input j of a row is real when it is the last token (j = 0) or a draft that was
        # accepted and kept: j < the number of tokens kept.
        real = torch.arange(width)[None, :] < counts[:, None]
        fed_ids.append(inputs)
        fed_hidden.append(hidden)
        fed_mask.append(real)
        if drafter is not None:
            drafter.extend(drafter_cache, hidden, emitted.clamp_min(0), real)
        next_position = next_position + counts
        rows = torch.arange(batch)
        last = torch.where(active, emitted[rows, (counts - 1).clamp_min(0)], last)
        finished = torch.tensor([done(row) for row in range(batch)])

    return Rollout(
        token_ids=tokens,
        logprobs=logprobs,
        input_ids=torch.cat(fed_ids, 1),
        hidden=torch.cat(fed_hidden, 1),
        mask=torch.cat(fed_mask, 1),
        **stats,
    )
