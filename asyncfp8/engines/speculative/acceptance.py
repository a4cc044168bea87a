"""Lossless acceptance of drafted tokens: the speculative-sampling rule (Leviathan et al.
2023; Chen et al. 2023), batched over sequences that accept different numbers of drafts.

For drafts d_1..d_k sampled from the drafter's processed distributions q_1..q_k, and the
target's processed distributions p_1..p_{k+1} from one verify forward (p_i conditions on
the drafts before d_i), draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i))
while every earlier one was; at the first rejection the token is drawn from the
normalized residual max(0, p_i − q_i); when all k are accepted a bonus token is drawn from
p_{k+1}. Every emitted token then follows the target's processed distribution exactly,
and the log-probabilities returned are the target's (the behaviour policy the learner's
corrections divide by), never the drafter's.

Greedy (temperature 0): drafts are accepted while they equal argmax p_i, and the token
after them is argmax p at that position, which is what greedy decoding without
speculation emits.

A caller may cut the emitted tokens short (at eos, or at `max_new_tokens`): a prefix of a
sample of the target's sequence distribution is a sample of that prefix's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncfp8.engines.request_sampling import inverse_cdf

PAD_TOKEN = -1


@dataclass
class AcceptanceResult:
    """One verify step for a batch of B sequences with k drafts each.

    tokens[b, :num_emitted[b]] are the emitted tokens (accepted drafts, then the resampled
    or bonus token); positions after that hold PAD_TOKEN. logprobs[b, j] is the target's
    processed log-probability of tokens[b, j] at its position (0.0 after num_emitted[b]).
    """

    tokens: torch.Tensor  # [B, k + 1] long
    logprobs: torch.Tensor  # [B, k + 1] float32
    num_accepted: torch.Tensor  # [B] long, in 0..k
    num_emitted: torch.Tensor  # [B] long, num_accepted + 1


def accept(
    target_logp: torch.Tensor,
    draft_logp: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    uniforms: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> AcceptanceResult:
    """target_logp [B, k+1, V]: the target's processed log-probs (`processed_logprobs`)
    after the last emitted token and after each draft; draft_logp [B, k, V]: the
    drafter's processed log-probs each draft was sampled from; draft_tokens [B, k].
    The acceptance coins and the resampled tokens are drawn from `generator` (seeded:
    the same inputs give the same result) or, given `uniforms` = (coins [B, k], finals
    [B, k+1]) in [0, 1), from those: draft i's coin, and the uniform that picks the
    final token when it lands at position j (the slot loop's per-request streams)."""
    if target_logp.dim() != 3 or draft_logp.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError(
            "need target_logp [B, k+1, V], draft_logp [B, k, V], draft_tokens [B, k]; got "
            f"{tuple(target_logp.shape)}, {tuple(draft_logp.shape)}, {tuple(draft_tokens.shape)}"
        )
    batch, k = draft_tokens.shape
    if tuple(draft_logp.shape[:2]) != (batch, k):
        raise ValueError(
            f"draft_logp is {tuple(draft_logp.shape)}, draft_tokens {tuple(draft_tokens.shape)}"
        )
    if tuple(target_logp.shape[:2]) != (batch, k + 1):
        raise ValueError(
            f"target_logp must hold k+1 = {k + 1} positions for {batch} sequences, got "
            f"{tuple(target_logp.shape[:2])}"
        )
    vocab = target_logp.shape[-1]
    if draft_logp.shape[-1] != vocab:
        raise ValueError(f"vocab sizes differ: target {vocab}, drafter {draft_logp.shape[-1]}")

    target_logp, draft_logp = target_logp.float(), draft_logp.float()
    drafts = draft_tokens.long()
    logp_of_drafts = target_logp[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, k]
    if greedy:
        accepted = drafts == target_logp[:, :k].argmax(-1)
    else:
        if uniforms is not None:
            coins = uniforms[0].to(target_logp.dtype)
        else:
            coins = torch.rand(batch, k, generator=generator, device=target_logp.device)
        p_x = logp_of_drafts.exp()
        q_x = draft_logp.gather(-1, drafts[..., None])[..., 0].exp()
        # u < p/q without dividing: p ≥ q always accepts (u < 1), p = 0 never does.
        accepted = coins * q_x < p_x
    # Accepted while every earlier draft was: the length of the leading run of True.
    num_accepted = accepted.long().cumprod(-1).sum(-1)

    rows = torch.arange(batch, device=target_logp.device)
    p_last = target_logp[rows, num_accepted]  # [B, V]: the position of the final token
    if greedy:
        final = p_last.argmax(-1)
    else:
        # With a zero q row appended, the residual at position k (all accepted) is p itself:
        # the bonus token and the resampled token come from one expression.
        q_padded = torch.cat([draft_logp.exp(), draft_logp.new_zeros(batch, 1, vocab)], 1)
        residual = (p_last.exp() - q_padded[rows, num_accepted]).clamp_min(0)
        # Rounding can leave no positive residual where p and q agree to the last bit (a
        # rejection then has probability ~0 anyway): such rows draw from p.
        empty = residual.sum(-1) <= 0
        residual = torch.where(empty[:, None], p_last.exp(), residual)
        if uniforms is not None:
            final = inverse_cdf(residual, uniforms[1][rows, num_accepted])
        else:
            final = torch.multinomial(residual, 1, generator=generator)[:, 0]

    positions = torch.arange(k + 1, device=target_logp.device)[None, :]
    tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], 1)
    tokens[rows, num_accepted] = final
    num_emitted = num_accepted + 1
    emitted = positions < num_emitted[:, None]
    logprobs = target_logp.gather(-1, tokens[..., None])[..., 0]
    return AcceptanceResult(
        tokens=tokens.masked_fill(~emitted, PAD_TOKEN),
        logprobs=logprobs.masked_fill(~emitted, 0.0),
        num_accepted=num_accepted,
        num_emitted=num_emitted,
    )
