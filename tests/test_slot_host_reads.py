"""The slot loop's reads of device values on the host. On a GPU each one waits for every
kernel queued before it, so the loop reads once per harvest of finished sequences (not
four times per sequence) and once per speculative step for all its counts. Counted on
the CPU by intercepting the tensor methods that read values (tolist, item, int, bool,
float, cpu, nonzero, boolean-mask indexing) where the slot loop's own code calls them."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.torch_engine import TorchEngine

READS = {"tolist", "item", "__int__", "__bool__", "__float__", "__index__", "cpu", "nonzero"}
LOOP_FILES = (str(Path("engines", "slots.py")), str(Path("speculative", "slots.py")))
PROMPTS = ["1+2=", "what is 13*7?", "3", "hello there", "9-4=", "12*12=", "7*8=", "5"]
BUDGETS = [3, 9, 5, 2, 12, 4, 7, 6]


class HostReads(TorchFunctionMode):
    """Counts the reads made from the slot loop's files, by file and line."""

    def __init__(self):
        super().__init__()
        self.at: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name == "__getitem__" and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool
            for index in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        if name in READS or masked:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.endswith(LOOP_FILES):
                self.at[f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
        return func(*args, **(kwargs or {}))


def generate_counting(engine: TorchEngine) -> HostReads:
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    sampling = SamplingParams(temperature=1.0, seed=0, ignore_eos=True)
    engine.generate_requests(prompts, BUDGETS, sampling)  # warm-up: the cache is allocated
    with HostReads() as reads:
        samples = engine.generate_requests(prompts, BUDGETS, sampling)
    assert [len(s.token_ids) for s in samples] == BUDGETS
    return reads


def test_plain_slot_steps_read_once_per_harvest(tiny_model_dir):
    engine = TorchEngine(str(tiny_model_dir), "bf16", device="cpu", slots=3)
    reads = generate_counting(engine)
    # ignore_eos: every end is known to the host; only harvesting reads the device, at
    # most once per finished sequence (sequences that end at one step share one read),
    # and the call's count of forwards at the end.
    assert sum(reads.at.values()) <= len(BUDGETS) + 1, reads.at


def test_speculative_steps_read_their_counts_once(tiny_model_dir):
    speculative = {"mode": "fixed", "draft_tokens": 2, "train_steps": 0}
    engine = TorchEngine(
        str(tiny_model_dir), "bf16", device="cpu", slots=3, speculative=speculative
    )
    reads = generate_counting(engine)
    steps = engine.last_stats.steps
    assert steps >= 3
    # One read per step; per sequence one for its harvest and one for the positions the
    # drafter trains on; the call's count of forwards.
    assert sum(reads.at.values()) <= steps + 2 * len(BUDGETS) + 1, (steps, reads.at)
