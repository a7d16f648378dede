"""Training and checkpoint helpers shared by the DDP hook tests.

Each test module keeps its own batches; these drive them, and ``small_mlp``
is the small model several modules share. ``FailedWork`` is a collective
that failed, for the hooks' failure paths.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

#: A rank's (inputs, labels) for a step.
BatchFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
#: A fresh (model, optimizer, hook state), built the same way every time.
FreshFn = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer, Any]]


def small_mlp() -> torch.nn.Module:
    """12 inputs -> 4 outputs, three layers: several buckets at small bucket caps."""
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: BatchFn, rank: int, steps: range
) -> None:
    """Cross-entropy SGD steps on ``batch(rank, step)`` for each step."""
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def checkpoint_resume(
    fresh: FreshFn, batch: BatchFn, rank: int, first: range, second: range
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trains ``first`` then ``second`` without a break, and again resuming
    from a checkpoint (model, optimizer, hook state) taken after ``first`` in a
    fresh model; returns both final parameter vectors (equal when resuming is
    exact)."""
    model, opt, state = fresh()
    train(model, opt, batch, rank, first)
    saved = copy.deepcopy(
        {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
    )
    train(model, opt, batch, rank, second)
    uninterrupted = flat_params(model)

    model2, opt2, state2 = fresh()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    state2.load_state_dict(saved["hook"])
    train(model2, opt2, batch, rank, second)
    return uninterrupted, flat_params(model2)


class FailedWork(torch.distributed.Work):
    """A collective that failed: its future holds a real error, as a
    transport's does (a Python ``set_exception`` would hold it as a value)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        started: torch.futures.Future = torch.futures.Future()
        started.set_result(None)
        self._future = started.then(lambda _: _raise(RuntimeError(message)))

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()
        return True


def _raise(error: Exception) -> None:
    raise error
