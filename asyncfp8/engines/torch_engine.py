"""The built-in rollout engine: a transformers model with the precision policy's quantized
modules, on the CPU or a CUDA GPU, decoding through one loop (`slot_loop`) over slots of a
static KV cache (BF16 or e4m3), on CUDA with a captured decode step (`slots`). Not vLLM,
but its FP8 / INT8 / FP8-KV numerics are the ones an engine would show."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from asyncfp8.engines.probe_scoring import (
    next_token_logprobs,
    recording_layer_rms,
    rows_by_length,
)
from asyncfp8.engines.speculative.settings import SpeculativeSettings
from asyncfp8.engines.speculative.slots import SlotSpeculation
from asyncfp8.hf.loading import load_model, load_tokenizer
from asyncfp8.moe import moe_layout
from asyncfp8.moe.routes import RouteRecorder
from asyncfp8.precision import PrecisionPolicy, get_policy
from asyncfp8.precision.experts import split_experts
from asyncfp8.precision.fp8_kv import kv_scale_names
from asyncfp8.precision.grouped_experts import group_experts
from asyncfp8.precision.kernel_support import launching_on, on_its_device
from asyncfp8.precision.manifest import TensorRole, check_received, decoder_layers
from asyncfp8.precision.modules import apply_policy

from .base import EngineUnsupported, Sample, SamplingParams, Scores, check_slots
from .decode import ATTENTION, Prefill, forward_static, processed_logprobs
from .kv_cache import quantize_kv
from .slot_loop import Generated, SlotLoop, SlotStats, seeded_requests
from .slots import SlotDecoder
from .torch_support import (
    check_counts,
    check_layer_kinds,
    probe,
    resolve_compile,
    resolve_device,
    supports,
)
from .torch_weights import ModelTensors

__all__ = ["TorchEngine", "processed_logprobs", "resolve_device", "supports"]


class TorchEngine:
    """The built-in engine. Its options (`device`, `max_batch`, `finish_check_every`,
    `cache_block`, `cuda_graph`, `slots`, `speculative`, `compile`) and `dtype`:
    docs/engines.md, "torch (built in)". `model`, `tokenizer`: a built model (moved to
    `device`, quantized in place, `dtype` its own) and its tokenizer instead of loading
    `model_dir` (benchmarks build random-init models on the GPU)."""

    name = "torch"

    def __init__(
        self,
        model_dir: str | None,
        policy: PrecisionPolicy | str = "bf16",
        dtype: torch.dtype | None = None,
        max_batch: int = 64,
        device: str = "auto",
        finish_check_every: int = 8,
        cache_block: int = 256,
        cuda_graph: bool = True,
        slots: int | None = None,
        speculative: Mapping[str, Any] | None = None,
        compile: bool | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer=None,
    ):
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        reason = supports(self.policy)
        if reason:
            raise EngineUnsupported(
                f"engine torch cannot run precision {self.policy.name!r}: {reason}"
            )
        check_counts(
            max_batch=max_batch, finish_check_every=finish_check_every, cache_block=cache_block
        )
        check_slots(slots)
        self.speculative = SpeculativeSettings.from_config(speculative, self.name, slots)
        if (model is None) != (tokenizer is None) or (model is None and model_dir is None):
            raise ValueError("TorchEngine needs model_dir, or both model and tokenizer")
        self.device = resolve_device(device, self.policy.name)
        config = self.policy.engine_config()
        if model is None:
            model = load_model(model_dir, dtype=dtype or self.policy.engine_dtype)
            tokenizer = load_tokenizer(model_dir)
        check_layer_kinds(model)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        layer_of = self._quantize(config)
        self.fp8_kv = config.get("kv_cache_dtype") == "fp8"
        layers = self.model.config.num_hidden_layers
        # Held here and overwritten in place by every version: caches and captured graphs
        # read them where they are.
        self.kv_scales = [
            tuple(torch.ones((), device=self.device) for _ in "kv") for _ in range(layers)
        ]
        self._kv_scales_loaded: set[tuple[int, str]] = set()
        self.max_batch, self.finish_check_every = max_batch, finish_check_every
        self.cache_block = cache_block
        #: the decode step through torch.compile (SlotDecoder); engine.compile resolved
        self.compile = resolve_compile(compile, self.device)
        self.slots = slots
        self._slot_decoder: SlotDecoder | None = None
        self._routes: RouteRecorder | None = None  # the decoder's, for an MoE
        self._generating = False  # a generation is running (updates land mid-way)
        #: called between two decode steps of a slot generation (a worker applies the
        #: newest version there); None: nothing runs between steps
        self.between_steps: Callable[[], None] | None = None
        #: what the last generation did (steps, prefills, tokens, versions applied)
        self.last_stats: SlotStats | None = None
        self.version: int | None = None
        self._tensors = ModelTensors.of(self.model)
        self.expected = self._tensors.specs(self.policy, layer_of, self.fp8_kv)
        self._probe()
        self.speculation: SlotSpeculation | None = None
        if self.speculative.enabled:
            self.speculation = SlotSpeculation.from_settings(
                self.speculative, self.model, self.device, slots
            )

    def _quantize(self, config: Mapping[str, Any]) -> dict[str, int]:
        """Binds the policy to the model and swaps in its quantized modules (on the engine's
        GPU); returns each tensor's decoder layer, read before the linears are replaced."""
        if self.policy.model_config is None:
            self.policy.bind_model(self.model.config)
        if self.policy.quantizes_weights:  # an MoE's experts as linears a format can swap
            split_experts(self.model)
        layer_of = decoder_layers(self.model)  # read before quantized modules replace linears
        try:
            with launching_on(self.device):  # the Triton quantizers, on the engine's GPU
                apply_policy(self.model, self.policy)
        except NotImplementedError as err:
            raise EngineUnsupported(f"engine torch: {err}") from None
        looped = group_experts(self.model)
        if looped and self.cuda_graph:
            raise EngineUnsupported(
                f"engine torch: the experts of {looped[0]} run in a loop over the experts "
                f"(no grouped kernel for precision {self.policy.name!r} here: Triton runs "
                "16-bit and blockwise FP8 experts), which a CUDA graph cannot capture; set "
                "engine.cuda_graph=false"
            )
        if config.get("lm_head_dtype") == "float32":
            # FlashRL's LM-head option: the last projection in FP32 (weights and input).
            self.model.lm_head.float()
            self.model.lm_head.register_forward_pre_hook(lambda _module, args: (args[0].float(),))
        self.model.set_attn_implementation(ATTENTION)
        return layer_of

    @on_its_device
    def _probe(self) -> None:
        """One token through the model: what the device cannot run fails at start."""
        probe(self.model, self.policy.name, self.device, self.tokenizer.eos_token_id or 0)

    # -- the drafter ----------------------------------------------------------------------------

    def _drafting(self) -> SlotSpeculation:
        if self.speculation is None:
            raise ValueError("this engine has no drafter (engine.speculative.mode=none)")
        return self.speculation

    def drafter_state(self) -> dict:
        """The online drafter's state for a worker checkpoint: the trainer's (drafter,
        optimizer, counters, acceptance per version) and the controller's."""
        return self._drafting().state_dict()

    def load_drafter_state(self, state: Mapping[str, Any]) -> None:
        """Restores `drafter_state()`; a drafter of another model is refused before
        anything changes."""
        self._drafting().load_state_dict(state)

    @property
    def speculating(self) -> bool:
        """Whether this engine speculates (engine.speculative.mode other than none)."""
        return self.speculation is not None

    def acceptance_by_version(self) -> dict[int, dict[str, float]]:
        """The drafter's acceptance per policy version (the trainer's records)."""
        return self._drafting().trainer.acceptance_by_version()

    def speculation_metrics(self) -> dict[str, float]:
        """Acceptance (rate, mean accepted length), drafter losses, the fraction of steps
        that speculated and the controller's choices; empty without a drafter."""
        return {} if self.speculation is None else self.speculation.metrics()

    # -- weights -----------------------------------------------------------------------------

    @on_its_device
    def update_weights(
        self,
        version: int,
        named_tensors: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor] | None = None,
        manifest: Mapping[str, TensorRole] | None = None,
    ) -> None:
        """Checks the version first (`check_received`) and only then writes any of it: a
        version is applied whole or not at all. Values are copied into the existing
        storage (no parameter, buffer or KV scale moves), so a captured decode graph
        runs the new version."""
        extra = extra or {}
        roles = check_received(
            version, [*named_tensors.items(), *extra.items()], manifest, self.expected
        )
        layers, params, kv = self._tensors.sort(named_tensors, extra, roles)
        with torch.no_grad():
            for module, tensors in layers.items():
                module.load(tensors)
            for param, tensor in params:
                param.copy_(tensor)
            for (layer, part), value in kv.items():
                self._rescale_live_cache(layer, part, value)
                self.kv_scales[layer]["kv".index(part)].copy_(value)
        self._kv_scales_loaded |= set(kv)
        self.version = version
        if self.speculation is not None:
            self.speculation.trainer.on_new_version(version)

    def _rescale_live_cache(self, layer: int, part: str, new_scale: torch.Tensor) -> None:
        """An in-flight update of an e4m3 cache's scale: the bytes already written were
        quantized with the old scale and would be read with the new one, so the running
        slot generation's cache is requantized to the new scale (rounded once more; the
        values it holds stay those the old version computed)."""
        decoder = self._slot_decoder if self._generating else None
        if decoder is None or not decoder.cache.fp8:
            return
        old_scale = self.kv_scales[layer]["kv".index(part)]
        buffer = (decoder.cache.keys if part == "k" else decoder.cache.values)[layer]
        buffer.copy_(quantize_kv(buffer.float() * old_scale, new_scale.to(old_scale.device)))

    # -- the refit probe -----------------------------------------------------------------------

    @torch.no_grad()
    @on_its_device
    def score(self, sequences: Sequence[Sequence[int]]) -> Scores:
        """Teacher-forced log-probs (temperature 1) and each decoder layer's output RMS of
        `sequences`, through the engine's prefill path (its quantized modules; an e4m3 cache
        written and read back with the scales held). Sequences of one length share a forward,
        never padded: in BF16 a padded row's attention sums in another order, moving log-probs
        beyond the probe's tolerance (0.007 on the tiny model)."""
        for index, sequence in enumerate(sequences):
            if len(sequence) < 2:
                raise ValueError(f"probe sequence {index} has {len(sequence)} tokens; need >= 2")
        logprobs: list[torch.Tensor | None] = [None] * len(sequences)
        layer_rms: list[torch.Tensor | None] = [None] * len(sequences)
        for width, members in rows_by_length([len(s) for s in sequences]).items():
            ids = torch.tensor([list(sequences[i]) for i in members], device=self.device)
            prefill = Prefill(self.model, len(members), width, self._kv_cache_scales())
            positions = torch.arange(width, device=self.device)[None]
            causal = torch.ones(1, 1, width, width, dtype=torch.bool, device=self.device).tril()
            prefill.cache.write_at(torch.arange(width, device=self.device), visible=width)
            with recording_layer_rms(self.model) as rms:
                _, logits = forward_static(
                    self.model, prefill.cache, prefill.kinds, ids, causal, positions, width
                )
            rows_logprobs = next_token_logprobs(logits, ids).cpu()
            rows_rms = torch.stack(rms, dim=1).cpu()  # [rows, layers, width]
            for j, index in enumerate(members):
                logprobs[index], layer_rms[index] = rows_logprobs[j], rows_rms[j]
        return Scores(logprobs=logprobs, layer_rms=layer_rms)

    def held_kv_scales(self) -> dict[str, float]:
        """The KV scales the e4m3 cache uses now, by the names a version sends them ({}
        without an e4m3 cache; scales no version has sent yet are left out)."""
        if not self.fp8_kv:
            return {}
        held = {}
        for layer, part in sorted(self._kv_scales_loaded):
            held[kv_scale_names(layer)[part]] = float(self.kv_scales[layer]["kv".index(part)])
        return held

    # -- generation --------------------------------------------------------------------------

    def _kv_cache_scales(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if not self.fp8_kv:
            return None
        missing = [
            i
            for i in range(len(self.kv_scales))
            if not {(i, "k"), (i, "v")} <= self._kv_scales_loaded
        ]
        if missing:
            names = kv_scale_names(missing[0])
            raise ValueError(
                f"the FP8 KV cache needs per-layer scales ({names['k']}, ...): apply a version "
                "with the policy's calibrate() output as extra first"
            )
        return self.kv_scales

    @torch.no_grad()
    def start(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> tuple[SlotDecoder, torch.Tensor]:
        """Prefills token-id prompts, one slot each (identical ones once), for up to
        `max_new_tokens` new tokens each: (the engine's slot decoder, ready for its first
        decode step; the logits of each sequence's first new token [B, V]). What the
        decode loop does first, for a caller that feeds the tokens itself (teacher
        forcing)."""
        width = max(len(ids) for ids in prompts)
        # The last token generated is never fed back: max_new_tokens - 1 decode steps.
        decoder = self.slot_decoder(len(prompts), width + max_new_tokens - 1)
        return decoder, decoder.fill(range(len(prompts)), prompts)

    @property
    def supports_inflight_updates(self) -> bool:
        """Versions can be applied between decode steps: with `slots` set, through
        `between_steps`."""
        return self.slots is not None

    def slot_decoder(self, slots: int, positions: int) -> SlotDecoder:
        """A decoder of `slots` slots for sequences of up to `positions` positions: the
        last one when it has as many slots and as many positions rounded up to
        `cache_block`, else a new one (the old cache and graph are freed first)."""
        kv_scales = self._kv_cache_scales()
        max_tokens = -(-positions // self.cache_block) * self.cache_block
        current = self._slot_decoder
        if current is None or (current.slots, current.max_tokens) != (slots, max_tokens):
            # No reference to the old decoder may outlive this line: its KV cache (GBs on
            # a GPU) and graph are freed before the new ones are allocated.
            self._slot_decoder = current = None
            self._set_route_recorder(slots)
            current = self._slot_decoder = SlotDecoder(
                self.model,
                slots,
                max_tokens,
                kv_scales,
                record_hidden=self.speculation is not None,
                graph=self.cuda_graph,
                compiled=self.compile,
            )
        return current

    def release_memory(self) -> int:
        """`MemoryRelease`: drops the slot decoder, its static KV cache and its captured
        decode graph; the next generation allocates (and on CUDA captures) them again,
        which changes none of its tokens. The bytes of the cache freed (the graph's pool
        is not counted)."""
        decoder, self._slot_decoder = self._slot_decoder, None
        self._set_route_recorder(None)
        if decoder is None:
            return 0
        cache = decoder.cache
        freed = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
        del decoder, cache  # the last references: the allocator has the blocks back now
        return freed

    @torch.no_grad()
    def generate_requests(
        self,
        prompts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        sampling: SamplingParams,
        indices: Sequence[int] | None = None,
    ) -> list[Sample]:
        """Token-id prompts, each with its own `max_new_tokens` (`sampling.n` and
        `sampling.max_new_tokens` are not used), through the slots: one sample per
        prompt, request i seeded from (`sampling.seed`, `indices[i]`) (default: i), so a
        request split off into another call keeps its stream."""
        if len(prompts) != len(budgets) or any(b < 1 for b in budgets):
            raise ValueError("one budget >= 1 per prompt")
        indices = list(range(len(prompts))) if indices is None else list(indices)
        if len(indices) != len(prompts):
            raise ValueError("one index per prompt")
        jobs = list(zip(indices, prompts, strict=True))
        return self._generate(jobs, list(budgets), sampling, indices)

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[str], sampling: SamplingParams, first_request: int = 0
    ) -> list[Sample]:
        """`sampling.n` samples per prompt; sample j of prompt i is request
        `first_request + i * n + j`, whose stream it samples from: a lease split over a
        colocated run's ranks (learner/colocated.py) makes the whole lease's tokens."""
        encoded = [self.tokenizer(p)["input_ids"] for p in prompts]
        jobs = [(i, ids) for i, ids in enumerate(encoded) for _ in range(sampling.n)]
        if not jobs:
            return []
        indices = range(first_request, first_request + len(jobs)) if first_request else None
        return self._generate(jobs, [sampling.max_new_tokens] * len(jobs), sampling, indices)

    @on_its_device
    def _generate(
        self, jobs, budgets: list[int], sampling: SamplingParams, indices: list[int] | None = None
    ) -> list[Sample]:
        """jobs: (prompt_index, prompt ids), through `engine.slots` slots or (None) one
        per job, at most `max_batch`; request i's stream is `indices[i]`'s (default: its
        position in the call)."""
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        seed = 0 if sampling.seed is None else sampling.seed
        if sampling.seed is None and sampling.temperature > 0:
            seed = int(torch.randint(0, 2**62, ()))  # unseeded: a fresh stream per call
        requests = seeded_requests([ids for _, ids in jobs], budgets, seed, indices)
        # An eos-finished row runs on (recording nothing) until the next check.
        positions = max(len(r.prompt_ids) for r in requests) + max(budgets)
        drafts = 0 if self.speculation is None else self.speculation.max_k + 1
        slots = self.slots or min(len(requests), self.max_batch)
        decoder = self.slot_decoder(slots, positions + self.finish_check_every + drafts)
        stats = SlotStats()
        self._generating = True
        started = time.perf_counter()
        try:
            generated = SlotLoop(
                decoder,
                requests,
                sampling,
                eos,
                pad,
                check_every=self.finish_check_every,
                version=lambda: -1 if self.version is None else self.version,
                between_steps=self.between_steps if self.slots is not None else None,
                stats=stats,
                strategy=self.speculation,
                routes=self._route_recorder(decoder),
            ).run()
        finally:
            self._generating = False
        self.last_stats = stats
        self._train_drafter(started)
        return [
            self._sample(prompt_index, prompt_ids, g, sampling)
            for (prompt_index, prompt_ids), g in zip(jobs, generated, strict=True)
        ]

    def _set_route_recorder(self, slots: int | None) -> None:
        """An MoE's route recorder for a decoder of `slots` rows (None: none), its hooks on
        before the decoder's first step is compiled or captured, the old one's removed."""
        if self._routes is not None:
            self._routes.detach()
            self._routes = None
        if slots is not None and moe_layout(self.model.config) is not None:
            self._routes = RouteRecorder(self.model, step_rows=slots)
            self._routes.attach()

    def _route_recorder(self, decoder) -> RouteRecorder | None:
        """The current decoder's (an MoE's: every step's routes, eager, compiled or captured)."""
        return self._routes

    def _train_drafter(self, started: float) -> None:
        """Online: the drafter learns from the rollouts just made, between generations, for
        at most train_time_fraction of the time they took (since `started`)."""
        if self.speculation is None or not self.speculative.train_steps:
            return
        fraction = self.speculative.train_time_fraction
        now = time.perf_counter()
        deadline = None if fraction is None else now + fraction * (now - started)
        with torch.enable_grad():
            self.speculation.trainer.train(self.speculative.train_steps, deadline)

    def _sample(self, prompt_index, prompt_ids, generated: Generated, sampling) -> Sample:
        eos, ids = self.tokenizer.eos_token_id, generated.token_ids
        return Sample(
            prompt_ids=list(prompt_ids),
            token_ids=ids,
            logprobs=generated.logprobs,
            versions=generated.versions,
            routes=generated.routes,
            finish_reason="stop"
            if ids and ids[-1] == eos and not sampling.ignore_eos
            else "length",
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            prompt_index=prompt_index,
        )

    def close(self) -> None:
        self._slot_decoder = None
        self._set_route_recorder(None)
        self.model = None
