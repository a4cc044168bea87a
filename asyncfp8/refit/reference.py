"""The refit probe's reference (asyncfp8/refit/probe.py): what an engine running a version
must compute, from the learner's FP32 masters, quantized as the policy quantizes them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from asyncfp8.engines.probe_scoring import (
    next_token_logprobs,
    recording_layer_rms,
    rows_by_length,
)
from asyncfp8.hf.cpu_half import is_plain_linear
from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.experts import split_experts, split_named
from asyncfp8.precision.fp8_kv import fake_quantize_e4m3, kv_scale_names
from asyncfp8.refit.probe import Probe

#: The attention implementation of the reference forward with an FP8 KV cache.
REFERENCE_ATTENTION = "asyncfp8_probe_reference"


def _reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention as the built-in engine's prefill computes it: keys and values rounded to
    e4m3 with the version's scales for an FP8 cache, then the engine's own grouped SDPA
    (its head layout decides the order SDPA sums in; transformers' SDPA is 1 BF16 ulp off in
    1 of 150 probes, which an e4m3 cache turns into |Δ log p| 0.004) under a causal mask.
    Probe rows are unpadded, so transformers' `attention_mask` is not needed."""
    from asyncfp8.engines.decode import grouped_attention

    scales = getattr(module, "probe_kv_scales", None)
    if scales is not None:
        key = fake_quantize_e4m3(key, scales[0]).to(key.dtype)
        value = fake_quantize_e4m3(value, scales[1]).to(value.dtype)
    tokens, span = query.shape[2], key.shape[2]
    causal = torch.ones(tokens, span, dtype=torch.bool, device=query.device).tril(span - tokens)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return grouped_attention(query, key, value, causal[None, None], scale), None


class ReferenceLinear(torch.nn.Module):
    """A linear layer as a quantized engine GEMM computes it: the policy's fake-quantized
    input times its fake-quantized FP32 master weight, accumulated in FP32, the output in
    the input's dtype (the built-in FP8 and INT8 modules do the same)."""

    def __init__(self, linear: torch.nn.Linear, name: str, policy: PrecisionPolicy):
        super().__init__()
        self.name, self.policy = name, policy
        self.master = torch.nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.policy.reference_matmul(self.name, x, self.master)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


def _use_reference_linears(model: torch.nn.Module, policy: PrecisionPolicy) -> dict[str, str]:
    """Swaps every linear layer the policy quantizes for a ReferenceLinear, in place;
    {weight name: the name of the FP32 master that now holds it}."""
    renamed = {}
    for prefix, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            name = f"{prefix}.{child_name}.weight".lstrip(".")
            if is_plain_linear(child) and policy.quantizes(name, child.weight):
                setattr(module, child_name, ReferenceLinear(child, name, policy))
                renamed[name] = name.removesuffix("weight") + "master"
    return renamed


class ReferenceForward:
    """What an engine running a version computes: the model in the engine's dtype (the
    policy's `engine_dtype`; an FP32 reference sits further from a correct BF16 engine than a
    step moves the log-probs, docs/reliability.md), its quantized linears fake-quantized by
    the policy and, for an FP8 KV cache, keys and values rounded with the version's scales.
    It lives on rank 0 (colocated: every rank) and loads the masters each version comes from."""

    def __init__(self, model_dir: str | Path, policy: PrecisionPolicy):
        from transformers import AttentionInterface

        from asyncfp8.hf.loading import load_model

        self.policy = policy
        self.model = load_model(model_dir, dtype=policy.engine_dtype).eval()
        # The weights a policy quantizes stay FP32 masters (a version is quantized from
        # them); every other parameter is held in the engine's dtype, as engines hold it.
        if policy.quantizes_weights:  # an MoE's experts as their linears (experts.py)
            split_experts(self.model)
        self.renamed = _use_reference_linears(self.model, policy)
        if policy.engine_config().get("lm_head_dtype") == "float32":
            # As the engine runs it (TorchEngine): the last projection in FP32, weight and
            # input, its weight the FP32 master the version ships.
            self.model.lm_head.float()
            self.model.lm_head.register_forward_pre_hook(lambda _module, args: (args[0].float(),))
        self.model.requires_grad_(False)
        self.params = dict(self.model.named_parameters())
        self.fp8_kv = policy.engine_config().get("kv_cache_dtype") == "fp8"
        AttentionInterface.register(REFERENCE_ATTENTION, _reference_attention)
        self.model.set_attn_implementation(REFERENCE_ATTENTION)
        self.loaded = False

    def load(self, masters: Iterable[tuple[str, torch.Tensor]], extra: Mapping[str, torch.Tensor]):
        if self.policy.quantizes_weights:
            masters = split_named(masters)
        with torch.no_grad():
            for name, tensor in masters:
                if name in self.renamed:  # a quantized layer's FP32 master, as it is
                    self.params[self.renamed[name]].copy_(tensor)
                elif name in self.params:
                    # Every other tensor as the engine holds it: cast to its dtype, and,
                    # where a policy rescales it (INT8 smoothing divides a norm, or the
                    # layer before a smoothed one, by the factors), rescaled the same way,
                    # so that the quantized layers' inputs are the engine's.
                    self.params[name].copy_(self.policy.passthrough(name, tensor))
        if self.fp8_kv:
            for layer, module in enumerate(self.model.model.layers):
                names = kv_scale_names(layer)
                module.self_attn.probe_kv_scales = (
                    extra[names["k"]].float(),
                    extra[names["v"]].float(),
                )
        self.loaded = True

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p [P, L-1], layer RMS [P, layers, L]); NaN where a row has no token. Rows
        of one length share a forward, never padded, as engines score them (see
        TorchEngine.score; the probe's rows are usually all `sync.probe.tokens` long)."""
        rows, width = input_ids.shape
        layers = len(self.model.model.layers)
        # FP32 by name, not torch's default dtype: this runs on the learner's publishing
        # thread while its main thread may build a model, which transformers does under
        # torch.set_default_dtype(BF16), a process-wide setting.
        logp = torch.full((rows, width - 1), math.nan, dtype=torch.float32)
        layer_rms = torch.full((rows, layers, width), math.nan, dtype=torch.float32)
        for length, members in rows_by_length(lengths.tolist()).items():
            ids = input_ids[members, :length]
            with recording_layer_rms(self.model) as rms:
                logits = self.model(input_ids=ids).logits
            logp[members, : length - 1] = next_token_logprobs(logits, ids)
            layer_rms[members, :, :length] = torch.stack(rms[-layers:], dim=1)
        return logp, layer_rms

    def probe(
        self,
        masters: Iterable[tuple[str, torch.Tensor]],
        extra: Mapping[str, torch.Tensor],
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
    ) -> Probe:
        """The probe of the version made of `masters` (and `extra`, its KV scales): the
        previous version's log-probs first (the weights held now), then this one's."""
        previous = torch.full(
            (input_ids.shape[0], input_ids.shape[1] - 1), math.nan, dtype=torch.float32
        )
        if self.loaded:
            previous, _ = self.forward(input_ids, lengths)
        self.load(masters, extra)
        logprobs, layer_rms = self.forward(input_ids, lengths)
        return Probe(input_ids, lengths, logprobs, previous, layer_rms)
