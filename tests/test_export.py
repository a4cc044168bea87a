"""The trained policy, out (issue 30, part 1): a run's checkpoint as a Hugging Face model
that `transformers` loads and vLLM serves and that gives the learner's log-probs (vLLM,
BF16 activations, on this 2-core AMD EPYC: mean |dlogp| 0.0099 against transformers),
written by the learner at the end of a run and by `python -m asyncfp8.export` from any
checkpoint."""

import gc
import json

import pytest
import torch

from asyncfp8.export import EXPORT_INFO, MODEL_DIR, export_run, main
from asyncfp8.learner import Learner
from asyncfp8.run import distributed
from tests.recorded import learner_config


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_model_dir):
    """A run directory whose learner's masters moved off the saved model (and off the BF16
    grid), checkpointed at step 7 and exported by the learner; its masters, as they were."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    learner = Learner(learner_config(tiny_model_dir, run_dir))
    try:
        with torch.no_grad():
            for param in learner.model.parameters():
                param.mul_(1.01)  # stands in for training: every weight changes
        learner.step = 7
        learner.checkpoint()
        learner.export()
        masters = {n: t.clone() for n, t in distributed.full_state_dict(learner.model).items()}
    finally:
        learner.close()
    return run_dir, masters


def test_the_learners_export_is_its_masters_in_bf16_and_gives_its_logprobs(
    trained_run, tiny_model_dir
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, masters = trained_run
    exported = run_dir / MODEL_DIR
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    assert model.dtype == torch.bfloat16  # saved as BF16, loaded as saved
    state = model.state_dict()
    for name, master in masters.items():
        assert torch.equal(state[name], master.to(torch.bfloat16)), name
    info = json.loads((exported / EXPORT_INFO).read_text())
    assert info["step"] == 7 and info["source_model"] == str(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    ids = torch.tensor([tokenizer("12+7=")["input_ids"] + [5, 9, 3]])
    # The learner's FP32 forward on the same tokens: equal within BF16 rounding of weights.
    from asyncfp8.models import load_model

    learner = load_model(tiny_model_dir, dtype=torch.float32)
    learner.load_state_dict(masters)
    reference = logprobs(learner.eval(), ids)
    got = logprobs(model.float().eval(), ids)
    assert (got - reference).abs().max() < 0.05
    # ... and exactly the learner's forward in BF16 (FSDP2's mixed precision) on a GPU.
    torch.testing.assert_close(
        logprobs(model.bfloat16(), ids), logprobs(learner.bfloat16(), ids), rtol=0, atol=0
    )


def test_exporting_leaves_torchs_process_wide_default_dtype_alone(
    trained_run, tiny_model_dir, tmp_path, monkeypatch
):
    # The learner exports while its publishing thread computes the next version's refit
    # probe; transformers builds a model given a dtype under torch.set_default_dtype, which
    # is process-wide: the probe's reference came out in BF16 (a false alarm in CI).
    from transformers import AutoConfig

    from asyncfp8.export import save_model

    changed = []
    monkeypatch.setattr(torch, "set_default_dtype", changed.append)
    _, masters = trained_run
    out = save_model(masters, tiny_model_dir, tmp_path / "model", {"step": 7})
    assert changed == []
    assert AutoConfig.from_pretrained(out, local_files_only=True).dtype == torch.bfloat16


def test_the_command_exports_a_checkpoint_and_quantizes_it(trained_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    run_dir, _ = trained_run
    out = tmp_path / "from_checkpoint"
    assert main([str(run_dir), "--step", "7", "--out", str(out), "--precision", "int8"]) == 0
    printed = capsys.readouterr().out
    assert f"[export] {out}\n" in printed and f"[export] {out}-int8\n" in printed
    # The same model as the learner wrote from the weights it held.
    ours = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).state_dict()
    learners = AutoModelForCausalLM.from_pretrained(run_dir / MODEL_DIR).state_dict()
    assert ours.keys() == learners.keys()
    assert all(torch.equal(ours[name], learners[name]) for name in ours)
    config = json.loads((tmp_path / "from_checkpoint-int8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"


def test_an_fp16_export_is_the_checkpoints_fp32_masters_cast_to_fp16(trained_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, masters = trained_run
    written = export_run(run_dir, out=tmp_path / "model", precision="fp16")
    assert written == [tmp_path / "model", tmp_path / "model-fp16"]
    model = AutoModelForCausalLM.from_pretrained(written[1], local_files_only=True)
    assert model.dtype == torch.float16
    state = model.state_dict()
    for name, master in masters.items():
        # From the masters, not from the BF16 model beside it: 3 more mantissa bits.
        assert torch.equal(state[name], master.to(torch.float16)), name
    assert any(
        not torch.equal(state[n], m.to(torch.bfloat16).to(torch.float16))
        for n, m in masters.items()
    )


def test_what_cannot_be_exported_is_refused_naming_it(trained_run, tmp_path):
    run_dir, _ = trained_run
    with pytest.raises(
        SystemExit,
        match=r"no checkpoint at step 3 \(it keeps run.keep_checkpoints of them: steps 7\)",
    ):
        export_run(run_dir, step=3, out=tmp_path / "x")
    with pytest.raises(SystemExit, match=r"has no config\.yaml: not a run directory"):
        export_run(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    with pytest.raises(SystemExit, match="has no checkpoint"):
        export_run(tmp_path / "empty")
    with pytest.raises(ValueError, match="fp9"):
        export_run(run_dir, out=tmp_path / "y", precision="fp9")
    assert not (tmp_path / "y").exists()  # refused before anything was written


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_exported_model_with_the_learners_logprobs(trained_run, vllm_module):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = trained_run
    exported = run_dir / MODEL_DIR
    llm = vllm_module.LLM(
        model=str(exported),
        dtype="bfloat16",
        logprobs_mode="processed_logprobs",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    texts = [f"{a}+{b}={a + b}" for a, b in ((3, 4), (12, 9), (7, 11), (10, 10))]
    outputs = llm.generate(
        texts, vllm_module.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    )
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).float().eval()
    differences = []
    for text, output in zip(texts, outputs, strict=True):
        ids = tokenizer(text)["input_ids"]
        assert list(output.prompt_token_ids) == ids
        served = torch.tensor(
            [
                step[token].logprob
                for step, token in zip(output.prompt_logprobs[1:], ids[1:], strict=True)
            ]
        )
        differences.append((served - logprobs(model, torch.tensor([ids]))[0]).abs())
    del llm  # shut vLLM down while its process group exists (a later test may destroy it)
    gc.collect()
    differences = torch.cat(differences)
    print(f"vLLM on the export vs transformers: mean |dlogp| {differences.mean():.4f}")
    assert torch.isfinite(differences).all() and differences.mean() < 0.05
