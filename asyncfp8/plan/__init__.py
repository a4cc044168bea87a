"""The planner: what FP8, INT8, an FP8 KV cache, asynchrony and delta weight sync buy for
a model, GPU and RL workload (`python -m asyncfp8.plan`, docs/plan.md).

    model.py        facts of a model from its config.json (dense, MoE, GQA)
    gpus.py         the GPU table (datasheets) and custom specs
    precisions.py   what each rollout precision stores and computes in
    costs.py        FLOPs and bytes of a decode step, per primitive
    step.py         the price of a step: roofline x efficiency + fixed costs; KV capacity
    calibration.py  efficiency factors fitted to measured points (bench/results); CLI
    lengths.py      response-length distributions (lognormal, measured)
    rollout.py      one engine's rollout under continuous batching and a long tail
    rlstep.py       an RL step synchronous vs asynchronous, weight sync full vs delta
    planner.py      all of it for every precision, and the recommendation (make_plan)
    report.py       table, JSON, PNG
    __main__.py     the Hydra CLI (asyncfp8/conf/plan.yaml)

Nothing is imported here, so that `python -m asyncfp8.plan.calibration` runs its module
once.
"""
