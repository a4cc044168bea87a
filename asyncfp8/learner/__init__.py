"""The learner (`python -m asyncfp8.learner`): trains the policy on the workers'
trajectories and publishes versions. `loop.py` is the loop; the modules beside it are
its parts (see its docstring)."""

from .checkpoints import CHECKPOINT_DIR, LATEST_VERSION_FILE, LEARNER_STATE, Checkpointer
from .hub import Hub, Preempted, RankHub
from .loop import Learner
from .publisher import Publisher
from .step import Share, StepSums, TrainStep, lr_lambda, plan_shares
from .step_metrics import StepMetrics

__all__ = [
    "CHECKPOINT_DIR",
    "LATEST_VERSION_FILE",
    "LEARNER_STATE",
    "Checkpointer",
    "Hub",
    "Learner",
    "Preempted",
    "Publisher",
    "RankHub",
    "Share",
    "StepMetrics",
    "StepSums",
    "TrainStep",
    "lr_lambda",
    "plan_shares",
]
