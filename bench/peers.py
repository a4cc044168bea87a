"""asyncfp8 against TRL's GRPOTrainer, side by side on this machine: the same model files,
prompt stream, reward and hyperparameters, back to back.

    python bench/peers.py [--steps 300] [--seeds 0] [--out bench/results/peers-cpu.json]

Systems (each a fresh process, one after another, nothing else running):
- TRL (`trl==1.16.0`, pinned) `GRPOTrainer`: one process, HF `generate`, installed by this
  bench into its own environment (`.cache/peers/trl-1.16.0/`, torch the local build
  through constraints.txt) and driven by `bench/peers_trl.py` there;
- asyncfp8's launcher in each placement: separate (a learner and `run.workers` worker
  processes) asynchronous with 2 workers (three processes on two cores) and with 1, and
  `run.mode=sync` with 2; colocated (one process), asynchronous (a rollout thread
  generates the next step while the learner trains), the same without the refit probe
  (`sync.probe.enabled=false`: what checking each version costs), and in turns
  (`run.mode=sync`).

The job is the launcher's default (`make run`'s: the `small` model, `addition` with worked
answers, 8 prompts × 8 samples, lr 3e-4, T = 1, 40 new tokens, no KL) with held-out
evaluation off during training (TRL has none): each system's final weights (BF16, as
asyncfp8 exports them) are then scored by the same evaluation, asyncfp8's `HeldOut` (256
held-out prompts, greedy and 4 samples each at T = 1), as is the start model.

With `--curve K` each system also saves its weights every K steps (asyncfp8: a learner
checkpoint, exported; TRL: `save_steps`), and each saved point is scored greedily on the
same held-out prompts after the run, rounded to BF16 as the final weights are: the
held-out curve, and its mean over the second half of training (`heldout_late_mean`), a
figure less at the mercy of where step 300 happens to fall than the final weights. The
saves cost the runs a little time, so speed is best read from runs without it.

Trained samples/s is the steady state: samples of the steps after the first `--skip`
(process start-up, first compilations) over their seconds. Each row also gives the
whole run's wall time, the reward over the first and last 20% of steps, and where a step's
time goes (medians): generating (TRL: sampling and scoring; asyncfp8 separate: the
learner's wait for trajectories, which in async overlaps the workers' generation with
training; colocated: its own rollout turn), training, and the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_json

ROOT = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"
TAIL = 0.2  # first and last 20% of steps, as asyncfp8.report.summary.summarize
PLACEMENTS = {
    "asyncfp8 separate async, 2 workers": [
        "run.placement=separate",
        "run.mode=async",
        "run.workers=2",
    ],
    "asyncfp8 separate async, 1 worker": [
        "run.placement=separate",
        "run.mode=async",
        "run.workers=1",
    ],
    "asyncfp8 separate sync, 2 workers": [
        "run.placement=separate",
        "run.mode=sync",
        "run.workers=2",
    ],
    "asyncfp8 colocated async (overlapped)": ["run.placement=colocated", "run.mode=async"],
    # what the refit probe costs (TRL has none): the same, each version applied unchecked
    "asyncfp8 colocated async, no refit probe": [
        "run.placement=colocated",
        "run.mode=async",
        "sync.probe.enabled=false",
    ],
    "asyncfp8 colocated sync (turns)": ["run.placement=colocated", "run.mode=sync"],
    # two learner ranks (torchrun, gloo), each with its own engine and rollout thread
    "asyncfp8 colocated async, 2 ranks": [
        "run.placement=colocated",
        "run.mode=async",
        "run.learner_procs=2",
    ],
}
TRL = f"TRL {TRL_VERSION} GRPOTrainer"


def trl_python(venv: Path) -> Path:
    """TRL's environment, made on first use: torch pinned to the local CPU build."""
    python = venv / "bin" / "python"
    marker = venv / f"trl-{TRL_VERSION}.ok"
    if marker.exists():
        return python
    print(f"installing trl=={TRL_VERSION} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "-c",
            str(ROOT / "constraints.txt"),
            "torch==2.13.0",
            f"trl=={TRL_VERSION}",
        ],
        check=True,
    )
    marker.touch()
    return python


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def trl_job(cfg, steps: int, seed: int, threads: int, save_every: int = 0) -> dict:
    """What peers_trl.py needs: the model, the prompts in stream order, the reward."""
    from omegaconf import OmegaConf

    from asyncfp8.models.run_model import run_model_dir
    from asyncfp8.tasks import build_task

    model_dir = run_model_dir(cfg)
    task = build_task(cfg.task, model_dir)
    run = cfg.run
    prompts = [task.prompt(i) for i in range(steps * run.groups_per_step)]
    return {
        "model": str(model_dir),
        "prompts": [{"text": p.text, "answer": p.answer} for p in prompts],
        "reward": OmegaConf.to_container(cfg.task.reward, resolve=True),
        "optim": OmegaConf.to_container(cfg.optim, resolve=True),
        "steps": steps,
        "groups": run.groups_per_step,
        "group_size": run.group_size,
        "temperature": run.temperature,
        "max_new_tokens": run.max_new_tokens,
        "seed": seed,
        "threads": threads,
        "save_every": save_every,
    }


def steady(elapsed: list[float], skip: int, samples_per_step: int) -> float:
    """Trained samples/s after the first `skip` steps (elapsed[i]: end of step i+1)."""
    return (len(elapsed) - skip) * samples_per_step / (elapsed[-1] - elapsed[skip - 1])


def tail_means(values: list[float]) -> tuple[float, float]:
    n = max(1, round(len(values) * TAIL))
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:])


def run_trl(python: Path, job: dict, out: Path, skip: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(job))
    start = time.perf_counter()
    result = subprocess.run(
        [
            str(python),
            str(ROOT / "bench" / "peers_trl.py"),
            "--job",
            str(out / "job.json"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(job["threads"])},
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"TRL failed\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in records]
    generation = [r["generation_s_total"] for r in records]
    step_s = [b - a for a, b in zip(elapsed[skip - 1 :], elapsed[skip:], strict=False)]
    gen_s = [b - a for a, b in zip(generation[skip - 1 :], generation[skip:], strict=False)]
    rewards = [r["reward"] for r in records if r["reward"] is not None]
    start_reward, end_reward = tail_means(rewards)
    return {
        "trained_samples_per_s": steady(elapsed, skip, job["groups"] * job["group_size"]),
        "wall_s": wall,
        "reward_start": start_reward,
        "reward_end": end_reward,
        "phase_s_median": {
            "step": statistics.median(step_s),
            "generate": statistics.median(gen_s),
            "train_and_rest": statistics.median(s - g for s, g in zip(step_s, gen_s, strict=True)),
        },
        "model_dir": str(out / "model"),
    }


def run_asyncfp8(
    overrides: list[str],
    out: Path,
    skip: int,
    samples_per_step: int,
    cores: set[int] | None = None,
) -> dict:
    """One launcher run and its steady-state figures; `cores`: the CPUs it may use (its
    affinity, which every process it starts inherits and counts its threads from)."""
    from asyncfp8.report.summary import per_step, summarize

    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "asyncfp8.launch", *overrides, f"run.dir={out}"],
        capture_output=True,
        text=True,
        preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"asyncfp8 failed\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    records = per_step(out)
    tail = records[skip:]
    summary = summarize(out)

    def median(key: str) -> float | None:
        values = [r[key] for r in tail if key in r]
        return statistics.median(values) if values else None

    step, wait, train = median("time/step_total_s"), median("time/wait_s"), median("time/train_s")
    return {
        "trained_samples_per_s": steady(
            [r["time/elapsed_s"] for r in records], skip, samples_per_step
        ),
        "wall_s": wall,
        "reward_start": summary["reward_start"],
        "reward_end": summary["reward_end"],
        "phase_s_median": {
            "step": step,
            "generate": wait,  # the learner's wait for trajectories (see the docstring)
            "train": train,
            "publish_on_thread": median("sync/seconds"),
            "rest": step - wait - train,
        },
        "staleness_mean": summary["staleness_mean"],
        "model_dir": str(out / "model"),
    }


def heldout_evaluation(cfg, model_dir: str, prompts: int, samples: int, temperature: float):
    """The job's held-out evaluation (asyncfp8.learner.evaluation.HeldOut, one CPU rank), its
    task and tokenizer from `model_dir`; temperature 0: greedy only."""
    import torch

    from asyncfp8.hf.loading import load_tokenizer
    from asyncfp8.learner.evaluation import HeldOut
    from asyncfp8.run.distributed import Ranks
    from asyncfp8.tasks import build_task

    return HeldOut(
        build_task(cfg.task, model_dir),
        load_tokenizer(model_dir),
        prompts=prompts,
        samples=samples,
        max_new_tokens=cfg.run.max_new_tokens,
        temperature=temperature,
        seed=cfg.run.seed,
        ranks=Ranks(rank=0, world=1, local_rank=0, device=torch.device("cpu")),
    )


def heldout(cfg, model_dir: str, prompts: int, samples: int) -> dict:
    """pass@1 of the weights in `model_dir` on the job's held-out prompts, as the learner
    evaluates (asyncfp8.learner.evaluation.HeldOut), in FP32."""
    import torch

    from asyncfp8.hf.loading import load_model
    from asyncfp8.report.stats import binomial_se

    model = load_model(model_dir, dtype=torch.float32).eval()
    evaluation = heldout_evaluation(cfg, model_dir, prompts, samples, cfg.run.temperature)
    with torch.no_grad():
        scores = evaluation.evaluate(model)
    greedy, count = scores["eval/pass1_greedy"], scores["eval/prompts"]
    return {
        "heldout_pass1_greedy": greedy,
        "heldout_pass1_greedy_se": binomial_se(greedy, count),
        "heldout_pass1_sampled": scores["eval/pass1_sampled"],
        "heldout_prompts": count,
    }


def saved_points(system_dir: Path, trl: bool) -> list[tuple[int, Path]]:
    """(step, where the weights of that step are) for each point a `--curve` run saved:
    TRL's `checkpoint-N` folders (a model directory each), the learner's checkpoints
    (exported to model directories here, beside them)."""
    if trl:
        folders = (system_dir / "trainer").glob("checkpoint-*")
        return sorted((int(f.name.removeprefix("checkpoint-")), f) for f in folders)
    from asyncfp8.export import export_run
    from asyncfp8.learner import CHECKPOINT_DIR

    points = []
    for checkpoint in sorted((system_dir / CHECKPOINT_DIR).glob("step_*")):
        step = int(checkpoint.name.removeprefix("step_"))
        if step == 0:
            continue
        out = system_dir / "curve" / f"step_{step:08d}"
        export_run(system_dir, step=step, out=out)
        points.append((step, out))
    return points


def heldout_curve(cfg, start_dir: str, points: list[tuple[int, Path]], prompts: int) -> list:
    """[step, greedy pass@1] of each saved point, the weights rounded to BF16 (as the final
    weights are exported) and evaluated as `heldout` does (greedy only)."""
    import torch

    from asyncfp8.hf.loading import load_model

    evaluation = heldout_evaluation(cfg, start_dir, prompts, samples=1, temperature=0.0)
    curve = []
    for step, folder in points:
        model = load_model(str(folder), dtype=torch.bfloat16).float().eval()
        with torch.no_grad():
            curve.append([step, evaluation.evaluate(model)["eval/pass1_greedy"]])
    return curve


def late_mean(curve: list, steps: int) -> float | None:
    """The mean held-out greedy pass@1 of the points in the second half of training."""
    late = [score for step, score in curve if step > steps / 2]
    return statistics.fmean(late) if late else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps left out")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed of each pass")
    parser.add_argument("--only", nargs="+", default=None, help="systems to run (default all)")
    parser.add_argument(
        "--trl-venv", type=Path, default=ROOT / ".cache" / "peers" / f"trl-{TRL_VERSION}"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs under this folder")
    parser.add_argument(
        "--overrides",
        nargs="+",
        default=[],
        help="more Hydra overrides for every asyncfp8 system (e.g. precision.lm_head_fp32=true)",
    )
    parser.add_argument(
        "--job",
        nargs="+",
        default=[],
        help="Hydra overrides of the job itself, for every system, TRL's included (its "
        "optim.* are mapped onto GRPOConfig, e.g. optim.schedule=cosine)",
    )
    parser.add_argument(
        "--curve",
        type=int,
        default=0,
        metavar="K",
        help="also save every K steps and score each point on the held-out prompts (0: off)",
    )
    parser.add_argument("--out", default="bench/results/peers-cpu.json")
    args = parser.parse_args()
    if args.curve < 0 or (args.curve and args.curve > args.steps):
        parser.error(f"--curve must be 0 (off) or a step count <= --steps, got {args.curve}")
    unknown = set(args.only or []) - {TRL, *PLACEMENTS}
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {[TRL, *PLACEMENTS]}")
    return args


def main() -> int:
    args = parse_args()
    systems = [s for s in (TRL, *PLACEMENTS) if args.only is None or s in args.only]
    threads = os.cpu_count() or 1
    python = trl_python(args.trl_venv) if TRL in systems else None
    root = args.keep or Path(tempfile.mkdtemp(prefix="peers-"))
    job_overrides = [
        f"run.steps={args.steps}",
        "eval.every=0",
        "run.tensorboard=false",
        *args.job,
    ]
    curve_overrides = []
    if args.curve:  # every checkpoint kept: the curve's points
        keep = args.steps // args.curve + 2
        curve_overrides = [f"run.checkpoint_every={args.curve}", f"run.keep_checkpoints={keep}"]

    from asyncfp8.models.run_model import run_model_dir

    rows = []
    for seed in args.seeds:
        cfg = compose([*job_overrides, f"run.seed={seed}"])
        samples_per_step = cfg.run.groups_per_step * cfg.run.group_size
        start_dir = str(run_model_dir(cfg))
        if seed == args.seeds[0]:
            start_model = heldout(cfg, start_dir, cfg.eval.prompts, cfg.eval.samples)
            print(f"start model: held-out greedy pass@1 {start_model['heldout_pass1_greedy']:.3f}")
        for system in systems:
            out = root / f"{re.sub(r'[^A-Za-z0-9.]+', '_', system)}_seed{seed}"
            print(f"{system}, seed {seed}: {args.steps} steps ...", flush=True)
            if system == TRL:
                job = trl_job(cfg, args.steps, seed, threads, save_every=args.curve)
                row = run_trl(python, job, out, args.skip)
            else:
                overrides = [
                    *job_overrides,
                    f"run.seed={seed}",
                    *PLACEMENTS[system],
                    *curve_overrides,
                    *args.overrides,
                ]
                row = run_asyncfp8(overrides, out, args.skip, samples_per_step)
            rows.append(score_run(row, cfg, system, seed, out, start_dir, args))
    summary = summarize_rows(rows, systems)
    print_table(summary)
    path = write_json(
        args.out,
        {
            "benchmark": "peers",
            "job": "the launcher's default job, eval.every=0",
            "asyncfp8_overrides": args.overrides,
            "job_overrides": args.job,
            "steps": args.steps,
            "skip": args.skip,
            "curve_every": args.curve,
            "seeds": args.seeds,
            "threads": threads,
            "trl_version": TRL_VERSION,
            "start_model": start_model,
            "systems": summary,
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 0


def score_run(row: dict, cfg, system: str, seed: int, out: Path, start_dir: str, args) -> dict:
    """A finished run's row with its held-out scores (and, `--curve`, the held-out curve
    of its saved points), printed as it comes."""
    row.update(heldout(cfg, row["model_dir"], cfg.eval.prompts, cfg.eval.samples))
    row.update(system=system, seed=seed)
    if args.curve:
        points = saved_points(out, trl=system == TRL)
        row["heldout_curve"] = heldout_curve(cfg, start_dir, points, cfg.eval.prompts)
        row["heldout_late_mean"] = late_mean(row["heldout_curve"], args.steps)
        print(
            "  held-out greedy by step: "
            + " ".join(f"{step}:{score:.2f}" for step, score in row["heldout_curve"]),
            flush=True,
        )
    print(
        f"  {row['trained_samples_per_s']:.1f} trained samples/s, wall {row['wall_s']:.0f} s, "
        f"reward {row['reward_start']:.3f} -> {row['reward_end']:.3f}, held-out greedy "
        f"{row['heldout_pass1_greedy']:.3f}",
        flush=True,
    )
    return row


def summarize_rows(rows: list[dict], systems: list[str]) -> list[dict]:
    """Per system: means over seeds, and the ratio of its speed to TRL's."""
    from asyncfp8.report.stats import mean_ci

    summary = []
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        entry = {"system": system, "seeds": len(mine)}
        for key in (
            "trained_samples_per_s",
            "wall_s",
            "reward_start",
            "reward_end",
            "heldout_pass1_greedy",
            "heldout_pass1_sampled",
        ):
            mean, half = mean_ci([r[key] for r in mine])
            entry[key] = mean
            entry[f"{key}_ci95"] = half
        if all(r.get("heldout_late_mean") is not None for r in mine):
            entry["heldout_late_mean"], entry["heldout_late_mean_ci95"] = mean_ci(
                [r["heldout_late_mean"] for r in mine]
            )
        entry["phase_s_median"] = {
            phase: statistics.fmean(r["phase_s_median"][phase] for r in mine)
            for phase in mine[0]["phase_s_median"]
            if all(r["phase_s_median"][phase] is not None for r in mine)
        }
        summary.append(entry)
    trl = next((s for s in summary if s["system"] == TRL), None)
    for entry in summary:
        entry["speed_vs_trl"] = (
            entry["trained_samples_per_s"] / trl["trained_samples_per_s"] if trl else None
        )
    return summary


def print_table(summary: list[dict]) -> None:
    print(
        f"\n{'system':<36} {'samples/s':>9} {'vs TRL':>7} {'wall s':>7} "
        f"{'reward first→last 20%':>22} "
        f"{'held-out greedy':>15} {'sampled':>7}  step s: generate / train / rest"
    )
    for s in summary:
        phases = s["phase_s_median"]
        train = phases.get("train", phases.get("train_and_rest"))
        rest = phases.get("rest")
        ratio = f"{s['speed_vs_trl']:.2f}x" if s["speed_vs_trl"] else "-"
        print(
            f"{s['system']:<36} {s['trained_samples_per_s']:>9.1f} {ratio:>7} {s['wall_s']:>7.0f} "
            f"{s['reward_start']:>10.3f} → {s['reward_end']:<9.3f} "
            f"{s['heldout_pass1_greedy']:>15.3f} "
            f"{s['heldout_pass1_sampled']:>7.3f}  {phases['step']:.3f}: {phases['generate']:.3f} / "
            f"{train:.3f} / {'-' if rest is None else f'{rest:.3f}'}"
        )
    if any("heldout_late_mean" in s for s in summary):
        print(
            "\nheld-out greedy pass@1, mean over the saved points of the second half of training:"
        )
        for s in summary:
            if "heldout_late_mean" in s:
                half = s["heldout_late_mean_ci95"]
                spread = "" if half is None else f" ± {half:.3f}"
                print(
                    f"{s['system']:<36} {s['heldout_late_mean']:.3f}{spread} ({s['seeds']} seeds)"
                )


if __name__ == "__main__":
    raise SystemExit(main())
