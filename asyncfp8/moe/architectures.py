"""Which mixture-of-experts architectures the library runs, and their layout: Qwen3-MoE
(transformers' `Qwen3MoeForCausalLM`: softmax over the experts, top-k, renormalized or not
as `norm_topk_prob` says, no shared expert, every layer MoE). Any other config naming routed
experts (DeepSeek's grouped top-k, Mixtral, Qwen2-MoE's shared expert, ...) is refused at
start: the routing rule is the one the engines and the learner's routers are written for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Config keys other families use for their routed-expert count.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
SUPPORTED = ("Qwen3MoeForCausalLM",)


@dataclass(frozen=True)
class MoELayout:
    """An MoE model's routing shape: `experts` per layer, `top_k` of them per token, in
    the decoder layers `layers` (all of them for Qwen3-MoE as shipped here)."""

    experts: int
    top_k: int
    layers: tuple[int, ...]


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _architecture(config: Any) -> str:
    names = _get(config, "architectures") or []
    return names[0] if names else f"model_type={_get(config, 'model_type', '?')}"


def is_moe(config: Any) -> bool:
    """Whether the config names routed experts (any family's key)."""
    return any((_get(config, key) or 0) > 0 for key in _EXPERT_KEYS)


def check_architecture(config: Any, where: str) -> None:
    """Refuses an MoE the library does not run (ValueError naming `where`, the model's
    path or name, and its architecture). A dense model passes."""
    if not is_moe(config):
        return
    architecture = _architecture(config)
    if architecture in SUPPORTED or _get(config, "model_type") == "qwen3_moe":
        sparse_step = _get(config, "decoder_sparse_step", 1)
        if sparse_step == 1 and not (_get(config, "mlp_only_layers") or []):
            return
        raise ValueError(
            f"{where}: {architecture} with dense layers between the MoE ones "
            f"(decoder_sparse_step={sparse_step}, mlp_only_layers="
            f"{_get(config, 'mlp_only_layers')}) is not supported: every layer must be MoE"
        )
    raise ValueError(
        f"{where}: the mixture-of-experts architecture {architecture} is not supported "
        f"(supported: {', '.join(SUPPORTED)}; its routing rule is the only one the engines, "
        "the routing replay and the expert quantizers implement)"
    )


def moe_layout(config: Any) -> MoELayout | None:
    """The routing shape of a supported MoE config; None for a dense one."""
    if not is_moe(config):
        return None
    check_architecture(config, "moe_layout")
    return MoELayout(
        # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its alias)
        experts=int(_get(config, "num_experts") or _get(config, "num_local_experts")),
        top_k=int(_get(config, "num_experts_per_tok")),
        layers=tuple(range(int(_get(config, "num_hidden_layers")))),
    )
