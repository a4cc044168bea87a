"""A mixed precision: one weight format (FP8 or INT8) on most linear layers, the engine
dtype (BF16) on the layers where quantizing adds the most mismatch.

`keep` lists the layers left in BF16; left out, the launcher measures it once (sensitivity.py)
and the layout is then frozen for the run (docs/precision.md, "A mixed precision")."""

from __future__ import annotations

from typing import Any

import torch

from .policy import PrecisionPolicy, dtype_name
from .registry import get_policy, register_policy

MIXED_BASES = ("fp8", "int8")


def layer_of(weight_name: str) -> str:
    """The linear layer a weight belongs to: `model.layers.0.mlp.up_proj.weight` ->
    `model.layers.0.mlp.up_proj`."""
    return weight_name.removesuffix(".weight")


@register_policy("mixed")
class MixedPolicy(PrecisionPolicy):
    """`base` (fp8 or int8) on every linear layer it quantizes but those in `keep`."""

    name = "mixed"
    quantizes_weights = True

    def __init__(
        self,
        base: str = "fp8",
        keep: list[str] | None = None,
        budget: float | None = 1.3,
        quantized_share: float | None = None,
        calibration_prompts: int = 64,
        remeasure_every: int = 50,
        budget_kl: float | None = None,
        profile: str | None = None,
    ):
        if base not in MIXED_BASES:
            raise ValueError(
                f"precision=mixed: base must be one of {', '.join(MIXED_BASES)}, got {base!r}"
            )
        if budget_kl is not None:
            if quantized_share is not None:
                raise ValueError(
                    "precision.budget_kl and precision.quantized_share both given: one rule"
                )
            if not budget_kl > 0:
                raise ValueError(f"precision.budget_kl must be > 0, got {budget_kl}")
            budget = None  # an absolute target replaces the default relative budget
        elif quantized_share is not None:
            if not 0 < quantized_share <= 1:
                raise ValueError(
                    f"precision.quantized_share must be in (0, 1], got {quantized_share}"
                )
            budget = None  # a share replaces the default budget
        elif budget is None:
            raise ValueError("precision=mixed needs precision.budget or precision.quantized_share")
        elif budget < 1:
            raise ValueError(
                f"precision.budget={budget} is below BF16's own mismatch (1.0 = every layer "
                "in BF16, the floor no layout can go under); use a budget >= 1"
            )
        if calibration_prompts < 1 or remeasure_every < 0:
            raise ValueError(
                "precision.calibration_prompts must be >= 1 and precision.remeasure_every >= 0 "
                f"(0: never), got {calibration_prompts} and {remeasure_every}"
            )
        if profile and base != "int8":
            raise ValueError(
                f"precision.profile smooths INT8's per-token activations; precision.base={base} "
                "takes none (use precision.base=int8, or leave the profile out)"
            )
        self.base = get_policy(base, profile=profile) if profile else get_policy(base)
        self.keep = None if keep is None else frozenset(keep)
        self.budget, self.quantized_share, self.budget_kl = budget, quantized_share, budget_kl
        self.calibration_prompts, self.remeasure_every = calibration_prompts, remeasure_every
        self.engine_dtype = self.base.engine_dtype
        self.name = f"mixed_{base}"

    # -- the per-tensor decision -------------------------------------------------------------

    def require_layout(self) -> frozenset[str]:
        if self.keep is None:
            raise ValueError(
                "precision=mixed has no layout yet (precision.keep): `python -m asyncfp8.launch` "
                "measures it before it starts the learner and the workers; to start them by "
                "hand, measure it with `python -m asyncfp8.plan.layout` and pass "
                "precision.keep=[...] to every process"
            )
        return self.keep

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool:
        return self.base.quantizes(name, tensor) and layer_of(name) not in self.require_layout()

    # -- the base format's, unchanged --------------------------------------------------------

    def quantize_tensor(self, name, tensor):
        return self.base.quantize_tensor(name, tensor)

    def passthrough(self, name, tensor):
        return self.base.passthrough(name, tensor)

    def output_role(self, source, output):
        return self.base.output_role(source, output)

    def engine_config(self) -> dict[str, Any]:
        return self.base.engine_config()

    def set_engine_dtype(self, dtype):
        if dtype != self.base.engine_dtype:
            raise ValueError(
                f"precision=mixed measures its layout against a {self.base.engine_dtype} "
                f"engine; precision.engine_dtype={dtype_name(dtype)} is not supported with "
                "it (use precision=fp8 or int8 with that engine_dtype, or leave it null)"
            )

    def linear_module(self, name, tensors, bias, real=True):
        return self.base.linear_module(name, tensors, bias, real)

    def storage(self):
        return self.base.storage()

    def checkpoint_config(self, unquantized_layers=()):
        return self.base.checkpoint_config(unquantized_layers)

    def fake_quantize_weight(self, name, weight):
        return self.base.fake_quantize_weight(name, weight)

    def fake_quantize_input(self, name, x):
        return self.base.fake_quantize_input(name, x)

    def reference_matmul(self, name, x, weight):
        return self.base.reference_matmul(name, x, weight)

    def bind_model(self, config):
        """Also refuses a `keep` naming a layer the model lacks (a typo would quantize
        the layer it meant): checked on the model built on the meta device, no memory."""
        if self.keep:
            from transformers import AutoModelForCausalLM

            from .experts import split_experts

            with torch.device("meta"):  # an MoE's experts named as the layout names them
                model = split_experts(AutoModelForCausalLM.from_config(config))
            linear = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            unknown = sorted(self.keep - linear)
            if unknown:
                raise ValueError(
                    f"precision.keep names {len(unknown)} layer(s) this model does not have: "
                    f"{', '.join(unknown[:5])} (its linear layers are named like "
                    f"{min(linear)})"
                )
        self.base.bind_model(config)
        return super().bind_model(config)
