"""xcomm: a PyTorch distributed backend for training where the network is the bottleneck.

Importing xcomm registers the backend::

    import xcomm
    import torch.distributed as dist
    dist.init_process_group("xcomm")
"""

from . import compat, shm
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
    "disable_timeline",
    "enable_timeline",
    "group_plan",
    "register",
    "reset_stats",
    "save_timeline",
    "shm",
    "stats",
    "timeline_json",
]
__version__ = "0.1.0"

register()
