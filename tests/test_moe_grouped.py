"""The grouped expert GEMMs (asyncfp8/precision/grouped_experts.py): the routes' layout,
built on the device with no host sync, and the Triton kernel against the loops it replaces
under the interpreter (tests/moe_kernel_check.py, in a subprocess: TRITON_INTERPRET is read when
triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncfp8.precision.grouped_experts import align_routes

REPO = Path(__file__).resolve().parent.parent


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
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "ASYNCFP8_TRITON": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "moe_kernel_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " 0 mismatches" in summary and int(summary.split()[0]) >= 17, summary
