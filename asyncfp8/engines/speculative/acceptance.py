"""Lossless acceptance of drafted tokens, the speculative-sampling rule (Leviathan et al.
2023; Chen et al. 2023), batched over rows that accept different numbers of drafts: every
emitted token follows the target's processed distribution, and the log-probs returned are
the target's, never the drafter's. Greedy accepts drafts equal to argmax p (docs/engines.md,
"Speculative decoding (pieces)")."""

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
    """target_logp [B, k+1, V]: the target's processed log-probs after the last emitted
    token and after each draft; draft_logp [B, k, V]: the drafter's, each draft sampled
    from them; draft_tokens [B, k]. Coins and final tokens come from `generator` (seeded:
    reproducible) or from `uniforms` = (coins [B, k], finals [B, k+1]) in [0, 1): draft i's
    coin, and the uniform picking the final token at position j (per-request streams)."""
    batch, k = _check_shapes(target_logp, draft_logp, draft_tokens)
    target_logp, draft_logp = target_logp.float(), draft_logp.float()
    drafts = draft_tokens.long()
    num_accepted = _num_accepted(target_logp, draft_logp, drafts, greedy, generator, uniforms)
    rows = torch.arange(batch, device=target_logp.device)
    p_last = target_logp[rows, num_accepted]  # [B, V]: the position of the final token
    if greedy:
        final = p_last.argmax(-1)
    else:
        final = _resample(p_last, draft_logp, num_accepted, generator, uniforms)

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


def _check_shapes(
    target_logp: torch.Tensor, draft_logp: torch.Tensor, draft_tokens: torch.Tensor
) -> tuple[int, int]:
    """(B, k) of `accept`'s inputs; ValueError, naming the shapes, when they disagree."""
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
    return batch, k


def _num_accepted(
    target_logp: torch.Tensor,
    draft_logp: torch.Tensor,
    drafts: torch.Tensor,
    greedy: bool,
    generator: torch.Generator | None,
    uniforms: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """[B]: how many leading drafts each row accepts (coin u < p/q, or greedy's argmax)."""
    batch, k = drafts.shape
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
    return accepted.long().cumprod(-1).sum(-1)


def _resample(
    p_last: torch.Tensor,
    draft_logp: torch.Tensor,
    num_accepted: torch.Tensor,
    generator: torch.Generator | None,
    uniforms: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """[B]: the token after the accepted drafts, from the normalized residual max(0, p − q)
    at the first rejection, or from p itself (the bonus token) when all k were accepted."""
    batch, _, vocab = draft_logp.shape
    rows = torch.arange(batch, device=p_last.device)
    # With a zero q row appended, the residual at position k (all accepted) is p itself:
    # the bonus token and the resampled token come from one expression.
    q_padded = torch.cat([draft_logp.exp(), draft_logp.new_zeros(batch, 1, vocab)], 1)
    residual = (p_last.exp() - q_padded[rows, num_accepted]).clamp_min(0)
    # Rounding can leave no positive residual where p and q agree to the last bit (a
    # rejection then has probability ~0 anyway): such rows draw from p.
    empty = residual.sum(-1) <= 0
    residual = torch.where(empty[:, None], p_last.exp(), residual)
    if uniforms is not None:
        return inverse_cdf(residual, uniforms[1][rows, num_accepted])
    return torch.multinomial(residual, 1, generator=generator)[:, 0]
