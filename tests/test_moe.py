"""Mixture-of-experts models (asyncfp8/moe/, docs/moe.md): the shipped Qwen3-MoE models,
the supported-architecture check, the load-balancing loss against a reference written
here, the expert-load counts, the router tap, the refusals at start, and runs through the
launcher (one learner rank and two)."""

import json
import shutil

import pytest
import torch

from asyncfp8.moe import ExpertLoad, RouterTap, check_architecture, load_balancing_loss, moe_layout
from asyncfp8.report.summary import per_step
from tests.launched import launch, refusal


def test_the_shipped_moe_models_are_qwen3_moe_and_dense_ones_kept_their_keys():
    from asyncfp8.models.tiny import SHIPPED_DIR, make_tiny_model, shipped_on

    for size, task, experts in (("tiny_moe", "arithmetic", 4), ("small_moe", "addition", 8)):
        path = shipped_on(size, task)
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == ["Qwen3MoeForCausalLM"]
        assert moe_layout(config).experts == experts and moe_layout(config).top_k == 2
    # The dense models' fingerprints leave the MoE fields out: the ones shipped before
    # MoE existed are still found, not rebuilt.
    assert make_tiny_model("tiny", progress=False).parent == SHIPPED_DIR
    assert shipped_on("small", "addition").parent == SHIPPED_DIR


def test_only_qwen3_moe_with_every_layer_moe_is_accepted():
    qwen3 = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
    }
    check_architecture(qwen3, "m")
    assert moe_layout(qwen3).layers == (0, 1, 2)
    check_architecture({"architectures": ["Qwen2ForCausalLM"]}, "m")  # dense: passes
    assert moe_layout({"architectures": ["Qwen2ForCausalLM"]}) is None
    refused = {
        "DeepseekV3ForCausalLM": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "n_routed_experts": 64,
        },
        "MixtralForCausalLM": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8},
    }
    for name, config in refused.items():
        with pytest.raises(ValueError, match=f"m: the mixture-of-experts architecture {name}"):
            check_architecture(config, "m")
    with pytest.raises(ValueError, match="dense layers between the MoE ones"):
        check_architecture(qwen3 | {"mlp_only_layers": [1]}, "m")
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        check_architecture(qwen3 | {"decoder_sparse_step": 2}, "m")


def reference_balance_loss(logits, mask, experts, top_k):
    """Switch Transformer's loss written out token by token: E · Σ_e (picks of e per real
    token) · (e's mean probability over real tokens), every layer's tokens pooled."""
    picks, probs, tokens = [0.0] * experts, [0.0] * experts, 0
    real = mask.reshape(-1).tolist()
    for layer in logits:
        for row, keep in zip(layer.tolist(), real, strict=True):
            if not keep:
                continue
            tokens += 1
            p = torch.tensor(row, dtype=torch.float64).softmax(-1)
            for e in p.topk(top_k).indices.tolist():
                picks[e] += 1
            for e in range(experts):
                probs[e] += p[e].item()
    return experts * sum(picks[e] / tokens * probs[e] / tokens for e in range(experts))


def test_the_balance_loss_matches_the_switch_formula_and_its_bounds():
    torch.manual_seed(0)
    experts, top_k = 4, 2
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])  # padding on both sides
    logits = [torch.randn(8, experts) * 2 for _ in range(3)]
    got = load_balancing_loss(logits, mask, experts, top_k).item()
    assert got == pytest.approx(reference_balance_loss(logits, mask, experts, top_k), rel=1e-5)
    # Padding is left out: changing a padded row's logits changes nothing.
    moved = [layer.clone() for layer in logits]
    moved[0][3] = torch.tensor([50.0, 0, 0, 0])
    assert load_balancing_loss(moved, mask, experts, top_k).item() == pytest.approx(got, rel=1e-6)
    # Even: every expert equally likely and equally picked -> top_k. Collapsed: two experts
    # take every token with certainty -> experts.
    even = [
        torch.tensor(
            [[0.0] * experts] * 4 + [[1e-3 * (i % 4 == e) for e in range(4)] for i in range(4)]
        )
    ]
    flat = torch.ones(1, 8)
    assert load_balancing_loss(even, flat, experts, top_k).item() == pytest.approx(top_k, rel=1e-2)
    collapsed = [torch.tensor([[40.0, 40.0, 0, 0]] * 8)]
    assert load_balancing_loss(collapsed, flat, experts, top_k).item() == pytest.approx(
        experts, rel=1e-6
    )


def test_expert_load_counts_real_tokens_and_reads_as_shares():
    load = ExpertLoad(layers=2, experts=4)
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding
    chosen = [torch.tensor([[0, 1], [0, 2], [3, 3]]), torch.tensor([[0, 1], [2, 3], [0, 0]])]
    load.add(chosen, mask)
    assert load.counts.tolist() == [[2, 1, 1, 0], [1, 1, 1, 1]]
    # Summed over ranks as floats, back: unchanged.
    load.load_floats({k: 2 * v for k, v in load.as_floats().items()})
    assert load.counts.tolist() == [[4, 2, 2, 0], [2, 2, 2, 2]]
    metrics = load.metrics()
    assert metrics["moe/expert_load_max"] == 2.0  # layer 0's expert 0: half of the picks
    assert metrics["moe/expert_load_min"] == 0.0  # layer 0's expert 3: starved
    assert ExpertLoad(1, 4).metrics() == {}  # no picks yet: nothing to report


def test_the_router_tap_records_each_layer_once_inside_reading_only(tiny_moe_dir):
    from asyncfp8.hf.loading import load_model

    model = load_model(tiny_moe_dir, dtype=torch.float32)
    tap = RouterTap(model)
    layout = tap.layout
    assert (layout.experts, layout.top_k, len(layout.layers)) == (4, 2, 2)
    ids = torch.randint(0, 256, (2, 5))
    model(input_ids=ids)  # outside reading(): nothing kept
    assert tap.logits == [] and tap.chosen == []
    # Activation checkpointing recomputes each layer in the backward, outside reading().
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with tap.reading() as routes:
        loss = model(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    assert len(routes.logits) == len(routes.chosen) == 2
    assert routes.logits[0].shape == (10, 4) and routes.chosen[0].shape == (10, 2)
    # The picks are the top-2 of the logits the tap kept.
    assert torch.equal(
        routes.chosen[1].sort(-1).values, routes.logits[1].topk(2).indices.sort(-1).values
    )


def test_a_dense_model_has_no_routers_to_tap(tiny_model_dir):
    from asyncfp8.hf.loading import load_model

    with pytest.raises(ValueError, match="no routed experts to tap"):
        RouterTap(load_model(tiny_model_dir, dtype=torch.float32))


def test_moe_settings_the_library_cannot_honour_are_refused_at_start(
    tmp_path, tiny_moe_dir, tiny_model_dir
):
    # The balance loss asks for routers.
    for setting in ("optim.router_aux_coef=0.01", "correction.routing_replay=true"):
        message = refusal(tiny_model_dir, tmp_path / "dense", setting)
        key = setting.split("=")[0]
        assert f"{key} is for an MoE's routers, but {tiny_model_dir} is a dense model" in message
    # Replay needs an engine that returns the routes it ran.
    for setting, why in (
        ("engine=vllm", "engine vllm returns no routes here"),
        (
            "engine.speculative.mode=fixed engine.slots=8",
            "no routes for the tokens a speculative step keeps",
        ),
        ("correction.proximal_thread=true", "scores π_prox without the engine's routes"),
    ):
        message = refusal(
            tiny_moe_dir, tmp_path / "replay", "correction.routing_replay=true", *setting.split()
        )
        assert f"correction.routing_replay=true with model {tiny_moe_dir}" in message, message
        assert why in message, message
    message = refusal(tiny_moe_dir, tmp_path / "negative", "optim.router_aux_coef=-1")
    assert "optim.router_aux_coef must be >= 0" in message
    # Another family's experts: refused, naming the model and its architecture.
    mixtral = tmp_path / "mixtral"
    shutil.copytree(tiny_moe_dir, mixtral)
    config = json.loads((mixtral / "config.json").read_text())
    config |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    (mixtral / "config.json").write_text(json.dumps(config))
    message = refusal(mixtral, tmp_path / "mixtral-run", "engine=vllm")
    assert f"model {mixtral}: the mixture-of-experts architecture MixtralForCausalLM" in message


def test_the_fused_experts_split_into_the_names_save_pretrained_writes(tiny_moe_dir):
    """What vLLM and SGLang receive of a version: the learner's fused expert tensors under
    the checkpoint's per-expert names, equal to what transformers itself writes, and each
    part in its fused tensor's role; a dense tensor passes as it is."""
    from safetensors.torch import load_file

    from asyncfp8.hf.loading import load_model
    from asyncfp8.moe import checkpoint_named

    model = load_model(tiny_moe_dir, dtype=torch.float32)
    state = model.state_dict()
    fused = [name for name in state if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4  # two layers, two fused tensors each
    roles = {name: f"role of {name}" for name in state}
    named, split_roles = checkpoint_named(state, roles)
    written = load_file(tiny_moe_dir / "model.safetensors")  # save_pretrained's names
    assert set(named) == set(written) == set(split_roles)
    for name, tensor in written.items():
        assert torch.equal(named[name].to(tensor.dtype), tensor), name
    assert split_roles["model.layers.1.mlp.experts.3.up_proj.weight"] == (
        "role of model.layers.1.mlp.experts.gate_up_proj"
    )
    assert named["model.embed_tokens.weight"] is state["model.embed_tokens.weight"]
    assert checkpoint_named(state, None)[1] is None


def moe_metrics(run_dir):
    done = per_step(run_dir)
    assert done, "no steps"
    for record in done:
        assert record["moe/router_aux_loss"] >= 1.99  # top_k = 2 when even, more otherwise
        assert 0 <= record["moe/expert_load_min"] <= 1 <= record["moe/expert_load_max"] <= 4
    return done


@pytest.mark.slow
def test_an_moe_run_trains_with_the_balance_loss_and_exports_a_loadable_model(
    tmp_path, tiny_moe_dir
):
    from transformers import AutoModelForCausalLM

    run_dir, _ = launch(
        tmp_path, tiny_moe_dir, "run.steps=4", "optim.router_aux_coef=0.01", "precision=fp8_kv"
    )
    done = moe_metrics(run_dir)
    assert [r["step"] for r in done] == [1, 2, 3, 4]
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    start = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    # The routers trained (the policy loss and the balance loss both reach them).
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(exported.state_dict()[router], start.state_dict()[router])


@pytest.mark.slow
def test_an_moe_learner_runs_on_two_fsdp2_ranks(tmp_path, tiny_moe_dir):
    run_dir, _ = launch(
        tmp_path,
        tiny_moe_dir,
        "run.steps=3",
        "run.learner_procs=2",
        "run.workers=1",
        "optim.router_aux_coef=0.01",
        # each rank replays its micro-batches' routes, also in a checkpointed recompute,
        # through the experts' fake-quant forward over its FSDP2 shards
        "correction.routing_replay=true",
        "optim.activation_checkpointing=true",
        "precision=int8",
        "precision.learner_forward=quantized",
    )
    done = moe_metrics(run_dir)
    assert "2 rank(s)" in (run_dir / "learner.log").read_text()
    assert [r["step"] for r in done] == [1, 2, 3]
    assert all(r["moe/replayed_tokens"] > 0 for r in done)


def router_gradients(model_dir, groups, coef):
    """The routers' gradients after one train step (lr 0: the weights stay) on `groups`,
    one micro-batch, with optim.router_aux_coef = `coef`; and the step's metrics."""
    from asyncfp8.train.step import plan_shares
    from tests.recorded import plain_train_step

    overrides = ("optim.lr=0", "optim.grad_clip=1e9", "optim.micro_batch_tokens=null")
    step, model, cfg = plain_train_step(model_dir, *overrides, f"optim.router_aux_coef={coef}")
    sums = step(plan_shares(groups, cfg.optim, world=1)[0], 0, version=0)
    grads = {
        n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")
    }
    return grads, sums.moe


def test_the_balance_loss_reaches_the_routers_with_its_weight(tiny_moe_dir):
    """The step's router gradient with the balance loss at weight c, less the one without,
    is c times the gradient of transformers' own aux_loss on the same batch (its forward
    with output_router_logits): the term enters the loss once, at its weight, over the
    real tokens."""
    from asyncfp8.models import load_model, load_tokenizer
    from asyncfp8.train.batches import batch_tensors
    from tests.recorded import record_groups

    groups = record_groups(tiny_moe_dir, steps=1, groups=4, group_size=4)[0]
    coef = 0.5
    without, metrics = router_gradients(tiny_moe_dir, groups, 0.0)
    with_balance, _ = router_gradients(tiny_moe_dir, groups, coef)
    model = load_model(tiny_moe_dir, dtype=torch.float32)
    batch = batch_tensors(
        [t for g in groups for t in g.trajectories], load_tokenizer(tiny_moe_dir).pad_token_id
    )
    out = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True
    )
    out.aux_loss.backward()
    assert len(without) == 2  # one router per layer
    assert metrics["moe/router_aux_loss"] == pytest.approx(out.aux_loss.item(), rel=1e-5)
    for name, expected in ((n, p.grad) for n, p in model.named_parameters() if n in without):
        assert expected.abs().max() > 0, name
        torch.testing.assert_close(
            (with_balance[name] - without[name]) / coef, expected, rtol=1e-4, atol=1e-6
        )


@pytest.mark.slow
def test_a_vllm_worker_refits_the_moe_and_its_probe_agrees_at_every_version(
    tmp_path, tiny_moe_dir, vllm_module
):
    """vLLM loads the experts by their checkpoint names, and on the CPU wheel each refit
    repacks them (engines/vllm_engine.py): the refit probe compares the engine's log-probs
    with the learner's at every version, and none may fail."""
    run_dir, _ = launch(tmp_path, tiny_moe_dir, "run.steps=3", "engine=vllm", timeout=500)
    done = moe_metrics(run_dir)
    last = done[-1]
    probes = {k: v for k, v in last.items() if k.startswith("worker/") and "/refit/" in k}
    assert probes, "no refit probe metrics"
    assert all(v >= 3 for k, v in probes.items() if k.endswith("/refit/probes"))
    assert all(v == 0 for k, v in probes.items() if k.endswith("/refit/failures"))
    assert all(v < 0.1 for k, v in probes.items() if k.endswith("/refit/probe_mean_abs_dlogp"))


def test_the_refit_probe_catches_a_skipped_update_of_a_busy_expert(tiny_moe_dir):
    """A refit that left one expert of layer 1 at the previous version: caught, naming the
    layer, for the experts most of the probe's tokens go through (0 and 2: 109 and 70 of
    its 256 picks there). A quiet expert's (1 and 3: 35 and 42 picks) moves the layer's
    output RMS less than the probe's 1e-4 and passes unseen (docs/moe.md)."""
    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.models import load_model, load_tokenizer
    from asyncfp8.precision import calibrate_version, extra_roles, get_policy, version_weights
    from asyncfp8.precision.manifest import decoder_layers
    from asyncfp8.refit.probe import RefitChecker, probe_sequences
    from asyncfp8.refit.reference import ReferenceForward
    from tests.test_refit_probe import TASK, TIGHT, masters, stepped

    tokenizer = load_tokenizer(tiny_moe_dir)
    texts = [TASK.prompt(i).text + TASK.completion(TASK.prompt(i)) for i in range(4)]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    ids, lengths = probe_sequences(batch["input_ids"], batch["attention_mask"], 4, 32)
    prompts = [TASK.prompt(i).text for i in range(16)]
    calibration = dict(tokenizer(prompts, return_tensors="pt", padding=True))
    base = load_model(tiny_moe_dir, dtype=torch.float32)
    versions = [base, stepped(tiny_moe_dir, base)]
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    for skipped, caught in ((None, False), (0, True), (2, True)):
        policy = get_policy("bf16")
        policy.bind_model(base.config)
        reference = ReferenceForward(tiny_moe_dir, policy)
        engine = TorchEngine(str(tiny_moe_dir), get_policy("bf16"), device="cpu")
        sent = []
        for number, model in enumerate(versions):
            extra = calibrate_version(model, policy, calibration)
            probe = reference.probe(masters(model), extra, ids, lengths)
            roles = extra_roles(policy, extra)
            weights = dict(version_weights(policy, masters(model), roles, decoder_layers(model)))
            sent.append(weights)
            if number == 1 and skipped is not None:
                weights[fused] = weights[fused].clone()
                weights[fused][skipped] = sent[0][fused][skipped]
            engine.update_weights(number, weights, dict(extra), roles)
            check = RefitChecker(engine, TIGHT).check(number, probe, extra)
        assert check.passed is not caught, (skipped, check.describe())
        if caught:
            assert check.layers[0].startswith("model.layers.1 "), check.layers
