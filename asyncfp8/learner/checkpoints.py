"""The learner's checkpoints and exports. A checkpoint is a directory per step: the sharded
model and optimizer from every rank (torch.distributed.checkpoint: readable at another world
size) and rank 0's `learner.pt` (schedule, step, version, the inbox's state, RNG states);
written beside its name and renamed, so a directory of that name is complete
(docs/running.md#checkpoints-and-resume). An export is the policy as an HF model."""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncfp8.export import MODEL_DIR, save_model
from asyncfp8.run import distributed
from asyncfp8.run.files import CHECKPOINT_DIR, LATEST_VERSION_FILE, LEARNER_STATE

log = logging.getLogger("asyncfp8.learner")


@dataclass
class Restored:
    """What a resumed learner continues from."""

    step: int
    version: int
    elapsed_s: float
    inbox: dict[str, Any]
    folder: Path
    world_size: int


class Checkpointer:
    def __init__(
        self,
        run_dir: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        ranks: distributed.Ranks,
        keep: int,
    ):
        self.dir, self.folder = run_dir, run_dir / CHECKPOINT_DIR
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.ranks, self.keep = ranks, keep
        # More state saved in learner.pt and restored on every rank, by name: objects with
        # state_dict / load_state_dict (the FP16 loss scale, asyncfp8/train/loss_scale.py)
        self.stateful: dict[str, Any] = {}

    def save(self, step: int, version: int, inbox: dict | None, elapsed_s: float) -> Path:
        """Every rank writes its shards; rank 0 also `learner.pt` (with `inbox`, its state)."""
        final = self.folder / f"step_{step:08d}"
        staging = self.folder / f".{final.name}.{distributed.broadcast(secrets.token_hex(4))}.tmp"
        has_optimizer = bool(self.optimizer.state)  # an optimizer yet to step has no state
        distributed.save_checkpoint(
            str(staging), self.model, self.optimizer if has_optimizer else None
        )
        if not self.ranks.main:
            return final
        state = {
            "step": step,
            "version": version,
            "scheduler": self.scheduler.state_dict(),
            "inbox": inbox,
            "optimizer_saved": has_optimizer,
            "elapsed_s": elapsed_s,
            "world_size": self.ranks.world,
            **{name: kept.state_dict() for name, kept in self.stateful.items()},
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
            },
        }
        torch.save(state, staging / LEARNER_STATE)
        if final.exists():  # reached again after a resume from an older checkpoint
            shutil.rmtree(final)
        os.replace(staging, final)
        saved = sorted(p for p in self.folder.glob("step_*") if p.is_dir())
        for old in saved[: -self.keep]:
            shutil.rmtree(old)
        for leftover in self.folder.glob(".step_*.tmp"):  # of a learner killed mid-checkpoint
            shutil.rmtree(leftover, ignore_errors=True)
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        saved = sorted(self.folder.glob(f"step_*/{LEARNER_STATE}"))
        return saved[-1].parent if saved else None

    def restore(self) -> Restored:
        """Every rank reads the newest checkpoint (run.dir must be on storage they all
        see); the version continues after any number a killed learner reserved since
        (collective)."""
        saved = sorted(self.folder.glob(f"step_*/{LEARNER_STATE}"))
        if not saved and any(self.folder.glob("step_*.pt")):
            raise SystemExit(
                f"learner: {self.folder} holds only single-file checkpoints "
                "(step_N.pt) of an asyncfp8 from before the sharded learner; this one cannot "
                "resume them: start a new run.dir"
            )
        if not saved:
            raise SystemExit(
                f"learner: run.resume=true but {self.folder} holds no checkpoint; "
                "point run.dir at the run to continue"
            )
        folder = saved[-1].parent
        state = torch.load(saved[-1], weights_only=False)
        distributed.load_checkpoint(
            str(folder), self.model, self.optimizer if state["optimizer_saved"] else None
        )
        self.scheduler.load_state_dict(state["scheduler"])
        for name, kept in self.stateful.items():
            if name in state:  # absent from a checkpoint of a run in another dtype
                kept.load_state_dict(state[name])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        version = state["version"]
        latest = self.dir / LATEST_VERSION_FILE
        if self.ranks.main and latest.exists():
            version = max(version, int(latest.read_text()))
        # Rank 0's number, on every rank: read by each rank, a slow rank could see the
        # file rank 0's first publish after this rewrote (one version ahead), and the
        # colocated engines would disagree at the first lease. Collective, so no rank
        # publishes before every rank has its version.
        version = distributed.broadcast(version)
        return Restored(
            state["step"],
            version,
            state.get("elapsed_s", 0.0),
            state["inbox"],
            folder,
            state["world_size"],
        )

    def export(self, step: int, source_model: Path) -> Path:
        """The policy as a Hugging Face model in `<run.dir>/model/` (BF16, with the source
        model's tokenizer and generation config), replacing the previous export. Every rank
        takes part in the gather; rank 0 writes."""
        out = self.dir / MODEL_DIR
        with torch.no_grad():
            full = distributed.full_state_dict(self.model)
        if self.ranks.main:
            info = {"run": str(self.dir.resolve()), "step": step, "source_model": str(source_model)}
            save_model(full, source_model, out, info)
            log.info("exported the step-%d policy to %s", step, out)
        return out
