"""How an engine scores a refit probe's sequences in its own model: the rows scored
together (one forward per length, unpadded), the next-token log-probs and each decoder
layer's output RMS. The torch engine and the refit reference (asyncfp8.refit) share them,
so both sides of a probe sum in the same order."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


@contextlib.contextmanager
def recording_layer_rms(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, each forward of `model` (a transformers causal LM) appends the
    RMS of every decoder layer's output, [batch, tokens] fp32 per layer, to the list."""
    recorded: list[torch.Tensor] = []
    layers = model.model.layers

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        recorded.append(hidden.detach().float().pow(2).mean(-1).sqrt())

    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def rows_by_length(lengths: Sequence[int]) -> dict[int, list[int]]:
    """{length: the rows of that length}, rows shorter than 2 tokens left out: the rows a
    probe scores in one forward each, unpadded (padding would change the sums' order)."""
    groups: dict[int, list[int]] = {}
    for row, length in enumerate(lengths):
        if length >= 2:
            groups.setdefault(length, []).append(row)
    return groups


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens up to t) [B, T-1] fp32 from logits [B, T, V]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None])[..., 0]
