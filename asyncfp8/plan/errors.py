"""The one error the planner raises for bad input: the CLI prints its message and exits
non-zero without a traceback (anything else is a bug and keeps its traceback)."""

from __future__ import annotations


class PlanInputError(ValueError):
    """A model config, GPU spec, workload or calibration the planner cannot use."""
