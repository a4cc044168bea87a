"""BF16 and FP16 linear layers on a CPU without GEMM kernels for them
(asyncfp8.hf.cpu_half): the exact sum of the 16-bit products converted to the format,
checked against a term-by-term float64 reference, the same for a row whatever the batch
around it, and swapped in by load_model only where it applies."""

import pytest
import torch
from torch import nn

from asyncfp8.hf import cpu_half
from asyncfp8.hf.cpu_half import (
    ExactSumLinear,
    is_plain_linear,
    sum_half_linears_exactly,
)
from asyncfp8.models import load_model
from asyncfp8.train.logprobs import LogprobHead, install_logprob_head

HALF = [torch.bfloat16, torch.float16]


def half_linear(
    seed: int, bias: bool = True, dtype: torch.dtype = torch.bfloat16
) -> tuple[nn.Linear, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(96, 40, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=generator))
        if bias:
            linear.bias.copy_(torch.randn(40, generator=generator))
    return linear, torch.randn(3, 7, 96, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bias", [True, False])
def test_the_product_is_the_exact_sum_rounded_once_to_the_format(bias, dtype):
    linear, x = half_linear(seed=1, bias=bias, dtype=dtype)
    # the exact sum, term by term in float64 (another order than any GEMM's): the BF16
    # products are exact there and 96 of them sum within 1e-16 relative
    exact = (x.double()[..., None, :] * linear.weight.double()).sum(-1)
    if bias:
        exact = exact + linear.bias.double()
    out = ExactSumLinear(linear)(x)
    assert out.dtype == dtype
    assert torch.equal(out, exact.to(dtype))


@pytest.mark.parametrize("dtype", HALF)
def test_a_rows_product_does_not_depend_on_the_batch_around_it(dtype):
    # An FP32 GEMM's rows changed with the batch on the Zen 3 VM (rows of batches under 4
    # took another kernel); a token's log-prob must not depend on what decodes beside it.
    # (1,024 wide: at 96 the FP32 sums' differences all rounded away to the same BF16)
    generator = torch.Generator().manual_seed(4)
    linear = nn.Linear(1024, 1024).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1024, 1024, generator=generator))
    rows = torch.randn(16, 1024, generator=generator).to(dtype)
    layer = ExactSumLinear(linear)
    batch = layer(rows)
    for size in range(1, len(rows)):
        assert torch.equal(layer(rows[:size]), batch[:size]), size
        assert torch.equal(layer(rows[-size:]), batch[-size:]), size


def test_it_keeps_the_layers_parameters_and_gradients():
    linear, x = half_linear(seed=2)
    wrapped = ExactSumLinear(linear)
    assert wrapped.weight is linear.weight and wrapped.bias is linear.bias
    assert list(wrapped.state_dict()) == list(linear.state_dict())
    x.requires_grad_(True)
    wrapped(x).float().square().sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.dtype == torch.bfloat16
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def test_other_dtypes_run_nn_linears_own_forward():
    linear, x = half_linear(seed=3)
    linear.float()
    wrapped = ExactSumLinear(linear)
    assert torch.equal(wrapped(x.float()), linear(x.float()))


def test_a_models_linears_are_swapped_and_ties_kept():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)).eval()
    model[1].weight = model[0].weight  # tied, as an LM head to its embeddings
    sum_half_linears_exactly(model)
    assert type(model[1]) is ExactSumLinear and is_plain_linear(model[1])
    assert model[1].weight is model[0].weight
    assert not model[1].training


def test_a_large_layer_keeps_the_fallback_that_is_quick_at_one_row():
    model = nn.Sequential(nn.Linear(1024, 256), nn.Linear(256, 1024))
    sum_half_linears_exactly(model)
    assert [type(layer) for layer in model] == [nn.Linear, nn.Linear]
    assert min(layer.weight.numel() for layer in model) > cpu_half.LARGEST_SWAPPED


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("has_kernels", [True, False])
def test_load_model_swaps_only_where_the_cpu_has_no_gemm_for_the_format(
    tiny_model_dir, monkeypatch, has_kernels, dtype
):
    monkeypatch.setattr(cpu_half, "cpu_has_gemm", lambda asked: has_kernels)
    model = load_model(tiny_model_dir, dtype=dtype)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(is_plain_linear(m) for m in linears)
    swapped = {type(m) is ExactSumLinear for m in linears}
    assert swapped == {not has_kernels}
    # the learner's chunked log-probs take such a head's place as a plain one's
    assert isinstance(install_logprob_head(model), LogprobHead)
    assert not any(
        type(m) is ExactSumLinear for m in load_model(tiny_model_dir, dtype=torch.float32).modules()
    )
