"""PowerSGD gradient compression for DDP, computed by xcomm's C++ codec.

A drop-in for torch's ``powerSGD_hook``: the same algorithm, configuration and
results (to float rounding), with the per-step computation done in C++
(``xcomm._C.PowerSgdCodec``) without per-tensor Python work, fresh
allocations or copies of the bucket::

    import xcomm
    from xcomm.hooks import PowerSGDState, powersgd_hook

    state = PowerSGDState(process_group=None, matrix_approximation_rank=1,
                          start_powerSGD_iter=1000)
    ddp_model.register_comm_hook(state, powersgd_hook)

It needs only allreduce, so it runs over any process group (xcomm, gloo,
NCCL). Buckets hold float32, float64, float16 or bfloat16; CPU buckets run
xcomm's own kernels, GPU buckets the same steps as ATen ops (cuBLAS) on their
device, with no host synchronization.

Per bucket and step (after ``start_powerSGD_iter`` steps of plain averaging):

1. the error feedback is added to the gradients; each gradient is viewed as a
   matrix M (``size(0) x rest``); those that shrink by more than
   ``min_compression_rate`` are compressed, the rest (biases, small layers)
   are sent as they are;
2. P = M Q (Q from the previous step, or seeded random numbers identical on
   every rank), sent in ONE allreduce together with the uncompressed
   gradients (torch's hook spends a separate allreduce on those);
3. P is orthonormalized, Q = M^T P is allreduced;
4. the bucket becomes P Q^T / world_size and the error feedback keeps what
   was not transmitted.

The collectives and the phases between them are chained through future
callbacks in C++ (``xcomm._C.PowerSgdAllreduce``): nothing blocks, and no
Python runs per collective.

Differences from torch's hook, all outside its supported cases or in its
favour:

* State (error feedback, warm-start Q) is kept per parameter, not per bucket,
  so it follows parameters when DDP rebuilds its buckets. ``state_dict()``
  captures everything a resumed run needs to continue bit for bit, even
  though a freshly built DDP uses a different bucket layout in its first
  iteration (see :meth:`PowerSGDState.state_dict`).
* A compressed gradient that is not finite on some rank comes out NaN on
  every rank, as in torch, but it does not poison the error feedback or the
  warm-start Q: after a step skipped by a GradScaler, training goes on.
  (torch's hook keeps NaN in both forever.)
* 0-dimensional parameters are sent uncompressed (torch's hook fails on
  them).
* Results are bitwise reproducible: they do not depend on the thread count,
  the CPU's vector width or the bucket layout.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

import logging
import math
import numbers
import operator
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import _C
from ._common import IssueOrder, start_in_shared_turn
from ._pickling import pack_state, pickled_state
from .stats import CompressionStats, allreduce_bytes

__all__ = ["PowerSGDState", "powersgd_allreduce", "powersgd_hook"]

logger = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_STATE_DICT_VERSION = 1
#: Configuration that changes the arithmetic: a checkpoint must agree on it.
_MATH_CONFIG = (
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "use_error_feedback",
    "warm_start",
    "orthogonalization_epsilon",
    "batch_tensors_with_same_shape",
)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(  # noqa: TRY004 - one exception type for every bad setting
            f"PowerSGDState: {name} must be an integer; got {value!r}"
        )
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(
            f"PowerSGDState: {name} must be an integer; got {value!r} ({type(value).__name__})"
        ) from None


def _as_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(  # noqa: TRY004 - one exception type for every bad setting
            f"PowerSGDState: {name} must be a real number; got {value!r} ({type(value).__name__})"
        )
    return float(value)


class PowerSGDState:
    r"""Configuration and state of :func:`powersgd_hook`.

    The constructor takes the arguments of torch's
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``
    with the same meaning (see its documentation for tuning advice):

    * ``matrix_approximation_rank`` (>= 1): rank of the approximation; lower
      compresses more.
    * ``start_powerSGD_iter``: steps of plain averaging before compression
      starts. Must be >= 2 when ``use_error_feedback`` or ``warm_start`` is
      on, because DDP rebuilds its buckets after the first step.
    * ``min_compression_rate`` (>= 0): a gradient is compressed only when
      ``(rows + cols) * rank * min_compression_rate < rows * cols``. Values
      below 1 are allowed, as in torch, and compress tensors (even 1-D ones,
      as ``n x 1`` matrices) that do not get smaller.
    * ``use_error_feedback``, ``warm_start``: keep the compression error and
      the previous Q; both recommended.
    * ``orthogonalization_epsilon`` (>= 0): added to column norms; with 0 an
      all-zero gradient matrix yields NaN (as in torch) at rank <= 2.
    * ``random_seed``: seeds the initial Qs, identically on every rank.
    * ``compression_stats_logging_frequency``: log compression statistics
      every so many steps (at INFO level).
    * ``batch_tensors_with_same_shape``: draw the initial random Qs of
      same-shaped gradients in one batch, as torch does with this flag (the
      computation itself never copies gradients into batches, so unlike in
      torch it costs no memory).

    ``process_group`` is the group to average over (``None``: the default
    group). ``stats`` (:class:`~xcomm.hooks.stats.CompressionStats`) counts
    the bytes given to the hook and the bytes it sent; ``iter``,
    ``compression_stats()`` and ``rng`` behave as in torch.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        rank = _as_int("matrix_approximation_rank", matrix_approximation_rank)
        if rank < 1:
            raise ValueError(
                "PowerSGDState: matrix_approximation_rank must be >= 1 (1 to 4 is typical; "
                f"lower compresses more); got {rank}"
            )
        start = _as_int("start_powerSGD_iter", start_powerSGD_iter)
        if (use_error_feedback or warm_start) and start <= 1:
            raise ValueError(
                "PowerSGDState: start_powerSGD_iter must be > 1 when use_error_feedback or "
                f"warm_start is enabled (got {start}): DDP rebuilds its buckets after the first "
                "iteration, so compression can only start from the third. Use "
                "start_powerSGD_iter=2 or more, or disable both options."
            )
        rate = _as_real("min_compression_rate", min_compression_rate)
        if math.isnan(rate) or rate < 0:
            raise ValueError(
                "PowerSGDState: min_compression_rate must be >= 0 (a gradient is compressed "
                f"when it shrinks by more than this factor; torch's default is 2); got {rate}"
            )
        eps = _as_real("orthogonalization_epsilon", orthogonalization_epsilon)
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(
                "PowerSGDState: orthogonalization_epsilon must be a finite number >= 0 "
                f"(0, or a small value such as 1e-8); got {eps}"
            )
        seed = _as_int("random_seed", random_seed)
        if not 0 <= seed < 2**32:
            raise ValueError(f"PowerSGDState: random_seed must be in [0, 2**32); got {seed}")
        frequency = _as_int(
            "compression_stats_logging_frequency", compression_stats_logging_frequency
        )

        logger.info(
            "PowerSGD config: matrix_approximation_rank = %s; start_powerSGD_iter = %s; "
            "min_compression_rate = %s; orthogonalization_epsilon = %s; use_error_feedback = %s; "
            "warm_start = %s; random_seed = %s; compression_stats_logging_frequency = %s; "
            "batch_tensors_with_same_shape = %s",
            rank, start, min_compression_rate, orthogonalization_epsilon, use_error_feedback,
            warm_start, seed, frequency, batch_tensors_with_same_shape,
        )  # fmt: skip
        self.process_group = process_group
        self._config = {
            "matrix_approximation_rank": rank,
            "min_compression_rate": min_compression_rate,
            "use_error_feedback": bool(use_error_feedback),
            "warm_start": bool(warm_start),
            "orthogonalization_epsilon": orthogonalization_epsilon,
            "random_seed": seed,
            "batch_tensors_with_same_shape": bool(batch_tensors_with_same_shape),
        }
        self.start_powerSGD_iter = start
        self.compression_stats_logging_frequency = max(1, frequency)
        # Seeds for the random Qs, drawn in the same order on every rank (and
        # as torch's hook draws them).
        self.rng = np.random.RandomState(seed)
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0
        self.stats = CompressionStats()
        self._codec = _C.PowerSgdCodec(
            matrix_approximation_rank=rank,
            min_compression_rate=rate,
            orthogonalization_epsilon=eps,
            use_error_feedback=bool(use_error_feedback),
            warm_start=bool(warm_start),
            batch_tensors_with_same_shape=bool(batch_tensors_with_same_shape),
        )
        # Parameter keys: numbered in the order the hook first sees the
        # parameters, which is DDP's initial bucket order in every run that
        # registers the hook before its first backward.
        self._keys: dict[int, tuple[weakref.ref, int]] = {}
        self._key_shapes: list[tuple[int, ...]] = []
        self._restored_shapes: list[tuple[int, ...]] | None = None
        # Per bucket index: weak references to the parameters of its current
        # layout, to notice cheaply when DDP rebuilds the bucket.
        self._bucket_params: dict[int, list[weakref.ref]] = {}
        self._allreduce = _C.PowerSgdAllreduce()

    # -- torch's configuration attributes (read-only: the codec holds them) --
    matrix_approximation_rank = property(lambda self: self._config["matrix_approximation_rank"])
    min_compression_rate = property(lambda self: self._config["min_compression_rate"])
    use_error_feedback = property(lambda self: self._config["use_error_feedback"])
    warm_start = property(lambda self: self._config["warm_start"])
    orthogonalization_epsilon = property(lambda self: self._config["orthogonalization_epsilon"])
    random_seed = property(lambda self: self._config["random_seed"])
    batch_tensors_with_same_shape = property(
        lambda self: self._config["batch_tensors_with_same_shape"]
    )

    def config(self) -> dict[str, Any]:
        """The constructor arguments (without the process group)."""
        return {
            **self._config,
            "start_powerSGD_iter": self.start_powerSGD_iter,
            "compression_stats_logging_frequency": self.compression_stats_logging_frequency,
        }

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Counts a step when the last bucket of an iteration is done (as torch)."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_powerSGD_iter:
            logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def _count_step(self, bucket: dist.GradBucket, done: torch.futures.Future) -> torch.Tensor:
        averaged = done.value()  # a failed step raises here, and is not counted
        self.maybe_increase_iter(bucket)
        return averaged

    def compression_stats(self) -> tuple[float, int, int]:
        """(rate, elements before, elements after) since compression started, as torch."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after

    # -- checkpointing --

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit.

        Holds the step counter, the seed generator, the statistics and, per
        parameter, the error feedback and the warm-start Q (copies). Only
        tensors and Python scalars: ``torch.save`` / ``torch.load`` (also with
        ``weights_only=True``) round-trip it.

        Parameters are identified by the order in which the hook first sees
        them, which is the order of DDP's initial buckets as long as the hook
        is registered before DDP's first backward, in the saving run and in
        the resuming one. The resumed run may then use any bucket layout
        (a fresh DDP's first iteration differs from the rebuilt layout the
        saving run had): the state follows the parameters. With
        ``warm_start=False`` the random Qs are drawn per bucket, so a resumed
        run matches bit for bit only where its bucket layout does.
        """
        params = {}
        for key in self._codec.state_keys():
            error, q = self._codec.param_state(key)
            params[key] = {"error": error, "q": q}
        _mt, keys_arr, pos, has_gauss, cached = self.rng.get_state()
        return {
            "version": _STATE_DICT_VERSION,
            "config": self.config(),
            "iter": self.iter,
            "next_stats_report": self.next_stats_report,
            "total_numel_before_compression": self.total_numel_before_compression,
            "total_numel_after_compression": self.total_numel_after_compression,
            "rng": {
                "keys": torch.from_numpy(keys_arr.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "stats": {k: v for k, v in self.stats.as_dict().items() if k != "ratio"},
            "warm_buckets": list(self._codec.warm_buckets()),
            "param_shapes": [list(s) for s in self._key_shapes],
            "params": params,
        }

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restores :meth:`state_dict`'s output.

        With ``strict`` (default) the checkpoint's configuration must equal
        this state's where it changes the arithmetic; otherwise this state's
        configuration is kept. Call it before training resumes; each
        parameter's state is checked against its gradient when the hook
        first sees it.
        """
        version = state_dict.get("version")
        if version != _STATE_DICT_VERSION:
            raise ValueError(
                f"PowerSGDState.load_state_dict: unknown state_dict version {version!r} "
                f"(this xcomm writes version {_STATE_DICT_VERSION})"
            )
        if strict:
            saved, mine = state_dict["config"], self.config()
            diff = [
                f"{k}: checkpoint {saved.get(k)!r}, this state {mine[k]!r}"
                for k in _MATH_CONFIG
                if saved.get(k) != mine[k]
            ]
            if diff:
                raise ValueError(
                    "PowerSGDState.load_state_dict: the checkpoint was made with another "
                    "configuration (" + "; ".join(diff) + "). Build the state with the "
                    "checkpoint's configuration, or pass strict=False to keep this one."
                )
        rng = state_dict["rng"]
        self.rng.set_state(
            (
                "MT19937",
                rng["keys"].numpy().astype(np.uint32),
                int(rng["pos"]),
                int(rng["has_gauss"]),
                float(rng["cached_gaussian"]),
            )
        )
        self.iter = int(state_dict["iter"])
        self.next_stats_report = int(state_dict["next_stats_report"])
        self.total_numel_before_compression = int(state_dict["total_numel_before_compression"])
        self.total_numel_after_compression = int(state_dict["total_numel_after_compression"])
        self.stats.load_dict(state_dict["stats"])
        self._codec.clear_state()
        for key, entry in state_dict["params"].items():
            self._codec.set_param_state(int(key), entry["error"], entry["q"])
        self._codec.set_warm_buckets([int(b) for b in state_dict["warm_buckets"]])
        self._restored_shapes = [tuple(s) for s in state_dict["param_shapes"]]
        for key, shape in enumerate(self._key_shapes):
            self._check_restored_shape(key, shape)

    def __getstate__(self) -> dict[str, Any]:
        # Like torch's state, pickles without the process group; the state
        # dict as bytes, so it passes through mp.spawn (see _pickling.py).
        return {"config": self.config(), "state_bytes": pack_state(self.state_dict())}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__init__(None, **pickled["config"])
        self.load_state_dict(pickled_state(pickled))

    def release_error(self, bucket: dist.GradBucket) -> None:
        """Adds the error feedback of ``bucket``'s parameters into their
        gradients and forgets it (the warm-start Q stays): for a caller that
        reduces this bucket with another method from now on, which then sends
        or keeps what PowerSGD owed."""
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            entry = self._keys.get(id(param))
            if entry is None or entry[0]() is not param:
                continue
            error, q = self._codec.param_state(entry[1])
            if error is not None:
                grad.view(-1).add_(error.to(grad.dtype))
                self._codec.set_param_state(entry[1], None, q)

    # -- internals used by the hook --

    def _check_restored_shape(self, key: int, shape: tuple[int, ...]) -> None:
        restored = self._restored_shapes
        if restored is None or key >= len(restored) or restored[key] == shape:
            return
        raise ValueError(
            f"PowerSGDState: the checkpoint's parameter #{key} has shape {restored[key]}, but "
            f"this run's parameter #{key} has shape {shape}. Parameters are numbered in the "
            "order the hook first sees them: load the state into the same model, and register "
            "the hook before DDP's first backward in both runs."
        )

    def _key_of(self, param: torch.Tensor) -> int:
        entry = self._keys.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        key = len(self._key_shapes)
        shape = tuple(param.shape)
        self._check_restored_shape(key, shape)
        self._keys[id(param)] = (weakref.ref(param), key)
        self._key_shapes.append(shape)
        return key

    @property
    def codec(self) -> Any:
        """The C++ codec (``_C.PowerSgdCodec``) this state drives, with its
        settings: ``auto`` times it, on a layout of its own, as this state's
        cost."""
        return self._codec

    def observe_layout(self, index: int, bucket: dist.GradBucket, buffer: torch.Tensor) -> None:
        """Tells the codec bucket ``index``'s layout (its parameters'
        gradients in ``buffer``) when it is new or changed; a hook that runs
        this state's codec outside :func:`powersgd_hook` (``auto_hook``)
        calls it first."""
        params = bucket.parameters()
        known = self._bucket_params.get(index)
        if (
            known is not None
            and len(known) == len(params)
            and all(ref() is p for ref, p in zip(known, params))
        ):
            return
        keys = [self._key_of(p) for p in params]
        self._codec.set_layout(index, buffer, bucket.gradients(), keys)
        self._bucket_params[index] = [weakref.ref(p) for p in params]

    def _report_compression_stats(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info(
                "Compression stats: iter %s, total before compression %s, total after "
                "compression %s, rate %s",
                self.iter, before, after, rate,
            )  # fmt: skip
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency


def _allreduce(group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.futures.Future:
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def powersgd_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: PowerSGD, as torch's ``powerSGD_hook``.

    Register with ``ddp_model.register_comm_hook(state, powersgd_hook)``;
    see :class:`PowerSGDState` and the module documentation.
    """
    return powersgd_allreduce(state, bucket)


def powersgd_allreduce(
    state: PowerSGDState, bucket: dist.GradBucket, order: IssueOrder | None = None
) -> torch.futures.Future[torch.Tensor]:
    """:func:`powersgd_hook`, with buckets taking turns in ``order`` when one
    is given: a hook that mixes methods (``auto_hook``) shares one order
    between them, and sets ``state.iter`` to its own step count first.

    Example::

        >>> fut = powersgd_allreduce(state, bucket, order=IssueOrder())  # doctest: +SKIP
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = group.size()
    buffer = bucket.buffer()
    if buffer.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            "xcomm.hooks.powersgd_hook compresses buckets of float32, float64, float16 or "
            f"bfloat16; this bucket is {buffer.dtype}"
        )
    index = bucket.index()
    state.observe_layout(index, bucket, buffer)
    # Link traffic as every xcomm hook counts it (see stats.py).
    link_bytes_before = allreduce_bytes(buffer.numel() * buffer.element_size(), world_size)

    if state.iter < state.start_powerSGD_iter:
        # Plain averaging, exactly torch's default allreduce hook.
        state.maybe_increase_iter(bucket)
        state.stats.record(link_bytes_before, link_bytes_before)
        buffer.div_(world_size)
        return _allreduce(group, buffer).then(lambda fut: fut.value()[0])

    codec = state._codec
    seed = int(state.rng.randint(1_000_000_000)) if codec.needs_seed(index) else None
    wire, q_numel, numel_before, numel_after = codec.prepare(index, buffer, seed)
    state.total_numel_before_compression += numel_before
    state.total_numel_after_compression += numel_after
    element = buffer.element_size()
    state.stats.record(
        link_bytes_before,
        allreduce_bytes(wire.numel() * element, world_size)
        + allreduce_bytes(q_numel * element, world_size),
    )
    state._report_compression_stats(bucket)

    # The two allreduces and the phases between them run in C++, chained by
    # future callbacks (see csrc/collectives/chains/PowerSgdAllreduce.hpp): nothing
    # waits, no Python runs per collective, and buckets take turns so every
    # rank issues the collectives in the same order. On a GPU the future
    # carries CUDA events, so DDP's stream waits for finish's kernels.
    def start(turn: torch.futures.Future | None) -> tuple[torch.futures.Future, ...]:
        return state._allreduce.start(codec, group, index, buffer, wire, turn)

    if order is None:
        fut = start(None)[0]
    else:
        fut = start_in_shared_turn(order, start)
    if not bucket.is_last():
        state.maybe_increase_iter(bucket)
        return fut
    # torch counts the step once its last bucket is done; so does this, in
    # the one Python callback of the step.
    return fut.then(lambda done: state._count_step(bucket, done))
