"""DDP communication hooks with gradient compression, beside torch's own,
and FSDP2's compressed reduce-scatter (:func:`compress_reduce_scatter`).

Each method has a state class and a hook; register them with
``model.register_comm_hook(state, hook)``. Every state keeps
``CompressionStats`` in ``state.stats`` and checkpoints with
``state_dict()`` / ``load_state_dict()``.
"""

from .auto import AutoState, LinkModel, auto_hook
from .cast import CastState, bf16_cast_hook, fp16_cast_hook
from .feedback import FeedbackStore
from .fsdp import CompressedReduceScatter, FsdpCompressionState, compress_reduce_scatter
from .int8 import Int8State, int8_compress_hook
from .powersgd import PowerSGDState, powersgd_hook
from .sparse import RandomKState, TopKState, randomk_hook, topk_hook
from .stats import CompressionStats

__all__ = [
    "AutoState",
    "CastState",
    "CompressedReduceScatter",
    "CompressionStats",
    "FeedbackStore",
    "FsdpCompressionState",
    "Int8State",
    "LinkModel",
    "PowerSGDState",
    "RandomKState",
    "TopKState",
    "auto_hook",
    "bf16_cast_hook",
    "compress_reduce_scatter",
    "fp16_cast_hook",
    "int8_compress_hook",
    "powersgd_hook",
    "randomk_hook",
    "topk_hook",
]
