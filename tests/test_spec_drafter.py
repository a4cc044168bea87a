"""The EAGLE-style drafter (asyncfp8/engines/speculative/drafter.py): shared frozen target modules,
its KV cache against a full recompute, drafting, and checkpoints from another model.

Target and drafter run in float64 here, so cached and recomputed features agree to 1e-10
(in float32 drafting on its own features compounds rounding: ~1e-4 after a few steps with
these deliberately large weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.speculative.drafter import Drafter
from asyncfp8.engines.torch_engine import processed_logprobs

ATOL = 1e-10


# Tiny tensors: one torch thread for the whole module (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def qwen2(hidden=64, heads=2, kv_heads=1, vocab=96, seed=0) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval().double()


@pytest.fixture(scope="module")
def target():
    return qwen2()


def make_drafter(target, seed=1) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter(target, dtype=torch.float64)
    # Larger weights than the init, so the test sees a drafter with sharp, varied outputs.
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return drafter


def features(batch, length, hidden=64, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, hidden, generator=g, dtype=torch.float64), torch.randint(
        0, 96, (batch, length), generator=g
    )


def test_embeddings_and_head_are_the_targets_shared_and_frozen(target):
    drafter = make_drafter(target)
    own = {id(p) for p in drafter.parameters()}
    assert id(target.model.embed_tokens.weight) not in own
    assert id(target.lm_head.weight) not in own
    assert not any("embed" in n or "lm_head" in n for n in drafter.state_dict())
    hidden, tokens = features(2, 5)
    out = drafter(hidden, tokens)
    # The drafter's logits are the target's LM head applied to its features.
    assert torch.allclose(drafter.logits(out), target.lm_head(out).float(), atol=1e-5)
    drafter.logits(out).logsumexp(-1).sum().backward()
    assert target.lm_head.weight.grad is None and target.model.embed_tokens.weight.grad is None
    assert drafter.fc.weight.grad is not None
    # A weight update applied to the target in place reaches the drafter (no copies).
    before = drafter.logits(out[:, :1].detach())
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
    try:
        assert torch.allclose(drafter.logits(out[:, :1].detach()), 2 * before, atol=1e-5)
    finally:
        with torch.no_grad():
            target.lm_head.weight.div_(2.0)


def reference_layer(drafter: Drafter, hidden, tokens):
    """The drafter's causal forward written out as the EAGLE layer is specified: each
    query head h attends with KV head h // (heads / kv_heads) (transformers' repeat_kv),
    by an explicit softmax: the independent check of the drafter's folded attention."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, repeat_kv

    fused = drafter.fc(torch.cat([drafter.embed(tokens), hidden], -1))
    batch, length, _ = fused.shape
    d = drafter.head_dim
    q = drafter.q_proj(fused).view(batch, length, drafter.heads, d).transpose(1, 2)
    k = drafter.k_proj(fused).view(batch, length, drafter.kv_heads, d).transpose(1, 2)
    v = drafter.v_proj(fused).view(batch, length, drafter.kv_heads, d).transpose(1, 2)
    cos, sin = drafter.rotary(v, torch.arange(length).expand(batch, length))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    groups = drafter.heads // drafter.kv_heads
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = q @ k.transpose(-1, -2) / d**0.5
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    h = fused + drafter.o_proj(attn.transpose(1, 2).reshape(batch, length, -1))
    return h + drafter.mlp(drafter.post_attention_layernorm(h))


def test_grouped_query_attention_reads_each_heads_own_kv_head():
    """4 query heads over 2 KV heads: the training forward and the cached extends equal
    the written-out layer (a fold that paired a query head with the wrong KV head, or
    masked the wrong rows, would not)."""
    target = qwen2(hidden=128, heads=4, kv_heads=2)
    drafter = make_drafter(target)
    hidden, tokens = features(2, 9, hidden=128)
    expected = reference_layer(drafter, hidden, tokens)
    assert torch.allclose(drafter(hidden, tokens), expected, atol=ATOL)
    cache = drafter.new_cache(2)
    drafter.extend(cache, hidden[:, :4], tokens[:, :4])
    out = drafter.extend(cache, hidden[:, 4:], tokens[:, 4:])
    assert torch.allclose(out, expected[:, 4:], atol=ATOL)


def test_cache_extends_equal_the_full_causal_forward(target):
    """Feeding a sequence in chunks of different sizes per row (masks with holes and left
    padding) gives the features of one causal forward over the whole sequence."""
    drafter = make_drafter(target)
    hidden, tokens = features(3, 12)
    full = drafter(hidden, tokens)
    cache = drafter.new_cache(3)
    # Row 0 in chunks 5+7, row 1 in 1+11, row 2 in 12+0; each chunk in a 9-wide slot with
    # the valid entries scattered (packing must keep their order).
    splits = [5, 1, 12]
    for chunk in range(2):
        width = 14
        h = torch.zeros(3, width, 64, dtype=torch.float64)
        t = torch.zeros(3, width, dtype=torch.long)
        m = torch.zeros(3, width, dtype=torch.bool)
        for row, split in enumerate(splits):
            part = range(0, split) if chunk == 0 else range(split, 12)
            slots = torch.arange(width)[torch.arange(width) % 2 == row % 2][: len(part)]
            if len(part) > len(slots):
                slots = torch.arange(width - len(part), width)
            h[row, slots] = hidden[row, list(part)]
            t[row, slots] = tokens[row, list(part)]
            m[row, slots] = True
        out = drafter.extend(cache, h, t, m)
        for row, split in enumerate(splits):
            part = list(range(0, split) if chunk == 0 else range(split, 12))
            assert torch.allclose(out[row, : len(part)], full[row, part], atol=ATOL)
    assert cache.lengths.tolist() == [12, 12, 12]
    assert torch.allclose(cache.last, full[:, -1], atol=ATOL)


@pytest.mark.parametrize("k", [1, 4])
def test_draft_equals_autoregressive_recompute_and_leaves_the_cache(target, k):
    drafter = make_drafter(target)
    hidden, tokens = features(4, 6)
    cache = drafter.new_cache(4)
    drafter.extend(cache, hidden, tokens)
    lengths, last = cache.lengths.clone(), cache.last.clone()
    sampling = SamplingParams(temperature=0.8, top_k=20)
    drafted, logq = drafter.draft(cache, k, sampling, torch.Generator().manual_seed(0))
    assert drafted.shape == (4, k) and logq.shape == (4, k, 96)
    assert torch.equal(cache.lengths, lengths) and torch.equal(cache.last, last)
    # Recompute: the drafter's own features are fed back as the next hidden input.
    h, t = hidden, tokens
    for step in range(k):
        out = drafter(h, t)
        expected = processed_logprobs(drafter.logits(out[:, -1]), sampling)
        assert torch.allclose(logq[:, step], expected, atol=ATOL)
        assert bool((logq[:, step].gather(-1, drafted[:, step, None]) > -float("inf")).all())
        h = torch.cat([h, out[:, -1:]], 1)
        t = torch.cat([t, drafted[:, step, None]], 1)
    again, _ = drafter.draft(cache, k, sampling, torch.Generator().manual_seed(0))
    assert torch.equal(again, drafted)


def test_greedy_draft_is_the_argmax_and_rollback_after_verification(target):
    """After a verify step a row keeps only its accepted positions: extending with the
    accepted mask gives what a cache fed only those entries gives."""
    drafter = make_drafter(target)
    hidden, tokens = features(2, 8)
    greedy = SamplingParams(temperature=0.0)
    cache = drafter.new_cache(2)
    drafter.extend(cache, hidden[:, :5], tokens[:, :5])
    drafted, _ = drafter.draft(cache, 3, greedy)
    assert torch.equal(drafted[:, 0], drafter.logits(cache.last).argmax(-1))
    # Row 0 accepts 3 positions of the verify step, row 1 only 1.
    accepted = torch.tensor([[True, True, True], [True, False, False]])
    drafter.extend(cache, hidden[:, 5:8], tokens[:, 5:8], accepted)
    reference = drafter.new_cache(2)
    drafter.extend(reference, hidden[:1, :8].expand(2, -1, -1), tokens[:1, :8].expand(2, -1))
    assert cache.lengths.tolist() == [8, 6]
    assert torch.allclose(cache.last[0], reference.last[0], atol=ATOL)
    alone = drafter.new_cache(1)
    drafter.extend(alone, hidden[1:, :6], tokens[1:, :6])
    assert torch.allclose(cache.last[1], alone.last[0], atol=ATOL)
    d_cache, _ = drafter.draft(cache, 3, greedy)
    d_alone, _ = drafter.draft(alone, 3, greedy)
    assert torch.equal(d_cache[1], d_alone[0])


def test_draft_needs_a_started_cache_and_k_at_least_1(target):
    drafter = make_drafter(target)
    cache = drafter.new_cache(2)
    with pytest.raises(ValueError, match="extend"):
        drafter.draft(cache, 2, SamplingParams())
    hidden, tokens = features(2, 3)
    drafter.extend(cache, hidden, tokens)
    with pytest.raises(ValueError, match="k must be"):
        drafter.draft(cache, 0, SamplingParams())
    # A slot that takes a new prompt: emptied, it must be extended again before drafting.
    cache.truncate(torch.tensor([3, 0]))
    with pytest.raises(ValueError, match="extend"):
        drafter.draft(cache, 2, SamplingParams())
    with pytest.raises(ValueError, match="shorten"):
        cache.truncate(torch.tensor([4, 0]))
    fresh = drafter.new_cache(1)
    drafter.extend(fresh, hidden[1:], tokens[1:])
    drafter.extend(cache, hidden, tokens, torch.tensor([[False] * 3, [True] * 3]))
    assert cache.lengths.tolist() == [3, 3]
    assert torch.allclose(cache.last[1], fresh.last[0], atol=ATOL)


def test_checkpoint_round_trip_and_refusal_of_another_models(target):
    drafter = make_drafter(target)
    state = drafter.state_dict()
    fresh = Drafter(target, dtype=torch.float64)
    fresh.load_state_dict(state)
    hidden, tokens = features(2, 4)
    assert torch.equal(fresh(hidden, tokens), drafter(hidden, tokens))

    for other, field in [
        (qwen2(hidden=128, heads=4, kv_heads=2), "hidden_size"),
        (qwen2(kv_heads=2), "num_key_value_heads"),
        (qwen2(vocab=128), "vocab_size"),
    ]:
        with pytest.raises(ValueError, match=f"another model: .*{field}"):
            Drafter(other).load_state_dict(state)
    # Nothing was copied before the refusal.
    untouched = Drafter(qwen2(vocab=128))
    before = {k: v.clone() for k, v in untouched.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(ValueError):
        untouched.load_state_dict(state)
    after = untouched.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

    plain = {k: v for k, v in state.items() if k != "_extra_state"}
    with pytest.raises(ValueError, match="not an asyncfp8 drafter checkpoint"):
        fresh.load_state_dict(plain)
    with pytest.raises(ValueError, match="another model"):
        drafter.bind_target(qwen2(hidden=128, heads=4, kv_heads=2))


def test_a_target_without_a_qwen2_config_is_refused():
    class Config:
        hidden_size = 64

    class NotQwen(torch.nn.Module):
        config = Config()

    with pytest.raises(ValueError, match="Qwen2-family"):
        Drafter(NotQwen())
