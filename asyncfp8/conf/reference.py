"""The configuration reference, made from the schemas: every key with its type, default
and help, never written by hand; a test checks docs/configuration.md is what this prints.

    python -m asyncfp8.conf.reference > docs/configuration.md"""

from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any

from asyncfp8.conf.schemas import ENGINE_SCHEMAS, SCHEMAS
from asyncfp8.correction.schema import CorrectionConfig
from asyncfp8.precision.schema import PrecisionConfig

INTRO = """# Configuration reference

Every setting, with its type, its default and what it does, made from the schemas
(`python -m asyncfp8.conf.reference > docs/configuration.md`; a test keeps this page equal
to what it prints). Set any of them on the command line of the launcher, the learner or a
worker, e.g. `python -m asyncfp8.launch run.steps=100 optim.lr=1e-4`.
Groups with several options are chosen by name (`precision=fp8`, `correction=token_mis`,
`engine=vllm`, `task=gsm8k_jsonl`, `model=tiny`): their options' own keys are in
[Choosing a precision](precision.md), [Corrections and the guard](correction.md) and
[Engines](engines.md).
"""

GROUPS = [
    ("run", SCHEMAS["run"]),
    ("optim", SCHEMAS["optim"]),
    ("sync", SCHEMAS["sync"]),
    ("eval", SCHEMAS["eval"]),
    ("guard", SCHEMAS["guard"]),
    ("correction", CorrectionConfig),
    ("precision", PrecisionConfig),
    *((f"engine={name}", schema) for name, schema in ENGINE_SCHEMAS.items()),
]


def _type_name(hint: Any) -> str:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " \\| ".join(member.value for member in hint)
    if hint is Any:
        return "any"
    args = typing.get_args(hint)
    if args:
        names = [_type_name(a) for a in args if a is not type(None)]
        origin = typing.get_origin(hint)
        if origin in (list, tuple):
            return f"list of {names[0]}"
        return " or ".join(names) + (" or null" if type(None) in args else "")
    return getattr(hint, "__name__", str(hint))


def _default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def rows(settings: Any, prefix: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) of every leaf of `settings`, a schema at its defaults."""
    hints = typing.get_type_hints(type(settings))
    out = []
    for f in dataclasses.fields(settings):
        if f.name.startswith("_"):
            continue
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            out += rows(value, f"{prefix}{f.name}.")
            continue
        text = f.metadata.get("help", "")
        out.append((prefix + f.name, _type_name(hints[f.name]), _default(value), text))
    return out


PLAN_INTRO = """## `python -m asyncfp8.plan`

The planner's own config (`asyncfp8/conf/plan.yaml`, where these defaults and their
comments live; [the planner](plan.md)).
"""


def plan_rows() -> list[tuple[str, str, str]]:
    """(key, default, help) of every setting of plan.yaml: the help is the comment on the
    key's line, or the block of comment lines right above it."""
    path = Path(__file__).parent / "plan.yaml"
    rows, stack, above = [], [], []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        body, _, comment = line.partition(" #")
        key, colon, value = body.strip().partition(":")
        if not colon or not key or key.startswith("-") or key in ("defaults", "hydra"):
            above = [] if not stripped else above
            if key in ("defaults", "hydra"):
                stack = [(len(line) - len(line.lstrip()), "skip")]
            continue
        depth = len(line) - len(line.lstrip())
        stack = [(d, k) for d, k in stack if d < depth]
        if any(k == "skip" for _, k in stack):
            above = []
            continue
        dotted = ".".join([k for _, k in stack] + [key])
        if value.strip():
            help_text = comment.strip() or " ".join(above)
            rows.append((dotted, value.strip(), help_text))
        else:
            stack.append((depth, key))
        above = []
    return rows


def reference() -> str:
    parts = [INTRO]
    for group, schema in GROUPS:
        doc = (schema.__doc__ or "").strip()
        prefix = group.split("=")[0] + "."
        parts.append(f"## `{group}`\n\n{' '.join(doc.split())}\n")
        parts.append("| key | type | default | what it does |\n|---|---|---|---|")
        for key, kind, default, text in rows(schema(), prefix):
            cells = [f"`{key}`", kind, f"`{default}`", text.replace("|", "\\|")]
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    parts.append(PLAN_INTRO)
    parts.append("| key | default | what it does |\n|---|---|---|")
    for key, default, text in plan_rows():
        parts.append(f"| `{key}` | `{default}` | {text.replace('|', chr(92) + '|')} |")
    parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
