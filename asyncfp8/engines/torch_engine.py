"""The built-in rollout engine: a transformers model, batched sampling with a KV cache,
and the precision policy's quantized modules. It runs wherever torch runs; it is not
vLLM, but its FP8 / INT8 / FP8-KV numerics are the ones an engine would show."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers.cache_utils import DynamicCache

from asyncfp8.models.loading import load_model, load_tokenizer
from asyncfp8.precision import PrecisionPolicy, get_policy
from asyncfp8.precision.fp8_kv import KV_SCALE_NAME, kv_scale_names
from asyncfp8.precision.modules import QuantizedLinear, apply_policy

from .base import EngineUnsupported, Sample, SamplingParams
from .kv_cache import fp8_kv_cache


def processed_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """log-probabilities of the distribution actually sampled from: logits / temperature,
    then top-k, then top-p (nucleus) truncation, renormalized. Greedy (temperature 0)
    keeps the unscaled distribution."""
    logits = logits.float()
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


class TorchEngine:
    name = "torch"

    def __init__(
        self,
        model_dir: str,
        policy: PrecisionPolicy | str = "bf16",
        dtype: torch.dtype = torch.bfloat16,
        max_batch: int = 64,
    ):
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        reason = self.policy.supported_by(self.name)
        if reason:
            raise EngineUnsupported(
                f"engine torch cannot run precision {self.policy.name!r}: {reason}"
            )
        config = self.policy.engine_config()
        self.model = load_model(model_dir, dtype=dtype).eval()
        self.tokenizer = load_tokenizer(model_dir)
        if self.policy.model_config is None:
            self.policy.bind_model(self.model.config)
        try:
            apply_policy(self.model, self.policy)
        except NotImplementedError as err:
            raise EngineUnsupported(f"engine torch: {err}") from None
        if config.get("lm_head_dtype") == "float32":
            # FlashRL's LM-head option: the last projection in FP32 (weights and input).
            self.model.lm_head.float()
            self.model.lm_head.register_forward_pre_hook(lambda _module, args: (args[0].float(),))
        self.fp8_kv = config.get("kv_cache_dtype") == "fp8"
        self.kv_scales: dict[int, dict[str, float]] = {}
        self.max_batch = max_batch
        self.version: int | None = None
        # Parameters, and the biases that quantized modules keep as buffers.
        self._params = dict(self.model.named_parameters()) | {
            name: buffer for name, buffer in self.model.named_buffers() if name.endswith(".bias")
        }
        # Every engine-side tensor name a quantized module owns -> that module.
        self._owners = {
            name: module
            for module in self.model.modules()
            if isinstance(module, QuantizedLinear)
            for name in module.expects
        }

    # -- weights -----------------------------------------------------------------------------

    def update_weights(
        self,
        version: int,
        named_tensors: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Checks every tensor against the model first and only then writes any: a
        version is applied whole or not at all. Values are copied into the existing
        storage (no parameter or buffer moves)."""
        params, layers, kv = [], {}, {}
        for name, tensor in named_tensors.items():
            if name in self._owners:
                layers.setdefault(self._owners[name], {})[name] = tensor
            elif name in self._params:
                param = self._params[name]
                if (tuple(param.shape), param.dtype) != (tuple(tensor.shape), tensor.dtype):
                    raise ValueError(
                        f"version {version}: {name} is {tuple(tensor.shape)} {tensor.dtype}, the "
                        f"engine's {tuple(param.shape)} {param.dtype} (do the learner and this "
                        "worker use the same model and precision?)"
                    )
                params.append((param, tensor))
            else:
                raise ValueError(
                    f"version {version}: unknown tensor {name!r} (is the worker's model the learner's?)"
                )
        for name, tensor in (extra or {}).items():
            match = KV_SCALE_NAME.match(name)
            if match is None or not self.fp8_kv:
                raise ValueError(
                    f"version {version}: extra tensor {name!r} is not a KV scale this engine "
                    f"uses (precision {self.policy.name!r})"
                )
            kv.setdefault(int(match.group(1)), {})[match.group(2)] = float(tensor)
        for module, tensors in layers.items():
            module.check(version, tensors)
        with torch.no_grad():
            for module, tensors in layers.items():
                module.load(tensors)
            for param, tensor in params:
                param.copy_(tensor)
        for layer, scales in kv.items():
            self.kv_scales.setdefault(layer, {}).update(scales)
        self.version = version

    # -- generation --------------------------------------------------------------------------

    def _cache(self):
        if not self.fp8_kv:
            return DynamicCache()
        layers = self.model.config.num_hidden_layers
        missing = [i for i in range(layers) if not {"k", "v"} <= set(self.kv_scales.get(i, {}))]
        if missing:
            names = kv_scale_names(missing[0])
            raise ValueError(
                f"the FP8 KV cache needs per-layer scales ({names['k']}, ...): apply a version with "
                "the policy's calibrate() output as extra first"
            )
        return fp8_kv_cache(
            [(self.kv_scales[i]["k"], self.kv_scales[i]["v"]) for i in range(layers)]
        )

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], sampling: SamplingParams) -> list[Sample]:
        encoded = [self.tokenizer(p)["input_ids"] for p in prompts]
        jobs = [(i, ids) for i, ids in enumerate(encoded) for _ in range(sampling.n)]
        generator = (
            torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        )
        samples = []
        for start in range(0, len(jobs), self.max_batch):
            samples += self._generate_batch(
                jobs[start : start + self.max_batch], sampling, generator
            )
        return samples

    def _generate_batch(self, jobs, sampling: SamplingParams, generator) -> list[Sample]:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        width = max(len(ids) for _, ids in jobs)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in jobs])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in jobs])
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = self._cache()
        logits = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        batch = len(jobs)
        tokens = torch.full((batch, sampling.max_new_tokens), pad, dtype=torch.long)
        logprobs = torch.zeros(batch, sampling.max_new_tokens)
        lengths = torch.zeros(batch, dtype=torch.long)
        finished = torch.zeros(batch, dtype=torch.bool)
        for step in range(sampling.max_new_tokens):
            logp = processed_logprobs(logits, sampling)
            if sampling.temperature == 0:
                chosen = logp.argmax(-1)
            else:
                chosen = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
            active = ~finished
            tokens[active, step] = chosen[active]
            logprobs[active, step] = logp.gather(-1, chosen[:, None])[:, 0][active]
            lengths += active.long()
            if not sampling.ignore_eos:
                finished |= chosen == eos
            if finished.all():
                break
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=-1)
            positions = positions[:, -1:] + 1
            logits = self.model(
                input_ids=chosen.masked_fill(finished, pad)[:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
        version = -1 if self.version is None else self.version
        out = []
        for row, (prompt_index, prompt_ids) in enumerate(jobs):
            n = int(lengths[row])
            ids = tokens[row, :n].tolist()
            out.append(
                Sample(
                    prompt_ids=list(prompt_ids),
                    token_ids=ids,
                    logprobs=logprobs[row, :n].tolist(),
                    versions=[version] * n,
                    finish_reason="stop"
                    if ids and ids[-1] == eos and not sampling.ignore_eos
                    else "length",
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    prompt_index=prompt_index,
                )
            )
        return out

    def close(self) -> None:
        self.model = None
