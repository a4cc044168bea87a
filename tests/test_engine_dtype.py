"""precision.engine_dtype: what the engine computes in around its quantized GEMMs. FP32 with
learner_forward=quantized leaves the activation quantizer no rounding to amplify, so the
engine samples what the learner computes (docs/precision.md, "The engine's compute dtype")."""

import pytest
import torch

from asyncfp8.engines import supports
from asyncfp8.precision import build_policy, get_policy, version_tensors


@pytest.mark.parametrize("name", ["bf16", "fp8", "int8", "fp8+fp8_kv", "fp8_kv", "bf16+fp8_kv"])
def test_the_engine_dtype_is_what_every_part_computes_in(name):
    policy = build_policy({"name": name, "engine_dtype": "float32"})
    assert policy.engine_dtype == torch.float32
    config = policy.engine_config()
    assert config["dtype"] == "float32" and config.get("lm_head_dtype", "float32") == "float32"
    for part in getattr(policy, "parts", []):
        assert part.engine_dtype == torch.float32
    assert build_policy({"name": name}).engine_dtype == torch.bfloat16  # the default kept


def test_a_mixed_layout_refuses_another_engine_dtype():
    """Its layout is measured against a BF16 engine (asyncfp8/precision/sensitivity.py)."""
    with pytest.raises(ValueError, match="precision=mixed measures its layout against"):
        build_policy({"name": "mixed", "base": "fp8", "keep": [], "engine_dtype": "float32"})
    kept = build_policy({"name": "mixed", "base": "fp8", "keep": [], "engine_dtype": "bfloat16"})
    assert kept.engine_dtype == torch.bfloat16


def test_an_fp32_bf16_rollout_has_its_lm_head_in_fp32_too():
    """No separate LM-head dtype: vLLM started with dtype=float32 runs it so."""
    config = build_policy({"name": "bf16", "engine_dtype": "float32"}).engine_config()
    assert config["lm_head_dtype"] == "float32"
    assert supports("vllm", build_policy({"name": "bf16", "engine_dtype": "float32"})) is None


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"name": "fp8", "engine_dtype": "fp64"}, "precision.engine_dtype must be one of"),
        ({"name": "fp16", "engine_dtype": "float32"}, "precision=fp16 computes in float16"),
    ],
)
def test_an_engine_dtype_out_of_range_is_refused_naming_the_key(cfg, words):
    with pytest.raises(ValueError, match=words):
        build_policy(cfg)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name", ["fp8", "fp8_kv", "bf16+fp8_kv"])
def test_checkpoint_engines_refuse_8_bit_weights_or_caches_around_fp32(engine, name):
    reason = supports(engine, build_policy({"name": name, "engine_dtype": "float32"}))
    assert reason is not None and "FP32 activations" in reason


def test_the_config_types_the_key():
    from hydra import compose, initialize_config_module

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("config", overrides=["precision=fp8", "precision.engine_dtype=float32"])
        assert build_policy(cfg.precision).engine_dtype == torch.float32
        with pytest.raises(Exception, match="engine_dtype"):
            compose("config", overrides=["precision=fp8", "precision.engine_dtype=double"])


def rollout_k3(model_dir, name: str, engine_dtype: torch.dtype) -> float:
    """Mean k3 of the torch engine's sampled log-probs (computing in `engine_dtype`)
    against the quantized learner's FP32 recompute of the same tokens."""
    from asyncfp8.engines.base import SamplingParams
    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.models import load_model, load_tokenizer
    from asyncfp8.tasks import ArithmeticTask

    def policy():
        made = get_policy(name)
        made.set_engine_dtype(engine_dtype)
        return made

    task = ArithmeticTask(seed=3)
    prompts = [task.prompt(i).text for i in range(4)]
    tokenizer = load_tokenizer(model_dir)
    learner = load_model(model_dir, dtype=torch.float32).eval()
    engine = TorchEngine(str(model_dir), policy(), cuda_graph=False)
    calibration = dict(tokenizer(prompts, return_tensors="pt", padding=True))
    version = version_tensors(learner, policy(), calibration)
    engine.update_weights(0, dict(version.weights), version.extra)
    quantized = get_policy(name)
    quantized.learner_forward = "quantized"
    quantized.bind_model(learner.config)
    learner = quantized.prepare_learner(learner)
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=0)
    k3s = []
    with torch.no_grad():
        for sample in engine.generate(prompts, sampling):
            ids = torch.tensor([sample.prompt_ids + sample.token_ids])
            logits = learner(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
            logp = torch.log_softmax(logits, -1)
            recomputed = logp.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            delta = (recomputed.double() - torch.tensor(sample.logprobs).double()).clamp(-20, 20)
            k3s.append(delta.exp() - delta - 1)
    return torch.cat(k3s).mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_an_fp32_engine_samples_what_the_quantized_learner_computes(name, tiny_model_dir):
    """In BF16 the engine's activations differ from the learner's FP32 ones by a rounding,
    and the 8-bit activation quantizer turns that into whole quantization steps; in FP32
    both quantize the same values (what is left: summation order)."""
    fp32 = rollout_k3(tiny_model_dir, name, torch.float32)
    bf16 = rollout_k3(tiny_model_dir, name, torch.bfloat16)
    print(f"{name}: k3 against the quantized learner, FP32 engine {fp32:.2e}, BF16 {bf16:.2e}")
    assert fp32 < 1e-7 and bf16 > 100 * max(fp32, 1e-12)


@pytest.mark.parametrize("engine_dtype, warned", [("bfloat16", True), ("float32", False)])
def test_a_quantized_learner_forward_that_cannot_match_the_engine_is_said_at_start(
    make_learner, caplog, engine_dtype, warned
):
    """The learner computes in FP32 on a CPU: a BF16 engine's rounding, multiplied by the
    quantizers, keeps the two forwards apart, which the start log says."""
    import logging

    with caplog.at_level(logging.WARNING, logger="asyncfp8.learner"):
        make_learner(
            "precision=fp8",
            "precision.learner_forward=quantized",
            f"precision.engine_dtype={engine_dtype}",
        )
    said = "the learner computing in float32 and the engine in bfloat16" in caplog.text
    assert said == warned
