"""SGLang as a rollout engine through its offline `sglang.Engine` API (versions by
`update_weights_from_tensor`, not the HTTP server). Written against SGLang 0.5's documented
API, not run here (CUDA only; its tests skip without `sglang`). Why the Engine API, the
logprobs it returns (so top-k / top-p are refused), the precisions (int8 refused) and seeds:
docs/engines.md, "sglang"."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from asyncfp8.hf.loading import check_model_dir
from asyncfp8.moe import checkpoint_named
from asyncfp8.precision import PrecisionPolicy, TensorRole, check_received, get_policy

from .base import EngineUnsupported, Sample, SamplingParams
from .checkpoints import checkpoint_refusal, policy_checkpoint, refuse_unsupported, version_specs

KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3"}


FORMATS = ("fp8",)  # the weight formats this adapter starts and refits


def supports(policy: PrecisionPolicy) -> str | None:
    """None if SGLang can run `policy` (bound to its model), else why not; imports no SGLang."""
    if policy.engine_config().get("quantization") == "compressed-tensors":
        return (
            "its update_weights_from_tensor re-runs no post-load processing, which int8 "
            "layers need (engine=vllm or engine=torch run int8)"
        )
    return checkpoint_refusal(policy, FORMATS)


class SGLangEngine:
    name = "sglang"

    def __init__(
        self,
        model_dir: str,
        policy: PrecisionPolicy | str = "bf16",
        seed: int = 0,
        mem_fraction_static: float = 0.5,
        export_dir: str | None = None,
        **engine_kwargs,
    ):
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        refuse_unsupported(self.name, self.policy, supports, check_model_dir(model_dir))
        config = self.policy.engine_config()
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"):
            raise EngineUnsupported(
                "engine sglang: SGLANG_RETURN_ORIGINAL_LOGPROB is set, so SGLang would return "
                "temperature-1 logprobs, not those of the distribution it sampled from; unset it"
            )
        try:
            import sglang
        except ImportError as err:
            raise EngineUnsupported(
                f"engine sglang needs the sglang package ({err}); it installs only on CUDA "
                "machines. engine=torch runs anywhere, engine=vllm on CPU and GPU."
            ) from None

        self.model_dir = policy_checkpoint(self.policy, check_model_dir(model_dir), export_dir)
        self.expected = version_specs(self.model_dir, self.policy)
        self.engine = sglang.Engine(
            model_path=str(self.model_dir),
            dtype=config.get("dtype", "bfloat16"),  # the policy's (precision.engine_dtype)
            quantization=config.get("quantization"),
            kv_cache_dtype=KV_CACHE_DTYPES[config.get("kv_cache_dtype", "auto")],
            random_seed=seed,
            mem_fraction_static=mem_fraction_static,
            **engine_kwargs,
        )
        self.tokenizer = self.engine.tokenizer_manager.tokenizer
        self.version: int | None = None

    def update_weights(
        self,
        version: int,
        named_tensors: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor] | None = None,
        manifest: Mapping[str, TensorRole] | None = None,
    ) -> None:
        # An MoE's fused experts, under the names of the checkpoint SGLang loaded
        named_tensors, manifest = checkpoint_named(named_tensors, manifest)
        pairs = [*named_tensors.items(), *(extra or {}).items()]
        check_received(version, pairs, manifest, self.expected)
        if pairs:
            success, message = self.engine.update_weights_from_tensor(
                named_tensors=pairs, flush_cache=True
            )
            if not success:
                # SGLang may have loaded part of the version: nothing it generates now is
                # any one version's, so the worker must not go on with it.
                raise RuntimeError(f"engine sglang: version {version} failed to load: {message}")
        self.version = version

    def generate(self, prompts: Sequence[str], sampling: SamplingParams) -> list[Sample]:
        if sampling.top_k or sampling.top_p < 1:
            raise ValueError(
                "engine sglang returns logprobs before top-k / top-p filtering: with "
                f"top_k={sampling.top_k}, top_p={sampling.top_p} they would not be those of the "
                "distribution sampled from; use engine=vllm or torch for filtered sampling"
            )
        params = {
            "temperature": sampling.temperature,
            "max_new_tokens": sampling.max_new_tokens,
            "ignore_eos": sampling.ignore_eos,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        encoded = [self.tokenizer(prompt)["input_ids"] for prompt in prompts]
        # n samples per prompt as n requests: SGLang shares the prompt's KV (radix cache).
        jobs = [index for index in range(len(prompts)) for _ in range(sampling.n)]
        outputs = self.engine.generate(
            input_ids=[encoded[index] for index in jobs],
            sampling_params=params,
            return_logprob=True,
        )
        version = -1 if self.version is None else self.version
        samples = []
        for index, output in zip(jobs, outputs, strict=True):
            meta = output["meta_info"]
            steps = meta["output_token_logprobs"]  # (logprob, token_id, text) per token
            ids = [token for _, token, _ in steps]
            samples.append(
                Sample(
                    prompt_ids=list(encoded[index]),
                    token_ids=ids,
                    logprobs=[float(logprob) for logprob, _, _ in steps],
                    versions=[version] * len(ids),
                    finish_reason="stop"
                    if meta["finish_reason"]["type"] == "stop" and not sampling.ignore_eos
                    else "length",
                    text=output["text"],
                    prompt_index=index,
                )
            )
        return samples

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
