"""Online drafter training (asyncfp8/engines/speculative/training.py) on a small random Qwen2
target: the buffer, the loss going down, checkpoints, per-version acceptance metrics."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncfp8.engines.speculative.drafter import Drafter
from asyncfp8.engines.speculative.training import DrafterTrainer

# Tiny tensors: one torch thread for the whole module (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def qwen2(hidden=64, vocab=96, seed=0):
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # sharper than the init, so the target's distributions vary
        model.lm_head.weight.mul_(30)
    return model


@pytest.fixture(scope="module")
def target():
    return qwen2()


@torch.no_grad()
def rollouts(target, batch=8, length=40, seed=0):
    """Token sequences and the target's last hidden states over them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (batch, length), generator=g)
    hidden = target.model(input_ids=tokens).last_hidden_state
    return hidden, tokens


def test_observe_keeps_each_rows_real_positions_in_order_and_bounds_the_buffer(target):
    trainer = DrafterTrainer(Drafter(target), buffer_tokens=100)
    hidden, tokens = rollouts(target, batch=3, length=10)
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, 2:] = True  # left padding
    mask[1, [0, 1, 4, 7]] = True  # holes (rejected drafts)
    mask[2, 5] = True  # a single position: no training pair, dropped
    assert trainer.observe(hidden, tokens, mask) == 12
    first, second = trainer.buffer
    assert torch.equal(first.tokens, tokens[0, 2:]) and torch.equal(first.hidden, hidden[0, 2:])
    assert torch.equal(second.tokens, tokens[1, [0, 1, 4, 7]])
    assert torch.equal(second.hidden, hidden[1, [0, 1, 4, 7]])
    # FIFO within the token budget: 12 + 4 × 30 > 100, the oldest go first.
    for seed in range(4):
        trainer.observe(*rollouts(target, batch=1, length=30, seed=seed))
    assert trainer.buffered == sum(len(s.tokens) for s in trainer.buffer) <= 100
    assert len(trainer.buffer) == 3 and trainer.buffered == 90


def test_training_lowers_the_loss_and_leaves_the_target_alone(target):
    before = {name: p.detach().clone() for name, p in target.named_parameters()}
    trainer = DrafterTrainer(Drafter(target), lr=3e-3, batch_size=8, seed=0)
    trainer.observe(*rollouts(target, batch=16))
    first = trainer.train(1)
    trainer.train(80)
    last = trainer.train(10)
    assert last["loss"] < 0.6 * first["loss"]
    assert last["kl"] < first["kl"] and last["hidden_loss"] < first["hidden_loss"]
    assert last["top1"] > first["top1"]
    for name, param in target.named_parameters():
        assert torch.equal(param, before[name]) and param.grad is None, name
    assert trainer.metrics()["drafter/steps"] == 91
    assert trainer.train(0) == {} and DrafterTrainer(Drafter(target)).train(5) == {}


def test_a_deadline_cuts_training_short_after_at_least_one_step(target):
    trainer = DrafterTrainer(Drafter(target), lr=3e-3, batch_size=8, seed=0)
    trainer.observe(*rollouts(target, batch=4))
    passed = trainer.train(50, deadline=time.perf_counter())  # already passed
    assert passed["steps_last"] == 1 and trainer.steps == 1
    assert trainer.metrics()["drafter/train_calls_cut_short"] == 1
    ample = trainer.train(5, deadline=time.perf_counter() + 600)
    assert ample["steps_last"] == 5 and trainer.steps == 6
    assert trainer.metrics()["drafter/train_calls_cut_short"] == 1
    assert ample["train_seconds"] > 0


def test_loss_terms_match_an_independent_computation(target):
    """One step with the whole buffer as the batch (one sequence, window covering it):
    the reported losses equal smooth L1 / cross-entropy / KL computed here directly."""
    drafter = Drafter(target)
    trainer = DrafterTrainer(drafter, batch_size=1, max_seq_len=64, lr=0.0)
    hidden, tokens = rollouts(target, batch=1, length=20)
    trainer.observe(hidden, tokens)
    with torch.no_grad():
        features = drafter(hidden[:, :-1], tokens[:, 1:])
        smooth_l1 = torch.nn.functional.smooth_l1_loss(features, hidden[:, 1:])
        logp = target.lm_head(hidden[:, 1:]).log_softmax(-1)
        logq = target.lm_head(features).log_softmax(-1)
        ce = -(logp.exp() * logq).sum(-1).mean()
        kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    got = trainer.train(1)
    assert got["hidden_loss"] == pytest.approx(float(smooth_l1), rel=1e-5)
    assert got["ce_loss"] == pytest.approx(float(ce), rel=1e-5)
    assert got["kl"] == pytest.approx(float(kl), rel=1e-4, abs=1e-6)
    assert got["loss"] == pytest.approx(0.5 * float(smooth_l1) + 0.5 * float(ce), rel=1e-5)


def test_checkpoint_resumes_training_exactly(target):
    data = rollouts(target, batch=8)

    def trainer():
        torch.manual_seed(5)
        t = DrafterTrainer(Drafter(target), lr=3e-3, batch_size=4, seed=3)
        t.observe(*data)
        return t

    a = trainer()
    a.on_new_version(2)
    a.train(5)
    a.record_acceptance(torch.tensor([1, 3]), k=4)
    state = a.state_dict()
    b = trainer()
    b.load_state_dict(state)
    assert b.version == 2 and b.steps == 5
    assert b.acceptance_by_version() == a.acceptance_by_version()
    a.train(5)
    b.train(5)
    for (name, pa), pb in zip(a.drafter.named_parameters(), b.drafter.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    # A checkpoint of a drafter for another target is refused before anything changes.
    other = DrafterTrainer(Drafter(qwen2(vocab=128)))
    with pytest.raises(ValueError, match=r"another model: .*vocab_size"):
        other.load_state_dict(state)
    assert other.steps == 0 and other.version == -1


def test_acceptance_metrics_per_version(target):
    trainer = DrafterTrainer(Drafter(target))
    trainer.on_new_version(1)
    trainer.record_acceptance(torch.tensor([0, 4, 2]), k=4)
    trainer.record_acceptance(torch.tensor([4, 4, 0]), k=4, active=torch.tensor([1, 1, 0]))
    trainer.on_new_version(2)
    trainer.record_acceptance(torch.tensor([1]), k=2)
    by_version = trainer.acceptance_by_version()
    assert by_version[1]["verify_steps"] == 5 and by_version[1]["accepted"] == 14
    assert by_version[1]["acceptance_rate"] == pytest.approx(14 / 20)
    assert by_version[1]["mean_accepted_length"] == pytest.approx((14 + 5) / 5)
    metrics = trainer.metrics()
    assert metrics["drafter/version"] == 2
    assert metrics["spec/acceptance_rate"] == pytest.approx(0.5)
    assert metrics["spec/mean_accepted_length"] == pytest.approx(2.0)


def test_bad_input_is_refused(target):
    drafter = Drafter(target)
    with pytest.raises(ValueError, match="batch_size"):
        DrafterTrainer(drafter, batch_size=0)
    with pytest.raises(ValueError, match="weights"):
        DrafterTrainer(drafter, hidden_weight=0, ce_weight=0)
    trainer = DrafterTrainer(drafter)
    hidden, tokens = rollouts(target, batch=2, length=5)
    with pytest.raises(ValueError, match="tokens"):
        trainer.observe(hidden, tokens[:, :4])
    with pytest.raises(ValueError, match="hidden size"):
        trainer.observe(hidden[..., :32], tokens)
    with pytest.raises(ValueError, match="steps"):
        trainer.train(-1)
