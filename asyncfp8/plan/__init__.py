"""The planner: what FP8, INT8, an FP8 KV cache, asynchrony and delta weight sync buy for
a model, GPU and RL workload (`python -m asyncfp8.plan`; docs/plan.md, "Files", says what
each module holds). Nothing is imported here, so that `python -m asyncfp8.plan.calibration`
runs its module once."""
