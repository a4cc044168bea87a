"""The built-in engine's forward pieces over a static KV cache: `processed_logprobs` (the
distribution sampled from), `forward_static` (one forward with per-layer-kind masks, no
growing shape, no host sync) and `Prefill` (distinct prompts over a cache of their own).
Attention is `static_attention`: SDPA in the model dtype, `fp8_kv_decode_attention` for an
e4m3 cache (docs/engines.md, "What runs where")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from asyncfp8.precision.fp8_kv.attention import fp8_kv_decode_attention

from .base import SamplingParams
from .kv_cache import StaticKVCache

ATTENTION = "asyncfp8_static"
#: Layer kinds the decoder builds masks for (no sliding windows).
LAYER_KINDS = ("full_attention",)
#: Forwards of at most this many tokens per row (speculative verify steps) fold a KV
#: head's query heads into rows instead of copying the cache per query head.
FOLD_TOKENS = 16


def processed_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """log-probabilities of the distribution actually sampled from: logits / temperature,
    then top-k, then top-p (nucleus) truncation, renormalized. Greedy (temperature 0)
    keeps the unscaled distribution."""
    logits = logits.float()
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


# --- attention ----------------------------------------------------------------------------


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA for query [B, Hq, T, D] over key / value [B, Hkv, S, D] (query head h reads KV
    head h // (Hq / Hkv)) under a bool mask [B, 1, T, S]; returns [B, T, Hq, D]."""
    batch, q_heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    if tokens == 1:
        # The query heads that share a KV head become that head's rows under one mask row:
        # grouped-query attention without repeating (copying) the cache.
        rows = query.reshape(batch, kv_heads, group, dim)
        out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scale)
        return out.reshape(batch, 1, q_heads, dim)
    if group > 1 and mask is not None and tokens <= FOLD_TOKENS:
        # A speculative verify step (a few tokens over a long cache): the same fold, the
        # mask's rows repeated per query head of the group (row g·T + t is token t's).
        rows = query.reshape(batch, kv_heads, group * tokens, dim)
        out = F.scaled_dot_product_attention(
            rows, key, value, attn_mask=mask.repeat(1, 1, group, 1), scale=scale
        )
        return out.reshape(batch, q_heads, tokens, dim).transpose(1, 2)
    if group > 1:  # prefill: once per generation, the prompt's keys repeated per query head
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    if mask is None:
        # The model called outside a decoder (scoring, the speculative reference loop):
        # transformers leaves out a mask that would only be causal. The queries are the last
        # `tokens` positions of the keys (SDPA's is_causal would align them to the first).
        span = key.shape[2]
        mask = torch.ones(tokens, span, dtype=torch.bool, device=query.device).tril(span - tokens)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def static_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    static_cache: StaticKVCache | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over a `StaticKVCache`: key and value are what
    its `update` returned (e4m3 for an FP8 cache), attention_mask a bool [B, 1, T, S]."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if static_cache is not None and static_cache.fp8:
        layer = module.layer_idx
        if query.shape[2] == 1:
            k_scale, v_scale = static_cache.scales[layer]
            out = fp8_kv_decode_attention(
                query[:, :, 0],
                key,
                value,
                k_scale,
                v_scale,
                attention_mask[:, 0, 0],
                sm_scale=scale,
                kv_len=static_cache.kv_len,
            )
            return out[:, None], None
        key, value = static_cache.dequantize(layer, key, value, query.dtype)
    return grouped_attention(query, key, value, attention_mask, scale), None


AttentionInterface.register(ATTENTION, static_attention)
# Outside a decoder (which passes its own masks), transformers builds SDPA's bool masks
# [B, 1, T, S] for this attention, or none when the mask would only be causal; without
# this registration it would drop a padding mask altogether.
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


# --- a forward over a static cache ----------------------------------------------------------


def forward_static(
    model: torch.nn.Module,
    cache: StaticKVCache,
    kinds: list[str],
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep: int = 1,
    hidden: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One forward over a static cache: (the last hidden states [B, T, H], the LM head's
    input, when `hidden`, else None; the logits of the last `keep` positions [B, keep, V]).
    Masks are given whole (per layer kind where there are several), so transformers builds
    none (a growing one would make each step a new shape, and its checks sync with the
    host)."""
    # One kind: the 4D mask itself, which every model's mask builder returns as given (a
    # model without per-kind masks, Qwen3-MoE's, refuses the dict).
    masks = mask if list(kinds) == ["full_attention"] else dict.fromkeys(kinds, mask)
    inputs = dict(
        input_ids=input_ids,
        attention_mask=masks,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        static_cache=cache,
    )
    if not hidden:
        return None, model(**inputs, logits_to_keep=keep).logits
    # The speculative drafter reads the target's features: the body, then the head.
    states = model.model(**inputs).last_hidden_state
    return states, model.lm_head(states[:, -keep:])


class Prefill:
    """The forward of `batch` distinct left-padded prompts of at most `width` tokens of
    `model` (attention `ATTENTION`) over a static cache of their own (`kv_scales`, `dtype`
    as for `StaticKVCache.for_model`), whose rows the slot decoder copies into its slots;
    the probe and scoring run through it too. `keep_hidden`: keep the last forward's
    hidden states in `hidden` (for a speculative drafter)."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        width: int,
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        keep_hidden: bool = False,
        dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.cache = StaticKVCache.for_model(model, batch, width, kv_scales, dtype)
        self.batch, self.width = batch, width
        self.kinds = sorted(set(getattr(model.config, "layer_types", None) or LAYER_KINDS))
        self.keep_hidden = keep_hidden
        self.hidden: torch.Tensor | None = None

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Runs the prompts (input_ids, attention_mask [batch, W], left padded, W at most
        `width`); returns the logits of each one's first new token [batch, V]."""
        rows, width = input_ids.shape
        if rows != self.batch or width > self.width:
            raise ValueError(
                f"prefill of {rows} prompts of {width} tokens: this cache holds "
                f"{self.batch} prompts of {self.width} positions"
            )
        input_ids = input_ids.to(self.device)
        valid = attention_mask.to(self.device).bool()
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        # A padding position attends to itself: a query row with no key at all gives NaN.
        itself = torch.eye(width, dtype=torch.bool, device=self.device)
        mask = (causal & valid[:, None, :]) | itself
        self.cache.write_at(torch.arange(width, device=self.device), visible=width)
        self.cache.kv_len = None
        self.hidden, logits = forward_static(
            self.model,
            self.cache,
            self.kinds,
            input_ids,
            mask[:, None],
            positions,
            1,
            self.keep_hidden,
        )
        return logits[:, -1]
