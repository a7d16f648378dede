"""xcomm's compression hooks (fp16/bf16 cast, int8, top-k, random-k) under DDP.

References: the exact mean gradient (math, from an uncompressed allreduce in
the same ranks), the codecs' documented error bounds, and an uninterrupted
run for checkpoint-and-resume (bitwise).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import checkpoint_resume, flat_params, train
from dist_harness import RankContext, run_ranks
from topk_reference import split_k_reference, topk_reference

xcomm = pytest.importorskip("xcomm")
from xcomm import _C, hooks

METHODS = ["fp16", "bf16", "int8", "topk", "topk_approx", "randomk"]


def make_state(method: str, **overrides: Any) -> tuple[Any, Callable]:
    if method in ("fp16", "bf16"):
        hook = hooks.fp16_cast_hook if method == "fp16" else hooks.bf16_cast_hook
        return hooks.CastState(), hook
    if method == "int8":
        return hooks.Int8State(chunk_elems=64, **overrides), hooks.int8_compress_hook
    if method == "topk":
        return hooks.TopKState(density=0.1, **overrides), hooks.topk_hook
    if method == "topk_approx":
        return hooks.TopKState(density=0.05, approximate=True, **overrides), hooks.topk_hook
    if method == "randomk":
        return hooks.RandomKState(density=0.3, seed=5, **overrides), hooks.randomk_hook
    raise ValueError(method)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 5),
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


# --------------------------------------------------------------------------- #


def _identical_params(
    ctx: RankContext, method: str, bucket_cap_mb: float = 25
) -> tuple[torch.Tensor, dict]:
    model = DDP(make_model(), bucket_cap_mb=bucket_cap_mb)
    state, hook = make_state(method)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(model, opt, batch, ctx.rank, range(8))
    return flat_params(model), state.stats.as_dict()


@pytest.mark.parametrize("method", METHODS)
def test_every_rank_holds_identical_parameters(method: str) -> None:
    results = run_ranks(_identical_params, 2, method)
    p0, stats = results[0]
    for p, _ in results[1:]:
        assert torch.equal(p, p0), f"{method}: ranks diverged"
    assert torch.isfinite(p0).all()
    assert stats["calls"] >= 8
    if method in ("fp16", "bf16"):
        assert stats["ratio"] == pytest.approx(2.0)
    if method == "int8":
        assert stats["ratio"] > 2.0  # the first 2 steps are uncompressed
    if method.startswith("topk") or method == "randomk":
        assert stats["ratio"] > 1.5


@pytest.mark.parametrize("method", ["int8", "topk", "randomk"])
def test_several_buckets_keep_ranks_in_step(method: str) -> None:
    """Buckets of ~4 KB: the int8 hook's second collective is issued from a
    callback while later buckets start; ranks must still agree on the order."""
    results = run_ranks(_identical_params, 3, method, 0.004)
    for p, _ in results[1:]:
        assert torch.equal(p, results[0][0]), f"{method}: ranks diverged"
    assert torch.isfinite(results[0][0]).all()


def _compressed_grad_vs_exact(ctx: RankContext, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One backward with the hook (compressing from step 0, no error feedback)
    and the exact mean gradient of the same inputs from a plain allreduce."""
    overrides = {} if method in ("fp16", "bf16") else {"start_iter": 0, "error_feedback": False}
    model = DDP(make_model())
    state, hook = make_state(method, **overrides)
    model.register_comm_hook(state, hook)
    x, y = batch(ctx.rank, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    ref = make_model()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    exact = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    dist.all_reduce(exact, group=ctx.ref)
    return got, exact / ctx.world_size


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.large_world)])
@pytest.mark.parametrize("method", ["fp16", "bf16", "int8"])
def test_dense_codecs_approximate_the_mean_gradient(method: str, world_size: int) -> None:
    got, exact = run_ranks(_compressed_grad_vs_exact, world_size, method)[0]
    scale = exact.abs().max().item()
    # fp16: 11-bit mantissa; bf16: 8-bit; int8: two roundings of 1/254 of a chunk's max.
    tol = {"fp16": 2e-3, "bf16": 1.6e-2, "int8": 2.5 / 127}[method] * scale
    assert (got - exact).abs().max().item() <= tol


def test_topk_without_feedback_sends_each_ranks_largest_entries() -> None:
    got, _exact = run_ranks(_compressed_grad_vs_exact, 2, "topk")[0]
    # Entries that survived are (sums of) true per-rank entries: sparse, finite.
    nonzero = (got != 0).float().mean().item()
    assert 0.0 < nonzero <= 0.2 + 1e-6  # at most 2 ranks x 10% density
    assert torch.isfinite(got).all()


def _checkpoint_resume(ctx: RankContext, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    def fresh() -> tuple[DDP, torch.optim.Optimizer, Any]:
        model = DDP(make_model())
        state, hook = make_state(method, model=model)
        model.register_comm_hook(state, hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state

    return checkpoint_resume(fresh, batch, ctx.rank, range(6), range(6, 12))


@pytest.mark.parametrize("method", ["int8", "topk", "topk_approx", "randomk"])
def test_checkpoint_and_resume_is_bitwise_identical(method: str) -> None:
    for uninterrupted, resumed in run_ranks(_checkpoint_resume, 2, method):
        assert torch.equal(uninterrupted, resumed), f"{method}: resumed run differs"


def _pickle_resume(ctx: RankContext, method: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Resumes through pickle (what ddp_spawn, mp.spawn args and torch.save do)
    instead of state_dict: the unpickled state continues bit for bit."""

    def build(state: Any = None) -> tuple[DDP, torch.optim.Optimizer, Any]:
        model = DDP(make_model())
        if state is None:
            state, hook = make_state(method, **({} if method in ("fp16",) else {"model": model}))
        else:
            hook = make_state(method)[1]
            state.bind_model(model)
        model.register_comm_hook(state, hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state

    problems = []
    model, opt, state = build()
    train(model, opt, batch, ctx.rank, range(6))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    blob, calls_at_pickle = pickle.dumps(state), state.stats.calls
    train(model, opt, batch, ctx.rank, range(6, 12))
    uninterrupted = flat_params(model)

    state2 = pickle.loads(blob)
    if state2.process_group is not None or getattr(state2, "model", None) is not None:
        problems.append("the process group or the model travelled with the pickle")
    if state2.stats.calls != calls_at_pickle or calls_at_pickle == 0:
        problems.append(f"statistics: {state2.stats.calls} calls, pickled at {calls_at_pickle}")
    model2, opt2, _ = build(state2)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(model2, opt2, batch, ctx.rank, range(6, 12))
    return uninterrupted, flat_params(model2), problems


@pytest.mark.parametrize("method", ["fp16", "int8", "topk", "randomk"])
def test_states_pickle_and_resume_bitwise(method: str) -> None:
    for uninterrupted, resumed, problems in run_ranks(_pickle_resume, 2, method):
        assert problems == []
        assert torch.equal(uninterrupted, resumed), f"{method}: the unpickled state differs"


def test_unpickled_state_without_its_model_refuses_per_parameter_residuals() -> None:
    model = make_model()
    state = hooks.Int8State(chunk_elems=64, model=model)
    state.feedback.load_state_dict({"by": "parameter", "residuals": {"0.weight": torch.ones(3)}})
    clone = pickle.loads(pickle.dumps(state))
    with pytest.raises(ValueError, match="bind_model"):
        clone.feedback.view(_FakeBucket())
    clone.bind_model(model)
    assert clone.feedback.by_parameter


class _FakeBucket:
    def __init__(self) -> None:
        self._buffer = torch.zeros(4)

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: hooks.TopKState(density=0.0), "density"),
        (lambda: hooks.TopKState(density=1.5), "density"),
        (lambda: hooks.RandomKState(density=-0.1), "density"),
        (lambda: hooks.TopKState(start_iter=1), "start_iter"),
        (lambda: hooks.RandomKState(start_iter=0), "start_iter"),
        (lambda: hooks.Int8State(start_iter=1), "start_iter"),
        (lambda: hooks.Int8State(chunk_elems=0), "chunk_elems"),
        (lambda: hooks.TopKState(warmup_steps=-1), "warmup_steps"),
    ],
)
def test_bad_configuration_is_a_clear_error(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_start_iter_below_two_is_fine_without_error_feedback() -> None:
    hooks.TopKState(start_iter=0, error_feedback=False)
    hooks.Int8State(start_iter=0, error_feedback=False)


def test_topk_warmup_decays_to_the_target_density() -> None:
    state = hooks.TopKState(density=0.01, warmup_steps=10, warmup_density=0.25)
    state.steps.iter = state.start_iter
    assert state.current_density() == pytest.approx(0.25)
    state.steps.iter = state.start_iter + 5
    assert 0.01 < state.current_density() < 0.25
    state.steps.iter = state.start_iter + 10
    assert state.current_density() == pytest.approx(0.01)


@pytest.mark.parametrize("cuda_codecs", [False, True])
def test_a_gpu_bucket_through_a_host_codec_is_warned_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, cuda_codecs: bool
) -> None:
    """In a build without CUDA kernels, int8, top-k and random-k encode on the
    CPU: a bucket on another device makes a round trip through the host every
    step, which the user is told (once per hook; a meta tensor stands in for a
    GPU bucket). A build with the kernels keeps GPU buckets on the device and
    says nothing."""
    import logging

    from xcomm import _C
    from xcomm.hooks import _common

    monkeypatch.setattr(_C, "cuda_codecs", cuda_codecs)
    _common._warned_host_codec.discard("topk_hook")
    with caplog.at_level(logging.WARNING, logger="xcomm.hooks._common"):
        _common.warn_host_codec("topk_hook", torch.empty(4))  # CPU: nothing to say
        for _ in range(3):
            _common.warn_host_codec("topk_hook", torch.empty(4, device="meta"))
    if cuda_codecs:
        assert not caplog.records, caplog.text
        return
    assert len(caplog.records) == 1, caplog.text
    assert "topk codec runs on the CPU" in caplog.text and "bf16_cast_hook" in caplog.text


@pytest.mark.parametrize("density", [0.0, 1.5, -0.01])
def test_topk_allreduce_refuses_a_density_outside_zero_to_one_by_name(density: float) -> None:
    """A density a caller passes (auto passes each bucket's) is checked before
    anything is reduced, and the error names the function and the value."""
    from xcomm.hooks.sparse import topk_allreduce

    with pytest.raises(
        ValueError, match=rf"topk_allreduce: density must be in \(0, 1\], got {density}"
    ):
        topk_allreduce(hooks.TopKState(), None, step=5, density=density)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- #
# Top-k per tensor: against a reference written here, in torch.


class _BagModel(torch.nn.Module):
    """An embedding table (mostly zero gradient rows) before dense layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.EmbeddingBag(2000, 16, mode="mean")
        self.head = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(x))


def _bag_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 2000, (16, 8), generator=g), torch.randint(0, 5, (16,), generator=g)


def _reference_per_tensor_topk(residuals, bucket):  # type: ignore[no-untyped-def]
    """(Unannotated: DDP checks a hook's annotations, which this module keeps
    as strings.) Each rank sends the top k_i of each gradient of (gradient + residual)
    as a dense vector; their allreduce is the sum top-k's allgather decodes."""
    buf, world = bucket.buffer(), dist.get_world_size()
    step = residuals.setdefault(("step", bucket.index()), 0)
    residuals[("step", bucket.index())] = step + 1
    if step < 2:  # TopKState's start_iter
        return (
            dist.all_reduce(buf.div_(world), async_op=True)
            .get_future()
            .then(lambda f: f.value()[0])
        )
    sizes = [g.numel() for g in bucket.gradients()]
    nonzero = [int((g != 0).sum()) for g in bucket.gradients()]
    k = _C.TopKCodec.k_for(buf.numel(), 0.02)
    acc = buf + residuals.get(bucket.index(), torch.zeros_like(buf))
    send, at = torch.zeros_like(acc), 0
    for size, part in zip(sizes, split_k_reference(nonzero, sizes, k)):
        if part:
            # Ties (rows of one bag share a gradient) go to the lower index.
            idx = topk_reference(acc[at : at + size], part) + at
            send[idx] = acc[idx]
        at += size
    residuals[bucket.index()] = acc - send
    return (
        dist.all_reduce(send, async_op=True)
        .get_future()
        .then(lambda f: buf.copy_(f.value()[0].div_(world)))
    )


def _per_tensor_run(ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    def run(hook: Callable, state: Any) -> torch.Tensor:
        model = DDP(_BagModel())
        model.register_comm_hook(state, hook)
        train(model, torch.optim.SGD(model.parameters(), lr=0.5), _bag_batch, ctx.rank, range(8))
        return flat_params(model)

    per_tensor = hooks.TopKState(density=0.02, per_tensor=True)
    got = run(hooks.topk_hook, per_tensor)
    reference = run(_reference_per_tensor_topk, {})
    bucket_wide = run(hooks.topk_hook, hooks.TopKState(density=0.02))
    return got, reference, bucket_wide, per_tensor.stats.calls


def test_top_k_per_tensor_matches_a_torch_reference_and_differs_from_bucket_wide() -> None:
    for got, reference, bucket_wide, calls in run_ranks(_per_tensor_run, 2):
        assert calls == 8  # one bucket, every step through the hook
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-6)
        # Bucket-wide, the dense layers' larger entries crowd out the table's.
        assert (got - bucket_wide).abs().max().item() > 1e-3
