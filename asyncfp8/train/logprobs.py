"""Completion-token log-probabilities without the batch's full-vocabulary logits (~20 GB in
FP32 for 64 × 512 tokens and a 151,936-token vocabulary): `LogprobHead` takes the place of
the output layer (same weight and name) and takes the log-softmax of the sampled positions
only, over chunks recomputed in the backward, inside the model's forward (FSDP shards it
as any layer). docs/running.md#memory-micro-batches-and-the-chunked-log-softmax"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from asyncfp8.hf.cpu_half import is_plain_linear
from asyncfp8.train.batches import TrainBatch

DEFAULT_CHUNK_TOKENS = 1024


@dataclass
class _Request:
    positions: (
        torch.Tensor | None
    )  # [B, T] position whose logits predict each token; None: no logits
    targets: torch.Tensor | None  # [B, T] the tokens
    mask: torch.Tensor | None  # [B, T] real tokens
    temperature: float
    chunk_tokens: int


def _chunk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(target) and the entropy of π, per row of `hidden` [K, H], in FP32 (or the
    model's dtype when it is wider)."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature > 0:
        logits = logits / temperature
    log_norm = logits.logsumexp(-1)
    logp = logits.gather(-1, targets[:, None])[:, 0] - log_norm
    probs = (logits - log_norm[:, None]).exp()
    entropy = log_norm - (probs * logits).sum(-1)
    return logp, entropy


class LogprobHead(nn.Linear):
    """The model's output layer (its `weight` and `bias` parameters, not copies). Without
    a request it is the plain linear layer (generation, calibration)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.request: _Request | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self.request
        if request is None:
            return F.linear(hidden, self.weight, self.bias)
        if request.positions is None:  # the caller wants the layers' activations only
            return hidden.new_zeros((*hidden.shape[:-1], 0))
        rows = hidden.gather(
            1, request.positions[..., None].expand(-1, -1, hidden.shape[-1])
        )  # [B, T, H]
        selected = rows[request.mask]  # [tokens, H], in the row-major order of `where` below
        targets = request.targets[request.mask]
        pieces = []
        for start in range(0, selected.shape[0], request.chunk_tokens):
            args = (
                selected[start : start + request.chunk_tokens],
                self.weight,
                self.bias,
                targets[start : start + request.chunk_tokens],
                request.temperature,
            )
            if torch.is_grad_enabled():
                pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(*args))
        if pieces:
            values = torch.stack(
                [torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])], -1
            )
        else:
            values = rows.new_zeros((0, 2), dtype=torch.promote_types(rows.dtype, torch.float32))
        # A new tensor, not a view: the sharded model's backward hook sits on this output.
        where = request.mask.nonzero(as_tuple=True)
        return values.new_zeros((*request.mask.shape, 2)).index_put(where, values)


def install_logprob_head(model: nn.Module) -> LogprobHead:
    """Replaces the model's output layer by a LogprobHead over the same parameters
    (before sharding: the sharded model then holds the head)."""
    head = model.get_output_embeddings()
    if isinstance(head, LogprobHead):
        return head
    if not is_plain_linear(head):
        raise ValueError(
            f"the model's output layer is a {type(head).__name__}, not a plain nn.Linear: the "
            "learner's chunked log-probabilities cannot take its place"
        )
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(
            "the model soft-caps its logits after the output layer "
            "(config.final_logit_softcapping): the learner's chunked log-probabilities do not"
        )
    replacement = LogprobHead(head)
    model.set_output_embeddings(replacement)
    return replacement


def _head(model: nn.Module) -> LogprobHead:
    head = model.get_output_embeddings()
    if not isinstance(head, LogprobHead):
        raise ValueError("call install_logprob_head(model) before completion_logprobs")
    return head


def completion_logprobs(
    model: nn.Module,
    batch: TrainBatch,
    temperature: float,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, T] log-probabilities, [N, T] entropies) of the completion tokens under
    `model` at `temperature` (the distribution the engine sampled from; no top-k/top-p),
    from a `TrainBatch`; 0 at padded positions. FP32 whatever the model's compute dtype."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    positions = batch.positions
    # The logits at position j predict token j + 1: completion token k sits at prompt_len + k.
    targets = batch.input_ids.gather(1, positions + 1)
    head = _head(model)
    head.request = _Request(positions, targets, batch.mask, temperature, chunk_tokens)
    try:
        out = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
        ).logits
    finally:
        head.request = None
    return out[..., 0], out[..., 1]


@contextlib.contextmanager
def without_logits(model: nn.Module) -> Iterator[None]:
    """Forwards inside run the layers but compute no logits (calibration reads the
    attention inputs only)."""
    head = _head(model)
    head.request = _Request(None, None, None, 1.0, DEFAULT_CHUNK_TOKENS)
    try:
        yield
    finally:
        head.request = None
