"""run.compute_dtype=float16 (issue 46, item 1): the learner computes in FP16 on FP32
masters with a dynamically scaled loss (asyncfp8/train/loss_scale.py). An update whose
gradients overflow is skipped and counted, the scale halved; one that keeps overflowing
stops the run naming the setting and the first parameter whose gradient was not finite;
bad settings are refused at start, naming the key."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from asyncfp8.correction import build_correction
from asyncfp8.learner import Learner
from asyncfp8.models import load_model, load_tokenizer
from asyncfp8.run import distributed
from asyncfp8.train.logprobs import install_logprob_head
from asyncfp8.train.loss_scale import LossScaleOverflow, LossScaler, LossScaleSettings
from asyncfp8.train.step import TrainStep, lr_lambda, plan_shares
from tests.recorded import assert_same_updates, learner_config, train

WEIGHT = "model.layers.1.mlp.down_proj.weight"


def plain_step(model_dir: Path, settings: LossScaleSettings, *overrides: str):
    """A TrainStep over a plain FP32 model with a loss scaler (what decides a skip does
    not depend on the dtype that overflowed)."""
    cfg = learner_config(model_dir, Path("unused"), "optim.mini_batches=2", *overrides)
    model = load_model(model_dir, dtype=torch.float32)
    install_logprob_head(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.run.steps))
    step = TrainStep(
        model,
        optimizer,
        scheduler,
        build_correction(cfg.correction),
        cfg.optim,
        cfg.correction.mode,
        cfg.run.temperature,
        load_tokenizer(model_dir).pad_token_id,
        torch.device("cpu"),
        loss_scaler=LossScaler(settings),
    )
    return step, cfg.optim


def test_an_update_with_an_inf_gradient_is_skipped_counted_and_the_scale_halved(
    tiny_model_dir, recorded, caplog
):
    step, optim = plain_step(tiny_model_dir, LossScaleSettings(init=1024.0, growth_interval=3))
    weight = dict(step.model.named_parameters())[WEIGHT]
    # The first of the step's two updates gets an infinite gradient in one layer.
    calls = []

    def poison(grad):
        calls.append(1)
        return torch.full_like(grad, math.inf) if len(calls) == 1 else grad

    handle = weight.register_hook(poison)
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    share = plan_shares(recorded[0], optim, world=1)[0]
    assert len(share.mini_batches[0]) == 1  # one micro-batch per update: one hook call each
    with caplog.at_level(logging.WARNING, logger="asyncfp8.learner"):
        sums = step(share, 0, version=0)
    handle.remove()
    assert sums.totals.updates == 1 and sums.totals.loss_scale_skipped == 1
    assert sums.loss_scale == {
        "loss_scale/scale": 512.0,
        "loss_scale/skipped": 1,
        "loss_scale/skipped_total": 1,
    }
    assert f"non-finite in {WEIGHT} first" in caplog.text and "scale now 512" in caplog.text
    # The skipped update left the weights alone; the second stepped them.
    moved = [n for n, p in step.model.named_parameters() if not torch.equal(p, before[n])]
    assert moved and all(torch.isfinite(p).all() for p in step.model.parameters())
    # Updates without an overflow: after growth_interval (3) of them the scale doubles.
    assert step(plan_shares(recorded[1], optim, world=1)[0], 1, 0).loss_scale == {
        "loss_scale/scale": 1024.0,
        "loss_scale/skipped": 0,
        "loss_scale/skipped_total": 1,
    }


def test_a_scale_that_keeps_overflowing_stops_naming_the_setting_and_the_layer(
    tiny_model_dir, recorded
):
    step, optim = plain_step(tiny_model_dir, LossScaleSettings(init=1024.0, max_skipped=3))
    weight = dict(step.model.named_parameters())[WEIGHT]
    weight.register_hook(lambda grad: torch.full_like(grad, math.nan))
    step(plan_shares(recorded[0], optim, world=1)[0], 0, version=0)  # 2 skipped: goes on
    assert step.loss_scaler.skipped_in_row == 2
    with pytest.raises(
        LossScaleOverflow,
        match=(
            r"step 1: FP16 gradients overflowed in 3 updates in a row "
            r"\(optim\.loss_scale\.max_skipped=3\), the last at loss scale 256; non-finite "
            rf"gradients in {WEIGHT} first \(of 1 parameters\).*run\.compute_dtype=bfloat16"
        ),
    ):
        step(plan_shares(recorded[1], optim, world=1)[0], 1, version=0)


def test_a_resumed_fp16_learner_goes_on_at_the_loss_scale_it_had_reached(
    make_learner, tiny_model_dir
):
    learner = make_learner("run.compute_dtype=float16")
    scaler = learner.train_step.loss_scaler
    scaler.scale, scaler.good_in_row, scaler.skipped_total = 128.0, 7, 5  # as after overflows
    learner.checkpoint()
    resumed = Learner(
        learner_config(tiny_model_dir, learner.dir, "run.compute_dtype=float16", "run.resume=true")
    )
    try:
        assert resumed.train_step.loss_scaler.state_dict() == scaler.state_dict()
    finally:
        resumed.close()


def gradients(learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in learner.model.named_parameters()}


def test_an_fp16_learner_gets_the_fp32_learners_gradients_within_fp16_rounding(
    make_learner, recorded
):
    """The same batch through learners computing in FP32, FP16 and BF16 (lr 0: the step's
    gradients stay in .grad, unscaled, in the FP32 masters' dtype). FP16's, from a loss
    scaled by 1024 with no overflow, are within FP16 rounding of FP32's, and nearer than
    BF16's (3 fewer mantissa bits)."""
    settings = ("optim.lr=0", "optim.grad_clip=1e9", "optim.loss_scale.init=1024")
    learners = {
        dtype: make_learner(*settings, f"run.compute_dtype={dtype}")
        for dtype in ("float32", "float16", "bfloat16")
    }
    assert learners["float16"].dtype == torch.float16
    assert learners["bfloat16"].train_step.loss_scaler is None  # BF16 has FP32's range
    metrics = {dtype: train(learner, recorded[0]) for dtype, learner in learners.items()}
    assert metrics["float16"]["loss_scale/skipped"] == 0
    assert metrics["float16"]["loss_scale/scale"] == 1024.0
    assert "loss_scale/scale" not in metrics["float32"]
    exact = gradients(learners["float32"])
    error = {}
    for dtype in ("float16", "bfloat16"):
        got = gradients(learners[dtype])
        assert all(g.dtype == torch.float32 for g in got.values())  # the masters stay FP32
        error[dtype] = {n: ((got[n] - g).norm() / g.norm()).item() for n, g in exact.items()}
    print({dtype: max(e.values()) for dtype, e in error.items()})
    assert max(error["float16"].values()) < 0.02
    assert sum(error["float16"].values()) * 2 < sum(error["bfloat16"].values())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.loss_scale.init=0", r"optim\.loss_scale\.init must be a number > 0, got 0"),
        ("optim.loss_scale.growth_interval=0", r"optim\.loss_scale\.growth_interval must be"),
        ("optim.loss_scale.max_skipped=-1", r"optim\.loss_scale\.max_skipped must be an integer"),
    ],
)
def test_bad_loss_scale_settings_are_refused_at_start_naming_the_key(
    tmp_path, tiny_model_dir, override, message
):
    with pytest.raises(ValueError, match=message):
        Learner(learner_config(tiny_model_dir, tmp_path, "run.compute_dtype=float16", override))
    distributed.close()
    with pytest.raises(ValueError, match=r"optim\.loss_scale has no inital"):
        LossScaleSettings.from_config({"inital": 3})
    assert LossScaleSettings.from_config(None) == LossScaleSettings()  # a run saved before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_learner_in_float16_trains_like_the_cpu_one(make_learner, recorded):
    """FSDP2's MixedPrecisionPolicy(param_dtype=float16) on a GPU: masters FP32, the loss
    scaled, the first step within FP16 rounding of the FP32 CPU learner's."""
    settings = ("optim.lr=1e-3", "optim.mini_batches=2", "optim.loss_scale.init=1024")
    gpu = make_learner(*settings, "run.device=cuda", "run.compute_dtype=float16")
    cpu = make_learner(*settings)
    assert gpu.ranks.device.type == "cuda" and gpu.dtype == torch.float16
    on_cpu, on_gpu = train(cpu, recorded[0]), train(gpu, recorded[0])
    assert on_gpu["loss_scale/skipped"] == 0
    assert on_gpu["optim/grad_norm"] == pytest.approx(on_cpu["optim/grad_norm"], rel=0.02)
    assert_same_updates(gpu, cpu, lr=1e-3, steps=2)
