"""Which linear layers a weight format hurts most, measured, and the layout that keeps the
mismatch within a budget (`precision=mixed`): the exact KL(engine || learner) on calibration
texts, layers kept in BF16 by the most sensitivity per FLOP (docs/precision.md, "A mixed
precision"). `python -m asyncfp8.plan.layout` measures a layout (asyncfp8/plan/layout.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping

import torch
from torch import nn

from asyncfp8.hf.cpu_half import is_plain_linear, where_cpu_lacks_gemm

from .experts import split_experts, split_named
from .mixed import MixedPolicy, layer_of
from .policy import PrecisionPolicy


@dataclasses.dataclass
class Layout:
    """A measured layout: which layers stay in BF16, and what each choice costs."""

    keep: list[str]  # left in BF16, in the order kept (the most harm per FLOP first)
    floor: float  # KL with every layer in BF16
    full: float  # KL with every layer the base format takes quantized
    kl: float  # KL of this layout

    sensitivity: dict[str, float]  # KL added by quantizing that layer alone
    flops: dict[str, float]  # multiply-adds per token of each layer the format takes

    @property
    def ratio(self) -> float:
        """This layout's KL over the floor's (1.0: as good as BF16)."""
        return self.kl / self.floor if self.floor > 0 else float("inf")

    @property
    def quantized_share(self) -> float:
        """The share of those layers' FLOPs that run quantized."""
        total = sum(self.flops.values())
        return sum(f for name, f in self.flops.items() if name not in self.keep) / total

    def summary(self) -> str:
        return (
            f"{len(self.flops) - len(self.keep)}/{len(self.flops)} linear layers quantized "
            f"({self.quantized_share:.0%} of their FLOPs); KL {self.kl:.2e} = {self.ratio:.2f}x "
            f"BF16's {self.floor:.2e} (every layer quantized: {self.full:.2e}, "
            f"{self.full / self.floor if self.floor > 0 else float('inf'):.2f}x)"
        )

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        return json.dumps(
            {**fields, "ratio": self.ratio, "quantized_share": self.quantized_share}, indent=1
        )


class Switch(nn.Module):
    """One linear layer of the engine twin: its BF16 copy, or the policy's runtime module
    of the FP32 master weight (the one the torch engine runs: its fake-quant twin sums in
    another order, which an AVX2 CPU rounded differently), as `quantized` says."""

    def __init__(self, plain: nn.Linear, quantized: nn.Module):
        super().__init__()
        self.plain, self.fake_quant, self.quantized = plain, quantized, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fake_quant(x) if self.quantized else self.plain(x)


class EngineTwin:
    """The engine's model with any layout of `base`'s quantized layers, switched per
    forward: the model in the engine dtype, each layer `base` quantizes a `Switch`."""

    def __init__(self, model: nn.Module, base: PrecisionPolicy):
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for name, param in twin.named_parameters():
                param.data = base.passthrough(name, param.detach())
        where_cpu_lacks_gemm(
            twin, base.engine_dtype
        )  # as load_model gives the torch engine its model
        # An MoE's experts as the engine holds them: each expert linear a layer of its own.
        split_experts(twin)
        masters = dict(split_named(model.named_parameters()))
        self.switches: dict[str, Switch] = {}
        for prefix, parent in list(twin.named_modules()):
            for child_name, child in list(parent.named_children()):
                weight = f"{prefix}.{child_name}.weight".lstrip(".")
                if not is_plain_linear(child) or not base.quantizes(weight, masters[weight]):
                    continue
                master = masters[weight].detach()
                produced = dict(base.quantize_tensor(weight, master))
                bias = child.bias.detach() if child.bias is not None else None
                switch = Switch(child, base.linear_module(weight, produced, bias))
                setattr(parent, child_name, switch)
                self.switches[layer_of(weight)] = switch
        if not self.switches:
            raise ValueError(f"precision {base.name!r} quantizes no linear layer of this model")
        self.model = twin.eval()

    def flops(self) -> dict[str, float]:
        """Multiply-adds per token of each layer; an expert's linear runs for k of E tokens
        (uniform routing), so it counts k/E of its size."""
        config = self.model.config
        experts = getattr(config, "num_experts", None) or 0
        share = config.num_experts_per_tok / experts if experts else 1.0
        return {
            name: s.plain.in_features * s.plain.out_features * (share if ".experts." in name else 1)
            for name, s in self.switches.items()
        }

    def logits(self, batch: Mapping[str, torch.Tensor], quantized: set[str]) -> torch.Tensor:
        for name, switch in self.switches.items():
            switch.quantized = name in quantized
        with torch.no_grad():
            return self.model(**batch).logits.float()


def mean_kl(engine_logits: torch.Tensor, learner_logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Exact KL(engine || learner) over the vocabulary, averaged over `mask`'s positions."""
    engine = torch.log_softmax(engine_logits.double(), -1)
    learner = torch.log_softmax(learner_logits.double(), -1)
    per_position = (engine.exp() * (engine - learner)).sum(-1)
    return float(per_position[mask].mean())


def calibration_batch(
    task, tokenizer, prompts: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The task's first `prompts` prompts, each followed by its reference completion as a
    rollout holds them (the prompt's tokens, then the completion's), left-padded, and the
    mask of the positions measured: those that predict a completion token, as a rollout's
    mismatch (`mismatch/kl_k3`) is over response tokens only (docs/precision.md)."""
    rows, starts = [], []
    for i in range(prompts):
        prompt = task.prompt(i)
        prompt_ids = tokenizer(prompt.text)["input_ids"]
        completion_ids = tokenizer(task.completion(prompt), add_special_tokens=False)["input_ids"]
        if not completion_ids:
            raise ValueError(f"prompt {i} has an empty reference completion: nothing to measure")
        rows.append(prompt_ids + completion_ids)
        starts.append(len(prompt_ids))
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, (row, start) in enumerate(zip(rows, starts, strict=True)):
        offset = width - len(row)  # left padding, as the engines pad a batch
        input_ids[r, offset:] = torch.tensor(row)
        attention[r, offset:] = 1
        mask[r, offset + start - 1 : width - 1] = True  # each predicts a completion token
    return {"input_ids": input_ids, "attention_mask": attention}, mask


def layout_kl(
    model: nn.Module, policy: MixedPolicy, batch: Mapping[str, torch.Tensor], mask: torch.Tensor
) -> tuple[float, float]:
    """(the KL of `policy`'s layout, BF16's floor) for `model` now: the learner's
    measure of a frozen layout as the weights move."""
    twin = EngineTwin(model, policy.base)
    with torch.no_grad():
        learner = model(**batch).logits.float()
    quantized = set(twin.switches) - set(policy.require_layout())
    return (
        mean_kl(twin.logits(batch, quantized), learner, mask),
        mean_kl(twin.logits(batch, set()), learner, mask),
    )


def plan_layout(
    model: nn.Module,
    base: PrecisionPolicy,
    batch: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
    budget: float | None = None,
    quantized_share: float | None = None,
    progress=None,
    budget_kl: float | None = None,
) -> Layout:
    """The layout of `base` over `model` within `budget` x BF16's KL, within an absolute
    mean KL `budget_kl` (refused below BF16's own, the floor), or quantizing
    `quantized_share` of the FLOPs (exactly one of the three). `progress(text)` hears of
    each measurement (one forward pass per layer, then one per layer kept and one per layer
    tried back)."""
    if sum(rule is not None for rule in (budget, quantized_share, budget_kl)) != 1:
        raise ValueError("plan_layout needs one of a budget, a budget_kl or a quantized_share")
    if budget is not None and budget < 1:
        raise ValueError(f"a budget below 1.0 is below BF16's own mismatch: {budget}")
    twin = EngineTwin(model, base)
    say = progress or (lambda text: None)
    with torch.no_grad():
        learner = model(**batch).logits.float()
    layers = list(twin.switches)

    def measure(quantized) -> float:
        return mean_kl(twin.logits(batch, set(quantized)), learner, mask)

    floor = measure(())
    if floor <= 0:
        raise ValueError(
            "BF16's measured mismatch on the calibration texts is 0: nothing to budget against"
        )
    if budget_kl is not None:
        budget = _relative_budget(budget_kl, floor)
    full = measure(layers)  # after the checks on the floor: a refusal costs one pass
    sensitivity = {}
    for i, name in enumerate(layers):
        sensitivity[name] = measure([name]) - floor
        say(f"sensitivity {i + 1}/{len(layers)}: {name} +{sensitivity[name]:.2e}")
    flops = twin.flops()
    # a layer kept in BF16 costs its FLOPs: rank by the KL it adds per FLOP, so that a small
    # harmful layer (a k or v projection under GQA) is kept before a large layer that
    # harms a little more (docs/precision.md)
    by_harm_per_flop = sorted(
        layers, key=lambda name: sensitivity[name] / flops[name], reverse=True
    )
    keep: list[str] = []
    if quantized_share is not None:
        keep = _keep_for_share(by_harm_per_flop, flops, quantized_share)
        kl = measure([n for n in layers if n not in keep])
    else:
        kl = full
        for name in by_harm_per_flop:
            if kl <= budget * floor:
                break
            keep.append(name)
            kl = measure([n for n in layers if n not in keep])
            say(f"kept {name} in BF16: {kl / floor:.2f}x BF16's KL")
        # sensitivities do not add: a layer kept early may not be needed once later ones
        # are kept; each goes back to the base format, the largest first, where the
        # layout stays within the budget without it (one forward pass per kept layer),
        # and again until none can (giving one back can lower the KL: they interact)
        given_back = True
        while given_back:
            given_back = False
            for name in sorted(keep, key=lambda n: (-flops[n], sensitivity[n])):
                trial = [n for n in keep if n != name]
                trial_kl = measure([n for n in layers if n not in trial])
                if trial_kl <= budget * floor:
                    keep, kl, given_back = trial, trial_kl, True
                    say(f"{name} back to {base.name}: {kl / floor:.2f}x BF16's KL")
    return Layout(keep, floor, full, kl, sensitivity, flops)


def _relative_budget(budget_kl: float, floor: float) -> float:
    """An absolute mean KL as a multiple of BF16's `floor`; refused below the floor."""
    if budget_kl < floor:
        raise ValueError(
            f"precision.budget_kl={budget_kl:.3e} is below BF16's own mismatch on the "
            f"calibration texts, {floor:.3e} (measured: every layer in BF16), the floor "
            "no layout can go under; ask for at least that, or precision.budget (a "
            "multiple of it)"
        )
    return budget_kl / floor


def _keep_for_share(
    by_harm_per_flop: list[str], flops: dict[str, int], quantized_share: float
) -> list[str]:
    """The most harmful layers per FLOP that still leave `quantized_share` of the FLOPs
    quantized, in that order."""
    keep: list[str] = []
    total, quantized = sum(flops.values()), sum(flops.values())
    for name in by_harm_per_flop:  # keep the worst that the share leaves room for
        if (quantized - flops[name]) / total < quantized_share - 1e-12:
            continue
        keep.append(name)
        quantized -= flops[name]
    return keep


class LayoutDrift:
    """The learner's watch over a frozen layout: every `policy.remeasure_every` versions,
    its KL and BF16's measured again on the version's weights (rank 0's gathered FP32
    state, loaded into a plain copy of the model kept for it), as metrics
    `precision/layout_kl`, `precision/layout_kl_bf16` and `precision/layout_kl_ratio`.
    RL moves the weights: a layout chosen within budget at the start may leave it."""

    def __init__(self, policy: MixedPolicy, model: nn.Module, task, tokenizer, device=None):
        # on the learner's device: on a GPU a measure is three forward passes of the
        # calibration texts and one quantization of the model, which a CPU would take
        # minutes over for billions of parameters; it holds the copy (FP32) and, while it
        # measures, its BF16 twin
        self.policy, self.model = policy, model.to(device).eval()
        batch, mask = calibration_batch(task, tokenizer, policy.calibration_prompts)
        self.batch = {key: value.to(device) for key, value in batch.items()}
        self.mask = mask.to(device)

    def due(self, version: int) -> bool:
        every = self.policy.remeasure_every
        return bool(every) and version > 0 and version % every == 0

    def measure(self, state: Mapping[str, torch.Tensor]) -> dict[str, float]:
        missing = [name for name, _ in self.model.named_parameters() if name not in state]
        if missing:
            raise ValueError(
                f"the version's state lacks {len(missing)} parameter(s): {missing[:3]}"
            )
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(state[name])
        kl, floor = layout_kl(self.model, self.policy, self.batch, self.mask)
        return {
            "precision/layout_kl": kl,
            "precision/layout_kl_bf16": floor,
            "precision/layout_kl_ratio": kl / floor if floor > 0 else float("inf"),
        }

    def over_budget(self, metrics: Mapping[str, float]) -> str | None:
        """A warning when the layout measured past its budget, else None."""
        ratio, kl = metrics.get("precision/layout_kl_ratio"), metrics.get("precision/layout_kl")
        budget, budget_kl = self.policy.budget, self.policy.budget_kl
        if ratio is None or kl is None:
            return None
        if budget is not None and ratio > budget:
            past = f"precision.budget={budget}"
        elif budget_kl is not None and kl > budget_kl:
            past = f"precision.budget_kl={budget_kl:.2e}"
        else:
            return None
        return (
            f"precision=mixed: the layout's KL is now {ratio:.2f}x BF16's, past {past} "
            f"(measured {kl:.2e}); the layout is frozen for the run: a new run measures a new one"
        )


def plan_for(policy: MixedPolicy, model: nn.Module, task, tokenizer, progress=None) -> Layout:
    """`policy`'s layout, measured on `model` and `task` as its parameters say."""
    batch, mask = calibration_batch(task, tokenizer, policy.calibration_prompts)
    return plan_layout(
        model,
        policy.base,
        batch,
        mask,
        policy.budget,
        policy.quantized_share,
        progress,
        budget_kl=policy.budget_kl,
    )


def keep_override(layout: Layout) -> str:
    """The override that starts a process with this layout."""
    return "precision.keep=[" + ",".join(f"'{name}'" for name in sorted(layout.keep)) + "]"


def mixed_part(policy: PrecisionPolicy) -> MixedPolicy | None:
    """The `mixed` part of `policy` (itself, or a part of a composition), if any."""
    parts = getattr(policy, "parts", [policy])
    return next((p for p in parts if isinstance(p, MixedPolicy)), None)


def unmeasured_mixed(policy: PrecisionPolicy) -> MixedPolicy | None:
    """The `mixed` part of `policy` when it has no layout yet (no precision.keep)."""
    mixed = mixed_part(policy)
    return mixed if mixed is not None and mixed.keep is None else None
