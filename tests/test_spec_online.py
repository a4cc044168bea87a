"""Speculation end to end on the tiny warm-started model, through the reference decode
loop (asyncfp8/engines/speculative/reference.py): exact log-probs, greedy equal to the torch
engine's, and fewer target forwards per token once the drafter has trained online on the
target's own rollouts.

The forwards-per-token measurement is hardware-independent: target forward passes each
sequence took part in (prefill included) over the tokens it generated; 1.0 without
speculation. Workload: arithmetic prompts, temperature 1, 48 new tokens with ignore_eos
(past its answer the tiny model keeps emitting digits and eos: low-entropy text, which a
trained drafter predicts well).
"""

from __future__ import annotations

import pytest
import torch

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.speculative.drafter import Drafter
from asyncfp8.engines.speculative.reference import generate
from asyncfp8.engines.speculative.training import DrafterTrainer
from asyncfp8.engines.torch_engine import TorchEngine, processed_logprobs
from asyncfp8.tasks import ArithmeticTask

NEW_TOKENS = 48
K = 4


# Tiny tensors: one torch thread for the whole module (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(request, one_thread):
    """The torch engine in float32: its model is the target, and its greedy decoding the
    reference the speculative loop must reproduce."""
    # Asked for here rather than as an argument, so that if this module is the first to
    # need the session's tiny model it is built under one_thread: the warm-start took
    # 245 s with 2 threads against 31 s with 1 on the shared 2-core VM (load 7).
    tiny_model_dir = request.getfixturevalue("tiny_model_dir")
    engine = TorchEngine(str(tiny_model_dir), "bf16", dtype=torch.float32)
    yield engine
    engine.close()


def prompt_ids(engine, start, count, seed=3):
    task = ArithmeticTask(seed=seed)
    return [engine.tokenizer(task.prompt(i).text)["input_ids"] for i in range(start, start + count)]


def run(engine, prompts, sampling, drafter=None, k=K, seed=0):
    return generate(
        engine.model,
        prompts,
        sampling,
        drafter=drafter,
        k=k,
        eos_token_id=engine.tokenizer.eos_token_id,
        pad_token_id=engine.tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
    )


@pytest.fixture(scope="module")
def online(engine):
    """A drafter before and after online training on 4 × 32 plain-sampled rollouts
    (150 AdamW steps), with forwards per token measured on 16 held-out prompts."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    held_out = prompt_ids(engine, 10_000, 16)
    torch.manual_seed(0)
    drafter = Drafter(engine.model)
    trainer = DrafterTrainer(drafter, lr=3e-3, batch_size=16, seed=0)
    before = run(engine, held_out, sampling, drafter, seed=1)
    for batch in range(4):
        rollout = run(engine, prompt_ids(engine, 32 * batch, 32), sampling, seed=10 + batch)
        assert rollout.forwards_per_token == 1.0
        trainer.observe(rollout.hidden, rollout.input_ids, rollout.mask)
        trainer.train(150 // 4 + (batch < 150 % 4))
    after = run(engine, held_out, sampling, drafter, seed=1)
    print(
        f"\ntarget forwards per token: before training {before.forwards_per_token:.3f} "
        f"(mean accepted length {before.mean_accepted_length:.2f}), after "
        f"{after.forwards_per_token:.3f} (mean accepted length {after.mean_accepted_length:.2f},"
        f" acceptance rate {after.accepted / after.drafted:.2f}); k = {K}, drafter "
        f"{trainer.metrics()}"
    )
    return {"drafter": drafter, "trainer": trainer, "before": before, "after": after}


def test_speculation_needs_fewer_target_forwards_once_trained(online):
    before, after = online["before"], online["after"]
    assert before.forwards_per_token > 0.9  # an untrained drafter is almost never right
    assert after.forwards_per_token <= 0.5  # the goal
    assert after.mean_accepted_length >= 2.0
    assert all(len(tokens) == NEW_TOKENS for tokens in after.token_ids)


@pytest.mark.parametrize("trained", [False, True])
def test_speculative_logprobs_are_the_targets_on_a_full_recompute(engine, online, trained):
    """Sampled with temperature 0.8 and top-k 40: every returned log-prob equals the
    target's processed log-prob of that token from one plain forward over prompt +
    completion (float32; the cache with holes only reorders the arithmetic)."""
    sampling = SamplingParams(temperature=0.8, top_k=40, max_new_tokens=20, ignore_eos=True)
    drafter = online["drafter"] if trained else Drafter(engine.model)
    prompts = prompt_ids(engine, 500, 6)
    rollout = run(engine, prompts, sampling, drafter, k=3, seed=4)
    assert rollout.accepted > 0 or not trained
    for prompt, tokens, logprobs in zip(prompts, rollout.token_ids, rollout.logprobs, strict=True):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        expected = processed_logprobs(logits, sampling).gather(-1, torch.tensor(tokens)[:, None])
        assert torch.allclose(torch.tensor(logprobs), expected[:, 0], atol=1e-4)


@pytest.mark.parametrize("trained", [False, True])
def test_greedy_speculation_reproduces_the_engines_greedy_decoding(engine, online, trained):
    """Same tokens as TorchEngine.generate at temperature 0 (eos on: rows end at different
    steps), and the same log-probs on them."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24)
    texts = [ArithmeticTask(seed=9).prompt(i).text for i in range(12)]
    expected = engine.generate(texts, sampling)
    drafter = online["drafter"] if trained else Drafter(engine.model)
    prompts = [engine.tokenizer(text)["input_ids"] for text in texts]
    rollout = run(engine, prompts, sampling, drafter, k=K)
    for sample, tokens, logprobs in zip(expected, rollout.token_ids, rollout.logprobs, strict=True):
        assert tokens == sample.token_ids
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(sample.logprobs), atol=1e-4)
    if trained:
        assert rollout.mean_accepted_length > 1.5
