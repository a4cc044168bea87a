"""Reading a run back after faults: was anything trained twice, left half done, or lost?
The learner's ledger says which samples each step trained or skipped
(`asyncfp8.learner.ledger`); its last checkpoint says which prompts were still out (leased,
queued again, received but not trained, skipped but not yet in the ledger). Together they
must account for every prompt handed out, exactly once."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncfp8.learner.ledger import read_ledger
from asyncfp8.run.files import CHECKPOINT_DIR, LEARNER_STATE


@dataclass
class Audit:
    steps: int = 0
    trained_samples: int = 0
    trained_groups: int = 0
    skipped_groups: int = 0  # consumed without training (dynamic sampling)
    dropped_stale_groups: int = 0
    duplicate_samples: list = field(default_factory=list)  # (sender, seq) trained twice
    duplicate_prompts: list = field(default_factory=list)  # prompts trained twice
    incomplete_groups: list = field(default_factory=list)  # wrong size or mixed senders
    lost_prompts: list = field(default_factory=list)  # handed out, neither trained nor open

    stale_samples: int = 0  # samples older than max_staleness at their step
    step_gaps_s: list = field(default_factory=list)  # wall time between consecutive steps
    senders: set = field(default_factory=set)

    @property
    def lost(self) -> int:
        """Everything that must be zero: samples or prompts trained twice, groups
        trained half, prompts lost, samples past the staleness bound."""
        return (
            len(self.duplicate_samples)
            + len(self.duplicate_prompts)
            + len(self.incomplete_groups)
            + len(self.lost_prompts)
            + self.stale_samples
        )


def last_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The learner's own state (step, version, inbox) in the newest checkpoint."""
    saved = sorted((Path(run_dir) / CHECKPOINT_DIR).glob(f"step_*/{LEARNER_STATE}"))
    if not saved:
        raise FileNotFoundError(f"no checkpoint in {run_dir}")
    return torch.load(saved[-1], weights_only=False)


def audit(run_dir: str | Path, group_size: int, max_staleness: int) -> Audit:
    """Checks a finished (or stopped) run. Its last checkpoint must have been written
    after its last ledger record, as a learner does at the end and on SIGTERM."""
    records = read_ledger(run_dir)
    result = Audit(steps=len(records))
    steps = [r["step"] for r in records]
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(f"the ledger's steps are not 1..{len(steps)}: {steps[:20]}...")
    samples: Counter = Counter()
    prompts: Counter = Counter()
    for record in records:
        skipped = record.get("skipped", [])
        for index, (lease, prompt, members) in enumerate([*record["groups"], *skipped]):
            trained = index < len(record["groups"])
            result.trained_groups += trained
            result.skipped_groups += not trained
            prompts[prompt] += 1
            if len(members) != group_size or len({sender for sender, _, _ in members}) != 1:
                result.incomplete_groups.append((record["step"], lease, prompt, len(members)))
            for sender, seq, oldest in members:
                samples[(sender, seq)] += 1
                result.senders.add(sender)
                result.trained_samples += trained
                result.stale_samples += trained and record["version"] - oldest > max_staleness
        result.dropped_stale_groups += len(record["dropped"])
    times = [r["time"] for r in records]
    result.step_gaps_s = [b - a for a, b in itertools.pairwise(times)]
    result.duplicate_samples = sorted(key for key, n in samples.items() if n > 1)
    result.duplicate_prompts = sorted(p for p, n in prompts.items() if n > 1)

    state = last_checkpoint(run_dir)
    if state["step"] != len(records):
        raise ValueError(
            f"the last checkpoint is of step {state['step']} but the ledger has {len(records)}"
        )
    inbox, book = state["inbox"], state["inbox"]["book"]
    open_prompts = Counter(book["retry"])
    open_prompts.update(p for lease in book["leases"] for p in lease["pending"])
    open_prompts.update(prompt for _, prompt, _ in inbox["ready"])
    open_prompts.update(prompt for _, prompt, _ in inbox.get("skipped", []))
    # (a partial group's prompt is still pending in its lease: not counted twice)
    result.duplicate_prompts += sorted(p for p in open_prompts if p in prompts)
    accounted = set(prompts) | set(open_prompts)
    result.lost_prompts = [p for p in range(book["next_prompt"]) if p not in accounted]
    return result


REJECTED_ONE = re.compile(r"rejected an? (.+?): ")
REJECTED_MANY = re.compile(r"rejected (\d+) more: (.+?) \(within")


def logged_rejections(log_text: str) -> Counter:
    """Rejections a process logged, by source: one line each, plus the summary lines
    of those not logged one by one (`asyncfp8.sync.limits.RejectionLog`)."""
    counts: Counter = Counter()
    for line in log_text.splitlines():
        if many := REJECTED_MANY.search(line):
            counts[many.group(2)] += int(many.group(1))
        elif one := REJECTED_ONE.search(line):
            counts[one.group(1)] += 1
    return counts


APPLIED = re.compile(r"applied version (\d+)")


def applied_versions(log_text: str) -> list[int]:
    """The versions a worker applied, in order."""
    return [int(v) for v in APPLIED.findall(log_text)]
