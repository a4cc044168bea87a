"""Mixture-of-experts models: which architectures the library runs (`architectures`), the
routers' decisions read during a forward (`routers`), the load-balancing loss and the
expert-load metrics the learner reports (`balance`), and the experts under a checkpoint's
names (`checkpoint_names`). docs/moe.md"""

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
