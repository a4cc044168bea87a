"""python -m asyncfp8.plan model.path=<HF dir | config.json | bundled name> gpu=h100 [...]

Prints a table per precision and a recommendation, writes a PNG (`plan.plot`) and, with
`plan.out=FILE.json`, the same as JSON. Bad input (a config without the needed fields,
an unknown GPU, a workload that cannot fit) ends with a message and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from asyncfp8 import exit_on_version_flag

from .errors import PlanInputError
from .planner import make_plan
from .report import plot, table, write_json


def plot_path(out: str | None, requested: str | None) -> Path | None:
    if requested is None:
        return None
    if requested != "auto":
        return Path(requested)
    return Path(out).with_suffix(".png") if out else Path("plan.png")


@hydra.main(version_base="1.3", config_path="../conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    try:
        plan = make_plan(OmegaConf.to_container(cfg, resolve=True))
    except PlanInputError as err:
        print(f"asyncfp8.plan: {err}", file=sys.stderr)
        sys.exit(2)
    print(table(plan))
    if cfg.plan.out:
        print(f"wrote {write_json(plan, cfg.plan.out)}")
    image = plot_path(cfg.plan.out, cfg.plan.plot)
    if image is not None:
        print(f"wrote {plot(plan, image)}")


if __name__ == "__main__":
    exit_on_version_flag()
    main()
