"""Local SGD with compressed outer steps (xcomm.diloco.DiLoCo).

References: DiLoCo's math replayed in one process (every rank's inner
training, the mean pseudo-gradient, the outer Nesterov step; with fragments,
overlap and mixing for Streaming DiLoCo), DDP and HSDP (DiLoCo with ``H = 1``,
an outer SGD of ``lr = 1`` and a plain inner SGD averages the models every step,
which for SGD is averaging the gradients), and an uninterrupted run
(checkpoint and resume must be bitwise it).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch
from torch import nn

from dist_harness import RankContext, run_ranks
from xcomm import _C
from xcomm.diloco import DiLoCo, nesterov_sgd


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank: int, step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :4].sin() + 0.1 * x[:, 4:]


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _inner_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


# -- settings --------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"method": "int4"}, "method must be one of"),
        ({"sync_every": 0}, "sync_every must be >= 1"),
        ({"sync_every": 4, "overlap_steps": 4}, r"overlap_steps must be in \[0, sync_every\)"),
        ({"sync_every": 2, "fragments": 3}, "fragments must be in"),
        ({"overlap_steps": 1, "mix": 1.0}, r"mix must be in \[0, 1\)"),
        ({"chunk_elems": 0}, "chunk_elems must be > 0"),
    ],
)
def test_bad_settings_name_the_setting(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DiLoCo(_model(), **settings)


def test_integer_parameters_are_refused() -> None:
    with pytest.raises(TypeError, match="floating point"):
        DiLoCo([torch.zeros(3, dtype=torch.int64)])


# -- the math, replayed in one process -------------------------------------------------


def _train(ctx: RankContext, steps: int, settings: dict[str, Any]) -> dict[str, Any]:
    model = _model()
    opt = _inner_opt(model)
    diloco = DiLoCo(model, **settings)
    agreed_after: dict[int, torch.Tensor] = {}
    for step in range(1, steps + 1):
        _inner_step(model, opt, ctx.rank, step)
        diloco.step()
        agreed_after[step] = _flat([f.agreed for f in diloco.fragments]).clone()
    diloco.close()
    return {
        "params": _flat(list(model.parameters())).clone(),
        "agreed": agreed_after,
        "fragments": [(f.start, f.end) for f in diloco.fragments],
        "stats": diloco.stats.as_dict(),
    }


def _replay(
    world: int,
    steps: int,
    sync_every: int,
    fragments: list[tuple[int, int]],
    overlap: int = 0,
    mix: float = 0.0,
    outer_lr: float = 0.7,
) -> torch.Tensor:
    """DiLoCo / Streaming DiLoCo for ``world`` ranks, written out directly;
    ``fragments`` are element ranges of the parameters laid end to end."""
    models = [_model() for _ in range(world)]
    opts = [_inner_opt(m) for m in models]
    params = [list(m.parameters()) for m in models]
    agreed = [nn.Parameter(_flat(params[0])[lo:hi].clone()) for lo, hi in fragments]
    outer = [torch.optim.SGD([a], lr=outer_lr, momentum=0.9, nesterov=True) for a in agreed]
    n_frag = len(fragments)
    offsets = [(k + 1) * sync_every // n_frag for k in range(n_frag)]
    in_flight: dict[int, tuple[int, torch.Tensor]] = {}

    def local(r: int, k: int) -> torch.Tensor:
        lo, hi = fragments[k]
        return _flat(params[r])[lo:hi].clone()

    def write(r: int, k: int, values: torch.Tensor) -> None:
        flat = _flat(params[r]).clone()
        flat[fragments[k][0] : fragments[k][1]] = values
        with torch.no_grad():
            at = 0
            for p in params[r]:
                p.copy_(flat[at : at + p.numel()].view_as(p))
                at += p.numel()

    def land(k: int) -> None:
        _, mean = in_flight.pop(k)
        agreed[k].grad = mean
        outer[k].step()
        for r in range(world):
            new = agreed[k].detach()
            if overlap and mix:
                new = (1 - mix) * new + mix * local(r, k)
            write(r, k, new)

    for step in range(1, steps + 1):
        for r in range(world):
            _inner_step(models[r], opts[r], r, step)
        for k in range(n_frag):
            if k in in_flight and in_flight[k][0] == step:
                land(k)
        for k in range(n_frag):
            if step >= offsets[k] and (step - offsets[k]) % sync_every == 0:
                deltas = [agreed[k].detach() - local(r, k) for r in range(world)]
                in_flight[k] = (step + overlap, sum(deltas) / world)
                if overlap == 0:
                    land(k)
    return torch.stack([_flat(p) for p in params])


def test_uncompressed_diloco_is_the_math() -> None:
    """H = 3 over 10 steps (3 outer steps, then a partial interval): every
    rank's parameters are DiLoCo's, and the agreed ones the same bits everywhere."""
    settings = {"sync_every": 3, "method": "none"}
    res = run_ranks(_train, 2, 10, settings, ref_group=False)
    expected = _replay(2, 10, 3, res[0]["fragments"])
    for r in range(2):
        torch.testing.assert_close(res[r]["params"], expected[r], rtol=1e-6, atol=1e-7)
    for step in range(1, 11):
        assert torch.equal(res[0]["agreed"][step], res[1]["agreed"][step]), step
    # After an outer step every rank continues from the same point.
    assert not torch.equal(res[0]["params"], res[1]["params"])  # 1 local step since step 9
    before = res[0]["stats"]["link_bytes_before"]
    assert res[0]["stats"]["calls"] == 3 and res[0]["stats"]["link_bytes_sent"] == before


def test_streaming_diloco_is_the_math() -> None:
    """Two fragments synced in turn, each exchange overlapping one inner step,
    landed with mix 0.5: Streaming DiLoCo's schedule, step for step."""
    settings = {"sync_every": 4, "method": "none", "fragments": 2, "overlap_steps": 1}
    res = run_ranks(_train, 2, 13, settings, ref_group=False)
    numel = res[0]["params"].numel()
    assert res[0]["fragments"] == [(0, numel // 2), (numel // 2, numel)]  # cut inside a layer
    expected = _replay(2, 13, 4, res[0]["fragments"], overlap=1, mix=0.5)
    for r in range(2):
        torch.testing.assert_close(res[r]["params"], expected[r], rtol=1e-6, atol=1e-7)
    # fragment 0 at steps 2, 6, 10; fragment 1 at 4, 8, 12 (landing one step later)
    assert res[0]["stats"]["calls"] == 6


@pytest.mark.parametrize("method", ["int8", "bf16"])
def test_compressed_diloco_stays_near_uncompressed(method: str) -> None:
    """int8 / bf16 pseudo-gradients with error feedback: the agreed parameters
    are the same bits on every rank, within the codec's precision of the
    uncompressed run, and each outer step sends an all-to-all of the encoded
    pseudo-gradient plus an all-gather of the encoded mean shard."""
    steps, settings = 12, {"sync_every": 4, "chunk_elems": 64}
    ref = run_ranks(_train, 2, steps, {**settings, "method": "none"}, ref_group=False)
    got = run_ranks(_train, 2, steps, {**settings, "method": method}, ref_group=False)
    for step in range(1, steps + 1):
        assert torch.equal(got[0]["agreed"][step], got[1]["agreed"][step]), step
    assert torch.equal(got[0]["params"], got[1]["params"])  # step 12 is an outer step
    diff = (got[0]["params"] - ref[0]["params"]).abs().max().item()
    assert 0 < diff < 2e-3, diff
    numel = ref[0]["params"].numel()
    if method == "int8":
        codec = _C.Int8Codec(64)
        shard_bytes = codec.packed_bytes(codec.shard_elems(numel, 2))
    else:
        shard_bytes = 2 * numel // 2
    # 2 ranks: half the all-to-all's buffer (one shard) out, one shard to the all-gather
    assert got[0]["stats"]["link_bytes_sent"] == 3 * 2 * shard_bytes
    assert got[0]["stats"]["link_bytes_before"] == 3 * 4 * numel  # a float32 ring allreduce
    assert ref[0]["stats"]["link_bytes_sent"] == 3 * 4 * numel


# -- DDP and HSDP as references --------------------------------------------------------


def _averaging(ctx: RankContext, ddp: bool) -> torch.Tensor:
    """Plain SGD on each rank's batch: DDP, or DiLoCo averaging every step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    trained: nn.Module = DDP(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = None
    if not ddp:
        outer = lambda ps: torch.optim.SGD(ps, lr=1.0)  # theta_g - mean delta
        diloco = DiLoCo(model, sync_every=1, method="none", outer_optimizer=outer)
    for step in range(1, 6):
        _inner_step(trained, opt, ctx.rank, step)
        if diloco is not None:
            diloco.step()
    return _flat(list(model.parameters())).clone()


def test_averaging_every_step_is_ddp() -> None:
    ddp = run_ranks(_averaging, 2, True, ref_group=False)
    avg = run_ranks(_averaging, 2, False, ref_group=False)
    for r in range(2):
        torch.testing.assert_close(avg[r], ddp[0], rtol=1e-5, atol=1e-6)


def _fsdp2(ctx: RankContext, diloco_method: str | None) -> dict[str, Any]:
    """A 2 x 2 mesh: FSDP2 over "shard"; the replicas average either by HSDP
    (``diloco_method`` None, plain SGD) or by DiLoCo on the "replicate" group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    shard_mesh = mesh if diloco_method is None else mesh["shard"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = None
    if diloco_method == "none":
        outer = lambda ps: torch.optim.SGD(ps, lr=1.0)
        diloco = DiLoCo(
            model,
            sync_every=1,
            method="none",
            outer_optimizer=outer,
            group=mesh.get_group("replicate"),
        )
    elif diloco_method is not None:
        diloco = DiLoCo(
            model,
            sync_every=2,
            method=diloco_method,
            chunk_elems=64,
            group=mesh.get_group("replicate"),
        )
    for step in range(1, 5):
        _inner_step(model, opt, ctx.rank, step)
        if diloco is not None:
            diloco.step()
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    return {"full": full, "stats": diloco.stats.as_dict() if diloco else None}


def test_fsdp2_shards_average_over_replicas_like_hsdp() -> None:
    """FSDP2 inside each replica, DiLoCo between replicas: with H = 1 it is
    HSDP; with int8 and H = 2 every rank holds the same model after an outer step."""
    hsdp = run_ranks(_fsdp2, 4, None, ref_group=False, timeout=240)
    avg = run_ranks(_fsdp2, 4, "none", ref_group=False, timeout=240)
    for r in range(4):
        torch.testing.assert_close(avg[r]["full"], hsdp[0]["full"], rtol=1e-5, atol=1e-6)
    int8 = run_ranks(_fsdp2, 4, "int8", ref_group=False, timeout=240)
    for r in range(1, 4):
        assert torch.equal(int8[r]["full"], int8[0]["full"]), r
    assert int8[0]["stats"]["calls"] == 2
    # a local shard is 210 elements: int8 chunks of 64 and their scales make it 3x, not 4x
    assert int8[0]["stats"]["link_bytes_before"] > 3 * int8[0]["stats"]["link_bytes_sent"]


# -- checkpoints and agreement -------------------------------------------------------


def _resume(ctx: RankContext, settings: dict[str, Any]) -> dict[str, Any]:
    steps, save_at = 12, 6
    model = _model()
    opt = _inner_opt(model)
    diloco = DiLoCo(model, **settings)
    path = os.path.join(ctx.tmpdir, f"rank{ctx.rank}.pt")
    for step in range(1, steps + 1):
        _inner_step(model, opt, ctx.rank, step)
        diloco.step()
        if step == save_at:
            state = diloco.state_dict()
            in_flight = sum(f["pending"] is not None for f in state["fragments"])
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "diloco": state}, path
            )
    uninterrupted = _flat(list(model.parameters())).clone()
    diloco.close()

    model2 = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))  # other init
    opt2 = _inner_opt(model2)
    diloco2 = DiLoCo(model2, **settings)
    saved = torch.load(path, weights_only=False)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    diloco2.load_state_dict(saved["diloco"])
    for step in range(save_at + 1, steps + 1):
        _inner_step(model2, opt2, ctx.rank, step)
        diloco2.step()
    diloco2.close()
    return {
        "uninterrupted": uninterrupted,
        "resumed": _flat(list(model2.parameters())).clone(),
        "in_flight": in_flight,
    }


@pytest.mark.parametrize(
    "settings",
    [
        {"sync_every": 4, "method": "int8", "chunk_elems": 64},
        {"sync_every": 4, "method": "int8", "fragments": 2, "overlap_steps": 1},
        {"sync_every": 4, "method": "bf16", "fragments": 2, "overlap_steps": 2},
    ],
    ids=["int8", "int8-streaming", "bf16-streaming"],
)
def test_resume_is_bitwise(settings: dict[str, Any]) -> None:
    res = run_ranks(_resume, 2, settings, ref_group=False)
    for r in res:
        assert torch.equal(r["resumed"], r["uninterrupted"])
    if settings.get("overlap_steps"):
        assert res[0]["in_flight"] == 1  # fragment 0 sent at step 6 lands at step 7+


def test_load_refuses_other_settings() -> None:
    res = run_ranks(_load_other, 2, ref_group=False)
    for message in res:
        assert "different settings" in message


def _load_other(ctx: RankContext) -> str:
    saved = DiLoCo(_model(), sync_every=4).state_dict()
    other = DiLoCo(_model(), sync_every=8)
    try:
        other.load_state_dict(saved)
    except ValueError as e:
        return str(e)
    return "loaded"


def _disagree(ctx: RankContext) -> str:
    try:
        DiLoCo(_model(), sync_every=4 + ctx.rank)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_fail_on_every_rank() -> None:
    for message in run_ranks(_disagree, 2, ref_group=False):
        assert "disagree on sync_every: [4, 5]" in message


def _dead_peer(ctx: RankContext) -> str:
    model = _model()
    diloco = DiLoCo(model, sync_every=1, method="int8", timeout=datetime.timedelta(seconds=10))
    if ctx.rank == 1:
        os._exit(0)
    try:
        _inner_step(model, _inner_opt(model), ctx.rank, 1)
        diloco.step()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return type(e).__name__ + ": " + str(e)
    return "no error"


def test_a_dead_peer_is_an_error_not_a_hang() -> None:
    res = run_ranks(
        _dead_peer,
        2,
        ref_group=False,
        may_die=[1],
        destroy=False,
        pg_timeout=datetime.timedelta(seconds=10),
        timeout=120,
    )
    assert res[0] != "no error"


def test_nesterov_sgd_is_diloco_s_outer_optimizer() -> None:
    p = nn.Parameter(torch.ones(3))
    opt = nesterov_sgd()([p])
    assert opt.defaults["lr"] == 0.7 and opt.defaults["momentum"] == 0.9
    p.grad = torch.full((3,), 0.5)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((3,), 1 - 0.7 * (0.5 + 0.9 * 0.5)))


def test_nesterov_sgd_without_momentum_is_plain_sgd() -> None:
    p = nn.Parameter(torch.ones(3))
    opt = nesterov_sgd(lr=1.0, momentum=0.0)([p])
    p.grad = torch.full((3,), 0.25)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.75))


def _sync_at_the_end(ctx: RankContext) -> torch.Tensor:
    model = _model()
    opt = _inner_opt(model)
    diloco = DiLoCo(model, sync_every=4, method="int8", fragments=2, overlap_steps=2)
    for step in range(1, 8):  # fragment 0 in flight (sent at 6), 1 local step since 4
        _inner_step(model, opt, ctx.rank, step)
        diloco.step()
    diloco.sync()
    diloco.close()
    return _flat(list(model.parameters())).clone()


def test_sync_leaves_every_rank_on_the_agreed_model() -> None:
    """sync() lands what is in flight (mixing, as scheduled) and then runs an
    outer step that is not overlapped: no mixing, the same model everywhere."""
    res = run_ranks(_sync_at_the_end, 2, ref_group=False)
    assert torch.equal(res[0], res[1])


# -- membership changes ------------------------------------------------------------


def _survivors_go_on(ctx: RankContext, method: str) -> dict[str, Any] | None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import SHRINK_ABORT

    import xcomm

    group = dist.new_group(
        backend="xcomm", pg_options=xcomm.Options(timeout=datetime.timedelta(seconds=20))
    )
    model = _model()
    opt = _inner_opt(model)
    diloco = DiLoCo(model, sync_every=2, method=method, group=group)
    steps, failed_at = 12, None
    for step in range(1, steps + 1):
        if step == 5 and ctx.rank == 2:
            os._exit(0)  # the replica is gone before its next outer step
        _inner_step(model, opt, ctx.rank, step)
        try:
            diloco.step()
        except Exception:  # noqa: BLE001 - the dead peer's error, expected once
            failed_at = step
            survivors = dist.shrink_group([2], group=group, shrink_flags=SHRINK_ABORT)
            diloco.use_group(survivors)
    diloco.sync()
    x, y = _batch(0, 10_000, n=256)
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(x), y).item()
    return {
        "failed_at": failed_at,
        "params": _flat(list(model.parameters())),
        "world": diloco.world,
        "loss": loss,
        "calls": diloco.stats.as_dict()["calls"],
    }


@pytest.mark.parametrize("method", ["int8", "bf16"])
def test_survivors_of_a_lost_replica_go_on_after_a_shrink(method: str) -> None:
    """A replica dies between two outer steps; the others shrink their group,
    hand it to DiLoCo (use_group), and their compressed outer steps go on:
    every survivor holds the same model after each of them, and training
    still lowers the loss (against the untrained model's)."""
    res = run_ranks(
        _survivors_go_on, 3, method, ref_group=False, may_die=[2], destroy=False, timeout=180
    )
    assert res[2] is None
    a, b = res[0], res[1]
    assert a is not None and b is not None
    assert a["failed_at"] == b["failed_at"] == 6, (a["failed_at"], b["failed_at"])
    assert a["world"] == b["world"] == 2
    assert torch.equal(a["params"], b["params"])  # the same model on every survivor
    x, y = _batch(0, 10_000, n=256)
    with torch.no_grad():
        untrained = nn.functional.mse_loss(_model()(x), y).item()
    assert a["loss"] < untrained, (a["loss"], untrained)
    assert a["calls"] >= 6  # outer exchanges ran before and after the shrink


def _newcomer_joins(ctx: RankContext, method: str) -> dict[str, Any]:
    """Ranks 0 and 1 train with DiLoCo; rank 2, a replacement with a model of
    its own, joins at an outer step by the documented path: a survivor's
    state_dict, then use_group. The reference resumes a fresh 3-rank DiLoCo
    from the same checkpoint, residuals left out (use_group starts them afresh)."""
    import copy

    import torch.distributed as dist

    join_at, steps = 6, 12
    pair = dist.new_group(ranks=[0, 1], backend="xcomm")
    solo = dist.new_group(ranks=[2], backend="xcomm")
    joined = dist.new_group(backend="xcomm")  # in a real job: the quorum's new group
    reference_group = dist.new_group(backend="xcomm")
    settings = {"sync_every": 2, "method": method}
    if ctx.rank < 2:
        model = _model()
    else:  # the newcomer: another initialisation, which the join replaces
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = _inner_opt(model)
    diloco = DiLoCo(model, group=pair if ctx.rank < 2 else solo, **settings)
    if ctx.rank < 2:
        for step in range(1, join_at + 1):
            _inner_step(model, opt, ctx.rank, step)
            diloco.step()
    # What a survivor hands the newcomer (a checkpoint, torchft's live transfer...).
    handed = [
        {"diloco": diloco.state_dict(), "model": copy.deepcopy(model.state_dict())}
        if ctx.rank == 0
        else None
    ]
    dist.broadcast_object_list(handed, src=0, group=joined)
    if ctx.rank == 2:
        diloco.load_state_dict(handed[0]["diloco"])
    reference_model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    reference_model.load_state_dict(handed[0]["model"])
    reference_opt = _inner_opt(reference_model)
    if ctx.rank < 2:
        reference_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    diloco.use_group(joined)
    newcomer_equal_at_join = torch.equal(
        _flat(list(model.parameters())), _flat(list(reference_model.parameters()))
    )
    reference = DiLoCo(reference_model, group=reference_group, **settings)
    without_residuals = copy.deepcopy(handed[0]["diloco"])
    for fragment in without_residuals["fragments"]:
        fragment["residual"] = None
    reference.load_state_dict(without_residuals)
    calls_at_join = diloco.stats.as_dict()["calls"]
    for step in range(join_at + 1, steps + 1):
        _inner_step(model, opt, ctx.rank, step)
        diloco.step()
        _inner_step(reference_model, reference_opt, ctx.rank, step)
        reference.step()
    out = {
        "equal_at_join": newcomer_equal_at_join,
        "params": _flat(list(model.parameters())),
        "reference": _flat(list(reference_model.parameters())),
        "world": diloco.world,
        "calls_since_join": diloco.stats.as_dict()["calls"] - calls_at_join,
    }
    diloco.close()
    reference.close()
    return out


@pytest.mark.parametrize("method", ["int8", "bf16"])
def test_a_newcomer_joins_with_a_survivors_state_and_use_group(method: str) -> None:
    """After a join (a survivor's state_dict loaded by the newcomer, then
    use_group on the grown group, on every member), the three ranks hold the
    same model at once and train on bit for bit like a 3-rank DiLoCo resumed
    from that checkpoint with fresh residuals."""
    res = run_ranks(_newcomer_joins, 3, method, ref_group=False, timeout=180)
    for r in res:
        assert r["equal_at_join"], "use_group gave this rank the survivors' model"
        assert r["world"] == 3
        assert r["calls_since_join"] == 3  # outer exchanges at steps 8, 10, 12
        assert torch.equal(r["params"], r["reference"])
    assert torch.equal(res[0]["params"], res[2]["params"])
