"""What the planner needs to know about a model, read from its HF `config.json`.

Dense and MoE decoder-only transformers with grouped-query attention (Qwen2/2.5, Qwen3,
Llama, Mistral, Mixtral and their kin); `model.path` is an HF model directory, a
`config.json`, or a config bundled with the planner (`asyncfp8/plan/data/models/`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PlanInputError

BUNDLED_MODELS = Path(__file__).parent / "data" / "models"
REQUIRED = {
    "hidden_size": "hidden size",
    "num_hidden_layers": "number of layers",
    "num_attention_heads": "number of attention heads",
}


@dataclass(frozen=True)
class ModelFacts:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # of the dense MLP layers (0 if every layer is MoE)
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    num_experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0  # how many of the layers are MoE layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self, moe: bool) -> list[tuple[str, int, int]]:
        """(name, out features, in features) of one layer's linear weights that W8A8
        quantizes, one entry per learner tensor (q, k and v separate, as the learner and
        the checkpoint hold them; an engine fuses them, which changes no byte count).
        Experts are listed once each; the router is left out (it stays BF16)."""
        h = self.hidden_size
        shapes = [
            ("q_proj", self.q_size, h),
            ("k_proj", self.kv_size, h),
            ("v_proj", self.kv_size, h),
            ("o_proj", h, self.q_size),
        ]
        if not moe:
            i = self.intermediate_size
            return [*shapes, ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]
        i = self.moe_intermediate_size
        for e in range(self.num_experts):
            shapes += [(f"experts.{e}.gate_proj", i, h), (f"experts.{e}.up_proj", i, h)]
            shapes += [(f"experts.{e}.down_proj", h, i)]
        if self.shared_expert_intermediate_size:
            s = self.shared_expert_intermediate_size
            shapes += [("shared_expert.gate_proj", s, h), ("shared_expert.up_proj", s, h)]
            shapes += [("shared_expert.down_proj", h, s)]
        return shapes

    def unquantized_layer_params(self, moe: bool) -> int:
        """Parameters of one layer that stay BF16 under every weight quantizer: norms,
        biases, q/k norms and the MoE router."""
        params = 2 * self.hidden_size  # input and post-attention RMSNorm
        if self.attention_bias:
            params += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            params += 2 * self.head_dim
        if moe:
            params += self.num_experts * self.hidden_size  # router
            if self.shared_expert_intermediate_size:
                params += self.hidden_size  # shared-expert gate (one output)
        return params

    def embedding_params(self) -> int:
        """Input embedding, LM head (unless tied) and the final norm: never quantized."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def parameter_count(self) -> int:
        total = self.embedding_params()
        for moe, layers in ((False, self.dense_layers), (True, self.moe_layers)):
            if layers:
                per_layer = sum(n * k for _, n, k in self.linear_shapes(moe))
                total += layers * (per_layer + self.unquantized_layer_params(moe))
        return total

    def active_parameter_count(self) -> int:
        """Parameters one token goes through (k of the experts), LM head included."""
        total = self.parameter_count()
        if self.is_moe:
            per_expert = 3 * self.hidden_size * self.moe_intermediate_size
            total -= self.moe_layers * (self.num_experts - self.experts_per_token) * per_expert
        return total


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    # Multimodal configs keep the language model's numbers under `text_config`.
    if "hidden_size" not in raw and isinstance(raw.get("text_config"), dict):
        return raw["text_config"]
    return raw


def facts_from_config(raw: dict[str, Any], name: str) -> ModelFacts:
    """ModelFacts from a parsed HF config.json; PlanInputError names what is missing."""
    cfg = _text_config(raw)
    missing = [f"{key} ({what})" for key, what in REQUIRED.items() if not cfg.get(key)]
    if missing:
        raise PlanInputError(
            f"model config {name}: missing {', '.join(missing)}; the planner needs at least "
            "hidden_size, num_hidden_layers and num_attention_heads (HF config.json names)"
        )
    if cfg.get("kv_lora_rank"):
        raise PlanInputError(
            f"model config {name}: multi-head latent attention (kv_lora_rank) is not modelled; "
            "the planner covers dense and MoE models with grouped-query attention"
        )
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise PlanInputError(
            f"model config {name}: {heads} attention heads is not a multiple of {kv_heads} KV heads"
        )
    if not cfg.get("vocab_size"):
        raise PlanInputError(f"model config {name}: missing vocab_size (vocabulary size)")
    experts = int(
        cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    )
    model_type = str(cfg.get("model_type", ""))
    moe_fields: dict[str, int] = {}
    if experts:
        per_token = int(cfg.get("num_experts_per_tok") or 0)
        if not per_token:
            raise PlanInputError(
                f"model config {name}: {experts} experts but no num_experts_per_tok"
            )
        moe_intermediate = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size"))
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        shared += int(cfg.get("n_shared_experts") or 0) * moe_intermediate
        dense_only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        moe_layers = sum(
            1
            for i in range(layers)
            if i not in dense_only and i >= first_dense and (i + 1) % step == 0
        )
        moe_fields = {
            "num_experts": experts,
            "experts_per_token": per_token,
            "moe_intermediate_size": moe_intermediate,
            "shared_expert_intermediate_size": shared,
            "moe_layers": moe_layers,
        }
    intermediate = int(cfg.get("intermediate_size") or 0)
    if not intermediate and moe_fields.get("moe_layers", 0) < layers:
        raise PlanInputError(f"model config {name}: missing intermediate_size (MLP width)")
    return ModelFacts(
        name=name,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2's attention always has q/k/v biases; other families say so in the config.
        attention_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))),
        qk_norm=model_type.startswith("qwen3"),
        **moe_fields,
    )


def bundled_models() -> list[str]:
    return sorted(p.stem for p in BUNDLED_MODELS.glob("*.json"))


def load_model_facts(path: str) -> ModelFacts:
    """ModelFacts of an HF directory, a config.json or a bundled config's name."""
    candidate = Path(path).expanduser()
    if candidate.is_dir():
        candidate = candidate / "config.json"
    elif not candidate.exists() and (BUNDLED_MODELS / f"{path}.json").exists():
        candidate = BUNDLED_MODELS / f"{path}.json"
    if not candidate.is_file():
        raise PlanInputError(
            f"model.path={path}: no such config.json, model directory or bundled config "
            f"(bundled: {', '.join(bundled_models())})"
        )
    try:
        raw = json.loads(candidate.read_text())
    except json.JSONDecodeError as err:
        raise PlanInputError(f"model config {candidate}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise PlanInputError(f"model config {candidate}: expected a JSON object")
    name = path if candidate.parent == BUNDLED_MODELS else str(candidate)
    return facts_from_config(raw, name)
