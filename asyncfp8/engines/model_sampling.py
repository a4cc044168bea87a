"""Sampling from a model held outside an engine (the learner's, sharded, for held-out
evaluation; a model being warm-started) through `TorchEngine.generate`'s path: a `SlotLoop`
with one slot per sequence, requests seeded as the engine seeds them, so the same weights
and seed give the engine's tokens. The model gets its own attention back after the call
(docs/engines.md, "The decode loop")."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .base import SamplingParams
from .decode import ATTENTION
from .slot_loop import Generated, SlotLoop, seeded_requests
from .slots import SlotDecoder


@torch.no_grad()
def sample_from_model(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    eos: int,
    pad: int,
    *,
    indices: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    all_done: Callable[[bool], bool] | None = None,
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[Generated]:
    """`sampling.n` completions of each token-id prompt from `model`, prompt-major:
    completion k of prompt i is request `indices[i] · n + k` (default `indices[i]` = i) of a
    call seeded with `sampling.seed` (None: 0). `dtype`: what the model computes in (FSDP's
    mixed precision); `all_done`: see `SlotLoop`; `kv_scales`: per layer (k, v) 0-dim fp32
    scales for an e4m3 KV cache (None: a cache in the model's dtype)."""
    if not prompts:
        raise ValueError("sample_from_model needs at least one prompt")
    if any(not ids for ids in prompts):
        raise ValueError("every prompt needs at least one token")
    n = sampling.n
    indices = range(len(prompts)) if indices is None else indices
    if len(indices) != len(prompts):
        raise ValueError(f"{len(indices)} indices for {len(prompts)} prompts")
    requests = seeded_requests(
        [ids for ids in prompts for _ in range(n)],
        [sampling.max_new_tokens] * (len(prompts) * n),
        0 if sampling.seed is None else sampling.seed,
        [index * n + k for index in indices for k in range(n)],
    )
    # Each step knows which rows ended (check_every 1), so a row writes at most one
    # position past its budget.
    positions = max(len(r.prompt_ids) for r in requests) + sampling.max_new_tokens + 1
    was_training, attention = model.training, model.config._attn_implementation
    model.eval()
    model.set_attn_implementation(ATTENTION)
    try:
        decoder = SlotDecoder(model, len(requests), positions, kv_scales, dtype=dtype)
        return SlotLoop(decoder, requests, sampling, eos, pad, all_done=all_done).run()
    finally:
        model.set_attn_implementation(attention)
        model.train(was_training)
