"""Sampling from a model held outside an engine (the learner's own, sharded, for held-out
evaluation; a model being warm-started) through the built-in engine's decode loop.

It is `TorchEngine.generate`'s path: a `SlotLoop` over a `SlotDecoder` with one slot per
sequence, the engine's sampling rule (`processed_logprobs`) and per-request random
streams, requests seeded as the engine seeds them (`seeded_requests`). So for the same
weights and seed it gives the engine's tokens, and a request's tokens do not depend on
the batch, the rank or the other requests it runs with.

The model runs with the decoder's attention (`decode.ATTENTION`) for the call and gets
its own back after.
"""

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
    """`sampling.n` completions of each token-id prompt from `model` (a transformers
    causal LM), prompt-major: completion k of prompt i is request `indices[i] · n + k`
    (default `indices[i]` = i) of a call seeded with `sampling.seed` (None: 0), as in
    `TorchEngine.generate`. `dtype`: what the model computes in, when not its embeddings'
    dtype (FSDP's mixed precision). `all_done`: see `SlotLoop` (ranks of a sharded model
    step together). `kv_scales`: per layer (k_scale, v_scale) 0-dim fp32 tensors for an
    e4m3 KV cache, as the engine's (None: a cache in the model's dtype)."""
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
