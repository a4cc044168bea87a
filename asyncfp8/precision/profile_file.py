"""A SmoothQuant profile on disk (safetensors): per-channel factors by tensor name, as
`python -m asyncfp8.precision.profile` computes them and the INT8 policy reads them.
Apart from profile.py so that the policy, imported with the package, does not import
the CLI module (`python -m` would then warn that it was imported before it ran)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# A producer's output-channel divisors (a fold's, profile.FOLDED) are stored under its
# weight's name plus this.
ROWS = ".rows"


def save_profile(profile: dict[str, torch.Tensor], path: str | Path, **metadata: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in profile.items()},
        path,
        metadata={k: str(v) for k, v in metadata.items()},
    )
    return path


def load_profile(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"INT8 calibration profile {str(path)!r} does not exist; make one with "
            "`python -m asyncfp8.precision.profile --model DIR --task arithmetic --out FILE`"
        )
    profile = load_file(path)
    bad = [
        name
        for name, t in profile.items()
        if t.dim() != 1 or not torch.isfinite(t).all() or (t <= 0).any()
    ]
    if bad:
        raise ValueError(f"{path}: factors must be finite, positive 1-D tensors; bad: {bad[:3]}")
    return profile
