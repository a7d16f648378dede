"""Every hook state class passes through ``torch.multiprocessing.spawn`` (as
``mp.spawn(fn, args=(state,))`` and Lightning's ``ddp_spawn`` send it) and
the child can use it (issue 44: ``PowerSGDState`` and ``TopKState`` failed
in the child with "unable to resize file ... Invalid argument (22)",
``AutoState`` in the parent with "bad value(s) in fds_to_keep").

The parent builds each state with a non-default configuration and some
history (byte counts; PowerSGD's random state advanced), then spawns 2 ranks
with the states as arguments, and also as plain ``pickle.dumps`` bytes (the
reference: what ``pickle`` has always carried). Each rank checks that the
two copies have the same configuration and state dict, then trains a small
DDP model on xcomm for a few steps with each copy's hook and returns the
parameters and the hook's call count: both copies must give the same bits,
and the hook must have run. ``FsdpCompressionState`` and ``FeedbackStore``
(no DDP hook) must arrive with the same configuration and state dict.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import xcomm  # noqa: F401 - registers the backend (also in the spawned children)
from ddp_helpers import flat_params, small_mlp, train
from xcomm import hooks

STEPS = 5
COSTS = {
    "bf16": 1e-9,
    "fp16": 1e-9,
    "int8": 5e-9,
    "topk": 8e-9,
    "powersgd_mnr": 2e-9,
    "powersgd_pass": 1e-10,
}


def _ddp_states() -> dict[str, tuple[Any, Any]]:
    """Every DDP hook state class with its hook, configured off its defaults."""
    powersgd = hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    powersgd.rng.standard_normal(7)  # history: the pickle must carry the advanced generator
    made = {
        "cast": (hooks.CastState(), hooks.bf16_cast_hook),
        "int8": (hooks.Int8State(chunk_elems=64, start_iter=2), hooks.int8_compress_hook),
        "powersgd": (powersgd, hooks.powersgd_hook),
        "topk": (hooks.TopKState(density=0.25, start_iter=2), hooks.topk_hook),
        "randomk": (hooks.RandomKState(density=0.25, start_iter=2), hooks.randomk_hook),
        "auto": (
            hooks.AutoState(
                link=hooks.LinkModel(latency_s=1e-3, bandwidth_bytes_per_s=1e6),
                codec_costs=COSTS,
                interval=2,
                observe=False,  # no timing decides: the child continues bit for bit
            ),
            hooks.auto_hook,
        ),
    }
    for state, _ in made.values():
        state.stats.record(link_bytes_before=4000, link_bytes_sent=1000)  # history
    return made


def _other_states() -> dict[str, Any]:
    feedback = hooks.FeedbackStore()
    feedback.feedback.store(3, torch.arange(5, dtype=torch.float32))
    fsdp = hooks.FsdpCompressionState(method="auto", chunk_elems=64, interval=3)
    fsdp.feedback.store(fsdp.key("layers.0"), torch.full((4,), 0.5))
    fsdp.stats.record(link_bytes_before=800, link_bytes_sent=200)
    return {"feedback_store": feedback, "fsdp": fsdp}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _config(state: Any) -> Any:
    return state.__getstate__().get("config")


def _train_with(state: Any, hook: Any, rank: int) -> tuple[torch.Tensor, int]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(small_mlp())
    calls_before = state.stats.calls
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, _batch, rank, range(STEPS))
    return flat_params(model), state.stats.calls - calls_before


def _child(rank: int, ddp: dict, other: dict, blob: bytes, init: str, out: str) -> None:
    dist.init_process_group("xcomm", init_method=init, rank=rank, world_size=2)
    ref_ddp, ref_other = pickle.loads(blob)
    result: dict[str, Any] = {"problems": [], "ddp": {}}
    for name, state in other.items():
        ref = ref_other[name]
        if type(state) is not type(ref) or not _same(state.state_dict(), ref.state_dict()):
            result["problems"].append(f"{name}: the state dict changed on the way")
        if not _same(_config(state), _config(ref)):
            result["problems"].append(f"{name}: the configuration changed on the way")
    for name, (state, hook) in ddp.items():
        ref_state, ref_hook = ref_ddp[name]
        if not _same(_config(state), _config(ref_state)):
            result["problems"].append(f"{name}: the configuration changed on the way")
        if not _same(state.state_dict(), ref_state.state_dict()):
            result["problems"].append(f"{name}: the state dict changed on the way")
        stats_in = state.stats.calls
        got, calls = _train_with(state, hook, rank)
        want, ref_calls = _train_with(ref_state, ref_hook, rank)
        result["ddp"][name] = {
            "stats_in": stats_in,
            "calls": calls,
            "ref_calls": ref_calls,
            "equal": torch.equal(got, want),
        }
    dist.destroy_process_group()
    torch.save(result, f"{out}.rank{rank}.pt")


@pytest.mark.slow
def test_every_state_class_passes_through_mp_spawn(tmp_path: Any) -> None:
    ddp, other = _ddp_states(), _other_states()
    blob = pickle.dumps((ddp, other))
    init = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "result")
    env_before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    mp.spawn(_child, args=(ddp, other, blob, init, out), nprocs=2, join=True)
    assert {k: os.environ.get(k) for k in env_before} == env_before
    classes = {type(s).__name__ for s, _ in ddp.values()} | {
        type(s).__name__ for s in other.values()
    }
    assert classes == {
        "CastState",
        "Int8State",
        "PowerSGDState",
        "TopKState",
        "RandomKState",
        "AutoState",
        "FeedbackStore",
        "FsdpCompressionState",
    }
    for rank in range(2):
        result = torch.load(f"{out}.rank{rank}.pt")
        assert result["problems"] == [], (rank, result["problems"])
        for name, r in result["ddp"].items():
            assert r["stats_in"] == 1, (rank, name, r)  # the parent's history arrived
            # the hook ran once per step (one bucket) with either copy ...
            assert r["calls"] == r["ref_calls"] >= STEPS, (rank, name, r)
            # ... and the spawned copy computes what the pickled one does
            assert r["equal"], (rank, name, r)
