"""precision=fp16 (issue 46, item 1): a built-in policy whose engines compute in float16.

What is checked: the policy is selectable wherever bf16 is (Hydra groups, engines'
`supports`, the planner); a version is the FP32 masters cast to FP16, and a weight past
FP16's range is refused naming it; an export is FP16 safetensors that transformers reads
back as float16; the torch engine in FP16 stays near an FP32 reference; and FP16 rollouts'
mismatch against the FP32 learner is a small fraction of BF16 rollouts' on the same
prompts (the issue's goal: k3 at most 0.3x). On the dev VM (2-core Intel Xeon, AVX-512, torch
2.13.0+cpu) the tiny model's k3 was 4.6e-7 (fp16) against 2.9e-4 (bf16): 0.0016x."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from asyncfp8.engines import SamplingParams, supports
from asyncfp8.engines.probe_scoring import next_token_logprobs
from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.models import load_model
from asyncfp8.precision import build_policy, get_policy, version_tensors
from asyncfp8.precision.export import export_checkpoint
from asyncfp8.tasks import ArithmeticTask

from .test_torch_engine import logprob_deltas, perturbed_state

TASK = ArithmeticTask(seed=3)
PROMPTS = [TASK.prompt(i).text for i in range(64)]
WEIGHT = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def engines(tiny_model_dir, one_thread):
    """The tiny model in the torch engine at bf16 and at fp16."""
    return {name: TorchEngine(str(tiny_model_dir), name, device="cpu") for name in ("bf16", "fp16")}


@pytest.fixture(scope="module")
def fp32_model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, sequence: list[int]) -> torch.Tensor:
    ids = torch.tensor([sequence])
    with torch.no_grad():
        return next_token_logprobs(model(ids).logits, ids)[0]


def test_precision_fp16_is_selectable_wherever_bf16_is(tiny_model_dir):
    from hydra import compose, initialize_config_module

    from asyncfp8.plan.precisions import get_precision

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        for config in ("config", "demo"):  # the launcher, learner and worker; the demo
            cfg = compose(config, overrides=["precision=fp16"])
            policy = build_policy(cfg.precision, tiny_model_dir)
            assert policy.name == "fp16" and policy.spec == "fp16"
            assert policy.engine_dtype == torch.float16
            assert policy.engine_config() == {"dtype": "float16"}
        with pytest.raises(
            ValueError, match=r"precision 'fp16' takes no parameter\(s\) \['lm_head"
        ):
            build_policy(
                compose(
                    "config", overrides=["precision=fp16", "+precision.lm_head_fp32=true"]
                ).precision
            )
    for engine in ("torch", "vllm", "sglang"):
        assert supports(engine, policy) is None, engine
    # The planner: 2 bytes a weight and a KV entry, GEMMs at the 16-bit tensor-core rate.
    priced = get_precision("fp16")
    assert (priced.weights, priced.kv, priced.kv_bytes_per_element) == ("bf16", "bf16", 2)
    assert priced.linear_bytes(96, 320) == 96 * 320 * 2


def test_a_version_is_the_fp32_masters_cast_to_fp16(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():  # off the BF16 grid: FP16 keeps 3 more bits of each
        for param in model.parameters():
            param.mul_(1.0 + 2**-10)
    version = dict(version_tensors(model, get_policy("fp16")).weights)
    masters = dict(model.named_parameters())
    assert version.keys() == masters.keys()
    for name, tensor in version.items():
        assert tensor.dtype == torch.float16, name
        assert torch.equal(tensor, masters[name].detach().to(torch.float16)), name
    assert not torch.equal(
        version[WEIGHT].float(), masters[WEIGHT].detach().to(torch.bfloat16).float()
    )


def test_a_weight_past_fp16s_range_is_refused_naming_it(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype=torch.float32)
    weight = dict(model.named_parameters())[WEIGHT]
    with torch.no_grad():
        weight.mul_(65504 / weight.abs().max())  # FP16's largest value: still sent
    assert torch.isfinite(dict(version_tensors(model, get_policy("fp16")).weights)[WEIGHT]).all()
    with torch.no_grad():
        weight[3, 5] = 7.0e4  # past it: would run as inf
    with pytest.raises(
        ValueError,
        match=rf"{WEIGHT}: 1 value\(s\) beyond FP16's range \(\|x\| up to 70000 > 65504, "
        r"first at \[3, 5\]\).*precision=bf16",
    ):
        dict(version_tensors(model, get_policy("fp16")).weights)
    dict(version_tensors(model, get_policy("bf16")).weights)  # BF16 has FP32's range
    with torch.no_grad():
        weight[3, 5] = float("nan")
    with pytest.raises(
        ValueError, match=rf"{WEIGHT}: 1 non-finite value\(s\) \(first at \[3, 5\]\)"
    ):
        dict(version_tensors(model, get_policy("fp16")).weights)


def test_an_activation_past_fp16s_range_is_caught_by_the_refit_probe_at_its_layer(
    tiny_model_dir,
):
    """Weights within range whose activations are not (layer 1's MLP input norm scaled
    3000x): the FP16 reference and engine both overflow there; the probe fails naming
    that layer and the cause, so the worker stops instead of sampling from it."""
    from asyncfp8.models import load_tokenizer
    from asyncfp8.precision import version_weights
    from asyncfp8.refit.probe import TOLERANCES, RefitChecker, probe_sequences
    from asyncfp8.refit.reference import ReferenceForward

    model = load_model(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight.mul_(3000)
    assert all(p.abs().max() < 65504 for p in model.parameters())
    policy = get_policy("fp16")
    policy.bind_model(model.config)
    texts = [TASK.prompt(i).text + TASK.completion(TASK.prompt(i)) for i in range(4)]
    batch = load_tokenizer(tiny_model_dir)(texts, return_tensors="pt", padding=True)
    ids, lengths = probe_sequences(batch["input_ids"], batch["attention_mask"], 4, 32)
    masters = [(name, p.detach()) for name, p in model.named_parameters()]
    probe = ReferenceForward(tiny_model_dir, policy).probe(masters, {}, ids, lengths)
    engine = TorchEngine(str(tiny_model_dir), "fp16", device="cpu")
    engine.update_weights(1, dict(version_weights(policy, masters)), {})
    check = RefitChecker(engine, TOLERANCES["torch"]).check(1, probe, {})
    assert not check.passed
    assert check.layers[0].startswith("model.layers.1 ")
    assert "log-probs not finite" in check.problems[0]
    assert "65504 in FP16" in check.cause and "precision=bf16" in check.cause


def test_an_export_is_fp16_and_transformers_reads_it_back_as_float16(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    masters = load_model(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in masters.parameters():
            param.mul_(1.0 + 2**-10)
    named = [(name, p.detach()) for name, p in masters.named_parameters()]
    out = export_checkpoint(get_policy("fp16"), tiny_model_dir, tmp_path / "fp16", tensors=named)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float16" and "quantization_config" not in config
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F16"}  # noqa: SIM118
    assert AutoConfig.from_pretrained(out, local_files_only=True).dtype == torch.float16
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.float16  # loaded as saved
    state = model.state_dict()
    for name, master in named:
        assert torch.equal(state[name], master.to(torch.float16)), name


def test_the_torch_engine_in_fp16_stays_near_an_fp32_reference(engines, fp32_model):
    """Teacher-forced on the same sequences: FP16's 10 mantissa bits keep the engine well
    within a bound BF16's 7 do not, and at least 4x nearer on average (8x finer rounding)."""
    samples = engines["bf16"].generate(
        PROMPTS[:16], SamplingParams(temperature=1.0, max_new_tokens=16, seed=0)
    )
    sequences = [s.prompt_ids + s.token_ids for s in samples]
    reference = [reference_logprobs(fp32_model, seq) for seq in sequences]
    delta = {
        name: torch.cat(
            [
                (got - want).abs()
                for got, want in zip(engine.score(sequences).logprobs, reference, strict=True)
            ]
        )
        for name, engine in engines.items()
    }
    print({name: (d.mean().item(), d.max().item()) for name, d in delta.items()})
    assert engines["fp16"].model.dtype == torch.float16
    assert delta["fp16"].mean() < 0.01 and delta["fp16"].max() < 0.1
    assert delta["fp16"].mean() * 4 < delta["bf16"].mean()


def test_fp16_rollouts_mismatch_the_fp32_learner_far_less_than_bf16_rollouts(engines, fp32_model):
    """Each engine samples the same prompts (temperature 1, one seed); the FP32 learner
    recomputes its tokens; k3 = mean(rho - log rho - 1) over them, as the step metrics'."""
    k3 = {}
    for name, engine in engines.items():
        samples = engine.generate(
            PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=24, seed=0)
        )
        learner = torch.cat(
            [
                reference_logprobs(fp32_model, s.prompt_ids + s.token_ids)[len(s.prompt_ids) - 1 :]
                for s in samples
            ]
        )
        rollout = torch.cat([torch.tensor(s.logprobs) for s in samples])
        log_ratio = learner - rollout
        k3[name] = (log_ratio.exp() - 1 - log_ratio).mean().item()
    print(f"k3 fp16 {k3['fp16']:.3g}, bf16 {k3['bf16']:.3g}: {k3['fp16'] / k3['bf16']:.4f}x")
    assert k3["bf16"] > 0
    assert k3["fp16"] <= 0.3 * k3["bf16"]  # the goal


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_runs_fp16_from_an_fp16_copy_and_takes_fp16_versions(tiny_model_dir, vllm_module):
    from asyncfp8.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), "fp16", max_model_len=256)
    assert engine.llm.llm_engine.model_config.dtype == torch.float16
    # Started from an FP16 copy of the model, so that FP16 versions fit what it holds.
    assert json.loads((engine.model_dir / "config.json").read_text())["dtype"] == "float16"
    learner = perturbed_state(tiny_model_dir)
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in learner.named_parameters()}
    with pytest.raises(ValueError, match=r"torch\.bfloat16, the engine's .* torch\.float16"):
        engine.update_weights(1, bf16)
    engine.update_weights(2, dict(version_tensors(learner, get_policy("fp16")).weights))
    samples = engine.generate(
        PROMPTS[:6], SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=0)
    )
    assert all(s.versions == [2] * len(s.token_ids) for s in samples)
    deltas = logprob_deltas(learner, samples, 0.8)
    print(f"vllm fp16 after an update: mean |dlogp| {deltas.mean():.4f}, max {deltas.max():.3f}")
    # The engine before the update scores ~0.3 against the new weights (test_vllm_engine).
    assert 0 < deltas.mean() < 0.01
