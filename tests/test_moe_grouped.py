"""The grouped expert GEMMs (asyncfp8/precision/grouped_experts.py): the routes' layout,
built on the device with no host sync, and the Triton kernel against the loops it replaces
under the interpreter (tests/moe_kernel_check.py, in a subprocess: TRITON_INTERPRET is read when
triton is imported)."""

from __future__ import annotations

import pytest
import torch

from asyncfp8.precision.grouped_experts import align_routes
from tests.test_engine_kernels import under_the_interpreter


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block"),
    [(1, 4, 2, 16), (5, 8, 2, 16), (37, 16, 4, 16), (64, 128, 8, 16), (9, 3, 3, 4)],
)
def test_the_routes_are_sorted_into_whole_blocks_of_one_expert(tokens, experts, top_k, block):
    generator = torch.Generator().manual_seed(tokens)
    index = torch.rand(tokens, experts, generator=generator).topk(top_k, -1).indices
    rows, block_expert = align_routes(index, experts, block)
    pairs = tokens * top_k
    capacity = -(-(pairs + experts * (block - 1)) // block) * block
    assert rows.shape == (capacity,) and block_expert.shape == (capacity // block,)
    assert rows.dtype == block_expert.dtype == torch.int32
    # Every pair exactly once; the rest is padding.
    real = rows[rows < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    assert (rows[rows >= pairs] == pairs).all()
    flat = index.reshape(-1)
    for b, expert in enumerate(block_expert.tolist()):
        members = rows[b * block : (b + 1) * block]
        members = members[members < pairs].long()
        if expert < 0:  # past the last expert's blocks: nothing to compute
            assert members.numel() == 0
            continue
        assert members.numel() > 0 and (flat[members] == expert).all(), (b, expert)
    # Each expert's blocks are as many as its pairs need, in expert order.
    used = block_expert[block_expert >= 0]
    counts = torch.bincount(flat, minlength=experts)
    assert torch.equal(torch.bincount(used.long(), minlength=experts), -(-counts // block))
    assert torch.equal(used, used.sort().values)


@pytest.mark.slow
def test_the_grouped_kernel_matches_the_expert_loops_under_the_interpreter():
    result = under_the_interpreter("moe_kernel_check.py")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " 0 mismatches" in summary and int(summary.split()[0]) >= 17, summary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_an_moe_decodes_in_a_cuda_graph_with_grouped_experts(precision, tiny_moe_dir):
    """On a GPU the experts are grouped GEMMs, which a CUDA graph captures: the captured
    decode gives the eager engine's greedy tokens, and its log-probs stay near the CPU's."""
    from asyncfp8.engines import SamplingParams
    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.precision.grouped_experts import GroupedExperts

    prompts = ["12+34=", "7+8=", "99+1="]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    graph = TorchEngine(str(tiny_moe_dir), precision, device="cuda")
    eager = TorchEngine(str(tiny_moe_dir), precision, device="cuda", cuda_graph=False)
    experts = graph.model.model.layers[0].mlp.experts
    assert isinstance(experts, GroupedExperts) or experts.grouped is not None
    captured, plain = graph.generate(prompts, sampling), eager.generate(prompts, sampling)
    assert [s.token_ids for s in captured] == [s.token_ids for s in plain]
    cpu = TorchEngine(str(tiny_moe_dir), precision, device="cpu")
    on_cpu = cpu.score([s.prompt_ids + s.token_ids for s in captured])
    on_gpu = graph.score([s.prompt_ids + s.token_ids for s in captured])
    for a, b in zip(on_cpu.logprobs, on_gpu.logprobs, strict=True):
        assert (torch.as_tensor(a) - torch.as_tensor(b)).abs().max() < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_int8_experts_ask_for_the_graph_off(tiny_moe_dir):
    from asyncfp8.engines import EngineUnsupported
    from asyncfp8.engines.torch_engine import TorchEngine

    with pytest.raises(EngineUnsupported, match=r"set engine\.cuda_graph=false"):
        TorchEngine(str(tiny_moe_dir), "int8", device="cuda")
    TorchEngine(str(tiny_moe_dir), "int8", device="cuda", cuda_graph=False)
