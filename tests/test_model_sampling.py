"""Sampling a model outside an engine (held-out evaluation, the warm-start's measure)
goes through the built-in engine's decode loop: the engine's tokens for the same weights
and seed, a prompt's tokens independent of the prompts beside it, ranks of a sharded
model stepping together, and the model handed back as it came."""

import pytest
import torch

from asyncfp8.engines import SamplingParams
from asyncfp8.engines.model_sampling import sample_from_model
from asyncfp8.engines.slot_loop import SlotLoop, seeded_requests
from asyncfp8.engines.slots import SlotDecoder
from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.learner.evaluation import HeldOut
from asyncfp8.models import load_model, load_tokenizer
from asyncfp8.models.sampling import sample_completions
from asyncfp8.tasks import ArithmeticTask
from tests.taught import PROMPTS


def encoded(tokenizer, prompts):
    return [tokenizer(p)["input_ids"] for p in prompts]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_samples_what_the_engine_samples_with_the_same_weights(
    taught_model_dir, temperature
):
    tokenizer = load_tokenizer(taught_model_dir)
    sampling = SamplingParams(n=3, temperature=temperature, max_new_tokens=14, seed=11)
    engine = TorchEngine(str(taught_model_dir), "bf16")
    expected = engine.generate(PROMPTS, sampling)
    model = load_model(taught_model_dir, dtype=torch.bfloat16)
    got = sample_from_model(
        model,
        encoded(tokenizer, PROMPTS),
        sampling,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert len({len(s.token_ids) for s in expected}) > 2  # sequences end at different steps
    assert [g.token_ids for g in got] == [s.token_ids for s in expected]
    assert [g.logprobs for g in got] == [s.logprobs for s in expected]


def test_a_prompts_tokens_do_not_depend_on_the_prompts_beside_it(taught_model_dir):
    # What lets each rank evaluate its share: prompt i keeps its stream (its index) and
    # its tokens wherever it runs. FP32: rows of different batches agree to ~1e-6.
    tokenizer = load_tokenizer(taught_model_dir)
    model = load_model(taught_model_dir, dtype=torch.float32)
    ids = encoded(tokenizer, PROMPTS)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=5)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    whole = sample_from_model(model, ids, sampling, eos, pad)
    for rank in range(2):
        indices = list(range(rank, len(ids), 2))
        share = sample_from_model(
            model, [ids[i] for i in indices], sampling, eos, pad, indices=indices
        )
        expected = [whole[i * 2 + k].token_ids for i in indices for k in range(2)]
        assert [g.token_ids for g in share] == expected
    # And the batches of the warm-start's measure do not change its completions.
    texts = [p for p in PROMPTS for _ in range(3)]
    assert sample_completions(model, tokenizer, texts, 14, seed=2, batch_size=4) == (
        sample_completions(model, tokenizer, texts, 14, seed=2, batch_size=256)
    )


def test_a_loop_joined_to_other_ranks_steps_until_all_are_done(taught_model_dir):
    tokenizer = load_tokenizer(taught_model_dir)
    model = load_model(taught_model_dir, dtype=torch.float32)
    model.set_attn_implementation("asyncfp8_static")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=14)
    requests = seeded_requests(encoded(tokenizer, PROMPTS), [14] * len(PROMPTS), 0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))

    def run(all_done=None):
        forwards.clear()
        decoder = SlotDecoder(model, len(requests), 64)
        out = SlotLoop(decoder, requests, sampling, eos, pad, all_done=all_done).run()
        return out, len(forwards)

    alone, alone_forwards = run()
    asked = []

    def others_take_three_more_steps(done_here):
        asked.append(done_here)
        return done_here and asked.count(True) > 3

    joined, joined_forwards = run(others_take_three_more_steps)
    assert [g.token_ids for g in joined] == [g.token_ids for g in alone]
    assert joined_forwards == alone_forwards + 3  # idle steps, to match the other ranks
    assert asked.count(False) == alone_forwards - 1  # the prefill, then a step per ask
    with pytest.raises(ValueError, match=r"needs 1 to 2 requests \(one slot each\)"):
        SlotLoop(SlotDecoder(model, 2, 64), requests, sampling, eos, pad, all_done=bool)


def test_sampling_hands_the_model_back_as_it_came(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype=torch.float32).train()
    attention = model.config._attn_implementation
    state = torch.random.get_rng_state()
    sample_from_model(model, [[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=1), 0, 0)
    assert model.training and model.config._attn_implementation == attention
    assert torch.equal(torch.random.get_rng_state(), state)  # per-request streams only
    with pytest.raises(ValueError, match="at least one prompt"):
        sample_from_model(model, [], SamplingParams(), 0, 0)
    with pytest.raises(ValueError, match="at least one token"):
        sample_from_model(model, [[]], SamplingParams(), 0, 0)
    with pytest.raises(ValueError, match="2 indices for 1 prompts"):
        sample_from_model(model, [[1]], SamplingParams(), 0, 0, indices=[0, 1])


def test_held_out_evaluation_scores_the_engines_samples(tiny_model_dir):
    from asyncfp8.run import distributed

    task = ArithmeticTask(seed=3)
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_model(tiny_model_dir, dtype=torch.float32)
    ranks = distributed.Ranks(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    heldout = HeldOut(task, tokenizer, 12, 3, 8, 1.0, 7, ranks)
    metrics = heldout.evaluate(model)
    # The same scores from the engine's sampler by hand: greedy, then 3 samples a prompt.
    prompts = heldout.prompts
    ids = encoded(tokenizer, [p.text for p in prompts])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def pass1(sampling):
        out = sample_from_model(model, ids, sampling, eos, pad)
        texts = tokenizer.batch_decode([g.token_ids for g in out], skip_special_tokens=True)
        scores = [task.score(t, prompts[i // sampling.n]) for i, t in enumerate(texts)]
        return sum(scores) / len(scores)

    greedy = pass1(SamplingParams(temperature=0.0, max_new_tokens=8))
    sampled = pass1(SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=7))
    assert metrics == {
        "eval/pass1_greedy": greedy,
        "eval/pass1_sampled": sampled,
        "eval/prompts": 12,
    }
    assert heldout.evaluate(model) == metrics  # fixed streams: the same score each time


def test_with_kv_scales_a_model_samples_what_an_fp8_kv_cache_engine_samples(taught_model_dir):
    # Held-out evaluation of a learner whose forward rounds keys and values to e4m3
    # (precision.learner_forward=quantized): its cache stores e4m3 with the version's
    # scales, as the engine's does.
    from asyncfp8.precision import calibrate_version, get_policy, version_weights
    from asyncfp8.precision.fp8_kv import kv_scale_names

    tokenizer = load_tokenizer(taught_model_dir)
    policy = get_policy("fp8_kv")
    model = load_model(taught_model_dir, dtype=torch.float32)
    policy.bind_model(model.config)
    calibration = dict(tokenizer(PROMPTS, return_tensors="pt", padding=True))
    extra = calibrate_version(model, policy, calibration)
    masters = [(name, p.detach()) for name, p in model.named_parameters()]
    engine = TorchEngine(str(taught_model_dir), "fp8_kv")
    engine.update_weights(0, dict(version_weights(policy, masters)), extra)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=4)
    expected = engine.generate(PROMPTS, sampling)
    names = [kv_scale_names(layer) for layer in range(model.config.num_hidden_layers)]
    scales = [(extra[n["k"]].float(), extra[n["v"]].float()) for n in names]
    bf16 = load_model(taught_model_dir, dtype=torch.bfloat16)
    ids, eos, pad = encoded(tokenizer, PROMPTS), tokenizer.eos_token_id, tokenizer.pad_token_id
    got = sample_from_model(bf16, ids, sampling, eos, pad, kv_scales=scales)
    assert [g.token_ids for g in got] == [s.token_ids for s in expected]
    assert [g.logprobs for g in got] == [s.logprobs for s in expected]
    plain = sample_from_model(bf16, ids, sampling, eos, pad)  # the control: no e4m3 cache
    assert [g.logprobs for g in plain] != [s.logprobs for s in expected]


@pytest.mark.parametrize("forward", ["master", "quantized"])
def test_the_learner_evaluates_with_an_e4m3_cache_only_when_its_forward_rounds_kv(
    tmp_path, tiny_model_dir, forward
):
    from asyncfp8.learner import Learner
    from asyncfp8.precision.fp8_kv import kv_scale_names
    from tests.recorded import learner_config

    learner = Learner(
        learner_config(
            tiny_model_dir,
            tmp_path / "run",
            "precision=fp8_kv",
            f"precision.learner_forward={forward}",
            "eval.every=1",
        )
    )
    try:
        learner.publisher.publish()
        scales = learner._evaluation_kv_scales()
        if forward == "master":
            assert scales is None  # the learner's attention is plain: so is evaluation's
            return
        extra = learner.publisher.latest_extra
        layers = learner.model.config.num_hidden_layers
        assert len(scales) == layers
        for layer, (k, v) in enumerate(scales):
            names = kv_scale_names(layer)
            assert torch.equal(k, extra[names["k"]]) and torch.equal(v, extra[names["v"]])
        assert 0 <= learner.heldout.evaluate(learner.model)["eval/pass1_greedy"] <= 1
    finally:
        learner.close()
