"""Rollout engines: the built-in torch engine and the vLLM and SGLang adapters.

engine = make_engine("torch", model_dir, policy)  # or "vllm", "sglang"; supports(name, policy)
engine.update_weights(version, tensors, extra)
samples = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=32, seed=0))"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncfp8.precision import PrecisionPolicy

from .base import EngineUnsupported, RolloutEngine, Sample, SamplingParams

ENGINES = ("torch", "vllm", "sglang")


def make_engine(
    name: str, model_dir: str, policy: PrecisionPolicy | str = "bf16", **options: Any
) -> RolloutEngine:
    """Starts engine `name` on `model_dir` with the policy's engine config; anything the
    engine cannot run fails here, with the reason, not at the first generate."""
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(model_dir, policy, **options)
    if name == "vllm":
        try:
            from .vllm_engine import VLLMEngine
        except ImportError as err:
            raise EngineUnsupported(
                f"engine vllm needs the vllm extra ({err}); engine=torch runs anywhere"
            ) from None
        return VLLMEngine(model_dir, policy, **options)
    if name == "sglang":
        from .sglang_engine import SGLangEngine  # imports sglang itself, at start

        return SGLangEngine(model_dir, policy, **options)
    raise ValueError(f"unknown engine {name!r}; available: {', '.join(ENGINES)}")


def supports(name: str, policy: PrecisionPolicy) -> str | None:
    """None if engine `name` can run `policy` (bound to its model, for the checks that
    need its shapes), else the reason; each adapter says (its `supports`), without
    importing vLLM or SGLang."""
    if name == "torch":
        from .torch_support import supports as adapter_supports
    elif name == "vllm":
        from .vllm_engine import supports as adapter_supports
    elif name == "sglang":
        from .sglang_engine import supports as adapter_supports
    else:
        raise ValueError(f"unknown engine {name!r}; available: {', '.join(ENGINES)}")
    return adapter_supports(policy)


def build_engine(
    cfg: Mapping[str, Any], model_dir: str, policy: PrecisionPolicy | str
) -> RolloutEngine:
    """An engine from its `engine=` config entry: `name` plus engine options."""
    options = {k: v for k, v in dict(cfg).items() if k != "name"}
    return make_engine(cfg["name"], model_dir, policy, **options)


__all__ = [
    "ENGINES",
    "EngineUnsupported",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "build_engine",
    "make_engine",
    "supports",
]
