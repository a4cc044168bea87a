"""The planner: what FP8, INT8, an FP8 KV cache, asynchrony and delta weight sync buy for
a model, GPU and RL workload (`python -m asyncfp8.plan`, docs/plan.md).

    model.py        facts of a model from its config.json (dense, MoE, GQA)
    gpus.py         the GPU table (datasheets) and custom specs
    precisions.py   what each rollout precision stores and computes in
    costs.py        FLOPs and bytes of a decode step, per primitive
    step.py         the price of a step: roofline × efficiency + fixed costs; KV capacity
    calibration.py  efficiency factors fitted to measured points (bench/results)
    lengths.py      response-length distributions (lognormal, measured)
    rollout.py      one engine's rollout under continuous batching and a long tail
    rlstep.py       an RL step synchronous vs asynchronous, weight sync full vs delta
    planner.py      all of it for every precision, and the recommendation
    report.py       table, JSON, PNG
"""

from .errors import PlanInputError
from .planner import make_plan

__all__ = ["PlanInputError", "make_plan"]
