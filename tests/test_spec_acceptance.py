"""Lossless acceptance (asyncfp8/engines/speculative/acceptance.py) against the distribution it
must reproduce.

The statistical tests run whole generations on a toy Markov "model" over 8 tokens (the
target's and the drafter's next-token distributions depend on the previous token),
batched: every row is one independent generation, so each `accept` call holds sequences
with different accepted lengths. The emitted tokens must follow the target's *processed*
distribution (temperature, top-k, top-p) whatever the drafter proposes. Pearson's
chi-square on the joint distribution of the first two emitted tokens (64 cells; the cells
the target gives probability 0 are left out and must stay empty), p-value from the
regularized upper incomplete gamma; significance level 0.001 per test, 30 000 sequences
per test, fixed seeds (deterministic). Each test also shows the statistic has power: it
rejects (p < 1e-6) a sample of the same size drawn from the drafter's chain.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.request_sampling import (
    COIN,
    DRAFT,
    FINAL,
    inverse_cdf,
    request_seed,
    uniforms,
)
from asyncfp8.engines.speculative.acceptance import accept
from asyncfp8.engines.torch_engine import processed_logprobs

ALPHA = 0.001
SEQUENCES = 30_000
VOCAB = 8


# Tiny tensors: one torch thread for the whole module (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def markov(seed: int, sharpness: float) -> torch.Tensor:
    """Transition logits [VOCAB, VOCAB]: row a holds the logits of the token after a."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=g) * sharpness


TARGET = markov(1, sharpness=0.7)


def drafter_logits(kind: str) -> torch.Tensor:
    if kind == "close":  # near the target: most drafts accepted
        return TARGET + 0.3 * markov(2, sharpness=1.0)
    if kind == "far":  # an unrelated, sharper chain
        return markov(3, sharpness=3.0)
    if kind == "onehot_bad":  # always proposes the token the target rates lowest
        worst = TARGET.argmin(-1)
        return torch.full((VOCAB, VOCAB), -1e4).scatter(1, worst[:, None], 0.0)
    raise AssertionError(kind)


SAMPLINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_topk3": SamplingParams(temperature=0.7, top_k=3),
    "t0.7_topp0.8": SamplingParams(temperature=0.7, top_p=0.8),
}


def sample_chain(rows_logp, length, greedy, g, start):
    """Plain (non-speculative) sampling of chains after the `start` tokens [N]."""
    prev, out = start, []
    for _ in range(length):
        logp = rows_logp[prev]
        prev = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
        out.append(prev)
    return torch.stack(out, 1)


def speculative_generation(
    target_logits, draft_logits, sampling, k, length, seed, start=None, streams=False
):
    """Generations of at least `length` tokens after the `start` tokens (default:
    `SEQUENCES` zeros); each step drafts k tokens from the drafter's chain and verifies
    them against the target's. Returns tokens and logprobs [N, length], the target's
    processed rows, and every step's AcceptanceResult. `streams`: every draw comes from
    the row's own counter-based streams (the slot loop's), not a generator."""
    g = torch.Generator().manual_seed(seed)
    start = torch.zeros(SEQUENCES, dtype=torch.long) if start is None else start
    n = len(start)
    greedy = sampling.temperature == 0
    p_rows = processed_logprobs(target_logits, sampling)
    q_rows = processed_logprobs(draft_logits, sampling)
    width = length + k + 1
    tokens = torch.full((n, width), -1, dtype=torch.long)
    logprobs = torch.zeros(n, width)
    filled = torch.zeros(n, dtype=torch.long)
    last = start
    rows = torch.arange(n)
    results = []
    seeds = torch.tensor([request_seed(seed, i) for i in range(n)]) if streams else None
    offsets = torch.arange(k + 1)
    while bool((filled < length).any()):
        drafts, q, prev = [], [], last
        for j in range(k):
            logq = q_rows[prev]
            if greedy:
                prev = logq.argmax(-1)
            elif streams:
                prev = inverse_cdf(logq.exp(), uniforms(seeds, filled + j, DRAFT))
            else:
                prev = torch.multinomial(logq.exp(), 1, generator=g)[:, 0]
            drafts.append(prev)
            q.append(logq)
        drafts, q = torch.stack(drafts, 1), torch.stack(q, 1)
        # The target's distributions after last, d_1, ..., d_k: one "verify forward".
        p = p_rows[torch.cat([last[:, None], drafts], 1)]
        draws = None
        if streams:
            positions = filled[:, None] + offsets
            draws = (
                uniforms(seeds[:, None], positions[:, :k], COIN),
                uniforms(seeds[:, None], positions, FINAL),
            )
        result = accept(p, q, drafts, greedy=greedy, generator=g, uniforms=draws)
        results.append(result)
        active = filled < length  # rows already long enough only ride along
        for j in range(k + 1):
            take = active & (j < result.num_emitted)
            tokens[rows[take], filled[take] + j] = result.tokens[take, j]
            logprobs[rows[take], filled[take] + j] = result.logprobs[take, j]
        filled = filled + torch.where(active, result.num_emitted, 0)
        last = result.tokens[rows, result.num_emitted - 1]
    return tokens[:, :length], logprobs[:, :length], p_rows, results


def pair_counts(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB)


def chi_square_p(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square over the cells with probs > 0; 0.0 when a count
    falls in a cell of probability 0 (a sample that cannot come from `probs`)."""
    observed, probs = observed.double().flatten(), probs.double().flatten()
    support = probs > 0
    if observed[~support].sum() > 0:
        return 0.0
    expected = probs[support] / probs.sum() * observed.sum()
    assert expected.min() >= 5, "cells too small for the chi-square approximation"
    stat = ((observed[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize("drafter", ["close", "far", "onehot_bad"])
def test_emitted_tokens_follow_the_targets_processed_distribution(sampling_name, drafter):
    sampling = SAMPLINGS[sampling_name]
    draft = drafter_logits(drafter)
    seed = sum(map(ord, sampling_name + drafter))
    tokens, logprobs, p_rows, _ = speculative_generation(
        TARGET, draft, sampling, k=3, length=2, seed=seed
    )
    p = p_rows.exp()
    expected = p[0][:, None] * p  # P(y1, y2) = p(y1 | 0) p(y2 | y1)
    assert chi_square_p(pair_counts(tokens), expected) > ALPHA
    # The returned log-probs are the target's processed ones of the returned tokens.
    assert torch.equal(logprobs[:, 0], p_rows[0, tokens[:, 0]])
    assert torch.equal(logprobs[:, 1], p_rows[tokens[:, 0], tokens[:, 1]])
    # Power: the drafter's own chain, same sample size, is rejected by the same test.
    q_rows = processed_logprobs(draft, sampling)
    zeros = torch.zeros(SEQUENCES, dtype=torch.long)
    drafted = sample_chain(q_rows, 2, False, torch.Generator().manual_seed(seed + 1), zeros)
    assert chi_square_p(pair_counts(drafted), expected) < 1e-6


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize("drafter", ["close", "far"])
def test_per_request_streams_keep_the_targets_distribution(sampling_name, drafter):
    """The slot loop's draws: drafts, coins and final tokens from each sequence's own
    counter-based streams (a stream per purpose, indexed by token position; indices of
    drafts a step rejected are drawn again by the next step, which is sound because
    nothing emitted depended on them)."""
    sampling = SAMPLINGS[sampling_name]
    seed = sum(map(ord, sampling_name + drafter)) + 7
    tokens, logprobs, p_rows, results = speculative_generation(
        TARGET, drafter_logits(drafter), sampling, k=3, length=3, seed=seed, streams=True
    )
    p = p_rows.exp()
    expected = p[0][:, None] * p
    assert chi_square_p(pair_counts(tokens), expected) > ALPHA
    # Tokens 2 and 3 (the second comes from a later step for rows that rejected early).
    later = torch.bincount(tokens[:, 1] * VOCAB + tokens[:, 2], minlength=VOCAB * VOCAB)
    marginal = (p[0][:, None] * p).sum(0)
    assert chi_square_p(later, marginal[:, None] * p) > ALPHA
    assert torch.equal(logprobs[:, 1], p_rows[tokens[:, 0], tokens[:, 1]])
    assert any(bool((r.num_accepted > 0).any()) for r in results)
    # Deterministic: the same seeds give the same tokens.
    again, *_ = speculative_generation(
        TARGET, drafter_logits(drafter), sampling, k=3, length=3, seed=seed, streams=True
    )
    assert torch.equal(again, tokens)


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_acceptance_rate_is_the_overlap_of_p_and_q(sampling_name):
    """With k = 1 the first step from token 0 accepts with probability sum_x min(p, q):
    checked within 4.5 standard errors. (A rule that always rejected and resampled from p
    would pass the distribution test but not this one.)"""
    sampling = SAMPLINGS[sampling_name]
    draft = drafter_logits("close")
    _, _, p_rows, results = speculative_generation(TARGET, draft, sampling, k=1, length=1, seed=7)
    p0 = p_rows[0].exp()
    q0 = processed_logprobs(draft, sampling)[0].exp()
    overlap = float(torch.minimum(p0, q0).sum())
    rate = results[0].num_accepted.double().mean().item()
    stderr = math.sqrt(overlap * (1 - overlap) / SEQUENCES)
    assert abs(rate - overlap) < 4.5 * stderr
    assert 0.3 < overlap < 0.99  # the case is informative


@pytest.mark.parametrize("k", [1, 2, 5, 8])
@pytest.mark.parametrize("drafter", ["close", "far", "onehot_bad"])
def test_greedy_emits_exactly_the_argmax_chain(k, drafter):
    """One row per start token (greedy is deterministic: one row per chain suffices)."""
    sampling = SamplingParams(temperature=0.0)
    start = torch.arange(VOCAB)
    tokens, logprobs, p_rows, _ = speculative_generation(
        TARGET, drafter_logits(drafter), sampling, k=k, length=12, seed=k, start=start
    )
    assert torch.equal(tokens, sample_chain(p_rows, 12, True, None, start))
    prev = torch.cat([start[:, None], tokens[:, :-1]], 1)
    assert torch.equal(logprobs, p_rows[prev, tokens])


@pytest.mark.parametrize("k", [1, 8])
def test_long_and_short_drafts_mixed_in_one_batch(k):
    """k = 1 and k = 8 on a sampled chain: one batch holds rows that accepted nothing,
    some, and (k = 1) everything; the marginal of the first token still follows p, and
    each row's emitted count is its accepted count + 1."""
    sampling = SamplingParams(temperature=1.0)
    tokens, _, p_rows, results = speculative_generation(
        TARGET, drafter_logits("close"), sampling, k=k, length=1, seed=100 + k
    )
    first = results[0]
    assert torch.equal(first.num_emitted, first.num_accepted + 1)
    # k = 1: some rows accept their draft, some do not; k = 8: at least 5 distinct lengths.
    assert len(set(first.num_accepted.tolist())) >= min(k + 1, 5)
    counts = torch.bincount(tokens[:, 0], minlength=VOCAB)
    assert chi_square_p(counts, p_rows[0].exp()) > ALPHA
    # Beyond a row's emitted count the result holds padding.
    width = torch.arange(k + 1)[None, :]
    beyond = width >= first.num_emitted[:, None]
    assert bool((first.tokens[beyond] == -1).all())
    assert bool((first.logprobs[beyond] == 0).all())


def test_seeded_generator_reproduces_results():
    sampling = SamplingParams(temperature=0.7, top_p=0.9)
    start = torch.zeros(500, dtype=torch.long)

    def run(seed):
        return speculative_generation(
            TARGET, drafter_logits("far"), sampling, 4, 6, seed=seed, start=start
        )

    a, b, c = run(3), run(3), run(4)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], c[0])


def test_shape_mismatches_are_refused():
    p = torch.zeros(2, 4, VOCAB).log_softmax(-1)
    q = torch.zeros(2, 3, VOCAB).log_softmax(-1)
    drafts = torch.zeros(2, 3, dtype=torch.long)
    accept(p, q, drafts)
    with pytest.raises(ValueError, match="k"):
        accept(p[:, :3], q, drafts)
    with pytest.raises(ValueError, match="vocab"):
        accept(p, q[..., :5], drafts)
    with pytest.raises(ValueError, match="draft_tokens"):
        accept(p, q, drafts[:, :2])
