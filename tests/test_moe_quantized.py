"""An MoE's experts in FP8 and INT8: each expert linear quantized on its own under its
checkpoint name, the router kept in high precision; the torch engine running them as the
refit probe's reference computes them; the learner's quantized forward matching the engine;
a run launched end to end (asyncfp8/precision/experts.py, docs/moe.md)."""

from __future__ import annotations

import pytest
import torch

from asyncfp8.precision import get_policy, version_weights
from asyncfp8.precision.manifest import Role, TensorRole, decoder_layers
from tests.launched import launch, refusal
from tests.test_moe import moe_metrics

EXPERTS = "model.layers.1.mlp.experts"


def reference_quantized(precision: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The format's torch reference quantizer (not the policy's dispatch) on one slice."""
    if precision == "fp8":
        from asyncfp8.precision.fp8 import BLOCK, quantize_blockwise_reference

        return quantize_blockwise_reference(weight, BLOCK)
    from asyncfp8.precision.int8 import quantize_per_channel_reference

    return quantize_per_channel_reference(weight)


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_each_expert_linear_is_quantized_on_its_own_and_the_router_is_not(precision, tiny_moe_dir):
    from safetensors.torch import load_file

    from asyncfp8.models import load_model

    model = load_model(tiny_moe_dir, dtype=torch.float32)
    policy = get_policy(precision)
    policy.bind_model(model.config)
    roles: dict[str, TensorRole] = {}
    sent = dict(version_weights(policy, model.named_parameters(), roles, decoder_layers(model)))
    # The weights under the checkpoint's names (what save_pretrained wrote), no fused one.
    weights = {name for name in sent if roles[name].role == Role.WEIGHT}
    assert weights == set(load_file(tiny_moe_dir / "model.safetensors"))
    scales = {name for name in sent if roles[name].role == Role.WEIGHT_SCALE}
    assert len(scales) == 2 * (4 * 3 + 4)  # per layer: 4 experts × 3 linears, q k v o
    fused = model.state_dict()[f"{EXPERTS}.gate_up_proj"]
    down = model.state_dict()[f"{EXPERTS}.down_proj"]
    half = fused.shape[1] // 2
    for e in range(fused.shape[0]):
        for part, rows in (
            ("gate_proj", fused[e, :half]),
            ("up_proj", fused[e, half:]),
            ("down_proj", down[e]),
        ):
            name = f"{EXPERTS}.{e}.{part}.weight"
            q, scale = reference_quantized(precision, rows.clone())
            assert torch.equal(sent[name].view(torch.uint8), q.view(torch.uint8)), name
            scale_name = next(s for s in scales if s.startswith(name))
            assert torch.equal(sent[scale_name], scale), scale_name
            assert roles[name] == TensorRole(Role.WEIGHT, 1)
    # The router stays in the engine's dtype, as veRL and slime keep it.
    router = "model.layers.1.mlp.gate.weight"
    assert sent[router].dtype == torch.bfloat16
    assert torch.equal(sent[router], model.state_dict()[router].bfloat16())


def test_8bit_experts_other_than_in_the_torch_engine_are_refused(tmp_path, tiny_moe_dir):
    message = refusal(tiny_moe_dir, tmp_path / "vllm", "precision=fp8", "engine=vllm")
    assert "8-bit experts run in the built-in torch engine only" in message


@pytest.mark.slow
def test_the_mixed_layout_measures_each_expert_linear(tiny_moe_dir):
    """precision=mixed on an MoE: each expert's gate, up and down are layers of the layout,
    measured one at a time, their FLOPs k/E of their size; a layout that keeps one expert
    sends it in BF16 and quantizes the others."""
    from asyncfp8.models import load_model, load_tokenizer
    from asyncfp8.precision import build_policy
    from asyncfp8.precision.sensitivity import calibration_batch, plan_layout
    from tests.test_refit_probe import TASK

    model = load_model(tiny_moe_dir, dtype=torch.float32)
    batch, mask = calibration_batch(TASK, load_tokenizer(tiny_moe_dir), 16)
    layout = plan_layout(model, get_policy("fp8"), batch, mask, budget=1.5)
    projections = ("gate_proj", "up_proj", "down_proj")
    linears = [
        f"model.layers.{i}.mlp.experts.{e}.{p}"
        for i in (0, 1)
        for e in range(4)
        for p in projections
    ]
    assert set(linears) <= set(layout.sensitivity)
    assert not any(name.endswith("mlp.gate") for name in layout.sensitivity)
    config = model.config
    assert layout.flops[linears[0]] == pytest.approx(
        config.hidden_size * config.moe_intermediate_size * 2 / 4
    )
    kept = f"{EXPERTS}.2"
    policy = build_policy(
        {"name": "mixed", "keep": [f"{kept}.{p}" for p in projections]},
        tiny_moe_dir,
    )
    sent = dict(version_weights(policy, model.named_parameters()))
    assert sent[f"{kept}.up_proj.weight"].dtype == torch.bfloat16
    assert f"{kept}.up_proj.weight_scale_inv" not in sent
    assert sent[f"{EXPERTS}.1.up_proj.weight"].dtype == torch.float8_e4m3fn


def skip_expert(weights: dict, previous: dict, expert: int) -> None:
    """A refit that left `expert` of layer 1 at the previous version (every tensor of it)."""
    fused = f"{EXPERTS}.gate_up_proj"
    if fused in weights:  # bf16: fused tensors
        for name in (fused, f"{EXPERTS}.down_proj"):
            weights[name] = weights[name].clone()
            weights[name][expert] = previous[name][expert]
        return
    for name in weights:
        if name.startswith(f"{EXPERTS}.{expert}."):
            weights[name] = previous[name]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp8", "int8", "fp8+fp8_kv"])
def test_the_engine_runs_8bit_experts_as_the_probe_reference_computes_them(precision, tiny_moe_dir):
    """Two versions through the torch engine: each passes the refit probe's tight tolerance
    (the reference quantizes every expert linear as the engine does), the log-probs are the
    quantized ones (not BF16's), and an update that skipped a busy expert is caught."""
    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.models import load_model, load_tokenizer
    from asyncfp8.precision import calibrate_version, extra_roles
    from asyncfp8.refit.probe import RefitChecker, probe_sequences
    from asyncfp8.refit.reference import ReferenceForward
    from tests.test_refit_probe import TASK, TIGHT, masters, stepped

    tokenizer = load_tokenizer(tiny_moe_dir)
    texts = [TASK.prompt(i).text + TASK.completion(TASK.prompt(i)) for i in range(4)]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    ids, lengths = probe_sequences(batch["input_ids"], batch["attention_mask"], 4, 32)
    calibration = dict(
        tokenizer([TASK.prompt(i).text for i in range(16)], return_tensors="pt", padding=True)
    )
    base = load_model(tiny_moe_dir, dtype=torch.float32)
    versions = [base, stepped(tiny_moe_dir, base)]
    bf16 = get_policy("bf16")
    bf16.bind_model(base.config)
    bf16_probe = ReferenceForward(tiny_moe_dir, bf16).probe(masters(base), {}, ids, lengths)
    for skipped in (None, 0):
        policy = get_policy(precision)
        policy.bind_model(base.config)
        reference = ReferenceForward(tiny_moe_dir, policy)
        engine = TorchEngine(str(tiny_moe_dir), get_policy(precision), device="cpu")
        sent: list[dict] = []
        for number, model in enumerate(versions):
            extra = calibrate_version(model, policy, calibration)
            probe = reference.probe(masters(model), extra, ids, lengths)
            roles = extra_roles(policy, extra)
            weights = dict(version_weights(policy, masters(model), roles, decoder_layers(model)))
            sent.append(dict(weights))
            if number == 0:
                shift = (probe.logprobs - bf16_probe.logprobs).abs().nanmean().item()
                assert shift > 1e-3, f"{precision}: the experts' log-probs are BF16's"
            if number == 1 and skipped is not None:
                skip_expert(weights, sent[0], skipped)
            engine.update_weights(number, weights, dict(extra), roles)
            check = RefitChecker(engine, TIGHT).check(number, probe, extra)
            if skipped is None or number == 0:
                assert check.passed, check.describe()
        if skipped is not None:
            assert not check.passed, f"{precision}: a skipped expert passed the probe"
            assert check.layers[0].startswith("model.layers.1 "), check.layers


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_the_quantized_learner_forward_is_the_engines_forward_on_an_moe(precision, tiny_moe_dir):
    """learner_forward=quantized on an MoE: the experts' linears fake-quantized over the
    fused parameters give what an FP32 engine running the version computes; the gradient
    reaches the fused parameters straight through."""
    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.models import load_model, load_tokenizer
    from asyncfp8.precision import version_tensors
    from asyncfp8.precision.experts import FakeQuantExperts

    def in_fp32(policy):
        policy.engine_dtype = torch.float32
        return policy

    policy = in_fp32(get_policy(precision))
    policy.learner_forward = "quantized"
    learner = policy.prepare_learner(load_model(tiny_moe_dir, dtype=torch.float32))
    assert isinstance(learner.model.layers[1].mlp.experts, FakeQuantExperts)
    names = {name for name, _ in learner.named_parameters()}
    assert f"{EXPERTS}.gate_up_proj" in names and f"{EXPERTS}.down_proj" in names
    version = version_tensors(learner, policy)
    engine = TorchEngine(str(tiny_moe_dir), in_fp32(get_policy(precision)), dtype=torch.float32)
    engine.update_weights(0, dict(version.weights), version.extra)
    tokenizer = load_tokenizer(tiny_moe_dir)
    ids = tokenizer(["12+34=", "7+8=15", "99+1=100"], return_tensors="pt", padding=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        engine_logp = torch.log_softmax(engine.model(ids).logits, -1)
        master = load_model(tiny_moe_dir, dtype=torch.float32)
        master_logp = torch.log_softmax(master(ids).logits, -1)
    learner_logp = torch.log_softmax(learner(ids).logits, -1)
    gaps = (learner_logp.detach() - engine_logp).abs().amax(-1).flatten()
    master_gaps = (master_logp - engine_logp).abs().amax(-1).flatten()
    # As the dense test says (test_precision): the same quantized products summed in
    # another order; most positions agree to 1e-4, where the master forward does not.
    assert (gaps < 1e-4).float().mean() >= 0.75, gaps
    assert (master_gaps < 1e-4).float().mean() < 0.25, master_gaps
    learner_logp[..., 0].sum().backward()
    gate_up = learner.model.layers[1].mlp.experts.gate_up_proj
    assert gate_up.grad is not None and gate_up.grad.abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        ("precision=fp8", "correction.routing_replay=true", "precision.learner_forward=quantized"),
        ("precision=mixed", "precision.budget=1.5"),  # the layout measured at start
    ],
    ids=["fp8-replay-quantized-forward", "mixed"],
)
def test_an_8bit_moe_run_trains_and_every_refit_probe_passes(tmp_path, tiny_moe_dir, settings):
    run_dir, _ = launch(tmp_path, tiny_moe_dir, "run.steps=3", *settings)
    done = moe_metrics(run_dir)
    assert [r["step"] for r in done] == [1, 2, 3]
    last = done[-1]
    probes = {k: v for k, v in last.items() if k.startswith("worker/") and "/refit/" in k}
    assert any(k.endswith("/refit/probes") and v >= 3 for k, v in probes.items()), probes
    assert all(v == 0 for k, v in probes.items() if k.endswith("/refit/failures")), probes
    if "correction.routing_replay=true" in settings:
        assert all(r["moe/replayed_tokens"] > 0 for r in done)
