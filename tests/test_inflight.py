"""In-flight updates: a version applied between two decode steps of a slot generation.
Tokens sampled before it carry the old version and are not recomputed; the tokens after
it come from the new weights over the cache written under the old ones — exactly what a
decoder fed the same tokens, updated at the same step, computes."""

import pytest
import torch
from omegaconf import OmegaConf

from asyncfp8.checks import check_inflight_updates
from asyncfp8.engines import SamplingParams
from asyncfp8.engines.decode import processed_logprobs
from asyncfp8.engines.torch_engine import TorchEngine

PROMPTS = ["1+2=", "what is 13*7?", "hello there, how are you today"]
UPDATE_AT = 4  # the between-steps call that applies version 2


def versions_of(engine, scale, seed):
    torch.manual_seed(seed)
    return {
        name: p.detach() + scale * torch.randn_like(p)
        for name, p in engine.model.named_parameters()
    }


def forced_logprobs(engine, sample, sampling, v1, v2, switch_at):
    """The processed log-probs of `sample`'s tokens under a static decoder fed them one by
    one, with version 2 applied before the forward that produces token `switch_at`'s
    logits (None: never)."""
    engine.update_weights(1, v1)
    if switch_at == 0:
        engine.update_weights(2, v2)
    decoder, logits = engine.start([sample.prompt_ids], len(sample.token_ids))
    out = []
    for j, token in enumerate(sample.token_ids):
        out.append(float(processed_logprobs(logits, sampling)[0, token]))
        if j + 1 < len(sample.token_ids):
            if switch_at is not None and j + 1 == switch_at:
                engine.update_weights(2, v2)
            logits = decoder.step(torch.tensor([token]))
    return out


def test_an_update_between_steps_tags_tokens_and_keeps_the_cache(tiny_model_dir):
    engine = TorchEngine(str(tiny_model_dir), "bf16", dtype=torch.float32, slots=2)
    v1 = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    v2 = versions_of(engine, 0.05, seed=1)
    engine.update_weights(1, v1)
    calls = []

    def between_steps():
        calls.append(engine.version)
        if len(calls) == UPDATE_AT:
            engine.update_weights(2, v2)

    engine.between_steps = between_steps
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)
    samples = engine.generate(PROMPTS, sampling)
    assert engine.version == 2 and engine.last_stats.versions_applied == [2]
    # Once before each of the 33 steps: a refill (pairs of 12 tokens end together) runs
    # its prefill after the same call, just before that step, under the same version.
    assert engine.last_stats.steps == 3 * 11 and len(calls) == 33
    spanning = 0
    reference = TorchEngine(str(tiny_model_dir), "bf16", dtype=torch.float32)
    for sample in samples:
        versions = sample.versions
        assert len(versions) == len(sample.token_ids) == 12
        # Old version first, then the new one, never back.
        assert versions == sorted(versions) and set(versions) <= {1, 2}
        switch_at = versions.index(2) if 2 in versions else None
        spanning += (switch_at or 0) > 0
        expected = forced_logprobs(reference, sample, sampling, v1, v2, switch_at)
        torch.testing.assert_close(
            torch.tensor(sample.logprobs), torch.tensor(expected), atol=1e-5, rtol=0
        )
        if switch_at:
            # The update mattered: without it the same tokens score differently.
            unchanged = forced_logprobs(reference, sample, sampling, v1, v2, None)
            after = torch.tensor(unchanged[switch_at:]) - torch.tensor(expected[switch_at:])
            assert after.abs().max() > 1e-3
            before = torch.tensor(unchanged[:switch_at]) - torch.tensor(expected[:switch_at])
            assert before.abs().max() < 1e-5
    # Two slots, 6 sequences of 12: the first pair spans the update, later ones start on v2.
    assert spanning == 2
    assert samples[-1].versions == [2] * 12


def test_no_hook_no_change_and_static_batches_cannot(tiny_model_dir):
    static = TorchEngine(str(tiny_model_dir), "bf16")
    assert not static.supports_inflight_updates
    assert TorchEngine(str(tiny_model_dir), "bf16", slots=2).supports_inflight_updates


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"name": "vllm"}, "engine vllm applies them between generate calls"),
        ({"name": "sglang"}, "engine sglang applies them between generate calls"),
        ({"name": "torch", "slots": None}, "set engine.slots=N"),
        ({"name": "torch", "slots": 0}, r"engine\.slots must be null \(static batches\) or an int"),
    ],
)
def test_inflight_updates_refused_where_the_engine_cannot(engine, message):
    cfg = OmegaConf.create({"run": {"inflight_updates": True}, "engine": engine})
    with pytest.raises(ValueError, match=message) as err:
        check_inflight_updates(cfg)
    if engine.get("slots", 1) == 0:  # refused whatever run.inflight_updates says
        assert "engine.slots" in str(err.value)
        return
    assert "run.inflight_updates" in str(err.value)
    cfg.run.inflight_updates = False
    check_inflight_updates(cfg)  # off: any engine
    cfg = OmegaConf.create(
        {"run": {"inflight_updates": True}, "engine": {"name": "torch", "slots": 4}}
    )
    check_inflight_updates(cfg)


def run_with_scale_change(model_dir, rescale: bool, change: float):
    """Greedy generation through 2 slots of an FP8-KV engine whose KV scales are
    multiplied by `change` (weights unchanged) at the 3rd between-steps call. Returns the
    samples and, per layer and part, the cache as values (bytes × scale) just before and
    just after the change."""
    from asyncfp8.precision.fp8_kv import kv_scale_names

    def scales(factor):
        extra = {}
        for layer in range(2):
            names = kv_scale_names(layer)
            extra[names["k"]] = torch.tensor(0.02 * factor)
            extra[names["v"]] = torch.tensor(0.01 * factor)
        return extra

    engine = TorchEngine(str(model_dir), "fp8_kv", dtype=torch.float32, slots=2)
    engine.update_weights(1, {}, scales(1.0))
    if not rescale:  # what reading the old bytes under the new scales would give
        engine._rescale_live_cache = lambda *args: None
    calls, snapshots = [], []

    def cache_values():
        cache = engine._slot_decoder.cache
        return {
            (layer, part): buffers[layer].float() * engine.kv_scales[layer][index]
            for index, (part, buffers) in enumerate((("k", cache.keys), ("v", cache.values)))
            for layer in range(len(cache.keys))
        }

    def between_steps():
        calls.append(1)
        if len(calls) == 3:
            snapshots.append(cache_values())
            engine.update_weights(2, {}, scales(change))
            snapshots.append(cache_values())

    engine.between_steps = between_steps
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    return engine.generate(PROMPTS[:2], sampling), snapshots


def test_an_inflight_kv_scale_change_requantizes_the_cache(tiny_model_dir):
    """An e4m3 cache written under version 1's scales is requantized when version 2's
    scales arrive mid-generation: the values it holds stay those version 1 wrote, to one
    more e4m3 rounding; without the requantization every value would read `change`
    times too large. (Checked on the cache itself: how far the scores then move depends
    on the model, and the tiny model differs from one CPU to another.)"""
    change = 1.37
    kept, (before, after) = run_with_scale_change(tiny_model_dir, rescale=True, change=change)
    misread, (before_m, after_m) = run_with_scale_change(
        tiny_model_dir, rescale=False, change=change
    )
    assert [s.versions for s in kept] == [[1] * 3 + [2] * 7] * 2
    assert [s.token_ids[:3] for s in kept] == [s.token_ids[:3] for s in misread]
    for key, old in before.items():
        assert old.abs().max() > 0, key  # the prompts and 3 tokens were written
        torch.testing.assert_close(before_m[key], old, rtol=0, atol=0)
        # e4m3 has 3 mantissa bits: one rounding moves a normal value by at most 2^-4 of
        # itself; values in the subnormal range (below 2^-6 × scale) by half a step there.
        floor = 2.0**-10 * 0.02 * change
        assert ((after[key] - old).abs() <= old.abs() * 2.0**-4 + floor).all(), key
        torch.testing.assert_close(after_m[key], old * change, rtol=1e-6, atol=0)
