"""Continuous batching in the torch engine (engine.slots): a sample's tokens do not
depend on the number of slots or the order requests run in; per-request sampling draws
from the processed distribution; budgets per request; bad settings refused."""

import math

import pytest
import torch

from asyncfp8.engines import SamplingParams
from asyncfp8.engines.decode import processed_logprobs
from asyncfp8.engines.request_sampling import (
    COIN,
    DRAFT,
    draw,
    request_seed,
    sample_per_request,
    stream_keys,
    uniforms,
)
from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.precision.fp8_kv import kv_scale_names
from tests.taught import PROMPTS


def engine(model_dir, slots, policy="bf16", check_every=3, max_batch=64):
    # FP32 activations: rows of different batches then agree to ~1e-6 (bf16 would round
    # batch-dependent GEMM sums differently).
    return TorchEngine(
        str(model_dir),
        policy,
        dtype=torch.float32,
        slots=slots,
        finish_check_every=check_every,
        max_batch=max_batch,
    )


def assert_same(reference, other, atol=1e-5):
    assert [s.token_ids for s in reference] == [s.token_ids for s in other]
    assert [s.prompt_index for s in reference] == [s.prompt_index for s in other]
    for a, b in zip(reference, other, strict=True):
        assert len(a.logprobs) == len(a.token_ids) == len(a.versions)
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0
        )


def test_greedy_slots_give_the_static_paths_tokens(taught_model_dir):
    sampling = SamplingParams(n=3, temperature=0.0, max_new_tokens=14)
    static = engine(taught_model_dir, None).generate(PROMPTS, sampling)
    lengths = {len(s.token_ids) for s in static}
    assert len(lengths) > 2  # sequences end at different steps: slots get refilled
    for slots, check in ((1, 1), (2, 3), (8, 5), (18, 3)):
        e = engine(taught_model_dir, slots, check_every=check)
        assert_same(static, e.generate(PROMPTS, sampling))
        stats = e.last_stats
        assert stats.tokens == stats.useful_forwards == sum(len(s.token_ids) for s in static)
        if slots == 1:  # n tokens take n - 1 steps: none is run for a slot being refilled
            assert stats.steps == sum(len(s.token_ids) - 1 for s in static)
        if slots < 18:  # more requests than slots: some slots were refilled
            assert stats.prefills > 1


def test_sampled_tokens_do_not_depend_on_slots_or_order(tiny_model_dir):
    # Nor on whether engine.slots is set: without it a call is one static batch of up to
    # max_batch slots (here 24, 3 and 1 of them), through the same loop and streams.
    sampling = SamplingParams(n=4, temperature=1.0, top_k=20, max_new_tokens=12, seed=7)
    runs = [
        engine(tiny_model_dir, slots, check_every=check, max_batch=batch).generate(
            PROMPTS, sampling
        )
        for slots, check, batch in (
            (2, 1, 64),
            (5, 4, 64),
            (8, 2, 64),
            (24, 8, 64),
            (None, 3, 64),
            (None, 2, 3),
            (None, 1, 1),
        )
    ]
    for other in runs[1:]:
        assert_same(runs[0], other)
    # The same seed again: the same samples; another seed: other samples.
    e = engine(tiny_model_dir, 3)
    assert [s.token_ids for s in e.generate(PROMPTS, sampling)] == [s.token_ids for s in runs[0]]
    reseeded = e.generate(PROMPTS, SamplingParams(**{**sampling.__dict__, "seed": 8}))
    assert [s.token_ids for s in reseeded] != [s.token_ids for s in runs[0]]
    # The n samples of a prompt are not copies of each other (each has its own stream).
    first_group = [tuple(s.token_ids) for s in runs[0][:4]]
    assert len(set(first_group)) > 1


def test_fp8_kv_cache_through_slots(tiny_model_dir):
    """The e4m3 rows copied at refill and written per row give the static path's tokens."""
    extra = {}
    for layer in range(2):
        names = kv_scale_names(layer)
        extra[names["k"]] = torch.tensor(0.02)
        extra[names["v"]] = torch.tensor(0.01)
    sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    results = []
    for slots in (None, 3):
        e = engine(tiny_model_dir, slots, policy="fp8_kv")
        assert e.model.config.num_hidden_layers == 2
        e.update_weights(1, {}, extra)
        results.append(e.generate(PROMPTS, sampling))
    assert_same(*results)
    assert all(s.versions == [1] * len(s.token_ids) for s in results[1])


def test_per_request_budgets(tiny_model_dir):
    e = engine(tiny_model_dir, 2)
    ids = [e.tokenizer(p)["input_ids"] for p in PROMPTS]
    budgets = [3, 30, 2, 5, 1, 7]
    sampling = SamplingParams(temperature=1.0, seed=1, ignore_eos=True)
    samples = e.generate_requests(ids, budgets, sampling)
    assert [len(s.token_ids) for s in samples] == budgets
    assert [s.prompt_ids for s in samples] == ids
    assert all(s.finish_reason == "length" for s in samples)
    # Two slots: the long request runs while the short ones pass through the other slot.
    assert e.last_stats.steps < sum(budgets)
    assert e.last_stats.row_steps == 2 * e.last_stats.steps


def test_per_request_sampling_follows_the_processed_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    sampling = SamplingParams(temperature=0.8, top_k=6)
    p = processed_logprobs(logits, sampling).exp()[0]
    draws = 40_000
    seeds = torch.tensor([request_seed(3, i) for i in range(draws)])
    chosen, logp = sample_per_request(
        logits.expand(draws, -1), sampling, stream_keys(seeds), torch.zeros(draws, dtype=torch.long)
    )
    counts = torch.bincount(chosen, minlength=12).double()
    assert counts[p == 0].sum() == 0  # never a token top-k removed
    expected = p.double() * draws
    keep = expected > 0
    chi2 = (((counts - expected)[keep]) ** 2 / expected[keep]).sum().item()
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001
    assert chi2 < 20.5, (counts, expected)
    torch.testing.assert_close(logp, p.log()[chosen].float())
    # Uniforms of one stream over its token indices: in [0, 1), mean 1/2.
    u = uniforms(torch.full((draws,), request_seed(5, 0)), torch.arange(draws))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / draws)
    # The slot loop draws a row's k drafts at once from its stream key: the same numbers
    # as k draws of its seed.
    seeds, counters = seeds[:5], torch.tensor([0, 3, 9, 1, 40])
    at_once = draw(stream_keys(seeds, DRAFT)[:, None], counters[:, None] + torch.arange(4))
    for i in range(4):
        assert torch.equal(at_once[:, i], uniforms(seeds, counters + i, DRAFT))
    assert not torch.equal(at_once[:, 0], uniforms(seeds, counters, COIN))


@pytest.mark.parametrize("slots", [0, -2, True, 2.5])
def test_bad_slots_are_refused(tiny_model_dir, slots):
    with pytest.raises(ValueError, match=r"engine\.slots must be"):
        TorchEngine(str(tiny_model_dir), "bf16", slots=slots)
