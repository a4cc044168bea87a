"""A minimal reference decode loop, with or without speculation: plain transformers forwards
over a DynamicCache, batched, to check the speculative pieces end to end and count target
forwards per token; not a rollout engine. Rejected drafts stay in the cache as holes that
the 2D mask hides, and position ids count only real tokens, so the target computes what it
would over each row's real sequence. `Rollout` records what `DrafterTrainer.observe` takes."""

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
    decoding = _Decoding(model, sampling, drafter, k, eos_token_id, generator)
    decoding.prefill(prompts, pad_token_id)
    while not bool(decoding.finished.all()):
        decoding.step()
    return decoding.rollout()


class _Decoding:
    """One `generate` call: the target's cache and what was fed to it (ids, hidden states,
    real positions), the tokens kept per row, and the drafter's cache when speculating."""

    def __init__(self, model, sampling, drafter, k, eos_token_id, generator):
        self.model, self.sampling, self.generator = model, sampling, generator
        self.drafter, self.k, self.eos_token_id = drafter, k, eos_token_id
        self.greedy = sampling.temperature == 0
        self.cache = DynamicCache()

    def sample(self, logp: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            return logp.argmax(-1)
        return torch.multinomial(logp.exp(), 1, generator=self.generator)[:, 0]

    def done(self, row: int) -> bool:
        tokens = self.tokens[row]
        ended = not self.sampling.ignore_eos and tokens[-1] == self.eos_token_id
        return ended or len(tokens) >= self.sampling.max_new_tokens

    def prefill(self, prompts: Sequence[Sequence[int]], pad_token_id: int) -> None:
        """The prompts' forward, each row's first token, and the drafter fed the prompts."""
        self.batch = len(prompts)
        ids, mask = _left_padded(prompts, pad_token_id)
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        hidden, logits = target_forward(self.model, ids, mask.long(), positions, self.cache)
        self.fed_ids, self.fed_hidden, self.fed_mask = [ids], [hidden], [mask]
        self.next_position = mask.sum(-1)
        logp = processed_logprobs(logits[:, -1], self.sampling)
        self.last = self.sample(logp)
        self.tokens = [[int(t)] for t in self.last]
        self.logprobs = [[float(v)] for v in logp.gather(-1, self.last[:, None])[:, 0]]
        self.stats = {"target_forwards": 1, "sequence_forwards": self.batch, "verify_steps": 0}
        self.stats |= {"drafted": 0, "accepted": 0}
        self.finished = torch.tensor([self.done(row) for row in range(self.batch)])
        if self.drafter is not None:
            self.drafter_cache = self.drafter.new_cache(self.batch)
            following = torch.cat([ids[:, 1:], self.last[:, None]], 1)  # the token after each
            self.drafter.extend(self.drafter_cache, hidden, following, mask)

    def step(self) -> None:
        """One target forward for every row: the last token, and the drafts when drafting."""
        active = ~self.finished
        if self.drafter is None:
            inputs = self.last[:, None]
        else:
            drafts, logq = self.drafter.draft(
                self.drafter_cache, self.k, self.sampling, self.generator
            )
            inputs = torch.cat([self.last[:, None], drafts], 1)
        width = inputs.shape[1]
        step_positions = self.next_position[:, None] + torch.arange(width)
        # Tentatively every new position of an active row is real (the drafts must see
        # each other); the rejected ones become holes below.
        tentative = active[:, None].expand(-1, width)
        attention = torch.cat([*self.fed_mask, tentative], 1).long()
        hidden, logits = target_forward(self.model, inputs, attention, step_positions, self.cache)
        self.stats["target_forwards"] += 1
        self.stats["sequence_forwards"] += int(active.sum())
        logp = processed_logprobs(logits, self.sampling)
        if self.drafter is None:
            emitted = self.sample(logp[:, 0])[:, None]
            emitted_logp = logp[:, 0].gather(-1, emitted)
            counts = torch.ones(self.batch, dtype=torch.long)
        else:
            emitted, emitted_logp, counts = self.accept(logp, logq, drafts, active)
        counts = _keep_emitted(
            self.tokens, self.logprobs, emitted, emitted_logp, counts, active, self.done
        )
        self.record(inputs, hidden, emitted, counts, active)

    def accept(self, logp, logq, drafts, active):
        """The verify step's emitted tokens, their log-probs and counts (`accept`)."""
        result = accept(logp, logq, drafts, greedy=self.greedy, generator=self.generator)
        self.stats["verify_steps"] += int(active.sum())
        self.stats["drafted"] += self.k * int(active.sum())
        self.stats["accepted"] += int(result.num_accepted[active].sum())
        return result.tokens, result.logprobs, result.num_emitted

    def record(self, inputs, hidden, emitted, counts, active) -> None:
        """Keeps what a step fed, marks its real positions and advances every row."""
        # Input j of a row is real when it is the last token (j = 0) or a draft that was
        # accepted and kept: j < the number of tokens kept.
        real = torch.arange(inputs.shape[1])[None, :] < counts[:, None]
        self.fed_ids.append(inputs)
        self.fed_hidden.append(hidden)
        self.fed_mask.append(real)
        if self.drafter is not None:
            self.drafter.extend(self.drafter_cache, hidden, emitted.clamp_min(0), real)
        self.next_position = self.next_position + counts
        rows = torch.arange(self.batch)
        self.last = torch.where(active, emitted[rows, (counts - 1).clamp_min(0)], self.last)
        self.finished = torch.tensor([self.done(row) for row in range(self.batch)])

    def rollout(self) -> Rollout:
        return Rollout(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            input_ids=torch.cat(self.fed_ids, 1),
            hidden=torch.cat(self.fed_hidden, 1),
            mask=torch.cat(self.fed_mask, 1),
            **self.stats,
        )
