"""The learner (`python -m asyncfp8.learner`): trains the policy on the workers'
trajectories and publishes versions. `loop.py` is the loop; the modules beside it are
its parts (see its docstring); the training step itself is `asyncfp8.train`."""

from .checkpoints import CHECKPOINT_DIR, LATEST_VERSION_FILE, LEARNER_STATE, Checkpointer
from .hub import Hub, Preempted, RankHub
from .loop import Learner
from .publisher import Publisher

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
]
