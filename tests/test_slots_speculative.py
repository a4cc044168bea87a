"""Speculative decoding in the torch engine's slot loop (`engine.speculative`): lossless
(greedy tokens are plain decoding's, sampled tokens follow the target's processed
distribution, log-probs are the target's), fewer target forwards per token once the
online drafter has trained, its state saved and refused for another model, and bad
settings refused at start."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from asyncfp8.engines import SamplingParams
from asyncfp8.engines.decode import processed_logprobs
from asyncfp8.engines.slots import SlotDecoder
from asyncfp8.engines.speculative.settings import SpeculativeSettings, check_drafter_checkpoint
from asyncfp8.engines.torch_engine import TorchEngine
from tests.taught import PROMPTS

# All 60 steps whatever they take: the tests ask what a trained drafter achieves.
FIXED = {"mode": "fixed", "draft_tokens": 3, "train_steps": 60, "train_time_fraction": None}
ADAPTIVE = {**FIXED, "mode": "adaptive", "threshold": 4, "patience": 1, "ks": [0, 2, 3]}

pytestmark = pytest.mark.usefixtures("one_thread")


def engine(model_dir, slots=4, speculative=None):
    # FP32: rows of different batches and widths agree to ~1e-6.
    return TorchEngine(
        str(model_dir), "bf16", dtype=torch.float32, slots=slots, speculative=speculative
    )


def train(e, rounds=3):
    """Rounds of greedy rollouts, the drafter training after each (engine.generate does)."""
    sampling = SamplingParams(n=4, temperature=0.0, max_new_tokens=40, ignore_eos=True)
    for _ in range(rounds):
        e.generate(PROMPTS, sampling)


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    e = engine(tiny_model_dir, speculative=FIXED)
    train(e)
    return e


@pytest.fixture(scope="module")
def taught_trained(taught_model_dir):
    """A drafter trained on the taught model, whose greedy sequences end (on EOS) at
    different steps whatever CPU built the tiny model."""
    e = engine(taught_model_dir, speculative=FIXED)
    train(e)
    return e


def forced_logprobs(e, sample, sampling):
    """The processed log-probs of `sample`'s tokens, fed one by one through a static
    decoder of the same model (no slots, no speculation)."""
    decoder, logits = e.start([sample.prompt_ids], len(sample.token_ids))
    out = []
    for j, token in enumerate(sample.token_ids):
        out.append(float(processed_logprobs(logits, sampling)[0, token]))
        if j + 1 < len(sample.token_ids):
            logits = decoder.step(torch.tensor([token]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("settings", [FIXED, ADAPTIVE], ids=["fixed", "adaptive"])
def test_greedy_speculation_gives_plain_decodings_tokens(
    taught_model_dir, taught_trained, settings
):
    sampling = SamplingParams(n=3, temperature=0.0, max_new_tokens=24)
    plain = engine(taught_model_dir).generate(PROMPTS, sampling)
    assert len({len(s.token_ids) for s in plain}) > 2  # some end on EOS, at several steps
    assert {s.finish_reason for s in plain} == {"stop", "length"}
    e = engine(taught_model_dir, speculative=settings)
    e.load_drafter_state({"trainer": taught_trained.drafter_state()["trainer"]})
    samples = e.generate(PROMPTS, sampling)
    assert [s.token_ids for s in samples] == [s.token_ids for s in plain]
    for a, b in zip(samples, plain, strict=True):
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
    metrics = e.speculation_metrics()
    assert metrics["spec/fraction_steps_speculating"] > 0
    # The trained drafter is used (the adaptive bandit also spends steps on k = 0 and 2).
    assert metrics["spec/total/mean_accepted_length"] > (1.5 if settings is FIXED else 1.1)
    if settings is FIXED:  # (the adaptive bandit also tries plain steps, k = 0)
        stats = e.last_stats
        assert stats.useful_forwards / stats.tokens < 0.85


@pytest.mark.slow
def test_trained_drafter_needs_at_most_half_a_forward_per_token(trained):
    sampling = SamplingParams(n=4, temperature=0.0, max_new_tokens=40, ignore_eos=True)
    trained.generate(PROMPTS, sampling)
    stats = trained.last_stats
    assert stats.tokens == 6 * 4 * 40
    # Per sequence: its prefill and the forwards that produced its tokens.
    assert stats.useful_forwards / stats.tokens <= 0.5, stats


@pytest.mark.slow
def test_sampled_logprobs_are_the_targets_and_tokens_do_not_depend_on_slots(
    tiny_model_dir, trained
):
    sampling = SamplingParams(n=3, temperature=1.0, top_k=20, max_new_tokens=20, seed=11)
    state = {"trainer": trained.drafter_state()["trainer"]}
    runs = []
    for slots in (3, 7):
        e = engine(tiny_model_dir, slots=slots, speculative={**FIXED, "train_steps": 0})
        e.load_drafter_state(state)
        runs.append(e.generate(PROMPTS, sampling))
        assert e.speculation_metrics()["spec/total/acceptance_rate"] > 0.2
    # Each request draws from its own streams at its own token indices.
    assert [s.token_ids for s in runs[0]] == [s.token_ids for s in runs[1]]
    reference = engine(tiny_model_dir, slots=None)
    for sample in runs[0]:
        expected = forced_logprobs(reference, sample, sampling)
        torch.testing.assert_close(
            torch.tensor(sample.logprobs), torch.tensor(expected), atol=1e-5, rtol=0
        )


@pytest.mark.slow
def test_sampled_tokens_follow_the_targets_distribution(tiny_model_dir, trained):
    """The joint distribution of the first two tokens of 3000 samples of one prompt (the
    second from a verify step: an accepted draft or a resampled token) against the
    target's own: Pearson's chi-square over the top-4 × top-4 cells, level 0.001."""
    sampling = SamplingParams(
        n=3000, temperature=1.0, top_k=4, max_new_tokens=3, seed=5, ignore_eos=True
    )
    e = engine(tiny_model_dir, slots=64, speculative={**FIXED, "draft_tokens": 2, "train_steps": 0})
    e.load_drafter_state({"trainer": trained.drafter_state()["trainer"]})
    samples = e.generate(["1+2="], sampling)
    assert e.speculation_metrics()["spec/total/acceptance_rate"] > 0.1
    prompt = samples[0].prompt_ids
    model = e.model
    with torch.no_grad():
        first = processed_logprobs(model(torch.tensor([prompt])).logits[0, -1], sampling).exp()
        support = first.nonzero()[:, 0].tolist()
        expected, cells = [], []
        for a in support:
            after = model(torch.tensor([[*prompt, a]])).logits[0, -1]
            second = processed_logprobs(after, sampling).exp()
            for b in second.nonzero()[:, 0].tolist():
                expected.append(float(first[a] * second[b]))
                cells.append((a, b))
    counts = {cell: 0 for cell in cells}
    for sample in samples:
        pair = tuple(sample.token_ids[:2])
        assert pair in counts, f"{pair} has probability 0 under the target"
        counts[pair] += 1
    observed = torch.tensor([counts[c] for c in cells], dtype=torch.float64)
    probs = torch.tensor(expected, dtype=torch.float64)
    expected_counts = probs / probs.sum() * len(samples)
    keep = expected_counts >= 5  # the rest pooled into one cell
    stat_cells = torch.cat([observed[keep], observed[~keep].sum()[None]])
    stat_expected = torch.cat([expected_counts[keep], expected_counts[~keep].sum()[None]])
    if stat_expected[-1] < 5:
        stat_cells, stat_expected = stat_cells[:-1], stat_expected[:-1]
        stat_cells[-1] += observed[~keep].sum()
        stat_expected[-1] += expected_counts[~keep].sum()
    stat = float(((stat_cells - stat_expected) ** 2 / stat_expected).sum())
    dof = len(stat_cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
    assert p_value > 0.001, (stat, dof, counts)
    assert math.isfinite(stat)


@pytest.mark.slow
def test_drafter_state_round_trips_and_another_models_is_refused(tiny_model_dir, trained, tmp_path):
    path = tmp_path / "drafter.pt"
    torch.save(trained.drafter_state(), path)
    e = engine(tiny_model_dir, speculative={**FIXED, "init": str(path)})
    mine = e.speculation.drafter.state_dict()
    theirs = trained.speculation.drafter.state_dict()
    for name, tensor in theirs.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(mine[name], tensor), name
    assert e.speculation.trainer.steps == trained.speculation.trainer.steps
    # Another model: the check the engine runs before building its drafter.
    other = copy.deepcopy(e.model.config)
    other.hidden_size *= 2
    with pytest.raises(ValueError, match="for another model: hidden_size"):
        check_drafter_checkpoint(str(path), other)
    with pytest.raises(ValueError, match="not an asyncfp8 drafter checkpoint"):
        torch.save({"model": {}}, tmp_path / "other.pt")
        check_drafter_checkpoint(str(tmp_path / "other.pt"), e.model.config)


@pytest.mark.parametrize(
    ("node", "engine_name", "slots", "message"),
    [
        ({"mode": "fixed"}, "vllm", None, "engine vllm cannot speculate"),
        ({"mode": "adaptive"}, "sglang", 4, "engine sglang cannot speculate"),
        ({"mode": "fixed"}, "torch", None, "set engine.slots=N"),
        ({"mode": "adaptive", "threshold": 0}, "torch", 4, "threshold must be a batch size >= 1"),
        ({"mode": "adaptive", "threshold": -3}, "torch", 4, "threshold must be"),
        ({"mode": "adaptive", "ks": [0]}, "torch", 4, "at least one k >= 1"),
        ({"mode": "fixed", "draft_tokens": 0}, "torch", 4, "draft_tokens must be an int >= 1"),
        ({"mode": "on"}, "torch", 4, "mode must be one of"),
        ({"mode": "fixed", "init": "/nonexistent/d.pt"}, "torch", 4, "no drafter checkpoint"),
        ({"mode": "fixed", "drafter": 1}, "torch", 4, "unknown settings"),
        ({"mode": "fixed", "train_time_fraction": 0}, "torch", 4, "train_time_fraction must"),
        ({"mode": "fixed", "train_time_fraction": "1"}, "torch", 4, "train_time_fraction must"),
    ],
)
def test_bad_speculative_settings_are_refused(node, engine_name, slots, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeSettings.from_config(node, engine_name, slots)


def test_training_after_a_generate_keeps_to_its_time_budget(tiny_model_dir):
    """A budget no step fits in: one step per generate call, each call counted as cut
    short; without a budget every step is made."""
    tight = engine(tiny_model_dir, speculative={**FIXED, "train_time_fraction": 1e-9})
    train(tight, rounds=2)
    metrics = tight.speculation_metrics()
    assert metrics["drafter/steps"] == 2 and metrics["drafter/train_calls_cut_short"] == 2
    assert metrics["drafter/steps_last"] == 1
    free = engine(tiny_model_dir, speculative=FIXED)
    train(free, rounds=1)
    assert free.speculation_metrics()["drafter/steps"] == 60


def test_draft_feeds_live_rows_their_real_positions_paired_with_the_next_token(tiny_model_dir):
    """The drafter's rows are fed from the slot decoder's records: after a prefill, a
    plain step and a verify that kept 1, 3 and 2 of 3 positions, a live row's drafter
    row equals one extend of its sequence's (hidden state, next token) pairs, the last
    paired with the token sampled after it; a row that is not live is left alone."""
    e = engine(tiny_model_dir, slots=3, speculative={**FIXED, "train_steps": 0})
    spec, drafter = e.speculation, e.speculation.drafter
    decoder = SlotDecoder(e.model, 3, 64, record_hidden=True)
    prompts = [e.tokenizer(text)["input_ids"] for text in ("1+2=", "hello there", "37*2")]
    decoder.fill([0, 1, 2], prompts)
    spec.started([0, 1, 2])
    last = torch.tensor([5, 6, 7])
    spec.sync(decoder, last, [True, True, True])
    decoder.step(last)
    last = torch.tensor([8, 9, 10])
    drafts = torch.tensor([[11, 12], [13, 14], [15, 16]])
    decoder.verify(torch.cat([last[:, None], drafts], 1))
    decoder.commit(torch.tensor([1, 3, 2]), [1, 3, 2])
    last = torch.tensor([20, 21, 22])
    spec.sync(decoder, last, [True, True, False])
    for row in (0, 1):
        hidden, tokens = decoder.sequence(row)
        fed = [[5, 8], [6, 9, 13, 14]][row]  # after the prompt: its tokens as kept
        assert tokens.tolist() == prompts[row] + fed
        reference = drafter.new_cache(1)
        following = torch.cat([tokens[1:], last[row : row + 1]])
        drafter.extend(reference, hidden[None], following[None])
        n = len(tokens)
        assert int(spec.cache.lengths[row]) == n
        torch.testing.assert_close(spec.cache.last[row], reference.last[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            spec.cache.k[row, :, :n], reference.k[0, :, :n], atol=1e-5, rtol=1e-5
        )
    # Row 2 took in its prompt and first token at the first draft, nothing since.
    assert int(spec.cache.lengths[2]) == len(prompts[2])
    # (decoder positions: the prompts were left padded to the longest)
    assert spec.synced == [decoder.lengths[0], decoder.lengths[1], max(map(len, prompts))]


def test_mode_none_needs_nothing():
    assert not SpeculativeSettings.from_config({"mode": "none"}, "vllm", None).enabled
    assert not SpeculativeSettings.from_config(None, "torch", None).enabled


def test_the_worker_sees_the_drafter_and_in_flight_updates_as_protocols(trained, tiny_model_dir):
    """What the worker checks with isinstance: an engine with a drafter speculates and
    reports acceptance per version; one without refuses its drafter's state; an object
    that lacks the methods is not taken for either."""
    from asyncfp8.engines.base import InflightUpdates, SpeculativeDrafts

    assert isinstance(trained, SpeculativeDrafts) and trained.speculating
    acceptance = trained.acceptance_by_version()
    assert acceptance == trained.speculation.trainer.acceptance_by_version() and acceptance
    plain = engine(tiny_model_dir, slots=None)
    assert isinstance(plain, SpeculativeDrafts) and not plain.speculating
    with pytest.raises(ValueError, match="no drafter"):
        plain.acceptance_by_version()
    assert isinstance(trained, InflightUpdates) and trained.supports_inflight_updates
    assert isinstance(plain, InflightUpdates) and not plain.supports_inflight_updates

    class Elsewhere:  # an engine without either feature (vLLM, SGLang)
        name, version = "other", None

    assert not isinstance(Elsewhere(), SpeculativeDrafts)
    assert not isinstance(Elsewhere(), InflightUpdates)
