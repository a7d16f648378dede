"""One error-feedback model for every lossy method.

A lossy method sends an approximation ``s`` of ``a = g + e`` (the bucket's
gradient plus its residual) and keeps ``e' = a - s`` for the next step, so
nothing is lost, only delayed: ``s + e' = g + e`` holds per element.

:class:`FeedbackStore` keeps those residuals for int8, top-k and random-k
(and, through :meth:`FeedbackStore.flush`, for every other method):

* **By parameter.** A residual belongs to the parameters of the bucket it
  was made in. When DDP rebuilds its buckets, or a bucket is laid out
  differently after a resume, the pieces follow their parameters into the
  new buckets. While a layout stays, the residual is one contiguous float32
  tensor that the C++ codecs update in place (``store.feedback``, an
  ``xcomm._C.ErrorFeedback``).
* **Shared.** The states of several methods can hold the same store, so a
  bucket that switches method between steps keeps its residual (the ``auto``
  hook does this). A lossless method calls :meth:`flush`, which adds the
  residual into what it sends and drops it.
* **One checkpoint format**, versioned (``version`` 2); the unversioned
  format of xcomm's earlier hooks still loads.

Example::

    >>> from xcomm.hooks import FeedbackStore, Int8State, TopKState
    >>> store = FeedbackStore()
    >>> a, b = Int8State(feedback=store), TopKState(feedback=store)
    >>> a.feedback is b.feedback
    True
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from ._pickling import pack_state, pickled_state
from ._streams import used_on_this_stream

logger = logging.getLogger(__name__)

__all__ = ["FEEDBACK_STATE_VERSION", "BucketView", "FeedbackStore"]

#: The version :meth:`FeedbackStore.state_dict` writes.
FEEDBACK_STATE_VERSION = 2


class BucketView:
    """What a codec works on for one bucket: a key and a flat tensor.

    Usually the bucket's own buffer under the bucket's index. After a resume
    it may be a copy in the saved run's parameter order; :meth:`write_back`
    then copies the result into the bucket.
    """

    def __init__(
        self,
        key: int,
        tensor: torch.Tensor,
        index: torch.Tensor | None,
        buffer: torch.Tensor,
        segments: list[int] | None = None,
    ) -> None:
        self.key = key
        self.tensor = tensor
        self._index = index
        self._buffer = buffer
        #: The sizes of the consecutive stretches of :attr:`tensor` that are
        #: one parameter's gradient each (summing to its numel): what a
        #: per-tensor codec splits by.
        self.segments = segments if segments is not None else [tensor.numel()]

    @property
    def index(self) -> torch.Tensor | None:
        """Where :attr:`tensor`'s elements go in the bucket, or None when
        :attr:`tensor` is the bucket's buffer itself."""
        return self._index

    def write_back(self) -> torch.Tensor:
        """Puts the view's values into the bucket's buffer and returns the buffer."""
        if self._index is not None:
            self._buffer.index_copy_(0, self._index, self.tensor)
            # Usually called from a future's callback, on a stream of torch's
            # pool: the view and its index are this step's temporaries (else
            # the view is the bucket's own buffer, which DDP keeps).
            used_on_this_stream(self.tensor, self._index)
        return self._buffer


def _stretches(current: list[tuple[Any, int, int]], numel: int) -> list[int]:
    """The buffer cut at each gradient's offset: one stretch per gradient
    (any padding after one goes with it), sizes summing to ``numel``."""
    starts = sorted({offset for _, offset, _ in current if 0 < offset < numel})
    bounds = [0, *starts, numel]
    return [b - a for a, b in pairwise(bounds)] if numel else []


# A parameter's identity: its name when the model is known, else the
# parameter object's id (stable within the run, not across processes).
_Pid = Hashable
_Layout = list[tuple[Any, int]]  # [(pid, numel)] in the residual's order


class FeedbackStore:
    """Error-feedback residuals of every lossy method, kept per parameter.

    Args:
        model: the DDP model (optional). With it, residuals are checkpointed
            by parameter name, so a resumed run continues bit for bit even
            though a fresh DDP lays out its first buckets differently.
            Without it they still follow parameters within a run, but a
            checkpoint keeps them by bucket index.

    Example::

        >>> store = FeedbackStore()
        >>> store.state_dict()["version"]
        2
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.feedback = _C.ErrorFeedback()
        self._names: dict[int, str] = {}
        if model is not None:
            self.bind(model)
        self._layouts: dict[int, _Layout] = {}  # key -> layout of its live residual
        self._owner: dict[_Pid, int] = {}  # pid -> key whose residual holds it
        self._pending: dict[_Pid, torch.Tensor] = {}  # pieces waiting for a bucket
        self._saved_layouts: dict[int, _Layout] = {}  # from a checkpoint
        self._adopt: set[int] = set()  # keys loaded by bucket, not yet seen
        self._warned = False

    # -- identity and layout --

    @property
    def by_parameter(self) -> bool:
        return bool(self._names)

    def bind(self, model: torch.nn.Module) -> None:
        """Keys residuals by ``model``'s parameter names from now on."""
        self._names = {id(p): n for n, p in model.named_parameters()}

    def _pid(self, param: torch.Tensor) -> _Pid:
        name = self._names.get(id(param))
        return name if name is not None else ("id", id(param))

    def _current(self, bucket: dist.GradBucket) -> list[tuple[_Pid, int, int]]:
        base = bucket.buffer().storage_offset()
        return [
            (self._pid(p), g.storage_offset() - base, g.numel())
            for p, g in zip(bucket.parameters(), bucket.gradients())
        ]

    def _evict(self, key: int) -> None:
        """Splits the live residual of ``key`` into per-parameter pieces."""
        layout = self._layouts.pop(key, None)
        residual = self.feedback.get(key)
        self.feedback.erase(key)
        if layout is None:
            return
        offset = 0
        for pid, numel in layout:
            if self._owner.get(pid) == key:
                del self._owner[pid]
            if residual is not None:
                self._pending[pid] = residual.narrow(0, offset, numel).clone()
            offset += numel

    def view(self, bucket: dist.GradBucket) -> BucketView:
        """The codec's view of ``bucket``, with its residual (if any) in
        ``self.feedback`` under ``view.key`` and laid out like ``view.tensor``."""
        if not self._names and any(isinstance(p, str) for p in self._pending):
            raise ValueError(
                "xcomm.hooks: this state holds residuals saved by parameter (a checkpoint, "
                "or a pickled state made with model=); give it the model before training: "
                "state.bind_model(ddp_model)"
            )
        buffer = bucket.buffer()
        current = self._current(bucket)
        key, order, index = bucket.index(), [(p, k) for p, _, k in current], None
        if self._saved_layouts and self._names:
            pids = {p for p, _, _ in current}
            match = [k for k, lay in self._saved_layouts.items() if {p for p, _ in lay} == pids]
            if match:
                key, order = match[0], self._saved_layouts[match[0]]
                if order != [(p, k) for p, _, k in current]:
                    offsets = {p: off for p, off, _ in current}
                    index = torch.cat(
                        [torch.arange(offsets[p], offsets[p] + k) for p, k in order]
                        or [torch.empty(0, dtype=torch.long)]
                    ).to(buffer.device)
            elif not self._warned:
                self._warned = True
                logger.warning(
                    "xcomm.hooks: the resumed DDP groups parameters into buckets differently "
                    "from the checkpoint; residuals follow their parameters, but the run is "
                    "not bitwise that of an uninterrupted one"
                )
        if key in self._adopt:  # loaded by bucket index: taken as it is
            self._adopt.discard(key)
            live = self.feedback.get(key)
            if live is not None and live.numel() == sum(k for _, k in order):
                self._layouts[key] = order
                for pid, _ in order:
                    self._owner[pid] = key
        if self._layouts.get(key) != order:
            # A new or changed layout: take this bucket's pieces out of the
            # residuals that hold them, and the key's old residual apart.
            self._evict(key)
            for pid, _ in order:
                owner = self._owner.get(pid)
                if owner is not None:
                    self._evict(owner)
            self._assemble(key, order, buffer.device)
        if index is None:
            tensor, segments = buffer, _stretches(current, buffer.numel())
        else:
            tensor, segments = buffer.index_select(0, index), [k for _, k in order]
        return BucketView(key, tensor, index, buffer, segments)

    def _assemble(self, key: int, order: _Layout, device: torch.device) -> None:
        self._layouts[key] = order
        for pid, _ in order:
            self._owner[pid] = key
        pieces = [self._pending.pop(pid, None) for pid, _ in order]
        if all(p is None for p in pieces):
            return
        # Beside the bucket: a GPU bucket's codec keeps its residual there.
        residual = torch.zeros(sum(k for _, k in order), dtype=torch.float32, device=device)
        offset = 0
        for (_, numel), piece in zip(order, pieces):
            if piece is not None:
                residual.narrow(0, offset, numel).copy_(piece.reshape(-1))
            offset += numel
        self.feedback.store(key, residual)

    # -- residual access for methods without a fused codec --

    def residual(self, key: int) -> torch.Tensor | None:
        """The live residual of ``key`` (float32, laid out like its view), or None."""
        return self.feedback.get(key)

    def flush(self, view: BucketView) -> None:
        """Adds the residual of ``view`` into ``view.tensor`` and drops it: a
        lossless (or non-feedback) method then sends everything owed."""
        residual = self.feedback.get(view.key)
        if residual is None:
            return
        view.tensor.add_(residual.to(view.tensor.device, view.tensor.dtype))
        self.feedback.erase(view.key)

    def keep(self, view: BucketView, residual: torch.Tensor) -> None:
        """Stores ``residual`` (what a method did not send) for ``view``."""
        self.feedback.store(view.key, residual.to(torch.float32).reshape(-1))

    def clear(self) -> None:
        self.feedback.clear()
        self._layouts.clear()
        self._owner.clear()
        self._pending.clear()
        self._adopt.clear()

    # -- checkpointing --

    def state_dict(self) -> dict[str, Any]:
        """The residuals, by parameter name (with the model) or bucket index.

        ``{"version": 2, "by": "parameter", "residuals": {name: tensor},
        "layouts": {key: [[name, numel], ...]}}`` or ``{"version": 2, "by":
        "bucket", "residuals": {key: tensor}}``; copies, safe to keep.
        """
        live = self.feedback.state()  # copies
        if not self._names:
            return {"version": FEEDBACK_STATE_VERSION, "by": "bucket", "residuals": live}
        per_param: dict[str, torch.Tensor] = {
            p: t.clone() for p, t in self._pending.items() if isinstance(p, str)
        }
        for key, residual in live.items():
            offset = 0
            for pid, numel in self._layouts.get(key, []):
                if isinstance(pid, str):
                    per_param[pid] = residual.narrow(0, offset, numel).clone()
                offset += numel
        layouts = {
            k: [[p, n] for p, n in lay]
            for k, lay in self._layouts.items()
            if all(isinstance(p, str) for p, _ in lay)
        }
        return {
            "version": FEEDBACK_STATE_VERSION,
            "by": "parameter",
            "residuals": per_param,
            "layouts": layouts,
        }

    def __getstate__(self) -> dict[str, Any]:
        """:meth:`state_dict` as bytes, without the model (``bind(model)``
        after unpickling gives it back)."""
        return {"state_bytes": pack_state(self.state_dict())}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.load_state_dict(pickled_state(pickled))

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output, or the unversioned format of
        xcomm's earlier hooks (the same fields without ``version``)."""
        version = saved.get("version", 1)
        if version not in (1, FEEDBACK_STATE_VERSION) or saved.get("by") not in (
            "bucket",
            "parameter",
        ):
            raise ValueError(
                f"xcomm.hooks.FeedbackStore: unknown error-feedback state (version {version!r}, "
                f"by {saved.get('by')!r}); this xcomm reads versions 1 and "
                f"{FEEDBACK_STATE_VERSION}"
            )
        self.clear()
        self._saved_layouts = {}
        if saved["by"] == "bucket":
            for key, t in saved["residuals"].items():
                self.feedback.store(int(key), t.clone())
                self._adopt.add(int(key))
            return
        # Without the model yet, the residuals wait (view() asks for the model).
        self._pending = {str(n): t.clone() for n, t in saved["residuals"].items()}
        self._saved_layouts = {
            int(k): [(str(n), int(c)) for n, c in lay]
            for k, lay in saved.get("layouts", {}).items()
        }
