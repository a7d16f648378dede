"""PyTorch Lightning on xcomm: a strategy for the ``Trainer`` and one for
``Fabric`` that take :class:`xcomm.Options` and any DDP comm hook, on the CPU
as well as on GPUs.

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only on
CUDA (silently ignored on the CPU, with every backend), takes no process group
options, and ``strategy="ddp"`` runs on gloo/nccl. :class:`XcommStrategy` and
:class:`XcommFabricStrategy` run DDP on an xcomm group made with ``options``
and register the hook on every device. They are also registered by name
(``strategy="xcomm"``, ``"xcomm_spawn"``) once this module is imported.

Every launcher works: Lightning's subprocess launcher re-runs the script
(which imports this module), and the spawn launcher pickles the strategy, so
a spawned rank imports this module, and so registers the backend, before it
makes its group. Hook states pass through ``ddp_spawn`` (they pickle without
their process group).

This module needs PyTorch Lightning (``pip install pytorch-lightning``, or the
``lightning`` package); ``import xcomm`` does not import it. It builds on
``pytorch_lightning`` / ``lightning_fabric`` where installed, else on
``lightning.pytorch`` / ``lightning.fabric``: use the Trainer and Fabric of
that same package.

Example (Trainer)::

    import pytorch_lightning as pl
    import xcomm
    from xcomm import hooks
    from xcomm.lightning import XcommStrategy

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=XcommStrategy(
            options=xcomm.Options(compression_min_bytes=1 << 20),
            ddp_comm_hook=hooks.int8_compress_hook,
            ddp_comm_state=hooks.Int8State(),
        ),
    )

Example (Fabric)::

    from lightning_fabric import Fabric
    from xcomm.lightning import XcommFabricStrategy

    fabric = Fabric(
        accelerator="cpu",
        devices=2,
        strategy=XcommFabricStrategy(
            ddp_comm_hook=hooks.powersgd_hook,
            ddp_comm_state=hooks.PowerSGDState(None, start_powerSGD_iter=10),
        ),
    )
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)  # DDP on xcomm, hook registered
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ._registration import BACKEND_NAME
from .options import Options

try:
    from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning_fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
    from lightning_fabric.strategies import DDPStrategy as _FabricDDPStrategy
    from lightning_fabric.utilities.distributed import _init_dist_connection
    from lightning_fabric.utilities.seed import reset_seed
    from pytorch_lightning.strategies import DDPStrategy as _TrainerDDPStrategy
    from pytorch_lightning.strategies import StrategyRegistry as _TRAINER_REGISTRY
except ImportError:
    try:
        from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
        from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
        from lightning.fabric.strategies import DDPStrategy as _FabricDDPStrategy
        from lightning.fabric.utilities.distributed import _init_dist_connection
        from lightning.fabric.utilities.seed import reset_seed
        from lightning.pytorch.strategies import DDPStrategy as _TrainerDDPStrategy
        from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY
    except ImportError as exc:
        raise ImportError(
            "xcomm.lightning needs PyTorch Lightning: pip install pytorch-lightning (or lightning)"
        ) from exc

__all__ = ["XcommFabricStrategy", "XcommStrategy"]

#: A DDP communication hook: ``hook(state, bucket) -> Future[Tensor]``.
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def _init_group(strategy: Any, timeout: timedelta | None, options: Options | None) -> None:
    """Makes the default group on xcomm as Lightning's DDP strategies make
    theirs (addresses from the cluster environment), with ``options``."""
    kwargs: dict[str, Any] = {"timeout": timeout, "pg_options": options}
    device = strategy.root_device
    kwargs["device_id"] = device if device.type != "cpu" else None
    _init_dist_connection(strategy.cluster_environment, BACKEND_NAME, **kwargs)


def _register_hook(
    model: DistributedDataParallel,
    hook: CommHook | None,
    state: Any,
    wrapper: Callable[[CommHook], CommHook] | None,
) -> None:
    if hook is None:
        return
    if wrapper is not None:
        hook = wrapper(hook)
    model.register_comm_hook(state, hook)


class _XcommDDPMixin:
    """What both strategies add to Lightning's DDP: the xcomm group's options
    and timeout, and a hook registered on every device."""

    _xcomm_options: Options | None
    _xcomm_timeout: timedelta | None
    _xcomm_hook: tuple[CommHook | None, Any, Callable[[CommHook], CommHook] | None]

    @classmethod
    def _refuse_backend(cls, kwargs: dict[str, Any]) -> None:
        if "process_group_backend" in kwargs:
            raise TypeError(
                f"{cls.__name__} runs on the xcomm backend: drop process_group_backend "
                "(use Lightning's DDPStrategy for another backend)"
            )

    def _keep(
        self,
        options: Options | None,
        timeout: timedelta | None,
        hook: CommHook | None,
        state: Any,
        wrapper: Callable[[CommHook], CommHook] | None,
    ) -> None:
        self._xcomm_options = options
        self._xcomm_timeout = timeout
        self._xcomm_hook = (hook, state, wrapper)

    @property
    def options(self) -> Options | None:
        """The group's options, as given."""
        return self._xcomm_options

    @property
    def ddp_comm_hook(self) -> CommHook | None:
        return self._xcomm_hook[0]

    @property
    def ddp_comm_state(self) -> Any:
        """The hook's state (in a spawned rank: that rank's copy)."""
        return self._xcomm_hook[1]

    def _init_xcomm_group(self) -> None:
        _init_group(self, self._xcomm_timeout, self._xcomm_options)


class XcommStrategy(_XcommDDPMixin, _TrainerDDPStrategy):
    """Lightning ``Trainer`` DDP on an xcomm group, with any DDP comm hook.

    Args:
        options: the group's :class:`xcomm.Options` (``None``: defaults).
        ddp_comm_hook: a DDP communication hook (xcomm's, torch's or your
            own), registered on the DDP model on every device (Lightning's
            ``DDPStrategy`` registers it on CUDA only).
        ddp_comm_state: the hook's state (e.g. ``hooks.Int8State()``).
        ddp_comm_wrapper: wraps the hook first, as in Lightning
            (e.g. torch's ``fp16_compress_wrapper``).
        start_method: ``"popen"`` (Lightning re-runs the script per rank),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        timeout: the group's timeout (Lightning's default: 30 minutes).
        **kwargs: everything else Lightning's ``DDPStrategy`` takes
            (``find_unused_parameters``, ``static_graph``, ...) except
            ``process_group_backend``, which is xcomm.

    Example::

        >>> from xcomm import hooks
        >>> strategy = XcommStrategy(
        ...     ddp_comm_hook=hooks.fp16_cast_hook, ddp_comm_state=hooks.CastState()
        ... )
        >>> strategy.process_group_backend
        'xcomm'
    """

    def __init__(
        self,
        options: Options | None = None,
        ddp_comm_hook: CommHook | None = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Callable[[CommHook], CommHook] | None = None,
        start_method: str = "popen",
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        self._refuse_backend(kwargs)
        super().__init__(
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_wrapper=ddp_comm_wrapper,
            process_group_backend=BACKEND_NAME,
            start_method=start_method,  # type: ignore[arg-type]
            timeout=timeout,
            **kwargs,
        )
        self._keep(options, timeout, ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper)

    def setup_distributed(self) -> None:
        """Lightning's ``DDPStrategy.setup_distributed`` with the group's options."""
        reset_seed()
        self.set_world_ranks()
        self._init_xcomm_group()

    def configure_ddp(self) -> None:
        """Wraps the model in DDP and registers the hook on any device."""
        super().configure_ddp()  # registers the hook on CUDA only
        if self.root_device.type != "cuda":
            assert isinstance(self.model, DistributedDataParallel)
            _register_hook(self.model, *self._xcomm_hook)


class XcommFabricStrategy(_XcommDDPMixin, _FabricDDPStrategy):
    """Lightning ``Fabric`` DDP on an xcomm group, with any DDP comm hook.

    ``fabric.setup(model, optimizer)`` wraps the model in DDP on the xcomm
    group and registers the hook (Fabric's own ``DDPStrategy`` takes none:
    without this strategy it must be registered through the private
    ``model._forward_module``).

    Args:
        options: the group's :class:`xcomm.Options` (``None``: defaults).
        ddp_comm_hook: a DDP communication hook, registered on every device.
        ddp_comm_state: the hook's state.
        ddp_comm_wrapper: wraps the hook first (e.g. torch's
            ``fp16_compress_wrapper``).
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        timeout: the group's timeout.
        **kwargs: passed to ``DistributedDataParallel``.

    Example::

        >>> from xcomm import hooks
        >>> strategy = XcommFabricStrategy(
        ...     ddp_comm_hook=hooks.int8_compress_hook, ddp_comm_state=hooks.Int8State()
        ... )
        >>> strategy.process_group_backend
        'xcomm'
    """

    def __init__(
        self,
        options: Options | None = None,
        ddp_comm_hook: CommHook | None = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Callable[[CommHook], CommHook] | None = None,
        start_method: str = "popen",
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        self._refuse_backend(kwargs)
        super().__init__(
            process_group_backend=BACKEND_NAME,
            start_method=start_method,  # type: ignore[arg-type]
            timeout=timeout,
            **kwargs,
        )
        self._keep(options, timeout, ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper)

    def _setup_distributed(self) -> None:
        # Fabric's DDPStrategy._setup_distributed, with the group's options.
        self._set_world_ranks()
        self._init_xcomm_group()

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        """Wraps ``module`` in DDP on the xcomm group and registers the hook."""
        ddp = super().setup_module(module)
        _register_hook(ddp, *self._xcomm_hook)
        return ddp


def _register_names() -> None:
    for registry, cls in (
        (_TRAINER_REGISTRY, XcommStrategy),
        (_FABRIC_REGISTRY, XcommFabricStrategy),
    ):
        for name, start_method in (("xcomm", "popen"), ("xcomm_spawn", "spawn")):
            if name not in registry:
                registry.register(
                    name,
                    cls,
                    description=f"DDP on xcomm, start_method {start_method!r}",
                    start_method=start_method,
                )


_register_names()
