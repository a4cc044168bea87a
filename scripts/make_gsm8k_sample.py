"""Writes asyncfp8/tasks/data/gsm8k_sample.jsonl: 300 GSM8K-format word problems that
this project wrote itself (no dataset download), with GSM8K's `<<a*b=c>>` calculator
annotations and `#### N` final answers. Some answers carry thousands separators or
dollar cents, so the answer extractor is exercised on the forms real data has.

    python scripts/make_gsm8k_sample.py [--out PATH] [--n 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemi",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Pablo",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells"]


def fmt(value: float) -> str:
    """GSM8K writes whole numbers plainly and money with cents."""
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"


def buy_and_give(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, per_box, given = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 10)
    total = boxes * per_box
    q = (
        f"{name} buys {boxes} boxes of {item} with {per_box} {item} in each box. "
        f"{name} gives {given} {item} to a friend. How many {item} does {name} have left?"
    )
    a = (
        f"{name} buys {boxes}*{per_box}=<<{boxes}*{per_box}={total}>>{total} {item}.\n"
        f"After giving some away, {name} has "
        f"{total}-{given}=<<{total}-{given}={total - given}>>{total - given} {item}.\n"
        f"#### {total - given}"
    )
    return q, a


def hourly_wage(rng):
    name = rng.choice(NAMES)
    rate, hours, days = rng.randint(9, 40), rng.randint(2, 8), rng.randint(3, 6)
    daily, total = rate * hours, rate * hours * days
    q = (
        f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. "
        f"How much does {name} earn?"
    )
    a = (
        f"Each day {name} earns {rate}*{hours}=$<<{rate}*{hours}={daily}>>{daily}.\n"
        f"Over {days} days that is {daily}*{days}=$<<{daily}*{days}={total}>>{total}.\n#### {total}"
    )
    return q, a


def big_population(rng):
    town = rng.choice(["Millbrook", "Eastport", "Cedar Falls", "Rivertown"])
    start, growth, years = rng.randint(12, 95) * 1000, rng.randint(150, 900), rng.randint(2, 9)
    added, final = growth * years, start + growth * years
    q = (
        f"{town} has {start:,} residents. Its population grows by {growth} people every year. "
        f"How many residents will it have after {years} years?"
    )
    a = (
        f"The town gains {growth}*{years}=<<{growth}*{years}={added}>>{added} people.\n"
        f"So it will have {start}+{added}=<<{start}+{added}={final}>>{final} residents.\n"
        f"#### {final:,}"
    )
    return q, a


def money_change(rng):
    name = rng.choice(NAMES)
    price, count, paid = rng.randint(105, 995) / 100, rng.randint(2, 6), rng.choice([20, 50, 100])
    cost = round(price * count, 2)
    if cost >= paid:
        paid = 100
    change = round(paid - cost, 2)
    q = (
        f"{name} buys {count} notebooks at ${fmt(price)} each and pays with a ${paid} bill. "
        f"How much change does {name} get?"
    )
    a = (
        f"The notebooks cost "
        f"{count}*{fmt(price)}=$<<{count}*{fmt(price)}={fmt(cost)}>>{fmt(cost)}.\n"
        f"The change is "
        f"{paid}-{fmt(cost)}=$<<{paid}-{fmt(cost)}={fmt(change)}>>{fmt(change)}.\n"
        f"#### {fmt(change)}"
    )
    return q, a


def share_equally(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 8), rng.randint(2, 15)
    total, kept = friends * each, rng.randint(0, 9)
    q = (
        f"{name} had some {item}, kept {kept} and shared the rest equally among {friends} friends. "
        f"Each friend got {each} {item}. How many {item} did {name} have at first?"
    )
    a = (
        f"The friends got {friends}*{each}=<<{friends}*{each}={total}>>{total} {item}.\n"
        f"With the ones kept, {name} had "
        f"{total}+{kept}=<<{total}+{kept}={total + kept}>>{total + kept}.\n"
        f"#### {total + kept}"
    )
    return q, a


def temperature_drop(rng):
    start, drop, hours = rng.randint(-5, 12), rng.randint(2, 5), rng.randint(3, 8)
    fallen, final = drop * hours, start - drop * hours
    q = (
        f"At midnight the temperature was {start} degrees. It fell {drop} degrees every hour for "
        f"{hours} hours. What was the temperature then?"
    )
    a = (
        f"It fell {drop}*{hours}=<<{drop}*{hours}={fallen}>>{fallen} degrees.\n"
        f"So it was {start}-{fallen}=<<{start}-{fallen}={final}>>{final} degrees.\n#### {final}"
    )
    return q, a


def percent_discount(rng):
    name = rng.choice(NAMES)
    price, percent = rng.randint(4, 60) * 5, rng.choice([10, 20, 25, 50])
    off = price * percent // 100
    q = f"A jacket costs ${price}. {name} gets a {percent}% discount. How much does {name} pay?"
    a = (
        f"The discount is {price}*{percent}/100=$<<{price}*{percent}/100={off}>>{off}.\n"
        f"{name} pays {price}-{off}=$<<{price}-{off}={price - off}>>{price - off}.\n"
        f"#### {price - off}"
    )
    return q, a


def legs_on_farm(rng):
    chickens, cows = rng.randint(3, 40), rng.randint(2, 25)
    q = (
        f"A farm has {chickens} chickens and {cows} cows. "
        "How many legs do the animals have in total?"
    )
    chicken_legs, cow_legs = chickens * 2, cows * 4
    a = (
        f"The chickens have {chickens}*2=<<{chickens}*2={chicken_legs}>>{chicken_legs} legs.\n"
        f"The cows have {cows}*4=<<{cows}*4={cow_legs}>>{cow_legs} legs.\n"
        f"In total "
        f"{chicken_legs}+{cow_legs}=<<{chicken_legs}+{cow_legs}={chicken_legs + cow_legs}>>"
        f"{chicken_legs + cow_legs} legs.\n#### {chicken_legs + cow_legs}"
    )
    return q, a


TEMPLATES = [
    buy_and_give,
    hourly_wage,
    big_population,
    money_change,
    share_equally,
    temperature_drop,
    percent_discount,
    legs_on_farm,
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="asyncfp8/tasks/data/gsm8k_sample.jsonl")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for i in range(args.n):
            question, answer = TEMPLATES[i % len(TEMPLATES)](rng)
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    print(f"wrote {args.n} problems to {out}")


if __name__ == "__main__":
    main()
