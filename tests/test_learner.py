"""The learner's pieces that can be checked without workers: the chunked log-prob
recompute (against an independent per-sequence computation), the split of a step over
mini-batches, ranks and micro-batches, the train step on recorded groups (micro-batched
gradients = whole-batch gradients; PPO mini-batches clip; two ranks train like one),
dynamic sampling, and the settings refused at start."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from asyncfp8.checks import max_staleness_of
from asyncfp8.launch.processes import free_ports
from asyncfp8.learner import Learner
from asyncfp8.learner.inbox import Inbox
from asyncfp8.learner.leases import LeaseBook
from asyncfp8.models import load_model
from asyncfp8.run import distributed
from asyncfp8.sync import Trajectory
from asyncfp8.train.batches import batch_tensors, check_split, plan_step
from asyncfp8.train.logprobs import completion_logprobs, install_logprob_head
from asyncfp8.train.step import lr_lambda
from tests.recorded import assert_same_updates, learner_config, save_groups, train

ROOT = Path(__file__).resolve().parent.parent


def one_by_one(model, trajectories, temperature):
    """Each sequence alone, unpadded, full logits in float64: (log-probs, entropies)."""
    logps, entropies = [], []
    for t in trajectories:
        ids = torch.tensor([list(t.prompt_ids) + list(t.token_ids)])
        logits = model(ids).logits[0].double() / temperature
        logp = torch.log_softmax(logits, -1)
        start = len(t.prompt_ids)
        rows = [start - 1 + k for k in range(len(t.token_ids))]
        logps.append([logp[r, tok].item() for r, tok in zip(rows, t.token_ids, strict=True)])
        entropies.append([-(logp[r].exp() * logp[r]).sum().item() for r in rows])
    return logps, entropies


def random_trajectories(seed=0):
    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for i, (p, c) in enumerate([(3, 5), (9, 1), (5, 8), (12, 4)]):
        ids = torch.randint(0, 256, (p + c,), generator=generator).tolist()
        trajectories.append(Trajectory(ids[:p], ids[p:], [-1.0] * c, [i] * c, 0.0, group_id="g"))
    return trajectories


@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, 1024), (0.7, 3)])
def test_recompute_matches_each_sequence_alone(tiny_model_dir, temperature, chunk):
    plain = load_model(tiny_model_dir).eval()
    model = load_model(tiny_model_dir).eval()
    install_logprob_head(model)
    trajectories = random_trajectories()
    batch = batch_tensors(trajectories, pad=257)
    with torch.no_grad():
        logp, entropy = completion_logprobs(model, batch, temperature, chunk_tokens=chunk)
        expected, expected_entropy = one_by_one(plain, trajectories, temperature)
    for row, values in enumerate(expected):
        n = len(values)
        assert batch.mask[row].sum() == n and not batch.mask[row, n:].any()
        torch.testing.assert_close(
            logp[row, :n].double(), torch.tensor(values, dtype=torch.float64), atol=2e-5, rtol=0
        )
        torch.testing.assert_close(
            entropy[row, :n].double(),
            torch.tensor(expected_entropy[row], dtype=torch.float64),
            atol=2e-5,
            rtol=0,
        )
        assert batch.versions[row, :n].tolist() == [row] * n
        assert (logp[row, n:] == 0).all()


def test_chunked_logprobs_give_the_full_softmax_gradient(tiny_model_dir):
    """The chunks are recomputed in the backward pass: the gradient must still be that
    of log_softmax over the full logits (here of an unmodified model)."""
    plain = load_model(tiny_model_dir).eval()
    chunked = load_model(tiny_model_dir).eval()
    install_logprob_head(chunked)
    trajectories = random_trajectories(seed=1)
    batch = batch_tensors(trajectories, pad=257)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2))
    logp, _ = completion_logprobs(chunked, batch, 0.9, chunk_tokens=4)
    (logp * weights * batch.mask).sum().backward()
    logits = plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    full = torch.log_softmax(logits.float() / 0.9, -1)[:, :-1]
    rows = full.gather(1, batch.positions[..., None].expand(-1, -1, full.shape[-1]))
    targets = batch.input_ids.gather(1, batch.positions + 1)
    reference = rows.gather(-1, targets[..., None])[..., 0]
    (reference * weights * batch.mask).sum().backward()
    grads = dict(plain.named_parameters())
    for name, param in chunked.named_parameters():
        # FP32 sums in another order: elementwise, within 1e-5 of the tensor's largest
        # gradient (measured at most 1.7e-6 of it; in one suite run an AVX2 CPU put one of
        # the 20,480 embedding or LM-head gradients 3e-5 off, past a fixed 1e-5, at a
        # largest gradient of 11 to 198); a gradient without the softmax's normalizer is
        # off by as much as the gradient itself
        scale = float(grads[name].grad.abs().max())
        torch.testing.assert_close(param.grad, grads[name].grad, atol=1e-5 * scale, rtol=1e-4)


# --- the split of a step ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "mini_batches", "budget"), [(1, 1, None), (2, 2, 60), (4, 1, 25)]
)
def test_plan_uses_every_sample_once_with_equal_work_per_rank(world, mini_batches, budget):
    lengths = [(7 * i) % 23 + 3 for i in range(32)]
    plan = plan_step(lengths, mini_batches, world, budget)
    assert len(plan) == mini_batches
    seen = []
    for m, mini in enumerate(plan):
        assert len(mini) == world
        assert len({len(share) for share in mini}) == 1  # same number of micro-batches
        assert len({sum(map(len, share)) for share in mini}) == 1  # same number of samples
        size = len(lengths) // mini_batches
        for share in mini:
            for micro in share:
                assert micro and all(m * size <= i < (m + 1) * size for i in micro)
                cost = len(micro) * max(lengths[i] for i in micro)
                assert budget is None or cost <= budget or len(micro) == 1
                seen += micro
    assert sorted(seen) == list(range(len(lengths)))


def test_a_sample_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    plan = plan_step([50, 5, 5, 5], mini_batches=1, world=1, budget=20)
    assert plan == [[[[0], [1, 2, 3]]]]


def test_a_world_size_the_step_cannot_be_split_over_is_refused():
    check_split(32, mini_batches=4, world=2)
    with pytest.raises(ValueError, match=r"run\.learner_procs.*multiple of 6"):
        check_split(32, mini_batches=3, world=2)


# --- the train step on recorded groups ----------------------------------------------------


def gradients(learner):
    return {
        name: param.grad.full_tensor().clone() for name, param in learner.model.named_parameters()
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_micro_batched_gradients_equal_the_whole_batch_gradient(
    make_learner, recorded, monkeypatch, dtype
):
    """Micro-batches with gradient accumulation give the whole batch's gradient: exactly
    up to rounding. In float64 that is 1e-12; in FP32 it is the rounding of GEMMs of
    other shapes (splitting a [16, 64] × [64, 192] product by rows alone moves it by
    3e-7 relative on this CPU), which a forward and backward carry to ~3e-6 of each
    tensor's norm, ~1.5e-6 at most per element."""
    monkeypatch.setattr(
        "asyncfp8.learner.build.load_model",
        lambda path, dtype=None, wanted=dtype: load_model(path, wanted),
    )
    # lr 0: the step leaves the weights alone, and its gradient stays in .grad. In float64
    # no correction: the corrections compute their weights in FP32.
    overrides = ["optim.lr=0", "optim.grad_clip=1e9", "optim.micro_batch_tokens=null"]
    if dtype == torch.float64:
        overrides.append("correction=none")
    learner = make_learner(*overrides)
    train(learner, recorded[0])
    whole = gradients(learner)
    assert all(g.dtype == dtype for g in whole.values())
    learner.cfg.optim.micro_batch_tokens = 30  # about 2 samples per micro-batch
    assert len(learner.shares(recorded[0])[0].mini_batches[0]) >= 6
    train(learner, recorded[0])
    micro = gradients(learner)
    assert any(g.abs().max() > 1e-2 for g in whole.values())
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for name, gradient in whole.items():
        error = (micro[name] - gradient).norm() / gradient.norm()
        assert error <= tolerance, (name, error.item())
        if dtype == torch.float64:
            torch.testing.assert_close(micro[name], gradient, atol=1e-6, rtol=0, msg=name)


def test_a_train_step_needs_no_sockets_and_trains_as_the_learner(
    make_learner, recorded, tiny_model_dir
):
    """`TrainStep` over a plain (unsharded) model and AdamW, built from the config alone,
    with no learner, process group, ports or processes: the learner's parameters after
    two steps."""
    from asyncfp8.train.step import plan_shares
    from tests.recorded import plain_train_step

    overrides = ["correction=token_tis", "optim.mini_batches=2"]
    step, model, cfg = plain_train_step(tiny_model_dir, *overrides)
    optim = cfg.optim
    assert not torch.distributed.is_initialized()
    for number, groups in enumerate(recorded[:2]):
        sums = step(plan_shares(groups, optim, world=1)[0], number, version=0)
        assert sums.totals.updates == 2 and len(sums.seen[0]) == 16

    learner = make_learner(*overrides)
    for groups in recorded[:2]:
        train(learner, groups)
    expected = distributed.full_state_dict(learner.model)
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=1e-5, atol=1e-6)


def test_mini_batches_move_the_ratio_so_ppo_clips(make_learner, recorded):
    one = make_learner("optim.lr=1e-2")
    assert train(one, recorded[0])["loss/ppo_clip_frac"] == 0  # one update: the ratio is 1
    four = make_learner("optim.lr=1e-2", "optim.mini_batches=4")
    metrics = train(four, recorded[0])
    assert metrics["optim/updates"] == 4
    assert metrics["loss/ppo_clip_frac"] > 0


def test_kl_and_entropy_terms_enter_the_loss_with_their_signs(make_learner, recorded):
    # Adam's first step moves every weight by about ±lr: at 1e-2 the step is too large
    # for its first-order effect on the entropy to show (one warm-started tiny model
    # ended the bonus run with less entropy than the plain one); at 1e-3 two tiny models
    # gained 0.007 and 0.12.
    settings = ("optim.lr=1e-3", "optim.mini_batches=2")
    plain = train(make_learner(*settings), recorded[0])
    assert plain["loss/total"] == pytest.approx(plain["loss/policy"]) and "loss/kl_ref" not in plain
    kl = train(make_learner(*settings, "optim.kl_coef=0.5", "optim.kl_estimator=k3"), recorded[0])
    # The first mini-batch is at the reference weights (KL 0), the second is not.
    assert kl["loss/kl_ref"] > 0 and kl["loss/total"] > kl["loss/policy"]
    # A bonus: the update raises the entropy the second mini-batch sees.
    bonus = train(make_learner(*settings, "optim.entropy_coef=10.0"), recorded[0])
    assert bonus["loss/entropy"] > plain["loss/entropy"]
    assert bonus["loss/total"] < bonus["loss/policy"]


@pytest.mark.slow
def test_two_ranks_train_like_one(tmp_path, tiny_model_dir, recorded):
    groups = tmp_path / "groups.json"
    save_groups(recorded, groups)
    # Adam turns float noise in a gradient near its eps into a step of up to lr: a larger
    # eps keeps the comparison about sharding, not about that amplification.
    settings = ["optim.micro_batch_tokens=40", "optim.mini_batches=2", "optim.eps=1e-6"]
    results = {}
    for procs in (1, 2):
        out = tmp_path / f"world{procs}.pt"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={procs}",
                str(ROOT / "tests" / "train_recorded.py"),
                str(tiny_model_dir),
                str(groups),
                str(tmp_path / f"run{procs}"),
                str(out),
                *settings,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        results[procs] = torch.load(out, weights_only=False)
    one, two = results[1]["parameters"], results[2]["parameters"]
    start = dict(load_model(tiny_model_dir).named_parameters())
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3  # it did train
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=0, msg=name)
    for a, b in zip(results[1]["metrics"], results[2]["metrics"], strict=True):
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-5)
        assert a["mismatch/kl_k3"] == pytest.approx(b["mismatch/kl_k3"], rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_learner_in_bfloat16_trains_like_the_cpu_one(make_learner, recorded):
    """On a GPU the learner computes in BF16 on FP32 masters: its first step's metrics and
    weights stay within BF16 rounding of the FP32 CPU learner's."""
    settings = ("optim.lr=1e-3", "optim.mini_batches=2", "optim.micro_batch_tokens=40")
    # The GPU learner first: its process group (gloo and NCCL) serves the CPU one too.
    gpu, cpu = make_learner(*settings, "run.device=cuda"), make_learner(*settings)
    assert gpu.ranks.device.type == "cuda" and gpu.dtype == torch.bfloat16
    on_cpu, on_gpu = train(cpu, recorded[0]), train(gpu, recorded[0])
    # BF16 keeps 8 mantissa bits, FP16 11: on an H100 the BF16 grad norm came out 5.2% off
    # the FP32 one (16.05 against 16.94) where FP16 stayed within 2% (test_loss_scale.py).
    assert on_gpu["optim/grad_norm"] == pytest.approx(on_cpu["optim/grad_norm"], rel=0.1)
    assert on_gpu["mismatch/kl_k3"] < 0.05
    assert_same_updates(gpu, cpu, lr=1e-3, steps=2)


def test_a_cuda_learner_puts_the_tf32_switches_back_when_it_closes(monkeypatch):
    """A CUDA learner turns TF32 on for its FP32 matmuls; the switches are the process's,
    so `close` restores them (later FP32 work in the process, the float32 decode tests
    after the GPU learner's, must not be rounded to TF32). The GPU is faked: only the
    switches are under test."""
    monkeypatch.setattr(distributed, "resolve_device", lambda setting: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(distributed.dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)  # a group exists
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: None)
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = matmul.allow_tf32, cudnn.allow_tf32
    try:
        matmul.allow_tf32, cudnn.allow_tf32 = False, True  # as torch starts
        ranks = distributed.start("cuda", 60)
        assert ranks.device.type == "cuda" and matmul.allow_tf32 and cudnn.allow_tf32
        distributed.close()
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, True)
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = before


def test_a_version_of_a_tied_model_sends_the_shared_weight_once(tmp_path, tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    tied = tmp_path / "tied"
    AutoModelForCausalLM.from_config(config).save_pretrained(tied)
    for name in Path(tiny_model_dir).iterdir():
        if name.name.startswith(("tokenizer", "special_tokens")):
            (tied / name.name).write_bytes(name.read_bytes())
    learner = Learner(learner_config(tied, tmp_path / "run"))
    try:
        # The gathered state dict names the shared weight twice; a version sends it once.
        assert "lm_head.weight" in distributed.full_state_dict(learner.model)
        sent = {}

        def capture(version, weights, extra, **_):  # VersionPublisher.publish's arguments
            sent.update(weights)

        learner.hub.versions.publish = capture
        learner.publisher.publish()
        learner.hub.sender.wait()  # the version is quantized and sent on a thread
        reference = dict(load_model(tied).named_parameters())
        assert set(sent) == set(reference) and "lm_head.weight" not in sent
        for name, value in sent.items():
            assert value.device.type == "cpu"
            torch.testing.assert_close(value, reference[name].detach().to(torch.bfloat16))
    finally:
        learner.close()


@pytest.mark.parametrize("quantize_from", ["master", "compute"])
def test_a_version_is_quantized_from_the_weights_precision_quantize_from_names(
    tmp_path, tiny_model_dir, quantize_from
):
    """With a BF16 learner forward, `precision.quantize_from=compute` quantizes the masters
    rounded to BF16 (what that forward uses), `master` the FP32 masters; the two differ."""
    learner = Learner(
        learner_config(
            tiny_model_dir,
            tmp_path / "run",
            "precision=fp8",
            "run.compute_dtype=bfloat16",
            f"precision.quantize_from={quantize_from}",
        )
    )
    try:
        sent = {}

        def capture(version, weights, extra, **_):  # VersionPublisher.publish's arguments
            sent.update(weights)

        learner.hub.versions.publish = capture
        # The model is saved in BF16: masters leave the BF16 grid once trained; a nudge
        # stands in for training here.
        with torch.no_grad():
            for param in learner.model.parameters():
                param.mul_(1.001)
        masters = {n: t.clone() for n, t in distributed.full_state_dict(learner.model).items()}
        learner.publisher.publish()
        learner.hub.sender.wait()
        policy = learner.policy
        from_master = dict(policy.quantize_weights(masters.items()))
        from_bf16 = dict(
            policy.quantize_weights((n, t.to(torch.bfloat16)) for n, t in masters.items())
        )
        expected = from_bf16 if quantize_from == "compute" else from_master
        other = from_master if quantize_from == "compute" else from_bf16
        assert sent and set(sent) <= set(expected)
        for name, value in sent.items():
            assert torch.equal(value, expected[name]), name
        assert any(not torch.equal(sent[name], other[name]) for name in sent)
    finally:
        learner.close()


def test_an_unknown_quantize_from_is_refused_naming_the_setting():
    from asyncfp8.precision import build_policy

    with pytest.raises(
        ValueError, match=r"precision\.quantize_from must be one of master, compute"
    ):
        build_policy({"name": "fp8", "quantize_from": "fp32"})


# --- dynamic sampling -----------------------------------------------------------------------


def test_dynamic_sampling_skips_groups_without_reward_spread_and_frees_their_capacity():
    book = LeaseBook(capacity=4, timeout=60)
    inbox = Inbox(f"tcp://127.0.0.1:{free_ports(1)[0]}", book, 2, {}, 0, None)
    try:
        lease = book.grant("w", 4, 0, time.monotonic())
        for prompt, rewards in zip(lease.prompts, ([1, 0], [1, 1], [0, 0], [0, 1]), strict=True):
            for seq, reward in enumerate(rewards):
                t = Trajectory(
                    [1], [2], [-0.5], [0], float(reward), "g", prompt, meta={"lease": lease.id}
                )
                t.sender, t.seq = "w/1", 10 * prompt + seq
                with inbox.lock:  # as its receiving thread does
                    inbox._add(t)
        assert book.open_groups == 4
        skip = lambda g: len({t.reward for t in g.trajectories}) == 1  # noqa: E731
        groups = inbox.take(2, 0, 1, timeout=1.0, skip=skip)
        assert [g.prompt for g in groups] == [lease.prompts[0], lease.prompts[3]]
        skipped = inbox.take_skipped()
        assert [g.prompt for g in skipped] == [lease.prompts[1], lease.prompts[2]]
        assert inbox.counts["skipped_groups"] == 2 and inbox.take_skipped() == []
        assert book.open_groups == 2  # the skipped ones no longer count against the bound
    finally:
        inbox.close()


# --- settings refused at start ---------------------------------------------------------------


def test_learning_rate_schedule():
    optim = OmegaConf.create({"warmup_steps": 4, "schedule": "cosine"})
    factor = lr_lambda(optim, steps=104)
    assert factor(0) == pytest.approx(0.25) and factor(3) == pytest.approx(1.0)
    assert factor(54) == pytest.approx(0.55) and factor(104) == pytest.approx(0.1)


def test_sync_mode_means_no_staleness_and_bad_modes_are_refused():
    run = OmegaConf.create({"mode": "sync", "max_staleness": 4})
    assert max_staleness_of(run) == 0
    run.mode = "async"
    assert max_staleness_of(run) == 4
    run.mode = "asynch"
    with pytest.raises(ValueError, match=r"run\.mode"):
        max_staleness_of(run)


def test_counts_must_be_positive_integers():
    from hydra import compose, initialize_config_module

    from asyncfp8.run.process import check_counts

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("config")
    check_counts(cfg)  # the defaults pass
    for key, bad in (("run.lease_groups", 0), ("run.steps", -1), ("sync.every", 0)):
        broken = cfg.copy()
        section, name = key.split(".")
        broken[section][name] = bad
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            check_counts(broken)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.mini_batches=0", r"optim\.mini_batches must be a positive integer"),
        ("optim.micro_batch_tokens=-5", r"optim\.micro_batch_tokens must be a positive"),
        ("optim.clip_ratio_c=0.5", r"optim\.clip_ratio_c must be > 1"),
        ("eval.every=-1", r"eval\.every must be an integer >= 0"),
    ],
)
def test_bad_training_settings_are_named(tmp_path, tiny_model_dir, override, message):
    with pytest.raises(ValueError, match=message):
        Learner(learner_config(tiny_model_dir, tmp_path, override))
    distributed.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_without_a_gpu_is_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"run\.device=cuda but torch sees no CUDA GPU"):
        Learner(learner_config(tiny_model_dir, tmp_path, "run.device=cuda"))


def test_out_of_memory_names_the_settings_to_change():
    expected = r"optim\.micro_batch_tokens=64.*activation_checkpointing"
    advice = distributed.memory_advice("a train step", {"optim.micro_batch_tokens": 64})
    with pytest.raises(MemoryError, match=expected), advice:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    unrelated = distributed.memory_advice("a train step", {})
    with pytest.raises(ValueError, match="unrelated"), unrelated:  # other errors pass through
        raise ValueError("unrelated")


@pytest.mark.slow
def test_a_split_the_ranks_cannot_share_fails_every_rank_within_seconds(tmp_path, tiny_model_dir):
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "asyncfp8.learner",
            f"model.path={tiny_model_dir}",
            "task=arithmetic",
            "run.max_new_tokens=8",
            f"run.dir={tmp_path}",
            "run.groups_per_step=3",
            "run.group_size=3",
            "run.device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "cannot be split evenly" in out and "run.learner_procs" in out
    assert time.monotonic() - started < 60  # imports and the process group, not a timeout
