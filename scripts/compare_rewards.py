"""How often math-verify's reward agrees with the hand parser's on GSM8K-style completions.

    .venv/bin/python scripts/compare_rewards.py [--out docs/results/reward-agreement.json]

For every record of the bundled GSM8K sample it builds completions deterministically (the
reference solution, the final answer in other formats, wrong answers, a truncated solution,
an empty one), scores each with `math_verify_reward` and `final_number_reward`, prints one
row per kind of completion and writes the counts and every disagreement as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

from asyncfp8.tasks.answers import NUMBER, parse_number
from asyncfp8.tasks.gsm8k import bundled_sample_path, final_number_reward, read_gsm8k_jsonl
from asyncfp8.tasks.verified import math_verify_reward

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "reward-agreement.json"


def plain(value) -> str:
    return format(value.normalize(), "f")


def body_without_marker(solution: str) -> str:
    return solution.rsplit("####", 1)[0].rstrip()


def last_other_number(solution: str, value) -> str | None:
    """The last number of the worked solution whose value is not the final answer: the
    answer a model gives when it stops one step early."""
    for text in reversed(NUMBER.findall(body_without_marker(solution))):
        if parse_number(text) != value:
            return text
    return None


def truncated(solution: str) -> str:
    """The solution without its last worked line and its "#### N" line."""
    lines = body_without_marker(solution).splitlines()
    return " " + "\n".join(lines[:-1])


# name -> (the reward it should earn: 1, 0, or None when either can be right; builder)
Variant = tuple[int | None, Callable[[list[dict], int], str | None]]


def variants() -> dict[str, Variant]:
    def value(records, i):
        return parse_number(records[i]["final"])

    return {
        "reference": (1, lambda r, i: " " + r[i]["answer"]),
        "reference+next_question": (
            1,
            lambda r, i: " " + r[i]["answer"] + "\n\nQ: " + r[(i + 1) % len(r)]["question"],
        ),
        "#### N": (1, lambda r, i: f" #### {plain(value(r, i))}"),
        "The answer is $N$.": (1, lambda r, i: f"The answer is ${plain(value(r, i))}$."),
        "\\boxed{N}": (1, lambda r, i: f"\\boxed{{{plain(value(r, i))}}}"),
        "N with separators": (1, lambda r, i: f"The answer is {value(r, i):,}"),
        "N without separators": (1, lambda r, i: f"The answer is {plain(value(r, i))}"),
        "N.00": (1, lambda r, i: f"The answer is {plain(value(r, i))}.00"),
        "$N": (1, lambda r, i: f"The answer is ${plain(value(r, i))}"),
        "N dollars": (1, lambda r, i: f"The answer is {plain(value(r, i))} dollars."),
        "wrong: N+1": (0, lambda r, i: f"The answer is {plain(value(r, i) + 1)}."),
        "wrong: one step early": (
            0,
            lambda r, i: (
                None
                if (early := last_other_number(r[i]["answer"], value(r, i))) is None
                else " " + body_without_marker(r[i]["answer"]) + f"\n#### {early}"
            ),
        ),
        "truncated solution": (None, lambda r, i: truncated(r[i]["answer"])),
        "empty": (0, lambda r, i: ""),
    }


def compare(records: list[dict]) -> dict:
    rows, disagreements = {}, []
    for name, (intended, build) in variants().items():
        row = {"intended": intended, "count": 0, "agree": 0, "both_1": 0, "both_0": 0}
        row.update({"mv_only": 0, "hand_only": 0, "skipped": 0})
        for index in range(len(records)):
            completion = build(records, index)
            if completion is None:
                row["skipped"] += 1
                continue
            answer = records[index]["final"]
            verified = math_verify_reward(completion, answer)
            hand = final_number_reward(completion, answer)
            row["count"] += 1
            if verified == hand:
                row["agree"] += 1
                row["both_1" if hand == 1.0 else "both_0"] += 1
            else:
                row["mv_only" if verified == 1.0 else "hand_only"] += 1
                disagreements.append(
                    {
                        "record": index,
                        "variant": name,
                        "answer": answer,
                        "completion_tail": completion[-120:],
                        "math_verify": verified,
                        "hand": hand,
                    }
                )
        rows[name] = row
    return {"variants": rows, "disagreements": disagreements}


def print_table(rows: dict) -> None:
    columns = ["count", "agree", "both_1", "both_0", "mv_only", "hand_only"]
    print(f"{'format':28}" + "".join(f"{c:>10}" for c in columns))
    for name, row in rows.items():
        print(f"{name:28}" + "".join(f"{row[c]:>10}" for c in columns))


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return f"{os.cpu_count()} cores, {line.split(':', 1)[1].strip()}"
    return f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    records = read_gsm8k_jsonl(bundled_sample_path())
    started = time.perf_counter()
    result = compare(records)
    seconds = time.perf_counter() - started
    print_table(result["variants"])
    scored = sum(row["count"] for row in result["variants"].values())
    print(f"{len(result['disagreements'])} disagreements; {scored} completions in {seconds:.1f} s")
    result = {
        "sample": "asyncfp8/tasks/data/gsm8k_sample.jsonl",
        "records": len(records),
        "seconds": round(seconds, 1),
        "machine": machine(),
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
