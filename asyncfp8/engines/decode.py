"""The built-in engine's decode loop, in separately callable units.

- `StaticDecoder`: the state of one batch of `batch` sequences of up to `max_tokens`
  positions — a preallocated KV cache (`StaticKVCache`, BF16 or e4m3), an attention mask
  over all of them and the decode step's inputs, all static in shape and address (on the
  CPU, where nothing is captured, a step reads only the positions written so far).
  `prefill` runs each distinct prompt once and gives every sequence its prompt's keys and
  values; `step` runs one decode step over the whole batch, on CUDA as a captured CUDA
  graph replayed every step (the graph reads the weights and the KV scales where the
  engine updates them in place, so a new version needs no new graph).
- `sample`: the next token of every sequence and its log-probability under the processed
  distribution (temperature, top-k, top-p).
- `decode`: the loop the engine runs — sample, record, step — checking for finished
  sequences every k steps (a device-to-host sync each check), with the same tokens and
  the same random stream as a check at every step.

Attention runs through `static_attention`, registered with transformers' attention
interface: SDPA over the cache in the model dtype (grouped-query heads folded into rows,
so no copy of the cache), and for an e4m3 cache `fp8_kv_decode_attention`, which reads
the e4m3 bytes (a Triton kernel on CUDA, its torch reference elsewhere); prefill
dequantizes an e4m3 cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .base import SamplingParams
from .kernels import fp8_kv_decode_attention
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


def sample(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token [B], its processed log-probability [B] fp32) for logits [B, V]."""
    logp = processed_logprobs(logits, sampling)
    if sampling.temperature == 0:
        chosen = logp.argmax(-1)
    else:
        chosen = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return chosen, logp.gather(-1, chosen[:, None])[:, 0]


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


# --- one batch --------------------------------------------------------------------------------


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
    Masks are given per layer kind, so transformers builds none (a growing one would make
    each step a new shape, and its checks sync with the host)."""
    inputs = dict(
        input_ids=input_ids,
        attention_mask=dict.fromkeys(kinds, mask),
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


class StaticDecoder:
    """Decode state for `batch` sequences of at most `max_tokens` positions (prompt, left
    padded, plus generated tokens) of `model`, a transformers causal LM whose attention
    implementation is `ATTENTION`.

    `kv_scales`: per layer (k_scale, v_scale) 0-dim fp32 tensors for an e4m3 cache, None
    for a cache in the model dtype. `graph`: capture the decode step as a CUDA graph
    (CUDA only), at the first `step`. `fixed_length` (default: as `graph`): every step
    attends over all `max_tokens` positions under the mask, the one shape a graph
    replays; without it a step reads only the positions written so far (launched one
    by one, a step gains nothing from a fixed shape)."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        max_tokens: int,
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        graph: bool = False,
        fixed_length: bool | None = None,
    ):
        config = model.config
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.cache = StaticKVCache.for_model(model, batch, max_tokens, kv_scales)
        self.batch, self.max_tokens = batch, max_tokens
        self.kinds = sorted(set(getattr(config, "layer_types", None) or LAYER_KINDS))
        long = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(batch, **long)  # the step's input token per sequence
        self.positions = torch.zeros(batch, **long)  # its RoPE position
        self.slot = torch.zeros(1, **long)  # its cache position (the same in every row)
        #: the positions each sequence attends to: its prompt (not the padding) and its tokens
        self.kv_valid = torch.zeros(batch, max_tokens, dtype=torch.bool, device=self.device)
        if graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        self.use_graph = graph
        self.fixed_length = graph if fixed_length is None else fixed_length
        if graph and not self.fixed_length:
            raise ValueError("a captured decode step needs fixed_length=True")
        #: the host's copy of `slot`, so that a full cache is refused without a sync
        self.next_slot = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_logits: torch.Tensor | None = None
        #: keep the last forward's hidden states in `hidden` (the slot decoder's prefill,
        #: for a speculative drafter)
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None

    def _forward(self, input_ids, mask, position_ids) -> torch.Tensor:
        self.hidden, logits = forward_static(
            self.model, self.cache, self.kinds, input_ids, mask, position_ids, 1, self.keep_hidden
        )
        return logits[:, -1]

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int]
    ) -> torch.Tensor:
        """Runs the distinct prompts (input_ids, attention_mask [U, W], left padded, W at
        most max_tokens) and starts every sequence of the batch from one of them:
        `rows[i]` is sequence i's prompt. Returns the logits of each sequence's first new
        token [batch, V]."""
        distinct, width = input_ids.shape
        if len(rows) != self.batch or width > self.max_tokens or distinct > self.batch:
            raise ValueError(
                f"prefill of {distinct} prompts of {width} tokens for {len(rows)} sequences: "
                f"this decoder holds {self.batch} sequences of {self.max_tokens} positions"
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
        logits = self._forward(input_ids, mask[:, None], positions)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if rows != list(range(self.batch)):
            self.cache.copy_rows(index)
            logits = logits.index_select(0, index)
            if self.hidden is not None:
                self.hidden = self.hidden.index_select(0, index)
        self.kv_valid.zero_()
        self.kv_valid[:, :width] = valid.index_select(0, index)
        self.positions.copy_(positions[:, -1].index_select(0, index) + 1)
        self.slot.fill_(width)
        self.next_slot = width
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step: token i [batch] is appended to sequence i; returns the logits
        of the next token [batch, V] (with a graph, the graph's output buffer, which the
        next step overwrites)."""
        if self.next_slot >= self.max_tokens:
            raise ValueError(f"the decoder's {self.max_tokens} positions are full")
        self.next_slot += 1
        self.tokens.copy_(tokens)
        if not self.use_graph:
            return self._step(None if self.fixed_length else self.next_slot)
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._graph_logits

    def _step(self, visible: int | None = None) -> torch.Tensor:
        """The decode step, over all positions or (eager) the first `visible`."""
        self.kv_valid.index_fill_(1, self.slot, True)
        self.cache.write_at(self.slot, visible)
        self.cache.kv_len = self.slot + 1
        logits = self._forward(
            self.tokens[:, None],
            self.kv_valid[:, None, None, :visible],
            self.positions[:, None],
        )
        self.slot.add_(1)
        self.positions.add_(1)
        return logits

    def _capture(self) -> None:
        state = (self.slot, self.positions, self.kv_valid)
        saved = [t.clone() for t in state]
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Warm-up outside the capture (Triton compiles, cuBLAS picks its kernels). It
            # writes the cache slot the real step is about to write; the state is restored.
            for _ in range(2):
                self._step()
                for tensor, value in zip(state, saved, strict=True):
                    tensor.copy_(value)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._step()
        self._graph, self._graph_logits = graph, logits


# --- the loop ---------------------------------------------------------------------------------


def decode(
    decoder: StaticDecoder,
    logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    eos: int,
    pad: int,
    check_every: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generates up to `sampling.max_new_tokens` tokens per sequence from the prefill's
    `logits` [B, V]. Returns (tokens [B, max_new_tokens] long, padded with `pad`;
    logprobs [B, max_new_tokens] fp32, 0 after the end; lengths [B]), on the device.

    A sequence ends at `eos` (unless `sampling.ignore_eos`); a finished sequence is fed
    `pad` and records nothing. Whether all have finished is asked every `check_every`
    steps, each time a sync with the device; the steps run past the end record nothing,
    and the generator is put back where it stood after the last one needed, so tokens and
    the random stream are those of a check at every step."""
    batch, steps = logits.shape[0], sampling.max_new_tokens
    device = logits.device
    tokens = torch.full((batch, steps), pad, dtype=torch.long, device=device)
    logprobs = torch.zeros(batch, steps, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stops = not sampling.ignore_eos
    all_done = torch.zeros(steps, dtype=torch.bool, device=device)  # after each step
    states, checked = [], 0  # generator states before each step since the last check
    for step in range(steps):
        if stops and generator is not None:
            states.append(generator.get_state())
        chosen, chosen_logp = sample(logits, sampling, generator)
        active = ~finished
        tokens[:, step] = torch.where(active, chosen, pad)
        logprobs[:, step] = torch.where(active, chosen_logp, 0.0)
        lengths += active.long()
        if stops:
            finished |= chosen == eos
            all_done[step] = finished.all()
            if (step + 1 - checked) % check_every == 0 or step == steps - 1:
                if bool(all_done[step]):
                    # The first step after which all had finished; a check at every step
                    # would have stopped there, before sampling again.
                    last_needed = step + 1 - int(all_done[checked : step + 1].sum())
                    if generator is not None and last_needed < step:
                        generator.set_state(states[last_needed + 1 - checked])
                    break
                states, checked = [], step + 1
        if step == steps - 1:
            break
        logits = decoder.step(chosen.masked_fill(finished, pad))
    return tokens, logprobs, lengths
