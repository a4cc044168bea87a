"""The slot decoder: sequence slots over one static KV cache, each row with its own write
position, RoPE position and mask row. `fill` prefills prompts (once per distinct one) into
rows, `step` appends a token to every row, `verify` / `commit` run a speculative step. Fixed
shapes and addresses let CUDA replay the decode step as a graph; verify steps run eagerly
(docs/engines.md, "The decode loop")."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..precision.kernel_support import on_its_device
from .decode import LAYER_KINDS, Prefill, forward_static
from .kv_cache import StaticKVCache
from .stepping import RecordedSpan

log = logging.getLogger(__name__)


class SlotDecoder:
    """`slots` sequences of at most `max_tokens` positions of `model`. `kv_scales`: per layer
    (k, v) 0-dim fp32 scales of an e4m3 cache, or None. `record_hidden`: keep each forward's
    last hidden states and fed tokens (a drafter's). `graph`: capture the step on CUDA;
    `compiled`: the step through torch.compile, whole; `fixed_length` (default: either):
    attend over all positions, the one shape both need. `dtype`: the forward's."""

    def __init__(
        self,
        model: torch.nn.Module,
        slots: int,
        max_tokens: int,
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        record_hidden: bool = False,
        graph: bool = False,
        fixed_length: bool | None = None,
        dtype: torch.dtype | None = None,
        compiled: bool = False,
    ):
        if slots < 1 or max_tokens < 1:
            raise ValueError(f"need slots >= 1 and max_tokens >= 1, got {slots}, {max_tokens}")
        config = model.config
        self.model, self.kv_scales = model, kv_scales
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype if dtype is None else dtype
        self.cache = StaticKVCache.for_model(model, slots, max_tokens, kv_scales, self.dtype)
        self.slots, self.max_tokens = slots, max_tokens
        self.kinds = sorted(set(getattr(config, "layer_types", None) or LAYER_KINDS))
        long = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(slots, **long)
        self.positions = torch.zeros(slots, **long)  # RoPE position of each row's next token
        self.write_pos = torch.zeros(slots, **long)  # cache position it is written at
        #: rows whose position advances at the next step (idle rows rewrite one position)
        self.advance = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.kv_valid = torch.zeros(slots, max_tokens, dtype=torch.bool, device=self.device)
        self.rows = torch.arange(slots, device=self.device)
        # The value `_step` writes into kv_valid, on the device: a Python True there would
        # be a host-to-device copy, which CUDA-graph capture refuses (seen on an H100).
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self.advancing = [False] * slots  # the host's copy of `advance`
        #: the host's copy of each row's write position: a full row is refused, and an
        #: eager step reads only the positions some row has reached, without a sync
        self.lengths = [0] * slots
        self.record_hidden = record_hidden
        if record_hidden:
            size = config.hidden_size
            self.hidden_states = torch.zeros(
                slots, max_tokens, size, dtype=self.dtype, device=self.device
            )
            self.fed_tokens = torch.zeros(slots, max_tokens, **long)
        if graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        self.use_graph = graph
        self.fixed_length = graph or compiled if fixed_length is None else fixed_length
        if (graph or compiled) and not self.fixed_length:
            raise ValueError("a captured or compiled decode step needs fixed_length=True")
        #: the step through torch.compile until a compile fails (then eager, said once)
        self.compiled = compiled
        self._compiled_step = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_logits: torch.Tensor | None = None

    @torch.no_grad()
    @on_its_device
    def fill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Starts sequence `prompts[i]` in row `slots[i]` (identical prompts prefilled
        once): returns the logits of each one's first new token [len(slots), V]. With
        `record_hidden`, the prompts' hidden states and tokens are recorded at their
        positions (left padded to the longest)."""
        if len(slots) != len(prompts) or len(set(slots)) != len(slots):
            raise ValueError(f"fill needs one prompt per distinct slot: {slots}, {len(prompts)}")
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompts]
        width = max(len(ids) for ids in distinct)
        if width >= self.max_tokens:
            raise ValueError(
                f"a prompt of {width} tokens leaves no room in {self.max_tokens} positions"
            )
        pad = 0  # masked out: any id will do
        input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in distinct])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in distinct])
        # The prompts run over a small cache of their own, whose rows are then copied
        # into the slots' rows.
        #: the last fill's distinct prompt of each slot given, and their padded width
        self.filled = (rows, width)
        prefill = Prefill(
            self.model, len(distinct), width, self.kv_scales, self.record_hidden, self.dtype
        )
        logits = prefill.run(input_ids, mask)
        target = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        source = torch.tensor(rows, dtype=torch.long, device=self.device)
        for mine, theirs in zip(
            (*self.cache.keys, *self.cache.values),
            (*prefill.cache.keys, *prefill.cache.values),
            strict=True,
        ):
            mine_bytes = mine.view(torch.uint8) if self.cache.fp8 else mine
            theirs_bytes = theirs.view(torch.uint8) if self.cache.fp8 else theirs
            mine_bytes[target, :, :width] = theirs_bytes.index_select(0, source)
        valid = mask.to(self.device).bool().index_select(0, source)
        self.kv_valid[target] = False
        self.kv_valid[target, :width] = valid
        self.positions[target] = valid.long().sum(-1)
        self.write_pos[target] = width
        self.advance[target] = True
        for slot in slots:
            self.lengths[slot], self.advancing[slot] = width, True
        if self.record_hidden:
            hidden = prefill.hidden.index_select(0, source)
            self.hidden_states[target, :width] = hidden.to(self.hidden_states.dtype)
            self.fed_tokens[target, :width] = input_ids.to(self.device).index_select(0, source)
        return logits.index_select(0, source)

    def release(self, slot: int) -> None:
        """Row `slot` holds no sequence: its position stops advancing until it is filled."""
        self.advance[slot] = False
        self.advancing[slot] = False

    def length(self, slot: int) -> int:
        """Row `slot`'s positions so far: its (padded) prompt and the tokens it kept."""
        return self.lengths[slot]

    def recorded(self, slots: Sequence[int], starts: Sequence[int]) -> RecordedSpan:
        """With `record_hidden`: rows `slots`' recorded positions [start, length), as a
        `RecordedSpan` as wide as the longest (columns past a row's length are not real;
        columns past the cache repeat its last position)."""
        ends = [self.lengths[slot] for slot in slots]
        width = max(end - start for start, end in zip(starts, ends, strict=True))
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)[:, None]
        first = torch.tensor(list(starts), dtype=torch.long, device=self.device)[:, None]
        offsets = torch.arange(width, device=self.device)
        columns = (first + offsets).clamp_max(self.max_tokens - 1)
        inside = offsets < torch.tensor(ends, device=self.device)[:, None] - first
        return RecordedSpan(
            hidden=self.hidden_states[index, columns],
            tokens=self.fed_tokens[index, columns],
            real=self.kv_valid[index, columns] & inside,
            ends=ends,
        )

    def sequence(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """With `record_hidden`: row `slot`'s real positions so far, (hidden states [T, H],
        tokens [T]), prompt padding and rejected drafts left out."""
        end = self.lengths[slot]
        real = self.kv_valid[slot, :end].nonzero().squeeze(1)  # the one read of the device
        return self.hidden_states[slot].index_select(0, real), self.fed_tokens[slot][real]

    def _run(self, tokens, positions, mask, keep: int, where: torch.Tensor) -> torch.Tensor:
        """The forward of tokens [slots, T] written at cache positions `where` [slots, T]
        (the hidden states are recorded there too)."""
        hidden, logits = forward_static(
            self.model, self.cache, self.kinds, tokens, mask, positions, keep, self.record_hidden
        )
        if self.record_hidden:
            self.hidden_states[self.rows[:, None], where] = hidden.to(self.hidden_states.dtype)
            self.fed_tokens[self.rows[:, None], where] = tokens
        return logits

    @torch.no_grad()
    @on_its_device
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Appends token i [slots] to row i (idle rows: anything, recorded nowhere);
        returns the logits of every row's next token [slots, V] (with a graph, the
        graph's output buffer, which the next step overwrites)."""
        for slot in range(self.slots):
            if self.lengths[slot] >= self.max_tokens:
                raise ValueError(
                    f"slot {slot} has filled its {self.max_tokens} positions (a budget "
                    "longer than the decoder was sized for)"
                )
        self.tokens.copy_(tokens)
        if self.use_graph:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            logits = self._graph_logits
        else:
            logits = self._run_step(None if self.fixed_length else max(self.lengths) + 1)
        for slot in range(self.slots):
            self.lengths[slot] += self.advancing[slot]
        return logits

    def _run_step(self, visible: int | None = None) -> torch.Tensor:
        """`_step`, compiled where asked; a compile that fails leaves the eager step."""
        if not self.compiled:
            return self._step(visible)
        if self._compiled_step is None:
            self._compiled_step = torch.compile(self._step, fullgraph=True, dynamic=False)
        try:
            return self._compiled_step(visible)
        except Exception as err:  # dynamo, inductor or a compiler: every kind may raise
            # Tracing runs on fake tensors: a compile that fails has changed no state.
            self.compiled = False
            cause = str(err).strip().splitlines()
            log.warning(
                "the compiled decode step failed to compile (%s: %s); the eager step runs "
                "(engine.compile=false says so without trying)",
                type(err).__name__,
                cause[0][:300] if cause else "",
            )
            return self._step(visible)

    def _step(self, visible: int | None = None) -> torch.Tensor:
        """The decode step on the device, over all positions or (eager) the first
        `visible`: only device tensors in, so that a graph can hold it."""
        self.kv_valid[self.rows, self.write_pos] = self._true
        self.cache.write_rows(self.write_pos, visible)
        self.cache.kv_len = self.write_pos + 1
        logits = self._run(
            self.tokens[:, None],
            self.positions[:, None],
            self.kv_valid[:, None, None, :visible],
            keep=1,
            where=self.write_pos[:, None],
        )
        step = self.advance.long()
        self.write_pos.add_(step)
        self.positions.add_(step)
        return logits[:, -1]

    def _capture(self) -> None:
        state = (self.write_pos, self.positions, self.kv_valid)
        saved = [t.clone() for t in state]
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Warm-up outside the capture (Triton compiles, cuBLAS picks its kernels). It
            # writes the cache positions the real step is about to write (and records
            # there, with record_hidden); the state it advances is restored.
            for _ in range(2):
                self._run_step()
                for tensor, value in zip(state, saved, strict=True):
                    tensor.copy_(value)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a colocated learner's rollout thread captures while its main
        # thread trains on the same device, whose allocations and syncs are legal there
        # (the default, global, mode would fail them mid-capture).
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._run_step()
        self._graph, self._graph_logits = graph, logits

    @torch.no_grad()
    @on_its_device
    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """A speculative verify step: appends the T tokens of row i (tokens [slots, T]: the
        last sampled token, then the drafts) at its next T positions, each attending to
        the row and to the tokens before it; returns the logits after each [slots, T, V].
        Nothing advances until `commit` says how many of them each row keeps."""
        width = tokens.shape[1]
        for slot in range(self.slots):
            if self.advancing[slot] and self.lengths[slot] + width > self.max_tokens:
                raise ValueError(
                    f"slot {slot} has no room for {width} more positions in "
                    f"{self.max_tokens} (a budget longer than the decoder was sized for)"
                )
        offsets = torch.arange(width, device=self.device)
        # Idle rows write at their start: nothing reads them until a fill resets them.
        base = torch.where(self.advance, self.write_pos, 0)
        where = base[:, None] + offsets
        visible = (
            max(length for length, on in zip(self.lengths, self.advancing, strict=True) if on)
            + width
        )
        self.kv_valid[self.rows[:, None], where] = self.advance[:, None]
        keys = torch.arange(visible, device=self.device)
        mask = self.kv_valid[:, None, :visible] & (keys[None, None, :] <= where[:, :, None])
        self.cache.write_rows(where, visible)
        self.cache.kv_len = None
        logits = self._run(tokens, self.positions[:, None] + offsets, mask[:, None], width, where)
        self._verified = (where, width)
        return logits

    @on_its_device
    def commit(self, kept: torch.Tensor, kept_host: Sequence[int]) -> None:
        """After `verify`: row i keeps its first kept[i] positions (the last token and the
        drafts accepted before it), the rest become holes that the next step overwrites.
        `kept_host` is the host's copy of `kept`."""
        where, width = self._verified
        offsets = torch.arange(width, device=self.device)
        self.kv_valid[self.rows[:, None], where] &= offsets[None, :] < kept[:, None]
        self.write_pos.add_(kept)
        self.positions.add_(kept)
        for slot in range(self.slots):
            self.lengths[slot] += int(kept_host[slot])
