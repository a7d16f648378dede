"""xcomm: a PyTorch distributed backend for training where the network is the bottleneck.

Importing xcomm registers the backend::

    import xcomm
    import torch.distributed as dist
    dist.init_process_group("xcomm")
"""

from ._registration import register
from .options import Options

__all__ = ["Options", "register", "__version__"]
__version__ = "0.1.0"

register()
