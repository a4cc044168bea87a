"""correction.proximal=version (issue 45, item 2): π_prox of a stale token is the
learner's own weights of the version that sampled it, checked against a separately
loaded copy of those weights; tokens of a version the learner did not keep fall back to
the current weights and are counted; the settings it cannot run with are refused; the
default (auto) takes it wherever the learner can keep the versions."""

import copy

import pytest
import torch

from asyncfp8.checks import check_training
from asyncfp8.models import load_model
from asyncfp8.run import distributed
from asyncfp8.train.logprobs import completion_logprobs, install_logprob_head
from asyncfp8.train.versions import VersionWeights, choose_proximal
from tests.config import compose


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["correction.mode=bypass"], "correction.proximal=version needs correction.mode=decoupled"),
        (["run.learner_procs=2"], "correction.proximal=version runs on one learner rank only"),
    ],
)
def test_settings_it_cannot_run_with_are_refused_naming_them(overrides, message):
    check_training(compose("correction.proximal=version"))
    with pytest.raises(ValueError, match=message):
        check_training(compose("correction.proximal=version", *overrides))
    with pytest.raises(Exception, match=r"correction\.proximal"):
        compose("correction.proximal=oldest")


def test_auto_keeps_the_versions_where_it_can_and_says_why_not():
    gib, small = 2**30, 10**6
    assert choose_proximal("auto", "decoupled", 1, small, 2, 8 * gib)[0] == "version"
    assert choose_proximal("auto", "decoupled", 1, small, 2, None)[0] == "version"  # unknown
    # 500M parameters, 2 versions kept and one for swaps: 6e9 bytes, over half of 8 GiB
    for mode, ranks, parameters, reason in [
        ("bypass", 1, small, "bypass mode has no π_prox"),
        ("decoupled", 2, small, "2 learner ranks"),
        ("decoupled", 1, 500 * 10**6, "takes 5.6 GiB of host memory, more than 50% of the 8.0"),
    ]:
        chosen, why = choose_proximal("auto", mode, ranks, parameters, 2, 8 * gib)
        assert chosen == "current" and reason in why
    # asked for by name, it is what was asked (the start checks refuse what cannot run)
    assert choose_proximal("current", "decoupled", 1, small, 2, 8 * gib)[0] == "current"
    assert choose_proximal("version", "decoupled", 1, 500 * 10**6, 2, gib)[0] == "version"


def test_the_store_keeps_the_newest_versions_and_a_swap_puts_the_weights_back():
    model = torch.nn.Linear(3, 2)
    store = VersionWeights(model, keep=2)
    seen = {}
    for version in range(3):
        with torch.no_grad():
            model.weight.fill_(version)
        store.record(version)
        seen[version] = model.weight.detach().clone()
    assert (store.has(0), store.has(1), store.has(2), store.live) == (False, True, True, 2)
    with torch.no_grad():
        model.weight.fill_(9.0)
    store.changed()
    with store.swapped_in(1):
        assert torch.equal(model.weight, seen[1])
    assert (model.weight == 9.0).all() and store.live is None


def test_a_swap_scores_with_the_versions_own_kv_scales_and_puts_the_latest_back():
    """An FP8 KV cache's scales change with every version; a stale token was cached with
    its own version's, so the quantized learner must read those while scoring it."""
    from asyncfp8.precision import get_policy

    policy = get_policy("fp8+fp8_kv")
    kv_part = policy.parts[1]
    model = torch.nn.Linear(3, 2)
    store = VersionWeights(model, keep=2, policy=policy)
    for version in range(3):
        kv_part.latest_scales = {0: (torch.tensor(float(version)), torch.tensor(1.0))}
        store.record(version)
    assert sorted(store.states) == [1, 2]  # the evicted version's state goes with it
    with store.swapped_in(1):
        assert kv_part.latest_scales[0][0].item() == 1.0
    assert kv_part.latest_scales[0][0].item() == 2.0


@pytest.mark.slow
def test_stale_tokens_are_scored_under_their_own_versions_weights(tiny_model_dir, tmp_path):
    from asyncfp8.learner import Learner
    from asyncfp8.train.batches import batch_tensors
    from tests.recorded import learner_config, record_groups, train

    groups = record_groups(tiny_model_dir, steps=2, groups=4, group_size=4, seed=2)
    learner = Learner(learner_config(tiny_model_dir, tmp_path))  # the default: auto
    try:
        assert learner.proximal == "version" and learner.version_weights is not None
        learner.version = 0
        learner.version_weights.record(0)  # what publishing version 0 does
        train(learner, groups[0])
        learner.version = 1
        learner.version_weights.record(1)
        # the second batch: its first half sampled by version 0, a sample of version 7
        # (never kept), the rest by version 1
        batch = copy.deepcopy(groups[1])
        samples = [t for g in batch for t in g.trajectories]
        for i, t in enumerate(samples):
            version = 7 if i == len(samples) - 1 else 0 if i < len(samples) // 2 else 1
            t.versions = [version] * len(t.token_ids)
        share = learner.shares(batch)[0]
        # the live weights' log-probs from a copy, not a forward of the learner's model: a
        # forward leaves FSDP2's root unit unsharded, which once hid that the training
        # forward after a swap ran with the swapped version's root weights (0.15 nats off)
        live = load_model(tiny_model_dir, dtype=torch.float32)
        install_logprob_head(live)
        live.load_state_dict(distributed.full_state_dict(learner.model))
        with torch.no_grad():
            current = completion_logprobs(
                live, batch_tensors(samples, learner.tokenizer.pad_token_id), 1.0
            )[0]
        sums = learner.train_step(share, learner.step, learner.version)
    finally:
        learner.close()
    version_0 = load_model(tiny_model_dir, dtype=torch.float32)  # the weights it started from
    install_logprob_head(version_0)
    with torch.no_grad():
        before = completion_logprobs(
            version_0, batch_tensors(samples, learner.tokenizer.pad_token_id), 1.0
        )[0]
    (saw,) = sums.seen
    for i, t in enumerate(samples):
        n = len(t.token_ids)
        expected = before[i, :n] if t.versions[0] == 0 else current[i, :n]
        torch.testing.assert_close(saw[i], expected, rtol=0, atol=1e-5)
    assert not torch.allclose(before[: len(samples) // 2], current[: len(samples) // 2])
    stale = sum(len(t.token_ids) for t in samples if t.versions[0] == 0)
    assert sums.totals.proximal_version_tokens == stale
    assert sums.totals.proximal_fallback_tokens == len(samples[-1].token_ids)
