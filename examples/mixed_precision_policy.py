"""A PrecisionPolicy of your own: FP8 everywhere except the first and last decoder
layers, which stay in BF16 (they are the most sensitive to quantization).

    python examples/mixed_precision_policy.py                        # the small model
    python examples/mixed_precision_policy.py precision.keep_first=2 precision.keep_last=0
    python examples/mixed_precision_policy.py precision=fp8          # the built-in policy

The subclass reuses the FP8 policy and only narrows which tensors it quantizes;
`register_policy` makes it selectable by name, and its YAML in examples/conf/precision/
makes it a Hydra choice beside the built-in ones (the config adds asyncfp8's own groups
to its search path).
"""

from __future__ import annotations

import re

import hydra
import torch
from omegaconf import DictConfig

from asyncfp8.precision import build_policy, register_policy
from asyncfp8.precision.fp8 import FP8Policy

LAYER = re.compile(r"\.layers\.(\d+)\.")


@register_policy("fp8_edges_bf16")
class FP8EdgesBF16Policy(FP8Policy):
    name = "fp8_edges_bf16"

    def __init__(
        self, num_layers: int, keep_first: int = 1, keep_last: int = 1, block_size=(128, 128)
    ):
        super().__init__(block_size)
        self.num_layers, self.keep_first, self.keep_last = num_layers, keep_first, keep_last

    def kept_in_bf16(self, name: str) -> bool:
        match = LAYER.search(name)
        return (
            bool(match)
            and not self.keep_first <= int(match.group(1)) < self.num_layers - self.keep_last
        )

    def quantize_weights(self, named_tensors):
        for name, tensor in named_tensors:
            if self.kept_in_bf16(name):
                yield name, tensor.to(torch.bfloat16)
            else:
                yield from super().quantize_weights([(name, tensor)])

    def checkpoint_config(self) -> dict:
        # vLLM skips quantization for the layers listed here.
        config = super().checkpoint_config()
        config["ignored_layers"] = [
            f"model.layers.{i}.{proj}"
            for i in [
                *range(self.keep_first),
                *range(self.num_layers - self.keep_last, self.num_layers),
            ]
            for proj in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        ]
        return config


@hydra.main(version_base="1.3", config_path="conf", config_name="mixed_precision")
def main(cfg: DictConfig) -> None:
    from asyncfp8.models import load_model, resolve_model_dir

    model = load_model(resolve_model_dir(cfg.model.path, cfg.model.size, cfg.model.seed))
    policy = build_policy(cfg.precision)
    print(f"policy {policy.name}: {policy.engine_config()}")
    for name, tensor in policy.quantize_weights(model.state_dict().items()):
        if name.endswith("q_proj.weight") or name.endswith("q_proj.weight_scale_inv"):
            print(f"{name:<48} {tensor.dtype!s:<22} {tuple(tensor.shape)}")


if __name__ == "__main__":
    main()
