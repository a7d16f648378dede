"""State dicts as bytes inside a pickle, so states pass through ``mp.spawn``.

``torch.multiprocessing`` pickles a tensor for a child process by moving its
storage into shared memory and handing the child a file descriptor, which
must stay open until the child starts. A state's ``__getstate__`` builds its
state dict on the fly, so those tensors (a PowerSGD random state, a top-k
generator state, residuals) are gone by then: the child failed with "unable
to resize file ... Invalid argument (22)" and ``AutoState`` failed in the
parent with "bad value(s) in fds_to_keep". Serialised with ``torch.save``
into bytes, the state dict is plain data to every pickler (``pickle``,
``copy.deepcopy``, ``torch.save``, ``mp.spawn``, Lightning's ``ddp_spawn``).
"""

from __future__ import annotations

import io
from typing import Any

import torch


def pack_state(state_dict: dict[str, Any]) -> bytes:
    """``state_dict`` as ``torch.save``'s bytes.

    Example::

        >>> import torch
        >>> unpack_state(pack_state({"x": torch.arange(3)}))["x"].tolist()
        [0, 1, 2]
    """
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    return buf.getvalue()


def unpack_state(blob: bytes) -> dict[str, Any]:
    """The state dict :func:`pack_state` wrote (tensors on the devices they
    were saved from); plain data only (``weights_only``)."""
    return torch.load(io.BytesIO(blob), weights_only=True)


def pickled_state(pickled: dict[str, Any]) -> dict[str, Any]:
    """The state dict inside a state's pickle: ``state_bytes`` (this
    version) or ``state`` (pickles written before it)."""
    if "state_bytes" in pickled:
        return unpack_state(pickled["state_bytes"])
    return pickled["state"]
