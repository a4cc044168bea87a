"""Online training of the drafter from the target's own rollouts (TLT / fastrl): `observe`
buffers the target's last hidden states and tokens (bounded FIFO); `train(steps, deadline)`
runs fastrl's loss, 0.5 × smooth L1 to the next hidden state + 0.5 × cross-entropy through
the target's LM head (hidden states are all it needs). Acceptance is kept per version, to
see the drafter keep up (docs/engines.md, "Speculative decoding (pieces)")."""

from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncfp8.engines.speculative.drafter import Drafter


@dataclass
class _Sequence:
    hidden: torch.Tensor  # [T, H]: the target's hidden state at each position
    tokens: torch.Tensor  # [T]: the token at each position
    version: int


@dataclass
class _Acceptance:
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def summary(self) -> dict[str, float]:
        return {
            "verify_steps": self.verify_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            # Tokens emitted per verify forward: the accepted drafts plus the target's own
            # token (resampled or bonus). 1 / this = target forwards per generated token.
            "mean_accepted_length": (self.accepted + self.verify_steps) / self.verify_steps
            if self.verify_steps
            else 0.0,
        }


class DrafterTrainer:
    """AdamW on the drafter's own parameters (the target's embeddings and LM head are not
    among them). `seed` fixes which buffered sequences and windows each step trains on."""

    def __init__(
        self,
        drafter: Drafter,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        batch_size: int = 16,
        max_seq_len: int = 256,
        buffer_tokens: int = 65_536,
        hidden_weight: float = 0.5,
        ce_weight: float = 0.5,
        grad_clip: float = 1.0,
        seed: int = 0,
    ):
        if batch_size < 1 or max_seq_len < 1 or buffer_tokens < 2:
            raise ValueError(
                "need batch_size >= 1, max_seq_len >= 1, buffer_tokens >= 2; got "
                f"{batch_size}, {max_seq_len}, {buffer_tokens}"
            )
        if hidden_weight < 0 or ce_weight < 0 or hidden_weight + ce_weight == 0:
            raise ValueError(
                f"loss weights must be >= 0 and not both 0, got {hidden_weight}, {ce_weight}"
            )
        self.drafter = drafter
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.buffer_tokens = buffer_tokens
        self.hidden_weight, self.ce_weight = hidden_weight, ce_weight
        self.grad_clip = grad_clip
        self.generator = torch.Generator().manual_seed(seed)
        self.buffer: deque[_Sequence] = deque()
        self.buffered = 0
        self.version = -1
        self.steps = 0
        self.cut_short = 0  # train calls that stopped at their deadline
        self.last: dict[str, float] = {}
        self.acceptance: dict[int, _Acceptance] = {}

    # -- data -------------------------------------------------------------------------------

    def observe(
        self, hidden: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None = None
    ) -> int:
        """hidden [B, T, H]: the target's last hidden state at each position (what its LM
        head reads); tokens [B, T]: the token at that position; mask [B, T]: which
        positions are real (padding and the holes rejected drafts leave in a cache are
        not). Each row's real positions, in order, are one sequence. Returns the number
        of positions kept."""
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(tokens.shape):
            raise ValueError(
                f"need hidden [B, T, H] and tokens [B, T]; got {tuple(hidden.shape)}, "
                f"{tuple(tokens.shape)}"
            )
        if hidden.shape[-1] != self.drafter.hidden_size:
            raise ValueError(
                f"hidden size {hidden.shape[-1]} is not the target's {self.drafter.hidden_size}"
            )
        mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
        kept = 0
        for row in range(tokens.shape[0]):
            valid = mask[row]
            if int(valid.sum()) < 2:  # no (h_t, x_{t+1}) -> h_{t+1} pair in it
                continue
            sequence = _Sequence(
                hidden=hidden[row][valid].detach().clone(),
                tokens=tokens[row][valid].detach().clone(),
                version=self.version,
            )
            self.buffer.append(sequence)
            self.buffered += len(sequence.tokens)
            kept += len(sequence.tokens)
        while self.buffered > self.buffer_tokens and len(self.buffer) > 1:
            self.buffered -= len(self.buffer.popleft().tokens)
        return kept

    def _batch(self):
        """batch_size sequences drawn uniformly from the buffer, one random window of at
        most max_seq_len pairs from each, right-padded."""
        picks = torch.randint(len(self.buffer), (self.batch_size,), generator=self.generator)
        windows = []
        for index in picks.tolist():
            sequence = self.buffer[index]
            length = len(sequence.tokens)
            span = min(length, self.max_seq_len + 1)
            start = int(torch.randint(length - span + 1, (1,), generator=self.generator))
            windows.append(
                (sequence.hidden[start : start + span], sequence.tokens[start : start + span])
            )
        width = max(len(t) for _, t in windows) - 1
        dtype = self.drafter.fc.weight.dtype
        device = self.drafter.fc.weight.device
        size = self.drafter.hidden_size
        h_in = torch.zeros(len(windows), width, size, dtype=dtype, device=device)
        h_next = torch.zeros_like(h_in)
        t_next = torch.zeros(len(windows), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(windows), width, dtype=torch.bool, device=device)
        for row, (hidden, tokens) in enumerate(windows):
            pairs = len(tokens) - 1
            h_in[row, :pairs] = hidden[:-1].to(h_in)
            h_next[row, :pairs] = hidden[1:].to(h_in)
            t_next[row, :pairs] = tokens[1:].to(device)
            valid[row, :pairs] = True
        return h_in, t_next, h_next, valid

    # -- training ---------------------------------------------------------------------------

    def train(self, steps: int, deadline: float | None = None) -> dict[str, float]:
        """`steps` optimizer steps on the buffer, fewer if `time.perf_counter()` passes
        `deadline` (at least one is made); the means of the losses over the steps made
        (an empty dict when the buffer holds nothing to train on)."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if not self.buffer or steps == 0:
            return {}
        started = time.perf_counter()
        made = 0
        was_training = self.drafter.training
        self.drafter.train()
        totals: dict[str, float] = {}
        try:
            for _ in range(steps):
                if made and deadline is not None and time.perf_counter() >= deadline:
                    self.cut_short += 1
                    break
                made += 1
                h_in, t_next, h_next, valid = self._batch()
                features = self.drafter(h_in, t_next)
                weight = valid.to(features.dtype)
                count = weight.sum()
                hidden_loss = (
                    F.smooth_l1_loss(features, h_next, reduction="none").mean(-1) * weight
                ).sum() / count
                logq = self.drafter.logits(features).log_softmax(-1)
                with torch.no_grad():
                    logp = self.drafter.logits(h_next).log_softmax(-1)
                    p = logp.exp()
                    entropy = -(p * logp).sum(-1)
                    top1 = (logq.argmax(-1) == logp.argmax(-1)).to(weight)
                cross_entropy = -(p * logq).sum(-1)
                ce_loss = (cross_entropy * weight).sum() / count
                loss = self.hidden_weight * hidden_loss + self.ce_weight * ce_loss
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if self.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
                self.optimizer.step()
                self.steps += 1
                with torch.no_grad():
                    step = {
                        "loss": float(loss),
                        "hidden_loss": float(hidden_loss),
                        "ce_loss": float(ce_loss),
                        # KL(p || q) = CE − H(p): 0 for a drafter that matches the target.
                        "kl": float(((cross_entropy - entropy) * weight).sum() / count),
                        "top1": float((top1 * weight).sum() / count),
                    }
                for key, value in step.items():
                    totals[key] = totals.get(key, 0.0) + value
        finally:
            self.drafter.train(was_training)
        self.last = {key: value / made for key, value in totals.items()}
        self.last["train_seconds"] = time.perf_counter() - started
        self.last["steps_last"] = made
        return dict(self.last)

    def on_new_version(self, version: int) -> None:
        """The engine now runs `version`: later observations and acceptance records carry
        it. Nothing is dropped or reset; the drafter keeps training as the target moves."""
        self.version = int(version)

    # -- acceptance metrics -------------------------------------------------------------------

    def record_acceptance(
        self, num_accepted: torch.Tensor, k: int, active: torch.Tensor | None = None
    ) -> None:
        """One verify step: num_accepted [B] (AcceptanceResult.num_accepted) of k drafts
        each, for the rows where `active` [B] is set (all by default)."""
        counts = num_accepted if active is None else num_accepted[active.bool()]
        self.record_accepted(int(counts.sum()), counts.numel(), k)

    def record_accepted(self, accepted: int, rows: int, k: int) -> None:
        """`record_acceptance` from the counts already on the host: `accepted` drafts of
        `rows` rows' k each (the slot loop reads them with its other counts, one sync)."""
        record = self.acceptance.setdefault(self.version, _Acceptance())
        record.verify_steps += rows
        record.drafted += k * rows
        record.accepted += accepted

    def acceptance_by_version(self) -> dict[int, dict[str, float]]:
        return {version: record.summary() for version, record in sorted(self.acceptance.items())}

    def metrics(self) -> dict[str, float]:
        """Flat, for metrics.jsonl: the last `train` call's mean losses, the buffer, and the
        current version's acceptance."""
        out = {f"drafter/{key}": value for key, value in self.last.items()}
        out |= {
            "drafter/steps": self.steps,
            "drafter/train_calls_cut_short": self.cut_short,
            "drafter/buffer_tokens": self.buffered,
            "drafter/version": self.version,
        }
        current = self.acceptance.get(self.version)
        if current is not None:
            summary = current.summary()
            out["spec/acceptance_rate"] = summary["acceptance_rate"]
            out["spec/mean_accepted_length"] = summary["mean_accepted_length"]
        return out

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The drafter (with its target signature), the optimizer, the counters and the
        sampling generator. The buffer is not saved: it refills from the next rollouts.
        A deep copy: the optimizer's state tensors would otherwise be shared with any
        trainer that loads it in this process (torch's load keeps tensors as they are)."""
        return copy.deepcopy(
            {
                "drafter": self.drafter.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                "steps": self.steps,
                "cut_short": self.cut_short,
                "version": self.version,
                "last": dict(self.last),
                "acceptance": {v: vars(r).copy() for v, r in self.acceptance.items()},
            }
        )

    def load_state_dict(self, state: dict) -> None:
        # The drafter first: it refuses a checkpoint from another model before anything
        # else changes.
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.steps = int(state["steps"])
        self.cut_short = int(state.get("cut_short", 0))  # absent from older checkpoints
        self.version = int(state["version"])
        self.last = dict(state["last"])
        self.acceptance = {int(v): _Acceptance(**r) for v, r in state["acceptance"].items()}
