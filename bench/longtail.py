"""A long-tailed rollout batch through the torch engine: static batches against slots.

    python bench/longtail.py [--model small] [--batch 64] [--slots 16] [--out ...]
    python bench/longtail.py --device cuda --model qwen2.5-1.5b-shaped --batch 256 \
        --slots 64 --threshold 16       # on a GPU: `bash bench/gpu.sh longtail`

The workload is one rollout batch of `--batch` sequences, most of them short (budgets
drawn uniformly in [`--short-min`, `--short-max`] tokens) and every `--long-every`-th
one `--long-factor` times the mean short budget (exactly its budget: ignore_eos, one
max length per request), in request order. Each mode generates the whole batch through
`TorchEngine.generate_requests` and is timed (median of `--repeats` after one warm-up;
the modes take turns, repeat by repeat, so that load on a shared machine falls on all
of them alike):

- `static`: today's static path: the requests in batches of up to `--max-batch` (the
  engine's `max_batch`, 64; one batch when the rollout batch is no larger), every
  sequence of a batch started at once and the batch run until its longest sequence ends
  (rows that have finished still ride along in every decode step).
- `continuous`: `--slots` slots, each refilled with the next request as soon as its
  sequence ends.
- `static_batches`: the same KV-cache rows as `continuous` used the static way: the
  requests in consecutive batches of `--slots`, each running until its longest ends
  (the engine's `max_batch` batching, at equal memory).
- `speculative`: `continuous` + speculative decoding at every step, `--draft-tokens`
  drafted by the online drafter and verified in one target forward.
- `adaptive`: `continuous` + TLT's adaptive speculation: on once the active batch has
  been at or below `--threshold` for `--patience` steps, the draft length per batch-size
  bucket chosen among `--ks` by the bandit.

The drafter is trained first, as a worker trains it: `--train-rounds` generations of
the workload (another seed), `--train-steps` optimizer steps after each; the timed runs
then keep it frozen. Without speculation the modes use the same slot loop and
per-request sampling, so the tokens are the same and only the scheduling differs (with
it, each request still has its own streams, and its tokens follow the same
distribution). Reported per mode: `seconds` (the batch, prefill included),
`tokens_per_s`, `target_forwards_per_token` (per sequence: its prefill and the forwards
that produced its tokens; 1.0 without speculation), `mean_accepted_length` (tokens per
verify forward per sequence), and what the static shapes computed: `decode_steps`,
`prefills`, `row_steps_per_token` (slots × steps / tokens: 1.0 would waste no row).
Table on stdout, JSON to `--out`, written again after every round of repeats (the rows
of the repeats done so far: `repeats_done`). A mode that fails (its engine, its warm-up,
a timed run, or the drafter's training for the speculative modes) becomes a row with an
`error`; the others go on. `--dry-run`: the `qwen2.5-1.5b-shaped` code on the CPU with
a toy model of that architecture and a toy workload (bench/gpu.sh --dry-run).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table, failure, machine

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.slot_loop import SlotStats
from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.models import resolve_model_dir
from asyncfp8.tasks import ArithmeticTask

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def workload(args) -> list[int]:
    """Per-request budgets: short ones, and every long_every-th one long_factor × the
    mean short budget."""
    rng = random.Random(args.seed)
    mean_short = (args.short_min + args.short_max) / 2
    return [
        round(args.long_factor * mean_short)
        if (i + 1) % args.long_every == 0
        else rng.randint(args.short_min, args.short_max)
        for i in range(args.batch)
    ]


def generate(engine: TorchEngine, prompts, budgets, sampling, chunk: int | None):
    """All requests at once through the slots, or (chunk) in consecutive batches, each
    finished before the next starts; request i keeps stream i either way."""
    if chunk is None:
        return engine.generate_requests(prompts, budgets, sampling), engine.last_stats
    samples, total = [], SlotStats()
    for start in range(0, len(prompts), chunk):
        span = range(start, min(start + chunk, len(prompts)))
        part = engine.generate_requests(
            [prompts[i] for i in span], [budgets[i] for i in span], sampling, indices=span
        )
        samples += part
        for key in ("steps", "prefills", "row_steps", "useful_forwards", "tokens"):
            setattr(total, key, getattr(total, key) + getattr(engine.last_stats, key))
    return samples, total


def timed_run(engine: TorchEngine, prompts, budgets, sampling, chunk=None) -> tuple:
    """One timed generation of the batch: (seconds, tokens per request, stats)."""
    speculation = engine.speculation
    if speculation is not None:  # acceptance of the timed runs only
        speculation.verify_rows = speculation.accepted = speculation.drafted = 0
        speculation.steps = speculation.speculative_steps = 0
    start = time.perf_counter()
    samples, stats = generate(engine, prompts, budgets, sampling, chunk)
    return time.perf_counter() - start, [s.token_ids for s in samples], stats


def summarize(engine: TorchEngine, runs: list[tuple], budgets) -> dict:
    """A mode's row from its timed runs (the median time; the counts of the last run)."""
    times = [seconds for seconds, _, _ in runs]
    _, tokens, stats = runs[-1]
    total = sum(len(t) for t in tokens)
    assert total == sum(budgets) == stats.tokens  # ignore_eos: every budget generated
    seconds = statistics.median(times)
    extra = {}
    speculation = engine.speculation
    if speculation is not None:
        metrics = speculation.metrics()
        extra = {
            "mean_accepted_length": speculation.mean_accepted_length,
            "acceptance_rate": metrics["spec/total/acceptance_rate"],
            "fraction_steps_speculating": metrics["spec/fraction_steps_speculating"],
            "controller": {
                k: v for k, v in metrics.items() if k.startswith("spec/") and "batch" in k
            },
        }
    return {
        **extra,
        "slots": engine.slots,
        "seconds": seconds,
        "tokens": total,
        "tokens_per_s": total / seconds,
        "target_forwards_per_token": stats.useful_forwards / total,
        "decode_steps": stats.steps,
        "prefills": stats.prefills,
        "row_steps_per_token": stats.row_steps / total,
        "times": times,
        "_tokens": tokens,
    }


#: A random-init Qwen2 of Qwen2.5-1.5B's shape (bench/rollout.py), built once and shared
#: by every mode's engine (bf16: nothing quantizes it in place).
SHAPED = "qwen2.5-1.5b-shaped"


def engine_factory(args):
    """`build(slots, speculative)`: a TorchEngine of `--model` on `--device` (`--dry-run`:
    the shaped model's architecture at a toy size)."""
    if args.model != SHAPED:
        model_dir = str(resolve_model_dir(None, args.model, 0))
        return lambda slots, speculative: TorchEngine(
            model_dir,
            args.precision,
            dtype=DTYPES[args.dtype],
            device=args.device,
            slots=slots,
            speculative=speculative,
        )
    from rollout import TOY, random_qwen

    model, tokenizer = random_qwen(torch.device(args.device), TOY if args.dry_run else None)
    return lambda slots, speculative: TorchEngine(
        None,
        args.precision,
        device=args.device,
        slots=slots,
        speculative=speculative,
        model=model,
        tokenizer=tokenizer,
    )


def train_drafter(args, build, task, budgets) -> tuple[dict, dict]:
    """The drafter's trainer state after `--train-rounds` generations of the workload's
    shape on other prompts and another seed, `--train-steps` optimizer steps after each
    (what a worker does between generations), and its last losses."""
    engine = build(
        args.slots,
        # Every step, however long: the timed runs measure a drafter trained this much
        # (a worker's train_time_fraction only changes how soon it gets there).
        {
            "mode": "fixed",
            "train_steps": args.train_steps,
            "train_time_fraction": None,
        },
    )
    sampling = SamplingParams(temperature=1.0, seed=args.seed + 1000, ignore_eos=True)
    for round_ in range(args.train_rounds):
        offset = (round_ + 1) * args.batch
        prompts = [
            engine.tokenizer(task.prompt(offset + i).text)["input_ids"] for i in range(args.batch)
        ]
        engine.generate_requests(prompts, budgets, sampling)
    state = engine.drafter_state()["trainer"]
    training = {k: v for k, v in engine.speculation_metrics().items() if k.startswith("drafter/")}
    training["spec/mean_accepted_length_last_round"] = engine.speculation.mean_accepted_length
    engine.close()
    return state, training


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=["tiny", "small", SHAPED])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=sorted(DTYPES),
        help="the engine's model dtype (float32: rows round alike whatever the batch, so "
        "every mode samples the same tokens; bfloat16 rounds batch-dependently)",
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16, help="continuous mode's slots")
    parser.add_argument(
        "--max-batch", type=int, default=64, help="static mode's batches (engine.max_batch)"
    )
    parser.add_argument("--short-min", type=int, default=8)
    parser.add_argument("--short-max", type=int, default=24)
    parser.add_argument("--long-every", type=int, default=8)
    parser.add_argument("--long-factor", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=3, help="speculative mode's k")
    parser.add_argument("--threshold", type=int, default=8, help="adaptive: batch threshold")
    parser.add_argument("--patience", type=int, default=4, help="adaptive: steps at or below")
    parser.add_argument("--ks", default="0,1,2,3,4", help="adaptive: draft lengths to choose from")
    parser.add_argument("--train-rounds", type=int, default=4, help="drafter training generations")
    parser.add_argument("--train-steps", type=int, default=100, help="drafter steps per round")
    parser.add_argument(
        "--modes",
        default="static,continuous,static_batches,speculative,adaptive",
        help="comma-separated modes to run",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"--model {SHAPED} at a toy size and a toy workload on the CPU "
        "(bench/gpu.sh --dry-run)",
    )
    parser.add_argument("--out", default="bench/results/longtail-cpu.json")
    args = parser.parse_args(argv)
    if args.dry_run:
        toy = dict(batch=8, slots=4, short_min=2, short_max=4, long_every=4, long_factor=4.0)
        toy |= dict(repeats=1, train_rounds=1, train_steps=5, threshold=2, patience=1)
        vars(args).update(toy, model=SHAPED, device="cpu", precision="bf16")
    if not 1 <= args.slots <= args.batch:
        parser.error(f"--slots must be in 1..--batch ({args.batch}), got {args.slots}")
    if args.max_batch < 1:
        parser.error(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.model == SHAPED and args.precision != "bf16":
        parser.error(f"--model {SHAPED} shares one model across the modes: --precision bf16")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    if args.threads:
        torch.set_num_threads(args.threads)
    build = engine_factory(args)
    task = ArithmeticTask(seed=args.seed)
    budgets = workload(args)
    sampling = SamplingParams(temperature=1.0, seed=args.seed, ignore_eos=True)
    fixed = {"mode": "fixed", "draft_tokens": args.draft_tokens, "train_steps": 0}
    adaptive = {
        "mode": "adaptive",
        "threshold": args.threshold,
        "patience": args.patience,
        "ks": [int(k) for k in args.ks.split(",")],
        "train_steps": 0,
    }
    modes = {
        "static": (min(args.batch, args.max_batch), min(args.batch, args.max_batch), None),
        "continuous": (args.slots, None, None),
        "static_batches": (args.slots, args.slots, None),
        "speculative": (args.slots, None, fixed),
        "adaptive": (args.slots, None, adaptive),
    }
    wanted = args.modes.split(",")
    if unknown := set(wanted) - set(modes):
        parser.error(f"unknown --modes {sorted(unknown)}; choose from {list(modes)}")
    info = machine()
    table = Table(
        args.out,
        description=(
            "one long-tailed rollout batch through the torch engine's slot loop: "
            "static (slots = batch) against continuous (fewer slots, refilled), "
            "with speculation (fixed k) and adaptive speculation"
        ),
        model=args.model,
        precision=args.precision,
        dtype=args.dtype,
        device=args.device,
        batch=args.batch,
        budgets=budgets,
        same_tokens_in_every_mode=None,
        settings={k: v for k, v in vars(args).items() if k != "out"},
        torch_threads=info["torch_threads"],
        # The machine may be shared: timings are read with its load.
        load_average_1_5_15={"before": os.getloadavg(), "after": None},
    )
    errors: dict[str, str] = {}  # mode -> why it has no (further) timings
    drafter = None
    if {"speculative", "adaptive"} & set(wanted):
        try:
            drafter, training = train_drafter(args, build, task, budgets)
            print(f"drafter trained: {training}")
        except Exception as err:
            why = f"drafter training: {failure(err)}"
            errors |= {mode: why for mode in ("speculative", "adaptive") if mode in wanted}
    engines = {}
    for mode in wanted:
        if mode in errors:
            continue
        slots, chunk, speculative = modes[mode]
        try:
            engine = build(slots, speculative)
            if speculative is not None:
                engine.load_drafter_state({"trainer": drafter})
            prompts = [
                engine.tokenizer(task.prompt(i).text)["input_ids"] for i in range(args.batch)
            ]
            generate(engine, prompts, budgets, sampling, chunk)  # warm-up: caches allocated
            engines[mode] = (engine, prompts, chunk)
        except Exception as err:
            errors[mode] = failure(err)
    # Round robin: repeat r of every mode runs before repeat r + 1 of any, so a load that
    # comes and goes on a shared machine falls on every mode alike.
    runs = {mode: [] for mode in wanted}
    for _ in range(args.repeats):
        for mode, (engine, prompts, chunk) in engines.items():
            if mode in errors:
                continue
            try:
                runs[mode].append(timed_run(engine, prompts, budgets, sampling, chunk))
            except Exception as err:
                errors[mode] = failure(err)
        save_rows(table, wanted, engines, runs, errors, budgets)
    if not args.repeats:
        save_rows(table, wanted, engines, runs, errors, budgets)
    for engine, _, _ in engines.values():
        engine.close()
    table.payload["load_average_1_5_15"]["after"] = os.getloadavg()
    table.save()
    print_table(args, table, budgets)
    print(f"wrote {table.path}")
    return 1 if errors else 0


def save_rows(table: Table, wanted, engines, runs, errors, budgets) -> None:
    """The table's rows from the timed runs so far (a mode that failed: its error), and
    whether the modes without speculation sampled the same tokens (the same requests,
    the same per-request streams: they must)."""
    rows, tokens = [], {}
    for mode in wanted:
        row = {"mode": mode}
        if runs[mode]:  # a mode that failed later keeps the repeats it finished
            try:
                row |= summarize(engines[mode][0], runs[mode], budgets)
                tokens[mode] = row.pop("_tokens")
                row["repeats_done"] = len(runs[mode])
            except Exception as err:  # a count that does not add up: this mode's error
                errors[mode] = failure(err)
                row = {"mode": mode}
        if mode in errors:
            row["error"] = errors[mode]
        rows.append(row)
    plain = [tokens[mode] for mode in tokens if mode not in ("speculative", "adaptive")]
    table.rows[:] = rows
    table.update(same_tokens_in_every_mode=all(t == plain[0] for t in plain) if plain else None)


def print_table(args, table: Table, budgets) -> None:
    rows = [r for r in table.rows if "seconds" in r]
    print(
        f"{args.model} model, {args.precision} ({args.dtype}), batch {args.batch}: budgets "
        f"{args.short_min}-{args.short_max} tokens, every {args.long_every}th "
        f"{round(args.long_factor * (args.short_min + args.short_max) / 2)}; "
        f"{sum(budgets)} tokens; same tokens in every mode: "
        f"{table.payload['same_tokens_in_every_mode']}"
    )
    print(
        f"{'mode':<14} {'slots':>5} {'seconds':>8} {'tokens/s':>9} {'vs static':>9} "
        f"{'fwd/token':>9} {'accepted':>8} {'steps':>6} {'prefills':>8} {'row-steps/token':>15}"
    )
    base = rows[0]["seconds"] if rows else None
    for r in table.rows:
        if "seconds" not in r:
            print(f"{r['mode']:<14} failed: {r.get('error')}")
            continue
        accepted = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
        print(
            f"{r['mode']:<14} {r['slots']:>5} {r['seconds']:>8.3f} {r['tokens_per_s']:>9.0f} "
            f"{r['seconds'] / base:>8.2f}x {r['target_forwards_per_token']:>9.3f} "
            f"{accepted:>8} {r['decode_steps']:>6} {r['prefills']:>8} "
            f"{r['row_steps_per_token']:>15.2f}"
        )
        if "error" in r:
            print(f"{'':<14} then failed: {r['error']}")


if __name__ == "__main__":
    sys.exit(main())
