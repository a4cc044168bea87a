"""The SGLang adapter. SGLang does not install on this project's machines (CUDA only):
here the tests check what happens without it and what is refused before it is needed;
the fidelity tests run only where `sglang` imports (and skip, saying so, elsewhere)."""

import importlib.util

import pytest
import torch

from asyncfp8.engines import EngineUnsupported, SamplingParams, make_engine

from .test_torch_engine import PROMPTS, logprob_deltas, perturbed_state

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(
    not (HAS_SGLANG and torch.cuda.is_available()), reason="needs sglang and a CUDA GPU"
)


@pytest.mark.skipif(HAS_SGLANG, reason="sglang is installed here")
def test_without_sglang_the_engine_fails_at_start_saying_what_works(tiny_model_dir):
    with pytest.raises(
        EngineUnsupported, match=r"engine sglang needs the sglang package.*engine=torch"
    ):
        make_engine("sglang", str(tiny_model_dir), "bf16")


def test_int8_is_refused_before_anything_starts(tiny_model_dir):
    with pytest.raises(
        EngineUnsupported,
        match=r"engine sglang cannot run precision 'int8': its update_weights_from_tensor",
    ):
        make_engine("sglang", str(tiny_model_dir), "int8")


def test_temperature_one_logprobs_are_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "true")
    with pytest.raises(EngineUnsupported, match="SGLANG_RETURN_ORIGINAL_LOGPROB is set"):
        make_engine("sglang", str(tiny_model_dir), "bf16")


@needs_sglang
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_update_takes_effect_with_faithful_logprobs(precision, tiny_model_dir):
    from asyncfp8.precision import get_policy, version_tensors

    policy = get_policy(precision)
    engine = make_engine("sglang", str(tiny_model_dir), policy)
    try:
        learner = perturbed_state(tiny_model_dir)
        engine.update_weights(2, dict(version_tensors(learner, policy).weights))
        samples = engine.generate(
            PROMPTS, SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=0)
        )
        assert len(samples) == 12 and all(s.versions == [2] * len(s.token_ids) for s in samples)
        deltas = logprob_deltas(learner, samples, 0.8)
        print(f"sglang {precision} after an update: mean |dlogp| {deltas.mean():.4f}")
        # The bounds of the other engines (tests/test_torch_engine.py); an engine that
        # missed the update scores ~0.3.
        assert 0 < deltas.mean() < {"bf16": 0.01, "fp8": 0.05}[precision]
        with pytest.raises(ValueError, match="before top-k / top-p filtering"):
            engine.generate(PROMPTS, SamplingParams(top_p=0.9))
    finally:
        engine.close()
