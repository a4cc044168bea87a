"""The built-in engine's KV cache: preallocated, static in shape and address, so one
captured decode graph serves every step. One key and one value buffer per layer, in the
model dtype or in e4m3 (round(x / scale), the version's 0-dim fp32 k/v scales, overwritten
in place). `write_at` sets where the next forward writes. See docs/engines.md, "The decode
loop"."""

from __future__ import annotations

import torch

from asyncfp8.precision.fp8 import FP8_MAX

FP8 = torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as an e4m3 cache stores it: round(x / scale), clamped to the e4m3 range."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class StaticKVCache:
    """Keys and values of `batch` sequences × `max_tokens` positions for every layer.

    `scales`: one (k_scale, v_scale) pair of 0-dim fp32 tensors per layer for an e4m3
    cache, None for a cache in `dtype`. Buffers start as zeros and stay finite (a NaN in
    an unattended slot would still poison attention: 0 · NaN is NaN)."""

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        max_tokens: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        if scales is not None and len(scales) != layers:
            raise ValueError(f"an e4m3 cache needs one (k, v) scale pair per layer: {layers}")
        storage = FP8 if scales is not None else dtype
        shape = (batch, kv_heads, max_tokens, head_dim)
        self.keys = [torch.zeros(shape, dtype=storage, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=storage, device=device) for _ in range(layers)]
        self.scales = scales
        self.max_tokens = max_tokens
        self.positions: torch.Tensor | None = None
        #: set by `write_rows`: one position per row (slots decode at different lengths)
        self.row_positions: torch.Tensor | None = None
        self.visible: int | None = None
        #: positions below it may be attended (decode): lets attention skip the empty tail
        self.kv_len: torch.Tensor | None = None

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        batch: int,
        max_tokens: int,
        scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        dtype: torch.dtype | None = None,
    ) -> StaticKVCache:
        """A cache shaped for a transformers causal LM, on its device, in the dtype keys
        and values come in: `dtype` (a model whose forward casts its weights, as FSDP's
        mixed precision does), by default its embeddings'."""
        config = model.config
        embeddings = model.get_input_embeddings().weight
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        return cls(
            config.num_hidden_layers,
            batch,
            config.num_key_value_heads,
            max_tokens,
            head_dim,
            embeddings.dtype if dtype is None else dtype,
            embeddings.device,
            scales,
        )

    @property
    def fp8(self) -> bool:
        return self.scales is not None

    def write_at(self, positions: torch.Tensor, visible: int | None = None) -> None:
        """The next forward writes its tokens at `positions` (a long tensor on the cache's
        device, one per token of the forward, the same for every row) and, with `visible`,
        returns only the first `visible` positions to attention (prefill: the prompt's)."""
        self.positions, self.visible = positions, visible
        self.row_positions = None

    def write_rows(self, positions: torch.Tensor, visible: int | None = None) -> None:
        """The next forward writes row i's tokens at its own positions: `positions` [batch]
        (one token per row) or [batch, T] (T tokens per row: a speculative verify step),
        a long tensor on the cache's device. Sequences of different lengths share the
        cache, as the slot decoder's do."""
        self.positions, self.visible = None, visible
        self.row_positions = positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_):
        """Writes the new keys and values of rows 0..n-1 (n = key_states' batch) and
        returns what attention reads: those rows' buffers (e4m3 ones for an FP8 cache)."""
        rows = key_states.shape[0]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.fp8:
            k_scale, v_scale = self.scales[layer_idx]
            key_states, value_states = (
                quantize_kv(key_states, k_scale),
                quantize_kv(value_states, v_scale),
            )
        # Through byte views: index_copy_ has no e4m3 kernel on the CPU.
        for buffer, states in ((keys, key_states), (values, value_states)):
            buffer_bytes = buffer.view(torch.uint8) if self.fp8 else buffer
            states_bytes = states.view(torch.uint8) if self.fp8 else states.to(buffer.dtype)
            if self.row_positions is None:
                buffer_bytes[:rows].index_copy_(2, self.positions, states_bytes)
            elif self.row_positions.dim() == 1:  # [rows, heads, 1, dim]: row i at its position
                index = torch.arange(rows, device=buffer.device)
                buffer_bytes[index, :, self.row_positions[:rows]] = states_bytes[:, :, 0]
            else:  # [rows, heads, T, dim]: token t of row i at positions[i, t]
                index = torch.arange(rows, device=buffer.device)[:, None]
                # Advanced indices around a slice put their dims first: [rows, T, heads, dim].
                buffer_bytes[index, :, self.row_positions[:rows]] = states_bytes.transpose(1, 2)
        end = self.max_tokens if self.visible is None else self.visible
        return keys[:rows, :, :end], values[:rows, :, :end]

    def dequantize(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """e4m3 keys and values of layer `layer_idx` (as `update` returned them) · scale."""
        k_scale, v_scale = self.scales[layer_idx]
        return (keys.float() * k_scale).to(dtype), (values.float() * v_scale).to(dtype)
