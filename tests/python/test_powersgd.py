"""xcomm's PowerSGD hook against torch's ``powerSGD_hook``.

Reference: torch's own hook with the same configuration, inputs and seed
(results equal to float tolerance: the arithmetic is the same, the summation
order differs), and an uninterrupted run for checkpoint-and-resume (bitwise).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import FailedWork, checkpoint_resume, flat_params, train
from dist_harness import RankContext, run_ranks

xcomm = pytest.importorskip("xcomm")
from xcomm import hooks

STEPS = 8


class Net(torch.nn.Module):
    """Matrices of several shapes (some repeated, for batching), a conv, biases."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.fc1 = torch.nn.Linear(8 * 6 * 6, 64)
        self.fc2 = torch.nn.Linear(64, 64)
        self.fc3 = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x)).flatten(1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        x = torch.relu(self.fc3(x))
        return self.out(x)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Net()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def _config(rank: int, batched: bool) -> dict[str, Any]:
    return {
        "matrix_approximation_rank": rank,
        "start_powerSGD_iter": 2,
        "min_compression_rate": 2,
        "use_error_feedback": True,
        "warm_start": True,
        "random_seed": 7,
        "batch_tensors_with_same_shape": batched,
    }


def _against_torch(ctx: RankContext, rank: int, batched: bool) -> dict[str, Any]:
    results = {}
    for impl in ("torch", "xcomm"):
        # One bucket: torch's hook issues collectives from future callbacks,
        # which with several buckets can reach ranks in different orders.
        model = DDP(make_model())
        if impl == "torch":
            state = torch_psgd.PowerSGDState(process_group=None, **_config(rank, batched))
            model.register_comm_hook(state, torch_psgd.powerSGD_hook)
        else:
            state = hooks.PowerSGDState(process_group=None, **_config(rank, batched))
            model.register_comm_hook(state, hooks.powersgd_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        train(model, opt, batch, ctx.rank, range(STEPS))
        results[impl] = flat_params(model)
        results[impl + "_rate"] = state.compression_stats()[0]
    return results


@pytest.mark.parametrize("route", ["native", "aten"])
@pytest.mark.parametrize("rank,batched", [(1, False), (2, True), (4, False)])
def test_matches_torch_powersgd_hook(rank: int, batched: bool, route: str) -> None:
    """route "aten": the ATen ops GPU buckets run (XCOMM_POWERSGD_ROUTE=aten
    sends CPU buckets down that route), so a machine without a GPU tests them."""
    env = {"XCOMM_POWERSGD_ROUTE": "aten"} if route == "aten" else None
    out = run_ranks(_against_torch, 2, rank, batched, env=env)
    for r in out:
        torch.testing.assert_close(r["xcomm"], r["torch"], rtol=1e-4, atol=1e-5)
        assert r["xcomm_rate"] == pytest.approx(r["torch_rate"])
    # every rank holds bitwise the same parameters
    for r in out[1:]:
        assert torch.equal(r["xcomm"], out[0]["xcomm"])
    # and compression really happened: the parameters moved away from start
    assert not torch.equal(out[0]["xcomm"], flat_params(make_model()))


def _resume(ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor]:
    def fresh() -> tuple[DDP, torch.optim.Optimizer, Any]:
        model = DDP(make_model(), bucket_cap_mb=0.05)
        state = hooks.PowerSGDState(process_group=None, **_config(2, False))
        model.register_comm_hook(state, hooks.powersgd_hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state

    return checkpoint_resume(fresh, batch, ctx.rank, range(5), range(5, 10))


def test_checkpoint_and_resume_is_bitwise_identical() -> None:
    for uninterrupted, resumed in run_ranks(_resume, 2):
        assert torch.equal(uninterrupted, resumed)


def _stats(ctx: RankContext) -> dict[str, Any]:
    model = DDP(make_model())
    state = hooks.PowerSGDState(process_group=None, **_config(1, False))
    model.register_comm_hook(state, hooks.powersgd_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, opt, batch, ctx.rank, range(4))
    return state.stats.as_dict()


def test_compression_statistics_count_bytes_on_the_wire() -> None:
    stats = run_ranks(_stats, 2)[0]
    n = sum(p.numel() for p in make_model().parameters())
    # 4 steps of fp32 buckets were handed to the hook ...
    assert stats["link_bytes_before"] > 0 and stats["calls"] >= 4
    # ... and the last 2 steps went out as rank-1 factors: far fewer bytes.
    assert stats["ratio"] > 1.5
    # a ring allreduce of the fp32 gradients moves 2 (n-1)/n bytes per byte
    assert stats["link_bytes_before"] == pytest.approx(4 * n * 4 * 2 * (2 - 1) / 2, rel=0.01)
    assert stats["link_bytes_sent"] < stats["link_bytes_before"] / 1.5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"matrix_approximation_rank": 0}, "matrix_approximation_rank"),
        ({"start_powerSGD_iter": 1}, "start_powerSGD_iter"),
        ({"min_compression_rate": -1}, "min_compression_rate"),
        ({"orthogonalization_epsilon": float("inf")}, "orthogonalization_epsilon"),
    ],
)
def test_bad_configuration_is_a_clear_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hooks.PowerSGDState(process_group=None, **kwargs)


def _int_bucket(ctx: RankContext) -> str:
    model = DDP(torch.nn.Linear(4, 4).to(torch.float64))
    state = hooks.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    model.register_comm_hook(state, hooks.powersgd_hook)
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()  # float64 works
    return "ok"


def test_float64_buckets_work() -> None:
    assert run_ranks(_int_bucket, 2) == ["ok", "ok"]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


class _FailingQAllreduce(torch.distributed.ProcessGroup):
    """The WORLD group, except that every second allreduce (each bucket's
    Q, issued from a future callback inside the C++ chain) fails."""

    def __init__(self) -> None:
        world = torch.distributed.group.WORLD
        super().__init__(world.rank(), world.size())
        self._world = world
        self.calls = 0

    def allreduce(self, tensors: Any, opts: Any = None) -> torch.distributed.Work:
        self.calls += 1
        if self.calls % 2 == 0:
            return FailedWork("injected Q allreduce failure")
        return self._world.allreduce(tensors, opts or torch.distributed.AllreduceOptions())

    def getBackendName(self) -> str:
        return "failing-q"


def _rank_failing_hook(ctx: RankContext) -> str:
    model = DDP(make_model(), bucket_cap_mb=0.01)  # several buckets
    group = _FailingQAllreduce()
    state = hooks.PowerSGDState(
        group,
        matrix_approximation_rank=2,
        start_powerSGD_iter=0,
        use_error_feedback=False,
        warm_start=False,
    )
    model.register_comm_hook(state, hooks.powersgd_hook)
    x, y = batch(ctx.rank, 0)
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e} (allreduces {group.calls}, iter {state.iter})"
    return "no error"


def test_a_failing_hook_reaches_ddp_with_its_own_message() -> None:
    """Before: DDP read the exception object as the hook's value and raised
    "Unable to cast ... to Tensor"."""
    for message in run_ranks(_rank_failing_hook, 2, timeout=120):
        assert "injected Q allreduce failure" in message, message
        assert "Unable to cast" not in message, message
        # The first bucket failed at its Q: the later buckets, waiting for
        # their turn, failed with its error and issued nothing; the step is
        # not counted.
        assert message.endswith("(allreduces 2, iter 0)"), message


def test_the_chain_without_a_codec_or_group_is_a_clear_error() -> None:
    """The C++ chain refuses None where the hook passes its codec and group,
    rather than crashing on a null pointer."""
    chain = xcomm._C.PowerSgdAllreduce()
    codec = hooks.PowerSGDState(None, matrix_approximation_rank=1)._codec
    with pytest.raises(RuntimeError, match="a codec and a process group are needed"):
        chain.start(None, None, 0, torch.zeros(2), torch.zeros(2))
    with pytest.raises(RuntimeError, match="a codec and a process group are needed"):
        chain.start(codec, None, 0, torch.zeros(2), torch.zeros(2))


def test_an_idle_buckets_state_is_replaced_while_another_bucket_is_mid_step() -> None:
    """A caller that moves an idle bucket to another method (``auto``) hands
    over its error feedback while the next bucket's PowerSGD step is in
    flight; only the in-flight bucket's own parameters are refused."""
    codec = xcomm._C.PowerSgdCodec(matrix_approximation_rank=2)
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(64 * 32, generator=g), torch.randn(64 * 32, generator=g)
    codec.set_layout(0, first, [first.view(64, 32)], [0])
    codec.set_layout(1, second, [second.view(64, 32)], [1])

    def step_of(bucket: int, buffer: torch.Tensor) -> None:
        seed = 1 if codec.needs_seed(bucket) else None
        wire = codec.prepare(bucket, buffer, seed)[0]
        codec.finish(bucket, codec.reduce_p(bucket, wire.clone(), 1), 1)

    step_of(1, second)
    error, q = codec.param_state(1)
    assert error is not None and float(error.abs().sum()) > 0  # rank 2 of a random 64 x 32
    seed = 1 if codec.needs_seed(0) else None
    wire = codec.prepare(0, first, seed)[0]  # bucket 0: mid-step
    codec.set_param_state(1, None, q)  # bucket 1 is idle: its error is handed over
    assert codec.param_state(1)[0] is None and torch.equal(codec.param_state(1)[1], q)
    with pytest.raises(RuntimeError, match="bucket 0, which holds it, is in the middle of a step"):
        codec.set_param_state(0, None, None)
    codec.finish(0, codec.reduce_p(0, wire.clone(), 1), 1)
    assert codec.param_state(0)[0] is not None  # its step finished and kept its error
    step_of(1, torch.randn(64 * 32, generator=g))  # bucket 1 re-reads its state and runs
