"""PrecisionPolicy: how the learner's weights become what a rollout engine runs.

The base class (BF16 weights, no calibration) and the composition of policies with "+"
(`fp8+fp8_kv`); the registry and `build_policy` are in registry.py. What a policy is asked,
and when: docs/precision.md, "The lifecycle".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .experts import split_named, use_fake_quant_experts
from .manifest import Role, TensorRole
from .modules import use_fake_quant
from .storage import Storage

NamedTensors = Iterable[tuple[str, torch.Tensor]]

# Left in the engine dtype by the built-in weight quantizers: embeddings, the LM head,
# norms, biases (1-D anyway) and MoE routers (`mlp.gate`, not `mlp.gate_proj`).
UNQUANTIZED = re.compile(r"(embed|lm_head|norm|\.mlp\.gate\.weight$|\.bias$)")


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """A linear layer's 2-D weight that a W8A8 format can turn into 8 bits: the built-in
    policies' default for `quantizes`, and what an exported checkpoint lists as ignored
    when a policy declines it."""
    return name.endswith(".weight") and tensor.dim() == 2 and not UNQUANTIZED.search(name)


def check_weight(name: str, tensor: torch.Tensor) -> None:
    """The errors a quantizer must raise rather than produce garbage (or hide a NaN)."""
    if tensor.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight, got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got {tensor.dtype}")
    finite = torch.isfinite(tensor)
    if not finite.all():
        bad = (~finite).nonzero()[0].tolist()
        kind = "NaN" if torch.isnan(tensor).any() else "Inf"
        raise ValueError(
            f"{name}: {(~finite).sum().item()} non-finite values ({kind}, first at {bad}); "
            "refusing to quantize"
        )


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16: a dtype as engine configs (and vLLM) name it."""
    return str(dtype).removeprefix("torch.")


class PrecisionPolicy:
    """Base class: BF16 weights, no calibration. Subclasses override what they change.

    A policy receives the learner's master tensors (FP32, or the training dtype) and
    casts them itself, so what an engine gets is decided here and nowhere else."""

    name: str = "base"
    #: True if the policy has a weight format of its own (at most one such part per composition).
    quantizes_weights: bool = False
    #: True if `calibrate` returns tensors every version needs (KV-cache scales).
    needs_calibration: bool = False
    #: The dtype of every floating-point tensor the policy does not quantize.
    engine_dtype: torch.dtype = torch.bfloat16
    #: "master" (the learner's FP32 forward) or "quantized" (the engine's quantized forward,
    #: as fake-quant with straight-through gradients): set from `precision.learner_forward`.
    learner_forward: str = "master"
    #: What the learner hands `quantize_weights` each version: "master" (the FP32 master
    #: weights) or "compute" (the masters rounded to `run.compute_dtype` first, the weights
    #: the learner's forward uses): set from `precision.quantize_from`. Equal when the
    #: learner computes in FP32 (its default on a CPU).
    quantize_from: str = "master"
    #: Name and parameters, as the learner writes them into every version's header; a
    #: worker refuses a version whose spec differs from its own. Set by `get_policy`.
    spec: str = ""
    #: The model's HF config (layers, sizes), once `bind_model` has run.
    model_config: Any = None

    # -- the per-tensor decision -------------------------------------------------------------

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether this tensor goes through `quantize_tensor` (else `passthrough`). The
        built-in formats quantize every linear weight but the embeddings, LM head and
        routers; override to narrow or widen that."""
        return self.quantizes_weights and is_quantizable(name, tensor)

    def quantize_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine-side tensors for one learner tensor that `quantizes` accepts (one or
        several, e.g. a weight and its scale)."""
        yield name, self.passthrough(name, tensor)

    def passthrough(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the policy does not quantize, as the engine gets it."""
        return tensor.to(self.engine_dtype) if tensor.is_floating_point() else tensor

    def output_role(self, source: str, output: str) -> Role:
        """The role of `output`, one of the tensors `quantize_tensor(source, ...)` made:
        the weight itself under its own name, any other a scale of it. A format whose
        outputs are otherwise (a zero point, two halves of a weight) says so here."""
        return Role.WEIGHT if output == source else Role.WEIGHT_SCALE

    def extra_roles(self) -> dict[str, TensorRole]:
        """{name: role} of every tensor `calibrate` may return (KV scales, with their
        layer and part), for the version's manifest; a name `calibrate` returns that is
        not here travels as `Role.EXTRA`, which no built-in engine takes."""
        return {}

    def source_tensors(self, named_tensors: NamedTensors) -> NamedTensors:
        """The tensors `quantizes` is asked about: the learner's, except that a policy with
        a weight format sees an MoE's fused experts as each expert's linears, under
        checkpoint names (experts.py)."""
        return split_named(named_tensors) if self.quantizes_weights else named_tensors

    def quantize_weights(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Streams (name, tensor) pairs through the policy, one learner tensor at a time."""
        for name, tensor in self.source_tensors(named_tensors):
            if self.quantizes(name, tensor):
                yield from self.quantize_tensor(name, tensor)
            else:
                yield name, self.passthrough(name, tensor)

    # -- engines -----------------------------------------------------------------------------

    def engine_config(self) -> dict[str, Any]:
        """What the rollout engine must be started with: `dtype`, `quantization`,
        `quantization_config` (HF config.json form), `kv_cache_dtype`, ... Its `dtype` is
        `engine_dtype`'s name (`build_policy` refuses a policy where they differ)."""
        return {"dtype": dtype_name(self.engine_dtype)}

    def linear_module(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        bias: torch.Tensor | None,
        real: bool = True,
    ) -> torch.nn.Module:
        """The built-in torch engine's runtime module for a linear layer this policy
        quantizes, from `quantize_tensor`'s output for its weight `name` (an
        `asyncfp8.precision.modules.QuantizedLinear`). `real=False` asks for its
        fake-quant twin (the same rounding, float matmuls)."""
        raise NotImplementedError(
            f"precision {self.name!r} quantizes weights but gives the built-in torch engine no "
            "runtime module (PrecisionPolicy.linear_module)"
        )

    def storage(self) -> Storage:
        """What this precision's versions hold (weight and scale dtypes, scale layout, KV
        dtype) and the GEMM type: what the planner prices. The base stores every weight
        in `engine_dtype`."""
        return Storage(weight_dtype=self.engine_dtype)

    def checkpoint_config(self, unquantized_layers: Iterable[str] = ()) -> dict[str, Any] | None:
        """The `quantization_config` an exported checkpoint's config.json carries;
        `unquantized_layers` are the linear layers this policy left in the engine dtype
        (the format's ignore list)."""
        return None

    # -- the learner -------------------------------------------------------------------------

    def calibrate(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Extra tensors for this version (e.g. KV-cache scales); none by default."""
        return {}

    def fake_quantize_weight(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` as the engine multiplies with it (quantized and dequantized, no
        gradient); the learner's quantized forward uses it."""
        return weight

    def fake_quantize_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The input of linear layer `name` as the engine's GEMM sees it."""
        return x

    def reference_matmul(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., K] times the FP32 master `weight` [N, K] of linear layer `name`, without
        bias, as the engine's GEMM computes it: FP32 [..., N]. By default the fake-quantized
        input times the fake-quantized weight, one FP32 sum over K; a policy whose engine GEMM
        sums or scales in another order overrides it, for the refit probe's reference
        (docs/precision.md, "Your own policy")."""
        inputs = self.fake_quantize_input(name, x).float()
        return inputs @ self.fake_quantize_weight(name, weight).float().t()

    def prepare_learner(self, model: torch.nn.Module) -> torch.nn.Module:
        """With `learner_forward="quantized"`, makes the learner's forward the engine's
        quantized one (fake-quant, straight-through gradients); parameter names and
        objects are kept, so optimizer, checkpoints and versions see the same model."""
        if self.learner_forward != "quantized":
            return model
        model = use_fake_quant(model, self)
        return use_fake_quant_experts(model, self) if self.quantizes_weights else model

    # -- the model ---------------------------------------------------------------------------

    def learner_state(self) -> dict[str, Any]:
        """What the learner's quantized forward reads besides the weights that a version
        fixes (an FP8 KV cache's scales), kept with each version's weights so that a stale
        token is scored as the engine computed it (train/versions.py); {} for most."""
        return {}

    def load_learner_state(self, state: Mapping[str, Any]) -> None:
        """Puts back a `learner_state()`."""

    def set_engine_dtype(self, dtype: torch.dtype) -> None:
        """`precision.engine_dtype`: what the engine computes in around the quantized GEMMs
        and keeps the unquantized tensors in. FP32 with `learner_forward=quantized` leaves
        no rounding on either side for the activation quantizer to amplify (docs/precision.md,
        "The engine's compute dtype")."""
        self.engine_dtype = dtype

    def bind_model(self, config: Any) -> PrecisionPolicy:
        """Gives the policy the facts of the model it runs on (an HF config: layers,
        sizes); called by `build_policy`, the engines and checkpoint export."""
        self.model_config = config
        return self

    def require_model(self) -> Any:
        if self.model_config is None:
            raise ValueError(
                f"precision {self.name!r} needs the model's config (number of layers, ...): "
                "build it with build_policy(cfg, model_dir) or call policy.bind_model(config)"
            )
        return self.model_config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec or self.name!r})"


class ComposedPolicy(PrecisionPolicy):
    """Several policies applied together, e.g. FP8 weights + FP8 KV cache."""

    def __init__(self, parts: list[PrecisionPolicy]):
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"precision {'+'.join(names)!r} names a policy twice")
        weight_parts = [p.name for p in parts if p.quantizes_weights]
        if len(weight_parts) > 1:
            raise ValueError(
                f"precision {'+'.join(names)!r} makes no sense: {' and '.join(weight_parts)} both "
                "quantize the weights; compose one weight format with KV-cache policies"
            )
        self.parts, self.name = parts, "+".join(names)
        self._engine_config = self._merged_config()
        self._weights = next((p for p in parts if p.quantizes_weights), parts[0])
        self.quantizes_weights = self._weights.quantizes_weights
        self.needs_calibration = any(p.needs_calibration for p in parts)
        self.engine_dtype = self._weights.engine_dtype

    def _merged_config(self) -> dict[str, Any]:
        """The parts' engine configs as one; a key two parts set differently is refused."""
        config: dict[str, Any] = {}
        for part in self.parts:
            for key, value in part.engine_config().items():
                if key in config and config[key] != value:
                    raise ValueError(
                        f"precision {self.name!r}: {key!r} is {config[key]!r} in one part "
                        f"and {value!r} in another"
                    )
                config[key] = value
        return config

    def engine_config(self) -> dict[str, Any]:
        return dict(self._engine_config)

    def learner_state(self):
        return {part.name: part.learner_state() for part in self.parts}

    def load_learner_state(self, state):
        for part in self.parts:
            part.load_learner_state(state.get(part.name, {}))

    def set_engine_dtype(self, dtype):
        for part in self.parts:
            part.set_engine_dtype(dtype)
        self.engine_dtype = dtype
        self._engine_config = self._merged_config()

    def quantizes(self, name, tensor):
        return self._weights.quantizes(name, tensor)

    def quantize_tensor(self, name, tensor):
        return self._weights.quantize_tensor(name, tensor)

    def passthrough(self, name, tensor):
        return self._weights.passthrough(name, tensor)

    def output_role(self, source, output):
        return self._weights.output_role(source, output)

    def extra_roles(self):
        roles: dict[str, TensorRole] = {}
        for part in self.parts:
            roles |= part.extra_roles()
        return roles

    def linear_module(self, name, tensors, bias, real=True):
        return self._weights.linear_module(name, tensors, bias, real)

    def storage(self):
        smallest_kv = min((p.storage() for p in self.parts), key=lambda s: s.kv_dtype.itemsize)
        return self._weights.storage().with_kv(smallest_kv)

    def fake_quantize_weight(self, name, weight):
        return self._weights.fake_quantize_weight(name, weight)

    def fake_quantize_input(self, name, x):
        return self._weights.fake_quantize_input(name, x)

    def reference_matmul(self, name, x, weight):
        return self._weights.reference_matmul(name, x, weight)

    def prepare_learner(self, model):
        for part in self.parts:
            part.learner_forward = self.learner_forward
            model = part.prepare_learner(model)
        return model

    def bind_model(self, config):
        for part in self.parts:
            part.bind_model(config)
        return super().bind_model(config)

    def calibrate(self, model, batch):
        extra: dict[str, torch.Tensor] = {}
        for part in self.parts:
            extra |= part.calibrate(model, batch)
        return extra

    def checkpoint_config(self, unquantized_layers=()):
        """The weight format's config, plus what lets the engine load KV scales:
        compressed-tensors (INT8) takes a `kv_cache_scheme`; blockwise FP8's own config
        already loads `k_scale` / `v_scale`; BF16 weights take the KV part's config."""
        layers = list(unquantized_layers)
        config = self._weights.checkpoint_config(layers) if self.quantizes_weights else None
        kv = next(
            (
                p.checkpoint_config()
                for p in self.parts
                if p.needs_calibration and p.checkpoint_config()
            ),
            None,
        )
        if kv is None:
            return config
        if config is None:
            return kv
        if config.get("quant_method") == "compressed-tensors":
            return {**config, "kv_cache_scheme": kv["kv_cache_scheme"]}
        return config
