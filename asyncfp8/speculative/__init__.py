"""Speculative decoding pieces that do not depend on the engine's decode loop: lossless
acceptance, a one-layer EAGLE-style drafter, its online training from the target's
rollouts, adaptive control (when to speculate, how many tokens to draft), and a reference
decode loop that puts them together (docs/engines.md, "Speculative decoding (pieces)")."""

from .acceptance import AcceptanceResult, accept
from .adaptive import SpeculationController
from .drafter import Drafter, DrafterCache
from .training import DrafterTrainer

__all__ = [
    "AcceptanceResult",
    "Drafter",
    "DrafterCache",
    "DrafterTrainer",
    "SpeculationController",
    "accept",
]
