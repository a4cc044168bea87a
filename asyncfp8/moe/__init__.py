"""Mixture-of-experts models: which architectures the library runs (`architectures`), the
learner's routers read, compared and replayed (`routers`), an engine's routes recorded and
carried (`routes`), the load-balancing loss and expert-load metrics (`balance`), and the
experts under a checkpoint's names (`checkpoint_names`). docs/moe.md"""

from .architectures import MoELayout, check_architecture, moe_layout
from .balance import ExpertLoad, load_balancing_loss
from .checkpoint_names import checkpoint_named
from .routers import RouterTap

__all__ = [
    "ExpertLoad",
    "MoELayout",
    "RouterTap",
    "check_architecture",
    "checkpoint_named",
    "load_balancing_loss",
    "moe_layout",
]
