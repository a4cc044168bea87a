"""FP8 KV cache with the q/k/v scales recalibrated for every version.

RL moves the weights and with them the size of q, k and v, so scales computed once go stale
(clipped values, or a wasted e4m3 range): each version's scales come from a high percentile
of |q|, |k|, |v| after RoPE (docs/precision.md, "FP8 KV cache: why recalibrate every version")."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..fp8.quant import FP8_MAX
from ..manifest import Role, TensorRole
from ..policy import PrecisionPolicy, dtype_name
from ..registry import register_policy
from ..storage import Storage

CAPTURE_IMPLEMENTATION = "asyncfp8_kv_capture"
FAKE_QUANT_IMPLEMENTATION = "asyncfp8_fp8_kv"
KV_CACHE_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}
MAX_QUANTILE_ELEMENTS = 1 << 24  # torch.quantile's input limit


def kv_scale_names(layer: int) -> dict[str, str]:
    """{"q" | "k" | "v": the name vLLM loads that scale of `layer` under}."""
    prefix = f"model.layers.{layer}.self_attn"
    return {"q": f"{prefix}.attn.q_scale", "k": f"{prefix}.k_scale", "v": f"{prefix}.v_scale"}


def kv_scale_roles(layers: int) -> dict[str, TensorRole]:
    """{name: role} of every KV scale of a model with `layers` decoder layers."""
    return {
        name: TensorRole(Role.KV_SCALE, layer, part)
        for layer in range(layers)
        for part, name in kv_scale_names(layer).items()
    }


def fake_quantize_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x as an FP8 KV cache stores and returns it: round(x / scale) in e4m3, times scale."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


def high_percentile(values: torch.Tensor, percentile: float) -> torch.Tensor:
    flat = values.detach().abs().float().flatten()
    if flat.numel() > MAX_QUANTILE_ELEMENTS:
        # An evenly strided subsample: deterministic, and plenty for a 99.9th percentile.
        flat = flat[:: flat.numel() // MAX_QUANTILE_ELEMENTS + 1]
    return torch.quantile(flat, percentile / 100.0)


def capture_qkv(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
) -> dict[int, dict[str, torch.Tensor]]:
    """Runs `model` on `batch` and returns, per layer, the q, k, v the attention kernel
    received (after RoPE, before the KV-head repeat), restricted to real tokens.

    Uses transformers' attention-function registry (an attention implementation that
    records its inputs and then runs SDPA), so no module of the model is patched."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured: dict[int, dict[str, torch.Tensor]] = {}
    token_mask = batch.get("attention_mask")

    def record(module, query, key, value, attention_mask, **kwargs):
        layer = int(module.layer_idx)
        parts = {"q": query, "k": key, "v": value}  # [B, heads, T, head_dim]
        if token_mask is not None:  # [B, T, heads, dim] indexed by [B, T] -> [tokens, heads, dim]
            parts = {n: t.transpose(1, 2)[token_mask.bool()] for n, t in parts.items()}
        captured[layer] = {n: t.detach() for n, t in parts.items()}
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, record)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")})
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)
    if not captured:
        raise ValueError("fp8_kv: the model ran no attention layer through the attention interface")
    return captured


@register_policy("fp8_kv")
class FP8KVPolicy(PrecisionPolicy):
    """FP8 (e4m3) KV cache; q/k/v scales recalibrated by `calibrate` every version."""

    name = "fp8_kv"
    needs_calibration = True

    def __init__(self, percentile: float = 99.9, margin: float = 1.05):
        if not 0 < percentile <= 100:
            raise ValueError(f"fp8_kv: percentile must be in (0, 100], got {percentile}")
        if margin < 1:
            raise ValueError(f"fp8_kv: margin must be >= 1 (it widens the range), got {margin}")
        self.percentile, self.margin = float(percentile), float(margin)
        #: layer -> (k_scale, v_scale) of the last calibration (the learner's quantized forward)
        self.latest_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def storage(self) -> Storage:
        return Storage(kv_dtype=torch.float8_e4m3fn)

    def engine_config(self) -> dict:
        return {"dtype": dtype_name(self.engine_dtype), "kv_cache_dtype": "fp8"}

    def extra_roles(self) -> dict[str, TensorRole]:
        return kv_scale_roles(self.require_model().num_hidden_layers)

    def checkpoint_config(self, unquantized_layers=()) -> dict:
        """A compressed-tensors config with only a KV-cache scheme: it is what makes
        vLLM create per-layer k/v/q scale parameters for BF16 weights, so that each
        version's scales have somewhere to load."""
        return {
            "quant_method": "compressed-tensors",
            "format": "dense",
            "quantization_status": "compressed",
            "config_groups": {},
            "ignore": [],
            "kv_cache_scheme": KV_CACHE_SCHEME,
        }

    def calibrate(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Per-layer scalar fp32 scales: percentile(|x|) · margin / 448 for x in q, k, v."""
        extra = {}
        for layer, parts in sorted(capture_qkv(model, batch).items()):
            names = kv_scale_names(layer)
            for part, values in parts.items():
                amax = high_percentile(values, self.percentile).clamp_min(1e-8)
                extra[names[part]] = (amax * self.margin / FP8_MAX).float().reshape(())
            self.latest_scales[layer] = (extra[names["k"]], extra[names["v"]])
        return extra

    def learner_state(self) -> dict:
        return {"kv_scales": dict(self.latest_scales)}

    def load_learner_state(self, state) -> None:
        self.latest_scales = dict(state.get("kv_scales", {}))

    def prepare_learner(self, model: torch.nn.Module) -> torch.nn.Module:
        """With `learner_forward="quantized"`, attention reads k and v rounded to e4m3
        with the latest calibrated scales (a stale version's own while its tokens are
        scored, `learner_state`), as the engine's FP8 cache stores them
        (straight-through gradients)."""
        if self.learner_forward != "quantized":
            return model
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        from ..modules import straight_through

        def fake_quant_kv(module, query, key, value, attention_mask, **kwargs):
            scales = self.latest_scales.get(int(module.layer_idx))
            if scales is not None:
                with torch.no_grad():
                    key_hat = fake_quantize_e4m3(key.detach(), scales[0])
                    value_hat = fake_quantize_e4m3(value.detach(), scales[1])
                key, value = straight_through(key, key_hat), straight_through(value, value_hat)
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(FAKE_QUANT_IMPLEMENTATION, fake_quant_kv)
        model.set_attn_implementation(FAKE_QUANT_IMPLEMENTATION)
        return model
