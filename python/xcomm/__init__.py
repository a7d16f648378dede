"""xcomm: a PyTorch distributed backend for training where the network is the bottleneck.

Importing xcomm registers the backend::

    import xcomm
    import torch.distributed as dist
    dist.init_process_group("xcomm")

Every public module is reachable from the package, as the README writes it
(``xcomm.hooks.PowerSGDState``, ``xcomm.diloco.DiLoCo``), except those that
need an optional framework (``xcomm.lightning``), which are imported by name.
"""

from . import compat, diloco, hooks, shm
from ._registration import register
from .backend import group_plan
from .bucketer import GradientBucketer
from .opstats import reset_stats, stats
from .options import Options
from .trace import disable_timeline, enable_timeline, save_timeline, timeline_json

__all__ = [
    "GradientBucketer",
    "Options",
    "__version__",
    "compat",
    "diloco",
    "disable_timeline",
    "enable_timeline",
    "group_plan",
    "hooks",
    "register",
    "reset_stats",
    "save_timeline",
    "shm",
    "stats",
    "timeline_json",
]
__version__ = "0.1.0"

register()
