"""One engine's rollout of a step, simulated: continuous batching under a KV-cache
budget, with a long-tailed length distribution that empties the batch at the end.

Admission with vLLM's 1% watermark, recompute preemption of the latest admitted, and steps
taken in chunks between events, each priced at its mean context (docs/plan.md, "Rollout")."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import PlanInputError

MAX_CHUNK = 64  # decode steps priced as one; keeps the mean-context price accurate
WATERMARK = 0.01  # of the cache, kept free when admitting a sequence beside running ones


@dataclass(frozen=True)
class RolloutTrace:
    seconds: float
    tokens: int  # generated
    preemptions: int
    times: np.ndarray  # start of each chunk
    batches: np.ndarray  # running sequences during it

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def tail_fraction(self, below: float = 0.25) -> float:
        """Share of the time the running batch is under `below` of its peak."""
        durations = np.diff(np.append(self.times, self.seconds))
        return float(durations[self.batches < below * self.batches.max()].sum() / self.seconds)


def simulate(
    prompt_tokens: int,
    responses: np.ndarray,
    capacity_tokens: int,
    max_num_seqs: int,
    step_seconds: Callable[[int, float], float],
    prefill_seconds: Callable[[int], float],
) -> RolloutTrace:
    """Generate `responses[i]` tokens after a `prompt_tokens` prompt for every i."""
    longest = prompt_tokens + int(responses.max())
    if longest > capacity_tokens:
        raise PlanInputError(
            f"a sequence of {longest} tokens (prompt {prompt_tokens} + response "
            f"{int(responses.max())}) does not fit in the KV cache ({capacity_tokens} tokens)"
        )
    generated = np.zeros(len(responses), dtype=np.int64)
    waiting = deque(range(len(responses)))
    running: list[int] = []
    used = 0  # KV tokens held by the running sequences
    watermark = int(WATERMARK * capacity_tokens)
    seconds, preemptions = 0.0, 0
    times: list[float] = []
    batches: list[int] = []
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            i = waiting[0]
            held = prompt_tokens + generated[i]
            if used + held + 1 + (watermark if running else 0) > capacity_tokens:
                break
            waiting.popleft()
            running.append(i)
            used += held
            seconds += prefill_seconds(int(held))
        while used + len(running) > capacity_tokens:  # the next step would overflow
            i = running.pop()
            used -= prompt_tokens + generated[i]
            waiting.appendleft(i)
            preemptions += 1
        active = np.array(running)
        batch = len(running)
        left = responses[active] - generated[active]
        steps = int(min(MAX_CHUNK, left.min(), (capacity_tokens - used) // batch))
        # Step j of the chunk attends over used + batch * j tokens (its own included).
        mean_context = used + batch * (steps + 1) / 2
        times.append(seconds)
        batches.append(batch)
        seconds += steps * step_seconds(batch, mean_context)
        generated[active] += steps
        used += batch * steps
        done = {int(i) for i in active[left == steps]}
        if done:
            used -= sum(prompt_tokens + int(responses[i]) for i in done)
            running = [i for i in running if i not in done]
    return RolloutTrace(
        seconds, int(responses.sum()), preemptions, np.array(times), np.array(batches)
    )
