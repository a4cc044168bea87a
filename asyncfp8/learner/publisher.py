"""Publishing a version: rank 0 reserves its number on disk before any byte leaves (a learner
killed mid-send must not have its number reused), every rank gathers the weights and
calibrates (collectives), and the background sender quantizes, encodes and sends it while
the next step trains, computing the refit probe's reference from the same snapshot.
Colocated, every rank gathers the whole model for its own engine."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from asyncfp8.precision import PrecisionPolicy, calibrate_version, extra_roles, version_weights
from asyncfp8.precision.manifest import decoder_layers
from asyncfp8.precision.sensitivity import LayoutDrift
from asyncfp8.refit.probe import Probe, probe_sequences
from asyncfp8.refit.reference import ReferenceForward
from asyncfp8.run import distributed
from asyncfp8.run.files import LATEST_VERSION_FILE
from asyncfp8.sync import BackgroundPublisher, Trajectory
from asyncfp8.train.batches import batch_tensors
from asyncfp8.train.logprobs import without_logits

FIRST_CALIBRATION_PROMPTS = 32  # before the first step, KV scales come from task prompts


class Publisher:
    def __init__(
        self,
        model: torch.nn.Module,
        policy: PrecisionPolicy,
        sync: DictConfig,
        ranks: distributed.Ranks,
        run_dir: Path,
        dtype: torch.dtype,
        pad_token_id: int,
        first_calibration: dict[str, torch.Tensor],
        sender: BackgroundPublisher | None,
        probe_reference: ReferenceForward | None,
        every_rank: bool = False,
        drift: LayoutDrift | None = None,
    ):
        self.model, self.policy, self.sync, self.ranks = model, policy, sync, ranks
        self.run_dir, self.dtype, self.pad_token_id = run_dir, dtype, pad_token_id
        self.sender, self.probe_reference = sender, probe_reference
        #: precision=mixed: its frozen layout measured again every few versions (rank 0)
        self.drift = drift
        #: colocated: every rank gathers the whole model (its own engine takes it)
        self.every_rank = every_rank
        #: the rows the next version's KV scales (and its refit probe) come from
        self.calibration_batch = first_calibration
        self.version: int | None = None  # the latest version published
        #: its extra tensors (KV scales), on every rank
        self.latest_extra: dict[str, torch.Tensor] = {}
        #: each parameter's decoder layer, for the versions' manifests
        self.layers = decoder_layers(model)

    def calibrate_on(self, trajectories: list[Trajectory]) -> None:
        """The next version calibrates on these rows (the latest step's rollouts)."""
        batch = batch_tensors(trajectories, self.pad_token_id)
        self.calibration_batch = {
            "input_ids": batch.input_ids.to(self.ranks.device),
            "attention_mask": batch.attention_mask.to(self.ranks.device),
        }

    def publish(self) -> dict[str, float]:
        """The current weights out as the next version (collective); rank 0 gets the
        sync metrics, the other ranks {} (colocated: their own engine's)."""
        self.version = 0 if self.version is None else self.version + 1
        started = time.perf_counter()
        if self.ranks.main:
            latest = self.run_dir / LATEST_VERSION_FILE
            latest.with_suffix(".tmp").write_text(str(self.version))
            os.replace(latest.with_suffix(".tmp"), latest)
        with torch.no_grad():
            # on rank 0's CPU, in FP32 (colocated: on every rank)
            full = distributed.full_state_dict(self.model, self.every_rank)
            with without_logits(self.model):
                extra = calibrate_version(self.model, self.policy, self.calibration_batch)
        self.latest_extra = extra
        drifted = {}
        if self.drift is not None and self.ranks.main and self.drift.due(self.version):
            drifted = self.drift.measure(full)
        if self.sender is None:
            return drifted
        # By parameter name, so that tied weights are sent once. The sender snapshots them
        # (with one rank on the CPU the gathered tensors are the parameters themselves,
        # which the next step updates in place) before this returns. With
        # precision.quantize_from=compute the policy gets the masters rounded to the
        # compute dtype, as the learner's forward sees them.
        masters = ((name, full[name]) for name, _ in self.model.named_parameters())
        # The manifest: the extra tensors' roles now, each weight's as the sender's thread
        # quantizes it.
        roles = extra_roles(self.policy, extra) | Probe.roles()
        waited = self.sender.submit(
            self.version,
            masters,
            functools.partial(version_weights, self.policy, roles=roles, layers=self.layers),
            extra=extra,
            policy=self.policy.spec,
            engine_config=self.policy.engine_config(),
            dtype=self.dtype if self.policy.quantize_from == "compute" else None,
            annotate=self._refit_probe(),
            roles=roles,
        )
        last = self.sender.last  # the latest publish that finished
        return {
            "sync/version": self.version,
            "sync/bytes": last.bytes if last else 0,
            "sync/publish_s": last.seconds if last else 0.0,
            "sync/publish_wait_s": waited,
            "sync/probe_s": self.sender.annotate_s,
            "sync/seconds": time.perf_counter() - started,
            **drifted,
        }

    def _refit_probe(self):
        """The refit probe of the version being published, made on the publishing thread
        from its snapshot: the first rows the version was calibrated on, cut to
        sync.probe.tokens, with the reference's log-probs."""
        if self.probe_reference is None:
            return None
        settings = self.sync.probe
        ids, lengths = probe_sequences(
            self.calibration_batch["input_ids"],
            self.calibration_batch["attention_mask"],
            settings.sequences,
            settings.tokens,
        )
        reference = self.probe_reference
        return lambda snapshot, extra: reference.probe(snapshot, extra, ids, lengths).to_extra()
