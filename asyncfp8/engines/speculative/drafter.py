"""A one-layer EAGLE-style drafter (Li et al. 2024) over a Qwen2-family target, as fastrl's:
concat(embed(x_{t+1}), h_t) → linear 2H → H → one decoder layer without its input norm →
the target's LM head, h_t being the target's last hidden state. Embeddings and LM head are
the target's own modules, referenced: frozen, not in the state dict, updated with the
target. `DrafterCache` rolls rows back one by one (docs/engines.md, "Speculative decoding")."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2MLP,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
    apply_rotary_pos_emb,
)

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.decode import processed_logprobs
from asyncfp8.engines.request_sampling import inverse_cdf

FORMAT = "asyncfp8-eagle-drafter-1"
_REQUIRED = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "hidden_act",
    "rms_norm_eps",
)


def target_signature(config) -> dict:
    """What a drafter's weights depend on in the target's config: a checkpoint is only
    loadable into a drafter for a target with the same signature."""
    missing = [name for name in _REQUIRED if getattr(config, name, None) is None]
    if missing:
        raise ValueError(
            f"the drafter needs a Qwen2-family target config; {type(config).__name__} lacks "
            f"{', '.join(missing)}"
        )
    rope = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", None),
    }
    return {
        "model_type": getattr(config, "model_type", None),
        **{name: getattr(config, name) for name in _REQUIRED if name != "rms_norm_eps"},
        "head_dim": getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        "rope_parameters": {key: rope[key] for key in sorted(rope)},
    }


class DrafterCache:
    """The drafter's keys and values for B sequences. Row b holds `lengths[b]` entries
    (one per (hidden, next token) pair fed through `Drafter.extend`); entries past a row's
    length are dead and get overwritten. `last[b]` is the drafter's output at row b's
    last entry: the feature `draft` starts from."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, hidden: int, dtype, device):
        self.k = torch.zeros(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.last = torch.zeros(batch, hidden, dtype=dtype, device=device)
        self.started = torch.zeros(batch, dtype=torch.bool, device=device)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    def reserve(self, size: int) -> None:
        capacity = self.k.shape[2]
        if size <= capacity:
            return
        # Doubling keeps the number of reallocations logarithmic in the sequence length.
        grow = max(size, 2 * capacity, 16) - capacity
        pad = self.k.new_zeros(self.batch, self.k.shape[1], grow, self.k.shape[3])
        self.k = torch.cat([self.k, pad], 2)
        self.v = torch.cat([self.v, pad], 2)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Rolls rows back to `lengths` entries (no longer than they are); 0 empties a
        row, e.g. a slot that takes a new prompt. `last` is not recomputed: extend the
        rows again before drafting from them (`draft` refuses an emptied row until then)."""
        if bool((lengths > self.lengths).any()):
            raise ValueError("truncate can only shorten rows")
        self.lengths = lengths.to(self.lengths).clone()
        self.started &= self.lengths > 0


class Drafter(nn.Module):
    def __init__(self, target: nn.Module, dtype: torch.dtype = torch.float32):
        super().__init__()
        config = target.config
        self.signature = target_signature(config)
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.heads, self.kv_heads = heads, config.num_key_value_heads
        self.head_dim = self.signature["head_dim"]
        self.hidden_size = hidden
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # Qwen2's attention: biased q/k/v projections, unbiased output projection.
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.post_attention_layernorm = Qwen2RMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = Qwen2MLP(config)
        self.rotary = Qwen2RotaryEmbedding(config)
        std = getattr(config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.to(dtype)
        self.bind_target(target)

    # -- the target's frozen modules -----------------------------------------------------

    def bind_target(self, target: nn.Module) -> None:
        """Points the drafter at `target`'s embeddings and LM head (references: weight
        updates applied to the target in place reach the drafter). Refuses a target
        whose config differs from the one the drafter was built for."""
        _check_signature(target_signature(target.config), self.signature, "target")
        # object.__setattr__: kept out of nn.Module's registry, hence out of parameters(),
        # state_dict() and the optimizer.
        object.__setattr__(self, "_embed", target.get_input_embeddings())
        object.__setattr__(self, "_head", target.get_output_embeddings())
        object.__setattr__(self, "_target_dtype", next(target.parameters()).dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        embed = self._embed
        if isinstance(embed, nn.Embedding):
            out = F.embedding(tokens, embed.weight.detach())
        else:
            with torch.no_grad():
                out = embed(tokens)
        return out.to(self.fc.weight.dtype)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """float32 logits of the target's LM head for drafter (or target) features; the
        gradient reaches the features, never the head's weights."""
        head = self._head
        if isinstance(head, nn.Linear):
            weight = head.weight.detach()
            bias = None if head.bias is None else head.bias.detach()
            return F.linear(features.to(weight.dtype), weight, bias).float()
        return head(features.to(self._target_dtype)).float()

    # -- the layer ---------------------------------------------------------------------------

    def _fuse(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.embed(tokens), hidden.to(self.fc.weight.dtype)], -1))

    def _qkv(self, fused: torch.Tensor, positions: torch.Tensor):
        batch, length, _ = fused.shape
        q = self.q_proj(fused).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(fused).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(fused).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(v, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _attend_and_finish(self, fused, q, k, v, allowed):
        """Attention of q [B, heads, T, D] over k, v [B, kv_heads, S, D] under `allowed`
        ([T, S], or [B, 1, T, S]), then the rest of the layer."""
        batch, length, _ = fused.shape
        groups = self.heads // self.kv_heads
        # The query heads that share a KV head are folded into its rows (head h reads KV
        # head h // groups, as repeat_kv's order has it): attention reads the cache as it
        # is, instead of a copy of it per query head.
        q = q.reshape(batch, self.kv_heads, groups * length, self.head_dim)
        allowed = allowed.unsqueeze(-3).expand(*allowed.shape[:-2], groups, *allowed.shape[-2:])
        allowed = allowed.reshape(*allowed.shape[:-3], groups * length, allowed.shape[-1])
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        attn = attn.view(batch, self.heads, length, self.head_dim)
        h = fused + self.o_proj(attn.transpose(1, 2).reshape(batch, length, -1))
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Training: hidden [B, T, H] (the target's h_t), tokens [B, T] (token t+1 for
        each) → the drafter's features [B, T, H] (its prediction of h_{t+1}), causal over
        each row from position 0. Padding goes at the end of a row (it cannot reach the
        positions before it)."""
        fused = self._fuse(hidden, tokens)
        batch, length, _ = fused.shape
        positions = torch.arange(length, device=fused.device).expand(batch, length)
        q, k, v = self._qkv(fused, positions)
        causal = torch.ones(length, length, dtype=torch.bool, device=fused.device).tril()
        return self._attend_and_finish(fused, q, k, v, causal)

    # -- decoding -----------------------------------------------------------------------------

    def new_cache(self, batch: int) -> DrafterCache:
        return DrafterCache(
            batch,
            self.kv_heads,
            self.head_dim,
            self.hidden_size,
            self.fc.weight.dtype,
            self.fc.weight.device,
        )

    @torch.no_grad()
    def extend(
        self,
        cache: DrafterCache,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Appends (hidden[b, t], tokens[b, t]) pairs, the target's h_t and the token after
        it, to each row of `cache` (or to distinct cache rows `rows[b]`). `mask` [B, T] picks
        the valid pairs (any pattern: left padding, accepted positions), appended in order.
        Returns the drafter's features [B, T, H], each row's valid entries packed first, and
        sets `cache.last`."""
        batch, length = tokens.shape
        expected = cache.batch if rows is None else rows.numel()
        if batch != expected or tuple(hidden.shape[:2]) != (batch, length):
            raise ValueError(
                f"extending {expected} of the cache's {cache.batch} rows; hidden is "
                f"{tuple(hidden.shape)}, tokens {tuple(tokens.shape)}"
            )
        if mask is None:
            counts = torch.full((batch,), length, dtype=torch.long, device=tokens.device)
        else:
            mask = mask.bool()
            counts = mask.sum(-1)
            # A stable sort of "invalid" packs each row's valid entries first, in order.
            order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices
            tokens = tokens.gather(1, order)
            hidden = hidden.gather(1, order[..., None].expand_as(hidden))
        lengths = cache.lengths if rows is None else cache.lengths[rows]
        fused = self._fuse(hidden, tokens)
        positions = lengths[:, None] + torch.arange(length, device=fused.device)
        q, k, v = self._qkv(fused, positions)
        span = int(lengths.max()) + length
        cache.reserve(span)
        # Some rows: their keys and values are gathered (up to `span`), extended, and put back.
        keys_all = cache.k if rows is None else cache.k[rows, :, :span]
        values_all = cache.v if rows is None else cache.v[rows, :, :span]
        where = positions[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        keys_all.scatter_(2, where, k.to(keys_all.dtype))
        values_all.scatter_(2, where, v.to(values_all.dtype))
        # Entry j of row b sits at lengths[b] + j and sees the row's entries up to itself.
        keys = torch.arange(span, device=fused.device)
        allowed = (keys[None, None, None, :] <= positions[:, None, :, None]).expand(-1, 1, -1, -1)
        out = self._attend_and_finish(
            fused, q, keys_all[:, :, :span], values_all[:, :, :span], allowed
        )
        took = counts > 0
        picked = torch.arange(batch, device=fused.device)
        last = out[picked, (counts - 1).clamp_min(0)].to(cache.last.dtype)
        if rows is None:
            cache.last[took] = last[took]
            cache.started |= took
            cache.lengths = cache.lengths + counts
        else:
            cache.k[rows, :, :span] = keys_all
            cache.v[rows, :, :span] = values_all
            cache.last[rows] = torch.where(took[:, None], last, cache.last[rows])
            cache.started[rows] |= took
            cache.lengths = cache.lengths.index_add(0, rows, counts)
        return out

    @torch.no_grad()
    def draft(
        self,
        cache: DrafterCache,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        uniforms: Callable[[int], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k tokens per row, autoregressively from each row's `cache.last`, on its own
        predicted features: tokens [B, k] and the processed log-probs [B, k, V] they were
        drawn from (`accept`'s q; greedy at temperature 0), by `generator` or `uniforms(i)`
        [B] in [0, 1) for draft i. The cache is left as it was: after verification the caller
        extends it with the target's features of the accepted positions."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not bool(cache.started.all()):
            raise ValueError("every row needs at least one extend (the prompt) before draft")
        lengths, last = cache.lengths.clone(), cache.last.clone()
        features = cache.last
        tokens, logps = [], []
        try:
            for step in range(k):
                logp = processed_logprobs(self.logits(features), sampling)
                if sampling.temperature == 0:
                    token = logp.argmax(-1)
                elif uniforms is not None:
                    token = inverse_cdf(logp.exp(), uniforms(step))
                else:
                    token = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
                tokens.append(token)
                logps.append(logp)
                if step < k - 1:
                    features = self.extend(cache, features[:, None], token[:, None])[:, 0]
        finally:
            cache.lengths, cache.last = lengths, last
        return torch.stack(tokens, 1), torch.stack(logps, 1)

    # -- checkpoints -------------------------------------------------------------------------

    def get_extra_state(self) -> dict:
        return {"format": FORMAT, "target": self.signature}

    def set_extra_state(self, state) -> None:
        check_checkpoint(state, self.signature)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Refuses, before copying anything, a checkpoint that is not a drafter's or that
        was trained for another target model."""
        check_checkpoint(state_dict.get("_extra_state"), self.signature)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def check_checkpoint(extra, signature: dict) -> None:
    if not isinstance(extra, dict) or extra.get("format") != FORMAT:
        raise ValueError(
            f"not an asyncfp8 drafter checkpoint (no {FORMAT!r} signature in its _extra_state)"
        )
    _check_signature(extra.get("target", {}), signature, "drafter checkpoint")


def _check_signature(theirs: dict, ours: dict, what: str) -> None:
    differ = [key for key in ours if theirs.get(key) != ours[key]]
    if differ:
        details = ", ".join(f"{key} {theirs.get(key)!r} (expected {ours[key]!r})" for key in differ)
        raise ValueError(f"{what} is for another model: {details}")
