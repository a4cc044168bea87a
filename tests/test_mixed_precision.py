"""precision=mixed (issue 46): each linear layer's mismatch measured, the most harmful per
FLOP kept in BF16 within a budget, and the one decision (`quantizes`) honoured by the torch
engine, exported checkpoints and a launched run's learner and workers."""

import json
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module

import asyncfp8.conf  # noqa: F401
from asyncfp8.hf.cpu_half import is_plain_linear
from asyncfp8.models import load_model, load_tokenizer
from asyncfp8.precision import get_policy
from asyncfp8.precision.export import unquantized_layers
from asyncfp8.precision.modules import apply_policy
from asyncfp8.precision.sensitivity import (
    EngineTwin,
    LayoutDrift,
    calibration_batch,
    layout_kl,
    mean_kl,
    plan_layout,
)
from asyncfp8.tasks import build_task
from tests.launched import launch


@pytest.fixture(scope="module")
def measured(tiny_model_dir):
    """(model, calibration batch, mask) of the tiny model on the default task."""
    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("sensitivity", [f"model.path={tiny_model_dir}"])
    model = load_model(tiny_model_dir, dtype=torch.float32).eval()
    task = build_task(cfg.task, tiny_model_dir)
    batch, mask = calibration_batch(task, load_tokenizer(tiny_model_dir), 16)
    return model, batch, mask


def test_mean_kl_is_the_exact_kl_of_the_two_distributions():
    torch.manual_seed(0)
    engine, learner = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    mask = torch.tensor([[True, True, False, True, False], [False, True, True, True, True]])
    reference = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=engine.double()),
        torch.distributions.Categorical(logits=learner.double()),
    )[mask].mean()
    assert mean_kl(engine, learner, mask) == pytest.approx(float(reference), rel=1e-12)
    assert mean_kl(learner, learner, mask) == 0


class VariedLengths:
    """Prompts and completions of varied lengths (the default task's are all alike)."""

    def prompt(self, index):
        return SimpleNamespace(text="12+" * (1 + index % 4))

    def completion(self, prompt):
        return " " + "7" * (1 + len(prompt.text) % 3)


@pytest.mark.parametrize("varied", [False, True])
def test_calibration_measures_the_positions_that_predict_the_completion(tiny_model_dir, varied):
    """A rollout's mismatch is over its response tokens: the measure masks exactly the
    positions whose next token is the reference completion's, after the prompt's own
    tokens (as a rollout holds them), whatever the left padding."""
    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("sensitivity", [f"model.path={tiny_model_dir}"])
    task = VariedLengths() if varied else build_task(cfg.task, tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    batch, mask = calibration_batch(task, tokenizer, 8)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape
    assert (len(set(attention.sum(1).tolist())) > 1) == varied  # left-padded where they differ
    for row in range(8):
        prompt = task.prompt(row)
        prompt_ids = tokenizer(prompt.text)["input_ids"]
        completion = tokenizer(task.completion(prompt), add_special_tokens=False)["input_ids"]
        real = ids[row][attention[row].bool()].tolist()
        assert real == prompt_ids + completion
        predicted = ids[row][1:][mask[row][:-1]].tolist()  # the token after each masked one
        assert predicted == completion
        assert not mask[row][~attention[row].bool()].any()


@pytest.mark.parametrize("base", ["fp8", "int8"])
def test_the_twin_is_the_torch_engine_of_the_layout(measured, tiny_model_dir, base):
    """The model that measures a layout computes what the torch engine's modules of
    `precision=mixed` with that layout compute, bit for bit: what is measured is what
    will run (and kept layers are left as plain BF16 layers)."""
    model, batch, _ = measured
    policy = get_policy("mixed", base=base, keep=["model.layers.0.mlp.down_proj"])
    policy.bind_model(model.config)
    engine = apply_policy(load_model(tiny_model_dir, dtype=torch.bfloat16).eval(), policy)
    assert is_plain_linear(engine.model.layers[0].mlp.down_proj)
    assert not is_plain_linear(engine.model.layers[0].mlp.up_proj)
    twin = EngineTwin(model, policy.base)
    with torch.no_grad():
        expected = engine(**batch).logits.float()
    quantized = set(twin.switches) - {"model.layers.0.mlp.down_proj"}
    assert torch.equal(twin.logits(batch, quantized), expected)


def test_a_budget_is_met_by_keeping_the_most_harm_per_flop_and_no_layer_it_can_do_without(
    measured,
):
    model, batch, mask = measured
    base = get_policy("int8")
    layout = plan_layout(model, base, batch, mask, budget=1.5)
    assert layout.full > 1.5 * layout.floor  # the budget binds: INT8 everywhere is past it
    assert layout.kl <= 1.5 * layout.floor and 0 < len(layout.keep) < len(layout.flops)
    ranked = sorted(
        layout.sensitivity,
        key=lambda name: layout.sensitivity[name] / layout.flops[name],
        reverse=True,
    )
    # kept from the top of the harm-per-FLOP ranking (some may have gone back since)
    assert set(layout.keep) <= set(ranked[: ranked.index(layout.keep[-1]) + 1])
    # the run's own measure of the frozen layout agrees with the planner's
    policy = get_policy("mixed", base="int8", keep=layout.keep)
    assert layout_kl(model, policy, batch, mask) == pytest.approx((layout.kl, layout.floor))
    # none was kept that it did not need: each one given back is over the budget
    for name in layout.keep:
        fewer = get_policy("mixed", base="int8", keep=[n for n in layout.keep if n != name])
        assert layout_kl(model, fewer, batch, mask)[0] > 1.5 * layout.floor, name


def test_the_learner_measures_the_frozen_layout_again_on_a_versions_weights(
    measured, tiny_model_dir
):
    """LayoutDrift loads a version's gathered state into its own copy of the model and
    measures the frozen layout there: weights that moved give another KL, and a layout
    past its budget is named."""
    model = measured[0]
    keep = ["model.layers.0.self_attn.q_proj"]
    policy = get_policy("mixed", base="int8", keep=keep, budget=1.1, remeasure_every=5)
    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("sensitivity", [f"model.path={tiny_model_dir}"])
    drift = LayoutDrift(
        policy,
        load_model(tiny_model_dir, dtype=torch.float32),
        build_task(cfg.task, tiny_model_dir),
        load_tokenizer(tiny_model_dir),
    )
    assert [v for v in range(12) if drift.due(v)] == [5, 10]
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    first = drift.measure(state)
    expected = layout_kl(model, policy, drift.batch, drift.mask)
    assert (first["precision/layout_kl"], first["precision/layout_kl_bf16"]) == expected
    moved = dict(state)
    moved["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"] * 3
    assert drift.measure(moved)["precision/layout_kl"] != first["precision/layout_kl"]
    assert first["precision/layout_kl_ratio"] > 1.1  # INT8 on 13 of 14 layers: past 1.1x
    assert "past precision.budget=1.1" in drift.over_budget(first)
    assert drift.over_budget({**first, "precision/layout_kl_ratio": 1.05}) is None
    # an absolute target (precision.budget_kl) is held against the KL itself
    kl = first["precision/layout_kl"]
    drift.policy = get_policy("mixed", base="int8", keep=keep, budget_kl=kl / 2)
    assert f"past precision.budget_kl={kl / 2:.2e}" in drift.over_budget(first)
    drift.policy = get_policy("mixed", base="int8", keep=keep, budget_kl=kl * 2)
    assert drift.over_budget(first) is None
    with pytest.raises(ValueError, match="lacks 1 parameter"):
        drift.measure({k: v for k, v in state.items() if k != "lm_head.weight"})


def test_a_share_of_the_flops_is_quantized_least_harm_per_flop_first(measured):
    model, batch, mask = measured
    layout = plan_layout(model, get_policy("fp8"), batch, mask, quantized_share=0.5)
    assert 0.5 <= layout.quantized_share < 1
    total = sum(layout.flops.values())
    room = (layout.quantized_share - 0.5) * total  # FLOPs that could still be kept

    def harm(name):
        return layout.sensitivity[name] / layout.flops[name]

    # a quantized layer more harmful per FLOP than a kept one did not fit in the share
    least_kept = min(harm(name) for name in layout.keep)
    for name in set(layout.flops) - set(layout.keep):
        assert harm(name) <= least_kept or layout.flops[name] > room, name


def test_an_absolute_budget_plans_as_its_multiple_of_bf16_and_below_the_floor_is_refused(
    measured,
):
    """`precision.budget_kl`: a mean-KL target. Above BF16's own KL on the calibration
    texts it is the relative budget it comes to; below it no layout can meet it, and it is
    refused naming the floor measured."""
    model, batch, mask = measured
    base = get_policy("int8")
    relative = plan_layout(model, base, batch, mask, budget=1.5)
    absolute = plan_layout(model, base, batch, mask, budget_kl=1.5 * relative.floor)
    assert absolute.keep == relative.keep and absolute.kl == pytest.approx(relative.kl)
    floor = f"{relative.floor:.3e}"
    with pytest.raises(ValueError, match=rf"budget_kl=.* below BF16's own .*, {floor} \(measured"):
        plan_layout(model, base, batch, mask, budget_kl=0.5 * relative.floor)
    policy = get_policy("mixed", base="int8", budget_kl=1e-3)
    assert policy.budget is None and policy.budget_kl == 1e-3  # replaces the default budget
    with pytest.raises(ValueError, match=r"budget_kl and precision\.quantized_share"):
        get_policy("mixed", budget_kl=1e-3, quantized_share=0.5)
    with pytest.raises(ValueError, match="budget_kl must be > 0"):
        get_policy("mixed", budget_kl=0.0)


def test_bad_settings_are_refused_naming_them(measured):
    with pytest.raises(ValueError, match="below BF16's own mismatch"):
        get_policy("mixed", budget=0.9)
    with pytest.raises(ValueError, match="base must be one of fp8, int8"):
        get_policy("mixed", base="fp16")
    with pytest.raises(ValueError, match="quantized_share must be in"):
        get_policy("mixed", quantized_share=1.5)
    with pytest.raises(ValueError, match=r"precision\.base=fp8 takes none"):
        get_policy("mixed", base="fp8", profile="profile.safetensors")
    with pytest.raises(FileNotFoundError, match="make one with"):  # handed to the INT8 base
        get_policy("mixed", base="int8", profile="missing.safetensors")
    model = measured[0]
    unset = get_policy("mixed")
    with pytest.raises(ValueError, match=r"python -m asyncfp8\.plan\.layout"):
        unset.quantizes("model.layers.0.mlp.up_proj.weight", torch.zeros(4, 4))
    typo = get_policy("mixed", keep=["model.layers.0.mlp.up_prj"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_prj"):
        typo.bind_model(model.config)  # as every process's build_policy(cfg, model_dir)


def test_an_exported_checkpoint_lists_the_kept_layers_as_ignored(tiny_model_dir):
    for base, key in (("fp8", "ignored_layers"), ("int8", "ignore")):
        policy = get_policy("mixed", base=base, keep=["model.layers.1.self_attn.q_proj"])
        config = policy.checkpoint_config(unquantized_layers(policy, tiny_model_dir))
        assert "model.layers.1.self_attn.q_proj" in config[key], config


@pytest.mark.slow
def test_a_launched_mixed_run_measures_once_and_every_process_runs_the_layout(
    tmp_path, tiny_model_dir
):
    """The launcher measures the layout, writes it beside the run and starts the learner
    and the workers with it: the workers check every version's policy spec against
    their own, so a run that ends had one layout everywhere."""
    run_dir, output = launch(
        tmp_path,
        tiny_model_dir,
        "precision=mixed",
        "precision.name=mixed+fp8_kv",
        "precision.quantized_share=0.5",
        "precision.calibration_prompts=8",
        "precision.remeasure_every=2",
        "run.steps=4",
        "eval.every=0",
    )
    layout = json.loads((run_dir / "precision_layout.json").read_text())
    assert layout["quantized_share"] >= 0.5 and layout["keep"]
    assert "[launch] precision=mixed:" in output and "[launch] done in" in output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drift = [r["sync/version"] for r in records if "precision/layout_kl_ratio" in r]
    assert drift == [2, 4], drift  # the learner measured the frozen layout again
    saved = (run_dir / "config.yaml").read_text()
    for name in layout["keep"]:
        assert name in saved
