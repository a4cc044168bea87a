"""The torch engine's decode over a static KV cache (asyncfp8/engines/slots.py,
decode.py, kv_cache.py): the same logits as a growing cache, weights updated in place,
finish checks every k steps without changing outputs, the device option and what is
refused at start; on a GPU (marked `gpu`, skipped without CUDA) the CUDA-graph decode
step."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from asyncfp8.engines import EngineUnsupported, torch_engine
from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.slots import SlotDecoder
from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.models import load_model, load_tokenizer
from asyncfp8.precision import get_policy, kernel_support, version_tensors
from asyncfp8.precision.fp8 import FP8_MAX, FP8BlockLinear, quantize_blockwise_reference
from asyncfp8.precision.fp8 import quantize_activations_fp8 as module_quantize
from asyncfp8.precision.kernel_support import KernelUnavailable
from asyncfp8.tasks import ArithmeticTask

TASK = ArithmeticTask(seed=5)
PROMPTS = [TASK.prompt(i).text for i in range(6)]
PRECISIONS = ["bf16", "fp8", "int8", "fp8+fp8_kv"]


def calibration(model_dir):
    tokenizer = load_tokenizer(model_dir)
    texts = [TASK.prompt(i).text + TASK.completion(TASK.prompt(i)) for i in range(32)]
    return dict(tokenizer(texts, return_tensors="pt", padding=True))


def perturbed(model_dir, seed=1, scale=0.3):
    model = load_model(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.abs().mean())
    return model


def engine_with_version(model_dir, precision, **options):
    """An engine that has applied a (perturbed) version, KV scales included."""
    policy = get_policy(precision)
    engine = TorchEngine(str(model_dir), policy, **options)
    version = version_tensors(perturbed(model_dir), policy, calibration(model_dir))
    engine.update_weights(1, dict(version.weights), version.extra)
    return engine


# --- the reference: a growing cache, transformers' masks and SDPA ------------------------------


class GrowingFP8Layer(DynamicLayer):
    """The engine's former FP8 cache layer: concatenates e4m3, returns the whole cache
    dequantized every step."""

    def __init__(self, k_scale: float, v_scale: float):
        super().__init__()
        self.k_scale, self.v_scale = k_scale, v_scale

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        empty = (*key_states.shape[:2], 0, key_states.shape[3])
        self.keys = torch.empty(empty, dtype=torch.float8_e4m3fn, device=self.device)
        self.values = torch.empty(empty, dtype=torch.float8_e4m3fn, device=self.device)
        self.is_initialized = True

    @staticmethod
    def _quantize(x, scale):
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, self._quantize(key_states, self.k_scale)], dim=-2)
        self.values = torch.cat([self.values, self._quantize(value_states, self.v_scale)], dim=-2)
        return (
            (self.keys.float() * self.k_scale).to(self.dtype),
            (self.values.float() * self.v_scale).to(self.dtype),
        )


def growing_decode(engine, prompts, forced):
    """Logits [steps + 1, B, V] of the prompts (left padded, every row prefilled) and then
    of the forced tokens, fed one step at a time through a cache that grows."""
    pad = engine.tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    device = engine.device
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    forced = forced.to(device)
    if engine.fp8_kv:
        cache = Cache(layers=[GrowingFP8Layer(float(k), float(v)) for k, v in engine.kv_scales])
    else:
        cache = DynamicCache()
    model = engine.model
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            out = [
                model(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                ).logits[:, -1]
            ]
            for step in range(forced.shape[1]):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
                positions = positions[:, -1:] + 1
                out.append(
                    model(
                        input_ids=forced[:, step : step + 1],
                        attention_mask=mask,
                        position_ids=positions,
                        past_key_values=cache,
                    ).logits[:, -1]
                )
    finally:
        model.set_attn_implementation("asyncfp8_static")
    return torch.stack(out)


def static_decode(engine, prompts, forced, fixed_length=None):
    """Logits [steps + 1, B, V] of the engine's slot decoder, one slot per prompt;
    `fixed_length` True: every step attends over the whole cache under the mask, as a
    captured graph does (the CPU's default reads only the positions written so far)."""
    if fixed_length is not None:
        width, steps = max(len(p) for p in prompts), forced.shape[1]
        max_tokens = -(-(width + steps) // engine.cache_block) * engine.cache_block
        engine._slot_decoder = SlotDecoder(
            engine.model,
            len(prompts),
            max_tokens,
            engine._kv_cache_scales(),
            fixed_length=fixed_length,
        )
    decoder, logits = engine.start(prompts, forced.shape[1] + 1)
    assert fixed_length is None or decoder is engine._slot_decoder
    forced = forced.to(engine.device)
    out = [logits.clone()]
    for step in range(forced.shape[1]):
        out.append(decoder.step(forced[:, step]).clone())
    return torch.stack(out)


def test_the_reference_fp8_layer_is_what_the_static_cache_stores():
    # The growing reference quantizes as the static cache does (the same bytes).
    from asyncfp8.engines.kv_cache import quantize_kv

    x = torch.randn(2, 3, 5, 8) * 4
    scale = torch.tensor(0.013)
    assert torch.equal(
        GrowingFP8Layer._quantize(x, float(scale)).view(torch.uint8),
        quantize_kv(x, scale).view(torch.uint8),
    )


# Without 8-bit activations, FP32 as it is. With them, an ulp of difference in one
# activation can flip one rounding of the activation quantizer, and a logit moves by
# ~1e-4 (measured: 2.3e-4, FP8, with a cache of another length); in float64 the FP32
# activations each quantizer sees are the same in both paths, and the comparison is of
# the caches alone.
CASES = [("bf16", torch.float32), ("fp8_kv", torch.float32)] + [
    (precision, torch.float64) for precision in PRECISIONS
]


@pytest.mark.parametrize(("precision", "dtype"), CASES)
def test_static_cache_decode_gives_the_growing_cache_logits(precision, dtype, tiny_model_dir):
    # The two paths differ in the cache (static, with unattended tail slots, a fixed-length
    # mask, one prefill per distinct prompt), the attention code (grouped SDPA / the
    # FP8-KV decode reference vs transformers' SDPA) and the summation order that follows.
    # Measured in FP32: at most 6.7e-6 on logits of magnitude ~10; in float64: equal, bit
    # for bit.
    # 1e-5 allowed. A wrong position, mask row or cache slot moves logits by O(1).
    policy = get_policy(precision)
    engine = TorchEngine(str(tiny_model_dir), policy, dtype=dtype, cache_block=16)
    if policy.needs_calibration:
        scales = policy.calibrate(load_model(tiny_model_dir), calibration(tiny_model_dir))
        engine.update_weights(0, {}, scales)
    tokenizer = engine.tokenizer
    texts = [PROMPTS[0], PROMPTS[1] + PROMPTS[2], PROMPTS[0], "7"]  # left padding, a repeat
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    forced = torch.randint(3, 250, (len(prompts), 9), generator=torch.Generator().manual_seed(0))
    expected = growing_decode(engine, prompts, forced)
    # A fixed-length step with and without unattended slots at the cache's end, and one
    # that reads only the positions written (the CPU's eager default).
    for cache_block, fixed_length in ((16, True), (1, True), (16, None)):
        engine.cache_block = cache_block
        got = static_decode(engine, prompts, forced, fixed_length)
        assert got.shape == expected.shape == (10, 4, engine.model.config.vocab_size)
        assert got.dtype == dtype
        error = (got - expected).abs().max().item()
        print(
            f"{precision} {dtype} {cache_block} {fixed_length}: max |static - growing| {error:.2e}"
        )
        assert error <= 1e-5
        assert torch.equal(got[0, 0], got[0, 2])  # one prefill for a repeated prompt


def test_fp8_kv_decode_reads_the_e4m3_cache_through_the_attention_kernel(
    tiny_model_dir, monkeypatch
):
    from asyncfp8.engines import decode as decode_module

    calls = []
    real = decode_module.fp8_kv_decode_attention

    def spy(q, k_cache, v_cache, k_scale, v_scale, kv_valid, **kwargs):
        calls.append((k_cache.dtype, k_scale.dim(), tuple(kv_valid.shape)))
        return real(q, k_cache, v_cache, k_scale, v_scale, kv_valid, **kwargs)

    monkeypatch.setattr(decode_module, "fp8_kv_decode_attention", spy)
    engine = engine_with_version(tiny_model_dir, "fp8+fp8_kv", cache_block=32)
    engine.generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=3, seed=0, ignore_eos=True))
    layers = engine.model.config.num_hidden_layers
    width = max(len(engine.tokenizer(p)["input_ids"]) for p in PROMPTS[:2])
    # Two decode steps (the third token is not fed back), every layer, e4m3 and 0-dim
    # scales, over the positions written so far (eager, on the CPU).
    assert (
        calls
        == [(torch.float8_e4m3fn, 0, (4, width + 1))] * layers
        + [(torch.float8_e4m3fn, 0, (4, width + 2))] * layers
    )


def test_finish_checks_every_k_steps_change_no_output(tiny_model_dir):
    # 12 sequences through 4 slots: a row that ended idles until the next check, and
    # the request that refills it must still get the tokens of a check at every step.
    engine = TorchEngine(str(tiny_model_dir), "bf16", max_batch=4, finish_check_every=1)
    sampling = SamplingParams(n=2, max_new_tokens=24, seed=7)
    every_step = engine.generate(PROMPTS, sampling)
    assert max(len(s.token_ids) for s in every_step[:4]) < 24  # the first batch ends early
    for k in (5, 64):
        engine.finish_check_every = k
        again = engine.generate(PROMPTS, sampling)
        assert [s.token_ids for s in again] == [s.token_ids for s in every_step]
        assert [s.logprobs for s in again] == [s.logprobs for s in every_step]
        assert [s.finish_reason for s in again] == [s.finish_reason for s in every_step]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_an_update_leaves_every_parameter_buffer_and_kv_scale_where_it_was(
    precision, tiny_model_dir
):
    engine = TorchEngine(str(tiny_model_dir), precision)

    def storage():
        tensors = dict(engine.model.named_parameters()) | dict(engine.model.named_buffers())
        for layer, pair in enumerate(engine.kv_scales):
            tensors |= {f"kv_scale.{layer}.{part}": t for part, t in zip("kv", pair, strict=True)}
        return {name: (t.data_ptr(), t.clone()) for name, t in tensors.items()}

    before = storage()
    policy = engine.policy
    version = version_tensors(perturbed(tiny_model_dir), policy, calibration(tiny_model_dir))
    engine.update_weights(1, dict(version.weights), version.extra)
    after = storage()
    assert {n: p for n, (p, _) in after.items()} == {n: p for n, (p, _) in before.items()}
    changed = [n for n in before if not torch.equal(before[n][1], after[n][1])]
    # Every weight moved (the version is perturbed), so every quantized buffer did too.
    assert "model.layers.0.self_attn.q_proj.q" in changed or precision == "bf16"
    assert "model.embed_tokens.weight" in changed
    assert ("kv_scale.1.v" in changed) == engine.fp8_kv


# --- the runtime modules keep their CPU numerics ----------------------------------------------


def fp8_block_linear_loop(module, x):
    """FP8BlockLinear's forward before the kernels: one torch._scaled_mm per 128-column
    block with rowwise scales, accumulated in fp32."""
    group = module.block[1]
    shape, dtype = x.shape, x.dtype
    x = x.reshape(-1, module.in_features)
    x = torch.nn.functional.pad(x, (0, module.q.shape[1] - module.in_features))
    xq, x_scale = module_quantize(x, group)
    row_scales = module.scale_inv.t().repeat_interleave(module.block[0], 1)[:, None, :]
    out = torch.zeros(x.shape[0], module.q.shape[0])
    for block in range(module.scale_inv.shape[1]):
        cols = slice(block * group, (block + 1) * group)
        out += torch._scaled_mm(
            xq[:, cols],
            module.q[:, cols].t(),
            scale_a=x_scale[:, block : block + 1].contiguous(),
            scale_b=row_scales[block],
            out_dtype=torch.float32,
        )
    out = out[:, : module.out_features]
    if module.bias is not None:
        out = out + module.bias.float()
    return out.to(dtype).reshape(*shape[:-1], module.out_features)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "n", "k", "block"), [(1, 200, 300, (128, 128)), (5, 64, 96, (32, 48))]
)
def test_fp8_block_linear_on_the_cpu_is_the_per_block_loop_bit_for_bit(dtype, tokens, n, k, block):
    generator = torch.Generator().manual_seed(tokens)
    w_q, scale_inv = quantize_blockwise_reference(
        torch.randn(n, k, generator=generator) * 0.05, block
    )
    bias = torch.randn(n, generator=generator).to(dtype)
    module = FP8BlockLinear("w", w_q, scale_inv, bias, block)
    assert module.scale_mm is None  # the sm90 layout only where scaled_mm runs
    x = (torch.randn(2, tokens, k, generator=generator) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(module(x), fp8_block_linear_loop(module, x))


def test_int8_linear_on_the_cpu_is_int_mm_then_the_fp32_epilogue_bit_for_bit():
    from asyncfp8.precision.int8 import Int8Linear, quantize_activations_int8, quantize_per_channel

    generator = torch.Generator().manual_seed(0)
    q, scale = quantize_per_channel(torch.randn(48, 96, generator=generator))
    bias = torch.randn(48, generator=generator).to(torch.bfloat16)
    module = Int8Linear("w", q, scale, bias)
    for tokens in (1, 7):
        x = torch.randn(tokens, 96, generator=generator).to(torch.bfloat16)
        xq, x_scale = quantize_activations_int8(x)
        expected = torch._int_mm(xq, q.t()).float() * x_scale * scale.t() + bias.float()
        with torch.no_grad():
            assert torch.equal(module(x), expected.to(torch.bfloat16))


# --- attention ----------------------------------------------------------------------------------


def float64_attention(query, key, value, mask, scale):
    """Head by head and row by row, in float64; query head h reads KV head h // group."""
    batch, q_heads, tokens, _ = query.shape
    group = q_heads // key.shape[1]
    out = torch.zeros(batch, tokens, q_heads, query.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            for t in range(tokens):
                keep = mask[b, 0, t]
                scores = key[b, h // group, keep].double() @ query[b, h, t].double() * scale
                weights = torch.softmax(scores, 0)
                out[b, t, h] = weights @ value[b, h // group, keep].double()
    return out


@pytest.mark.parametrize("tokens", [1, 4])
def test_grouped_attention_matches_float64_head_by_head(tokens):
    # fp32 against float64: rounding of scores, softmax and sums, measured <= 3e-7;
    # 1e-5 allowed. Reading the wrong KV head, or a masked slot, is off by O(1).
    from asyncfp8.engines.decode import grouped_attention

    generator = torch.Generator().manual_seed(tokens)
    query = torch.randn(3, 6, tokens, 16, generator=generator)
    key, value = (torch.randn(3, 2, 10, 16, generator=generator) for _ in range(2))
    mask = torch.rand(3, 1, tokens, 10, generator=generator) > 0.4
    mask[..., 0] = True  # every row attends somewhere
    key[:, :, 9] = 1e4  # a masked slot that would dominate any row reading it
    mask[..., 9] = False
    got = grouped_attention(query, key, value, mask, 0.25)
    assert got.shape == (3, tokens, 6, 16)
    expected = float64_attention(query, key, value, mask, 0.25)
    assert (got.double() - expected).abs().max() <= 1e-5


# --- the device and what is refused at start ----------------------------------------------------


def test_device_auto_is_the_gpu_when_there_is_one_else_the_cpu(tiny_model_dir):
    engine = TorchEngine(str(tiny_model_dir), "fp8", device="auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine.device.type == expected
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    assert {t.device.type for t in tensors} == {expected}
    samples = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, seed=1))
    again = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, seed=1))
    assert [s.token_ids for s in samples] == [s.token_ids for s in again]


def test_everything_the_engine_launches_runs_with_its_device_current(tiny_model_dir, monkeypatch):
    """Triton kernels launch, and CUDA graphs capture and replay, on the thread's current
    CUDA device, not on their tensors'. So the engine makes its own device current around
    all it runs (quantizing, the start probe, generation, scoring, updates): an engine on
    cuda:1 driven from a thread on cuda:0 launches on cuda:1. Seen here by recording,
    at every module's forward, at the quantization and at an update, which device was
    made current."""
    policy = get_policy("fp8+fp8_kv")
    version = version_tensors(perturbed(tiny_model_dir), policy, calibration(tiny_model_dir))
    current: list[torch.device] = []
    seen: list[torch.device | None] = []

    @contextlib.contextmanager
    def recording(device):
        current.append(device)
        try:
            yield
        finally:
            current.pop()

    def record(*_):
        seen.append(current[-1] if current else None)

    def recorded(function):
        def run(*args, **kwargs):
            record()
            return function(*args, **kwargs)

        return run

    monkeypatch.setattr(kernel_support, "launching_on", recording)
    monkeypatch.setattr(torch_engine, "launching_on", recording)
    monkeypatch.setattr(torch_engine, "apply_policy", recorded(torch_engine.apply_policy))
    monkeypatch.setattr(torch_engine, "check_received", recorded(torch_engine.check_received))
    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        engine = TorchEngine(str(tiny_model_dir), policy, device="cpu")
        counts = [len(seen)]
        engine.update_weights(1, dict(version.weights), version.extra)
        counts.append(len(seen))
        engine.generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=4, seed=1))
        counts.append(len(seen))
        engine.score([engine.tokenizer(PROMPTS[0])["input_ids"] + [5, 6]])
        counts.append(len(seen))
    finally:
        hook.remove()
    # each call was seen (quantization and the probe, the update, generate, score)
    assert 0 < counts[0] < counts[1] < counts[2] < counts[3]
    assert set(seen) == {engine.device}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_that_is_not_there_is_refused_at_start_saying_what_runs(tiny_model_dir):
    with pytest.raises(EngineUnsupported) as raised:
        TorchEngine(str(tiny_model_dir), "fp8", device="cuda")
    message = str(raised.value)
    assert "engine.device=cuda" in message and "sees no CUDA GPU" in message
    assert "engine.device=cpu (or auto) runs precision 'fp8'" in message


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"device": "tpu"}, r"engine.device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
        ({"device": "cuda:x"}, r"engine.device must be"),
        ({"finish_check_every": 0}, r"engine.finish_check_every must be an int >= 1, got 0"),
        ({"cache_block": 2.5}, r"engine.cache_block must be an int >= 1"),
        ({"max_batch": True}, r"engine.max_batch must be an int >= 1"),
    ],
)
def test_bad_engine_options_are_refused_before_the_model_loads(options, message, tmp_path):
    # tmp_path holds no model: the options are checked first.
    with pytest.raises(ValueError, match=message):
        TorchEngine(str(tmp_path), "bf16", **options)


def test_a_kernel_the_device_cannot_run_is_refused_at_start(tiny_model_dir, monkeypatch):
    from asyncfp8.precision.fp8 import linear

    def unavailable(*args, **kwargs):
        raise KernelUnavailable(
            "fp8_block_matmul cannot run on cuda:0 (a GPU, sm80): Triton is not installed. "
            "What would work: install Triton"
        )

    monkeypatch.setattr(linear, "fp8_block_matmul", unavailable)
    with pytest.raises(EngineUnsupported) as raised:
        TorchEngine(str(tiny_model_dir), "fp8+fp8_kv")
    message = str(raised.value)
    assert "cannot run precision 'fp8+fp8_kv' on cpu" in message
    assert "What would work: install Triton" in message and "engine.device=cpu" in message
    TorchEngine(str(tiny_model_dir), "int8")  # a precision that does not use it starts


def test_kv_scales_a_version_cannot_use_are_refused_and_nothing_is_applied(tiny_model_dir):
    policy = get_policy("fp8_kv")
    engine = TorchEngine(str(tiny_model_dir), policy)
    scales = policy.calibrate(load_model(tiny_model_dir), calibration(tiny_model_dir))
    name = "model.layers.1.self_attn.k_scale"
    for bad, message in [
        (torch.tensor(float("nan")), "must be finite and > 0"),
        (torch.tensor(0.0), "must be finite and > 0"),
        (torch.ones(2), "must be one floating-point value"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.update_weights(1, {}, {**scales, name: bad})
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.7\.self_attn\.v_scale'"):
        engine.update_weights(
            1, {}, {**scales, "model.layers.7.self_attn.v_scale": torch.tensor(1.0)}
        )
    assert engine.version is None
    assert all(float(k) == float(v) == 1.0 for k, v in engine.kv_scales)
    engine.update_weights(1, {}, scales)  # q scales included: accepted, not used
    assert any(".q_scale" in n for n in scales)
    assert float(engine.kv_scales[1][0]) == float(scales[name])


def test_a_decoder_refuses_a_step_past_its_last_position(tiny_model_dir):
    engine = TorchEngine(str(tiny_model_dir), "bf16", cache_block=1)
    decoder, logits = engine.start([[5, 6, 7]], max_new_tokens=3)
    assert decoder.max_tokens == 5 and logits.shape == (1, engine.model.config.vocab_size)
    decoder.step(torch.tensor([8]))
    decoder.step(torch.tensor([9]))
    with pytest.raises(ValueError, match="slot 0 has filled its 5 positions"):
        decoder.step(torch.tensor([10]))


# --- on a GPU -----------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def forced_batch(engine):
    # Distinct prompts: a GPU GEMM may pick another kernel for another number of rows, and
    # one prefill per distinct prompt would then round the prefill otherwise.
    texts = [PROMPTS[0], PROMPTS[1] + PROMPTS[2], PROMPTS[3], "7"]
    prompts = [engine.tokenizer(t)["input_ids"] for t in texts]
    return prompts, torch.randint(3, 250, (4, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("precision", "dtype"), CASES)
def test_gpu_static_graph_decode_gives_the_growing_cache_logits(precision, dtype, tiny_model_dir):
    # As on the CPU, with the GPU kernels (scaled_mm or Triton GEMMs, the Triton FP8-KV
    # decode kernel in FP32: TF32x3 dots) and the decode step replayed from a CUDA graph.
    # FP32 GPU kernels differ from SDPA's summation order more than the CPU's: 1e-4.
    policy = get_policy(precision)
    engine = TorchEngine(str(tiny_model_dir), policy, dtype=dtype, device="cuda", cache_block=16)
    if policy.needs_calibration:
        scales = policy.calibrate(load_model(tiny_model_dir), calibration(tiny_model_dir))
        engine.update_weights(0, {}, scales)
    prompts, forced = forced_batch(engine)
    expected = growing_decode(engine, prompts, forced)
    got = static_decode(engine, prompts, forced)
    assert engine._slot_decoder._graph is not None  # the steps ran as a captured graph
    error = (got - expected).abs().max().item()
    print(f"{precision} {dtype}: max |static graph - growing| {error:.2e}")
    assert error <= (1e-4 if dtype == torch.float32 else 1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_graph_replays_the_eager_step_and_follows_a_weight_update(precision, tiny_model_dir):
    # The same kernels replayed from a graph or launched one by one: the same logits (up
    # to one bf16 step where cuBLAS picks another algorithm under capture). After an
    # update copied into the existing storage, the graph runs the new weights and scales.
    graph = engine_with_version(tiny_model_dir, precision, device="cuda")
    eager = engine_with_version(tiny_model_dir, precision, device="cuda", cuda_graph=False)
    prompts, forced = forced_batch(graph)

    def close(a, b):
        return (a.float() - b.float()).abs().max().item() <= 2**-7 * b.float().abs().max().item()

    assert close(static_decode(graph, prompts, forced), static_decode(eager, prompts, forced))

    def pointers():
        tensors = [*graph.model.named_parameters(), *graph.model.named_buffers()]
        return {name: t.data_ptr() for name, t in tensors}

    before = pointers()
    policy = graph.policy
    version = version_tensors(
        perturbed(tiny_model_dir, seed=2), policy, calibration(tiny_model_dir)
    )
    weights = dict(version.weights)  # a generator: read once, for both engines
    for engine in (graph, eager):
        engine.update_weights(2, weights, version.extra)
    assert pointers() == before
    captured = graph._slot_decoder._graph
    after = static_decode(graph, prompts, forced)
    assert graph._slot_decoder._graph is captured  # no new capture
    assert close(after, static_decode(eager, prompts, forced))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_generation_at_batch_1_and_64_is_seeded(precision, tiny_model_dir):
    engine = engine_with_version(tiny_model_dir, precision, device="cuda")
    for n in (1, 64):
        sampling = SamplingParams(n=n, max_new_tokens=16, seed=3)
        first = engine.generate(PROMPTS[:1], sampling)
        again = engine.generate(PROMPTS[:1], sampling)
        assert len(first) == n and all(len(s.token_ids) == len(s.logprobs) > 0 for s in first)
        assert [s.token_ids for s in first] == [s.token_ids for s in again]
        assert all(math.isfinite(p) and p <= 0 for s in first for p in s.logprobs)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_an_engine_on_the_second_gpu_runs_from_a_thread_on_the_first(precision, tiny_model_dir):
    # Its Triton kernels, graph capture and replays on cuda:1, though cuda:0 is current.
    torch.cuda.set_device(0)
    sampling = SamplingParams(n=4, max_new_tokens=16, seed=3)
    tokens = []
    for device in ("cuda:0", "cuda:1"):
        engine = engine_with_version(tiny_model_dir, precision, device=device)
        tokens.append([s.token_ids for s in engine.generate(PROMPTS[:2], sampling)])
        assert torch.cuda.current_device() == 0
    assert tokens[0] == tokens[1]


def test_the_engine_model_called_without_a_decoder_is_a_causal_lm(tiny_model_dir):
    """Outside a decoder (no static cache, no mask) the engine's model scores a sequence
    as the transformers model does: causal attention, not attention over every token."""
    policy = get_policy("bf16")
    policy.engine_dtype = torch.float32
    engine = TorchEngine(str(tiny_model_dir), policy, dtype=torch.float32)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = engine.model(ids).logits
        want = load_model(tiny_model_dir)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
