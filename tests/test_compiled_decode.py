"""The torch engine's compiled decode step (engine.compile): the whole step in one graph (no
graph break), the eager step's tokens, a refit that runs the new weights without compiling
again, a compile failure that falls back to eager with one warning, and `true` refused
where inductor cannot build."""

import logging

import pytest
import torch

from asyncfp8.engines import SamplingParams, torch_support
from asyncfp8.engines import slots as slots_module
from asyncfp8.engines.base import EngineUnsupported
from asyncfp8.engines.torch_engine import TorchEngine
from tests.taught import PROMPTS

SAMPLING = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=3)


def engine(model_dir, compile):
    # FP32: the compiled step's reductions may add in another order than eager's
    return TorchEngine(str(model_dir), "bf16", dtype=torch.float32, compile=compile)


def assert_same(reference, other):
    assert [s.token_ids for s in reference] == [s.token_ids for s in other]
    for a, b in zip(reference, other, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return engine(tiny_model_dir, False), engine(tiny_model_dir, True)


def compiled_frames() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]


@pytest.mark.slow
def test_the_compiled_step_is_one_graph_and_gives_the_eager_tokens(engines):
    eager, compiled = engines
    assert compiled.compile and not eager.compile
    assert_same(eager.generate(PROMPTS, SAMPLING), compiled.generate(PROMPTS, SAMPLING))
    # fullgraph: a graph break would have raised and left the decoder eager
    assert compiled._slot_decoder.compiled and compiled._slot_decoder._compiled_step


@pytest.mark.slow
def test_a_refit_runs_the_new_weights_without_compiling_again(engines):
    eager, compiled = engines
    compiled.generate(PROMPTS, SAMPLING)  # compiled for this cache size
    frames = compiled_frames()
    before = compiled.generate(PROMPTS, SAMPLING)
    for model in (eager.model, compiled.model):
        with torch.no_grad():  # what update_weights does: a copy into the same storage
            for param in model.parameters():
                param.mul_(1.5)
    after = compiled.generate(PROMPTS, SAMPLING)
    assert compiled_frames() == frames
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    assert_same(eager.generate(PROMPTS, SAMPLING), after)


def test_a_compile_failure_falls_back_to_eager_with_one_warning(
    tiny_model_dir, monkeypatch, caplog
):
    def failing(fn, **_):
        def run(*args, **kwargs):
            raise RuntimeError("inductor: no compiler\nmore lines")

        return run

    reference = engine(tiny_model_dir, False).generate(PROMPTS, SAMPLING)
    e = engine(tiny_model_dir, False)
    e.compile = True  # as resolved where a compiler was found
    monkeypatch.setattr(slots_module.torch, "compile", failing)
    with caplog.at_level(logging.WARNING, logger=slots_module.__name__):
        assert_same(reference, e.generate(PROMPTS, SAMPLING))
        e.generate(PROMPTS, SAMPLING)
    said = [r.getMessage() for r in caplog.records if "failed to compile" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: inductor: no compiler" in said[0]
    assert "engine.compile=false" in said[0] and not e._slot_decoder.compiled


def test_compile_where_it_cannot_run_is_refused_naming_the_key(tiny_model_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"engine\.compile must be true, false or null"):
        engine(tiny_model_dir, "yes")
    monkeypatch.setattr(torch_support.shutil, "which", lambda name: None)
    with pytest.raises(EngineUnsupported, match=r"engine\.compile=true cannot run here: .*C\+\+"):
        engine(tiny_model_dir, True)
    assert not engine(tiny_model_dir, None).compile  # null: on CUDA only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_compiled_step_inside_the_graph_gives_the_eager_graphs_tokens(tiny_model_dir):
    def on_gpu(compile):
        return TorchEngine(
            str(tiny_model_dir), "bf16", dtype=torch.float32, device="cuda", compile=compile
        )

    eager, compiled = on_gpu(False), on_gpu(True)
    assert_same(eager.generate(PROMPTS, SAMPLING), compiled.generate(PROMPTS, SAMPLING))
    decoder = compiled._slot_decoder
    assert decoder.use_graph and decoder.compiled and decoder._graph is not None


@pytest.mark.slow
def test_the_compiled_sampler_draws_the_eager_samplers_tokens_and_log_probs():
    """The same tokens (the hash is integer arithmetic; a uniform would have to fall on a
    rounding of the CDF to differ) and log-probs to 1e-6 (they came out bit-identical on
    this CPU; vector widths may round the last bit otherwise)."""
    from asyncfp8.engines.base import SamplingParams
    from asyncfp8.engines.request_sampling import (
        SAMPLE,
        CompiledSampler,
        sample_per_request,
        stream_keys,
    )

    compiled = CompiledSampler()
    generator = torch.Generator().manual_seed(0)
    for sampling in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=0.0),
    ):
        for _ in range(3):
            logits = torch.randn(16, 512, generator=generator) * 3
            keys = stream_keys(torch.randint(0, 2**62, (16,), generator=generator), SAMPLE)
            counters = torch.randint(0, 100, (16,), generator=generator)
            tokens, logp = sample_per_request(logits, sampling, keys, counters)
            again, again_logp = compiled(logits, sampling, keys, counters)
            assert torch.equal(tokens, again), sampling
            torch.testing.assert_close(logp, again_logp, atol=1e-6, rtol=0)
    assert not compiled.failed
