"""What the launcher prints when a run ends (its summary.json and plots written, the
held-out result, the guard's rollbacks) and how to go on from there. Shared by the local
launcher, the one under Slurm and the Ray driver."""

from __future__ import annotations

import json
import time
from pathlib import Path

from asyncfp8.export import MODEL_DIR
from asyncfp8.launch.processes import log_tail
from asyncfp8.report.metrics import wandb_sync_hint
from asyncfp8.report.plots import plot_runs
from asyncfp8.report.summary import LAST_STEPS, summarize
from asyncfp8.run.files import CHECKPOINT_DIR, GUARD_STOPPED, LEARNER_STATE


def resume_hint(run_dir: Path) -> str:
    """How to continue, when there is something to continue from."""
    if any((run_dir / CHECKPOINT_DIR).glob(f"step_*/{LEARNER_STATE}")):
        return f"[launch] continue with: run.resume=true run.dir={run_dir}"
    return "[launch] no checkpoint was written: nothing to resume"


def report_guard_stop(run_dir: Path, started: float) -> int:
    """A run the guard stopped is an outcome, not a crash: its summary.json and plots as a
    finished run's (with `guard_stopped`), the learner's reason (the last line of
    learner.log), and how to go on."""
    report_end(run_dir, started)
    tail = log_tail(run_dir / "learner.log", 1)
    print(f"[launch] the guard stopped the run. learner.log ends:\n{tail}")
    print(resume_hint(run_dir))
    return GUARD_STOPPED


def report_end(run_dir: Path, started: float, restarts: list[dict] | None = None) -> int:
    """The finished run's summary.json, plots and closing lines. `restarts`: the
    processes the launcher started again (`Process.exits`), listed in the summary as
    `process_restarts` and each said in a warning; None where this launcher does not
    see them (under Slurm each worker task restarts its own process), and the key is
    left out."""
    summary = summarize(run_dir)
    summary["wall_s"] = time.perf_counter() - started
    if restarts is not None:
        summary["process_restarts"] = list(restarts)
    plot = plot_runs([run_dir], run_dir / "plots.png")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[launch] {heldout_text(summary)}")
    print(
        f"[launch] done in {summary['wall_s']:.0f} s: {summary['steps']} steps, "
        f"{summary['samples']} samples ({summary['samples_per_s']:.1f}/s); "
        f"reward {summary['reward_start']:.3f} (first 20% of steps) -> "
        f"{summary['reward_end']:.3f} (last 20%); mismatch KL k3 {summary['kl_k3_mean']:.2e}"
        f"{fresh_kl_text(summary)}; mean staleness "
        f"{summary['staleness_mean']:.2f}, dropped {summary['stale_groups']} stale groups.\n"
        f"[launch] plots: {plot}; summary: {run_dir / 'summary.json'}"
    )
    if (run_dir / MODEL_DIR).is_dir():
        print(f"[launch] the trained model (Hugging Face, BF16): {run_dir / MODEL_DIR}")
    if sync := wandb_sync_hint(run_dir):
        print(f"[launch] W&B run saved offline; upload it with: {sync}")
    if summary.get("guard_rollbacks") is not None:
        print(f"[launch] guard: {summary['guard_rollbacks']} rollback(s) of a fatal step")
    for undone in summary.get("guard_heldout_rollbacks", []):
        print(
            f"[launch] guard: held-out greedy {undone['undone']:.3f} at step {undone['step']} "
            f"was below guard.heldout_below x the best; put back the weights of step "
            f"{undone['restored_step']} (held-out {undone['restored']:.3f})"
        )
    for warning in summary.get("warnings", []):
        print(f"[launch] warning: {warning}")
    for restarted in summary.get("process_restarts", []):
        print(
            f"[launch] warning: {restarted['process']} exited with {restarted['exit_code']} "
            f"and was started again; its log said: {restarted['error']}"
        )
    return 0


def heldout_text(summary: dict) -> str:
    """The run's held-out result, the number a reader looks at first."""
    if not summary.get("eval_steps"):
        return "held-out pass@1: not evaluated (eval.every=0)"
    return (
        f"held-out pass@1 on {summary.get('eval_prompts')} prompts never trained on: greedy "
        f"{summary['eval_pass1_greedy_start']:.3f} (step {summary['eval_steps'][0]}) -> "
        f"{summary['eval_pass1_greedy_end']:.3f} (step {summary['eval_steps'][-1]}, ± "
        f"{summary.get('eval_pass1_greedy_end_se', float('nan')):.3f} SE); sampled "
        f"{summary['eval_pass1_sampled_start']:.3f} -> {summary['eval_pass1_sampled_end']:.3f}; "
        f"training-stream reward over the last {LAST_STEPS} steps (the same distribution): "
        f"{summary['reward_last_steps']:.3f}"
    )


def fresh_kl_text(summary: dict) -> str:
    """The precision-only KL with its support, or why it is left out."""
    if summary.get("fresh_kl_k3_mean") is None:
        return (
            f" (precision-only KL left out: current-version tokens in only "
            f"{summary.get('fresh_kl_steps', 0)} steps)"
        )
    return (
        f" (precision-only, current-version tokens: {summary['fresh_kl_k3_mean']:.2e} over "
        f"{summary['fresh_kl_steps']} steps, {summary['fresh_kl_tokens']} tokens)"
    )
