"""Every collective of the backend under test against gloo.

Reference used by each test:

* gloo (``dist.new_group(backend="gloo")`` over the same ranks, identical
  deterministic per-rank inputs) for all_reduce, all_reduce_coalesced,
  broadcast, reduce, all_gather, all_gather_into_tensor, reduce_scatter,
  reduce_scatter_tensor, all_to_all, all_to_all_single, gather and scatter.
  An (op, dtype) pair that gloo rejects must be rejected by the backend under
  test with an exception too (e.g. BAND on float, AVG on integers).
  In ``future`` mode the value of ``work.get_future().wait()`` must equal
  gloo's (the list of output tensors).
* PREMUL_SUM: gloo does not implement it, so the reference is gloo SUM of the
  inputs multiplied by the factor on the reference side.
* Non-contiguous all_reduce / broadcast: gloo silently computes wrong results
  for strided views, so the reference is the math (reduction over the
  regenerated per-rank inputs); the backend must be right or raise an error
  that mentions contiguity.
* Point-to-point (send/recv, recv from any source, batch_isend_irecv) and
  barrier: the math (the receiver regenerates the sender's input).

Integer and bool results are compared bitwise; floating point with
``dist_harness.tolerances`` (summation-order tolerance).  Each test is one
spawn of ``world_size`` ranks that runs every dtype x op x mode combination
and lists all mismatches in its failure message.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import (
    ALL_DTYPES,
    BACKEND,
    BASIC_OPS,
    BITWISE_OPS,
    FLOAT_DTYPES,
    Checker,
    Mismatches,
    Mode,
    RankContext,
    assert_no_mismatches,
    dtype_name,
    make_input,
    run_ranks,
    world_size_params,
)

#: Default 1-D length: odd, so it is not divisible by any world size > 1.
N = 17
#: A larger size (float32: 256 KiB) to exercise chunked / pipelined paths.
BIG = 1 << 16
#: Ops used where a smaller op sweep keeps the run short.
FAST_MODES: tuple[Mode, ...] = ("sync",)

PG = dist.ProcessGroup | None


def _modes_for(dtype: torch.dtype) -> tuple[Mode, ...]:
    """Every mode for float32/int64, sync only for the other dtypes."""
    return ("sync", "async", "future") if dtype in (torch.float32, torch.int64) else FAST_MODES


def _reduce_math(stack: torch.Tensor, op_name: str) -> torch.Tensor:
    """Reduction over dim 0 of per-rank values (for math references)."""
    if op_name == "SUM":
        return (
            stack.sum(0, dtype=torch.float64).to(stack.dtype)
            if stack.is_floating_point()
            else stack.sum(0).to(stack.dtype)
        )
    if op_name == "MAX":
        return stack.amax(0)
    if op_name == "MIN":
        return stack.amin(0)
    raise ValueError(op_name)


# --------------------------------------------------------------------------- #
# all_reduce
# --------------------------------------------------------------------------- #


def _int_avg_reference(ctx: RankContext, dtype: torch.dtype) -> Any:
    """NCCL's AVG of integers over gloo: SUM, then divide rounding toward zero."""

    def ref(group: PG, async_op: bool) -> Any:
        t = make_input(ctx, dtype, (N,), small=False)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t.copy_(t.div(ctx.world_size, rounding_mode="trunc"))
        return None, [t]

    return ref


def _rank_all_reduce(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    for dtype in ALL_DTYPES:
        for op_name, op in BASIC_OPS.items():

            def case(
                group: PG,
                async_op: bool,
                dtype: torch.dtype = dtype,
                op: Any = op,
                name: str = op_name,
            ) -> Any:
                t = make_input(ctx, dtype, (N,), small=name == "PRODUCT")
                return dist.all_reduce(t, op=op, group=group, async_op=async_op), [t]

            label = f"all_reduce {dtype_name(dtype)} {op_name}"
            if op_name == "AVG" and not dtype.is_floating_point and dtype != torch.bool:
                # gloo rejects AVG on integers; xcomm averages them as NCCL does:
                # gloo's SUM divided by the group size, rounded toward zero.
                chk.run(label, case, ref_case=_int_avg_reference(ctx, dtype), modes=("sync",))
                continue
            chk.run(label, case, modes=_modes_for(dtype))

    # Self-check of the reference: gloo rejects exactly the bitwise ops on
    # floating point and AVG on bool (else the "must reject too" comparisons
    # above would be vacuous or the reference broken); AVG on integers is
    # checked against gloo's SUM above.
    expected_rejected = {
        f"all_reduce {dtype_name(d)} {o} [{mode}]"
        for d in ALL_DTYPES
        for o in BASIC_OPS
        if (o in BITWISE_OPS and d.is_floating_point) or (o == "AVG" and d == torch.bool)
        for mode in _modes_for(d)
    }
    if set(chk.rejected) != expected_rejected:
        chk.fail(
            "reference self-check",
            "gloo's rejections differ from the expected ones (symmetric difference): "
            f"{sorted(set(chk.rejected) ^ expected_rejected)}",
        )

    # Shapes: empty, scalar-like, 3-D, large.
    for dtype in (torch.float32, torch.int64):
        for shape in [(0,), (1,), (), (3, 5, 7), (BIG,)]:

            def case_shape(
                group: PG,
                async_op: bool,
                dtype: torch.dtype = dtype,
                shape: tuple[int, ...] = shape,
            ) -> Any:
                t = make_input(ctx, dtype, shape, salt=1)
                return dist.all_reduce(t, group=group, async_op=async_op), [t]

            chk.run(f"all_reduce {dtype_name(dtype)} SUM shape={shape}", case_shape)

    # PREMUL_SUM: reference is gloo SUM of (input * factor).  Not run when
    # developing against gloo, which does not implement PREMUL_SUM.
    for dtype in FLOAT_DTYPES if ctx.backend != "gloo" else ():
        for factor in (0.5, 3.0):

            def case_pre(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, f: float = factor
            ) -> Any:
                t = make_input(ctx, dtype, (N,), salt=2)
                op = dist._make_nccl_premul_sum(f)
                return dist.all_reduce(t, op=op, group=group, async_op=async_op), [t]

            def ref_pre(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, f: float = factor
            ) -> Any:
                t = make_input(ctx, dtype, (N,), salt=2) * f
                return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op), [t]

            chk.run(
                f"all_reduce {dtype_name(dtype)} PREMUL_SUM(factor={factor})",
                case_pre,
                ref_case=ref_pre,
                n_terms=2 * ctx.world_size,
            )
    return chk.items


@pytest.mark.parametrize("world_size", world_size_params())
def test_all_reduce(world_size: int) -> None:
    """all_reduce: every dtype x every ReduceOp (incl. PREMUL_SUM), shapes, modes."""
    assert_no_mismatches(run_ranks(_rank_all_reduce, world_size))


def _rank_all_reduce_coalesced(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    shapes = [(5,), (2, 3), (N,)]
    for dtype in ALL_DTYPES:
        for op_name, op in BASIC_OPS.items():

            def case(
                group: PG,
                async_op: bool,
                dtype: torch.dtype = dtype,
                op: Any = op,
                name: str = op_name,
            ) -> Any:
                ts = [
                    make_input(ctx, dtype, s, salt=i, small=name == "PRODUCT")
                    for i, s in enumerate(shapes)
                ]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # deprecated API
                    work = dist.all_reduce_coalesced(ts, op=op, group=group, async_op=async_op)
                return work, ts

            chk.run(
                f"all_reduce_coalesced {dtype_name(dtype)} {op_name}", case, modes=_modes_for(dtype)
            )
    return chk.items


@pytest.mark.skipif(not hasattr(dist, "all_reduce_coalesced"), reason="torch no longer has it")
@pytest.mark.parametrize("world_size", world_size_params((1, 2, 3)))
def test_all_reduce_coalesced(world_size: int) -> None:
    """all_reduce_coalesced (deprecated API): every dtype x op, 3 tensors of mixed shapes."""
    assert_no_mismatches(run_ranks(_rank_all_reduce_coalesced, world_size))


# --------------------------------------------------------------------------- #
# Non-contiguous inputs (math reference: gloo is wrong here)
# --------------------------------------------------------------------------- #


def _strided_views() -> list[tuple[str, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]]:
    """(name, base shape, view function) of non-contiguous views."""
    return [
        ("t[::2]", (2 * N,), lambda b: b[::2]),
        ("t[1::3]", (3 * N,), lambda b: b[1::3]),
        ("t.t() (4x6)", (4, 6), lambda b: b.t()),
        ("t[:, 1:4] (5x6)", (5, 6), lambda b: b[:, 1:4]),
    ]


def _rank_noncontiguous(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    ws = ctx.world_size
    for dtype in (torch.float32, torch.int64):
        for vname, shape, view in _strided_views():
            for op_name in ("SUM", "MAX"):
                op = BASIC_OPS[op_name]

                def case(
                    group: PG,
                    async_op: bool,
                    dtype: torch.dtype = dtype,
                    shape: Any = shape,
                    view: Any = view,
                    op: Any = op,
                ) -> Any:
                    base = make_input(ctx, dtype, shape, salt=3)
                    v = view(base)
                    assert not v.is_contiguous()
                    return dist.all_reduce(v, op=op, group=group, async_op=async_op), [base]

                # Expected: the strided elements hold the reduction over ranks,
                # every other element of the base tensor is untouched.
                expected = make_input(ctx, dtype, shape, salt=3)
                per_rank = torch.stack(
                    [view(make_input(ctx, dtype, shape, salt=3, rank=r)) for r in range(ws)]
                )
                view(expected).copy_(_reduce_math(per_rank, op_name))
                chk.expect(
                    f"all_reduce non-contiguous {vname} {dtype_name(dtype)} {op_name}",
                    case,
                    [expected],
                    may_raise_match=r"contiguous|stride|dense",
                )
            for root in range(ws):

                def case_b(
                    group: PG,
                    async_op: bool,
                    dtype: torch.dtype = dtype,
                    shape: Any = shape,
                    view: Any = view,
                    root: int = root,
                ) -> Any:
                    base = make_input(ctx, dtype, shape, salt=4)
                    return dist.broadcast(view(base), src=root, group=group, async_op=async_op), [
                        base
                    ]

                expected = make_input(ctx, dtype, shape, salt=4)
                view(expected).copy_(view(make_input(ctx, dtype, shape, salt=4, rank=root)))
                chk.expect(
                    f"broadcast non-contiguous {vname} {dtype_name(dtype)} root={root}",
                    case_b,
                    [expected],
                    may_raise_match=r"contiguous|stride|dense",
                )
    return chk.items


@pytest.mark.xfail(BACKEND == "gloo", reason="gloo silently mis-handles strided views", strict=True)
@pytest.mark.parametrize("world_size", world_size_params())
def test_non_contiguous(world_size: int) -> None:
    """all_reduce/broadcast on strided views: correct result or a 'contiguous' error."""
    assert_no_mismatches(run_ranks(_rank_noncontiguous, world_size))


# --------------------------------------------------------------------------- #
# broadcast / reduce
# --------------------------------------------------------------------------- #


def _rank_broadcast(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    for root in range(ctx.world_size):
        for dtype in ALL_DTYPES:
            for shape in [(N,), (2, 3, 4)] + ([(BIG,)] if dtype == torch.float32 else []):

                def case(
                    group: PG,
                    async_op: bool,
                    dtype: torch.dtype = dtype,
                    shape: Any = shape,
                    root: int = root,
                ) -> Any:
                    t = make_input(ctx, dtype, shape)
                    return dist.broadcast(t, src=root, group=group, async_op=async_op), [t]

                chk.run(
                    f"broadcast {dtype_name(dtype)} shape={shape} root={root}",
                    case,
                    modes=_modes_for(dtype),
                )
    return chk.items


@pytest.mark.parametrize("world_size", world_size_params())
def test_broadcast(world_size: int) -> None:
    """broadcast from every root, every dtype."""
    assert_no_mismatches(run_ranks(_rank_broadcast, world_size))


def _rank_reduce(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    for root in range(ctx.world_size):
        for dtype in ALL_DTYPES:
            for op_name, op in BASIC_OPS.items():

                def case(
                    group: PG,
                    async_op: bool,
                    dtype: torch.dtype = dtype,
                    op: Any = op,
                    root: int = root,
                    name: str = op_name,
                ) -> Any:
                    t = make_input(ctx, dtype, (N,), small=name == "PRODUCT")
                    work = dist.reduce(t, dst=root, op=op, group=group, async_op=async_op)
                    # Only the root's tensor is defined after reduce.
                    return work, [t] if ctx.rank == root else []

                modes = _modes_for(dtype) if op_name in ("SUM", "MAX") else FAST_MODES
                chk.run(f"reduce {dtype_name(dtype)} {op_name} root={root}", case, modes=modes)
    return chk.items


@pytest.mark.parametrize("world_size", world_size_params())
def test_reduce(world_size: int) -> None:
    """reduce to every root, every dtype x op (result checked on the root)."""
    assert_no_mismatches(run_ranks(_rank_reduce, world_size))


# --------------------------------------------------------------------------- #
# all_gather / all_gather_into_tensor
# --------------------------------------------------------------------------- #


def _rank_all_gather(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    ws, me = ctx.world_size, ctx.rank
    for dtype in ALL_DTYPES:
        for shape in [(N,), (3, 5)] + ([(BIG,), (0,)] if dtype == torch.float32 else []):

            def case(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, shape: Any = shape
            ) -> Any:
                t = make_input(ctx, dtype, shape)
                out = [torch.full(shape, 7).to(dtype) for _ in range(ws)]
                return dist.all_gather(out, t, group=group, async_op=async_op), out

            chk.run(f"all_gather {dtype_name(dtype)} shape={shape}", case, modes=_modes_for(dtype))

        def case_inplace(group: PG, async_op: bool, dtype: torch.dtype = dtype) -> Any:
            out = [torch.zeros(N, dtype=dtype) for _ in range(ws)]
            out[me].copy_(make_input(ctx, dtype, (N,)))
            return dist.all_gather(out, out[me], group=group, async_op=async_op), out

        chk.run(
            f"all_gather in-place (input is output[rank]) {dtype_name(dtype)}",
            case_inplace,
            modes=FAST_MODES,
        )
    return chk.items


@pytest.mark.parametrize("world_size", world_size_params())
def test_all_gather(world_size: int) -> None:
    """all_gather (list form), out of place and in place."""
    assert_no_mismatches(run_ranks(_rank_all_gather, world_size))


def _rank_all_gather_into_tensor(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    ws, me = ctx.world_size, ctx.rank
    for dtype in ALL_DTYPES:
        for layout in ("concat", "stack"):

            def case(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, layout: str = layout
            ) -> Any:
                t = make_input(ctx, dtype, (N,))
                out = torch.zeros((ws * N,) if layout == "concat" else (ws, N), dtype=dtype)
                return dist.all_gather_into_tensor(out, t, group=group, async_op=async_op), [out]

            chk.run(
                f"all_gather_into_tensor {dtype_name(dtype)} {layout}",
                case,
                modes=_modes_for(dtype),
            )

        def case_inplace(group: PG, async_op: bool, dtype: torch.dtype = dtype) -> Any:
            out = torch.zeros(ws * N, dtype=dtype)
            chunk = out[me * N : (me + 1) * N]
            chunk.copy_(make_input(ctx, dtype, (N,)))
            return dist.all_gather_into_tensor(out, chunk, group=group, async_op=async_op), [out]

        chk.run(
            f"all_gather_into_tensor in-place (input is a view of output) {dtype_name(dtype)}",
            case_inplace,
            modes=FAST_MODES,
        )

    def case_2d(group: PG, async_op: bool) -> Any:
        t = make_input(ctx, torch.float32, (3, 4))
        out = torch.zeros(ws * 3, 4)
        return dist.all_gather_into_tensor(out, t, group=group, async_op=async_op), [out]

    chk.run("all_gather_into_tensor float32 2-D input", case_2d)

    def case_big(group: PG, async_op: bool) -> Any:
        t = make_input(ctx, torch.float32, (BIG,))
        out = torch.zeros(ws * BIG)
        return dist.all_gather_into_tensor(out, t, group=group, async_op=async_op), [out]

    chk.run("all_gather_into_tensor float32 BIG", case_big, modes=FAST_MODES)
    return chk.items


@pytest.mark.parametrize("world_size", world_size_params())
def test_all_gather_into_tensor(world_size: int) -> None:
    """all_gather_into_tensor: concatenated and stacked outputs, in place, 2-D."""
    assert_no_mismatches(run_ranks(_rank_all_gather_into_tensor, world_size))


# --------------------------------------------------------------------------- #
# reduce_scatter / reduce_scatter_tensor
# --------------------------------------------------------------------------- #


def _rank_reduce_scatter(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    ws = ctx.world_size
    for dtype in ALL_DTYPES:
        for op_name, op in BASIC_OPS.items():
            small = op_name == "PRODUCT"

            def case_list(
                group: PG,
                async_op: bool,
                dtype: torch.dtype = dtype,
                op: Any = op,
                small: bool = small,
            ) -> Any:
                inputs = [make_input(ctx, dtype, (N,), salt=j, small=small) for j in range(ws)]
                out = torch.zeros(N, dtype=dtype)
                return dist.reduce_scatter(out, inputs, op=op, group=group, async_op=async_op), [
                    out
                ]

            modes = _modes_for(dtype) if op_name == "SUM" else FAST_MODES
            chk.run(f"reduce_scatter (list) {dtype_name(dtype)} {op_name}", case_list, modes=modes)

            for layout in ("concat", "stack"):

                def case_t(
                    group: PG,
                    async_op: bool,
                    dtype: torch.dtype = dtype,
                    op: Any = op,
                    small: bool = small,
                    layout: str = layout,
                ) -> Any:
                    shape = (ws * N,) if layout == "concat" else (ws, N)
                    inp = make_input(ctx, dtype, shape, salt=5, small=small)
                    out = torch.zeros(N, dtype=dtype)
                    return dist.reduce_scatter_tensor(
                        out, inp, op=op, group=group, async_op=async_op
                    ), [out]

                chk.run(
                    f"reduce_scatter_tensor {dtype_name(dtype)} {op_name} {layout}",
                    case_t,
                    modes=modes,
                )

    for dtype in (torch.float32, torch.int64):

        def case_inplace(group: PG, async_op: bool, dtype: torch.dtype = dtype) -> Any:
            # The output is this rank's chunk of the input (FSDP style).
            inp = make_input(ctx, dtype, (ws * N,), salt=5)
            out = inp[ctx.rank * N : (ctx.rank + 1) * N]
            return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op), [out]

        chk.run(
            f"reduce_scatter_tensor in-place (output is a view of input) {dtype_name(dtype)}",
            case_inplace,
            modes=FAST_MODES,
        )

    def case_big(group: PG, async_op: bool) -> Any:
        inp = make_input(ctx, torch.float32, (ws * BIG,), salt=6)
        out = torch.zeros(BIG)
        return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op), [out]

    chk.run("reduce_scatter_tensor float32 SUM BIG", case_big, modes=FAST_MODES)
    return chk.items


@pytest.mark.parametrize("shm", ["shm", "noshm"])
@pytest.mark.parametrize("world_size", world_size_params())
def test_reduce_scatter(world_size: int, shm: str) -> None:
    """reduce_scatter (list form) and reduce_scatter_tensor, every dtype x op;
    without shared memory, reduce_scatter_tensor is xcomm's all-to-all route."""
    env = {"XCOMM_SHM": "0"} if shm == "noshm" else {}
    assert_no_mismatches(run_ranks(_rank_reduce_scatter, world_size, env=env))


# --------------------------------------------------------------------------- #
# PREMUL_SUM on the other reducing collectives (all_reduce: above)
# --------------------------------------------------------------------------- #

#: PREMUL_SUM's factor in these tests.
FACTOR = 0.5


def _rank_premul_sum(ctx: RankContext) -> list[str]:
    """Every reducing collective but all_reduce with PREMUL_SUM, against gloo
    SUM over the inputs times the factor (gloo has no PREMUL_SUM)."""
    chk = Checker(ctx)
    ws, me = ctx.world_size, ctx.rank

    def premul(group: PG, *ts: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
        """The op and inputs: PREMUL_SUM over ``ts`` for the backend under
        test; for gloo, SUM over (contiguous) copies of ``ts`` times the factor."""
        if group is not chk.ref_group:
            return dist._make_nccl_premul_sum(FACTOR), list(ts)
        return dist.ReduceOp.SUM, [(t * FACTOR).contiguous() for t in ts]

    for dtype in FLOAT_DTYPES:
        modes = _modes_for(dtype)
        name = dtype_name(dtype)

        def coalesced(group: PG, async_op: bool, dtype: torch.dtype = dtype) -> Any:
            op, ts = premul(group, make_input(ctx, dtype, (5,)), make_input(ctx, dtype, (2, 3), 1))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated API
                return dist.all_reduce_coalesced(ts, op=op, group=group, async_op=async_op), ts

        if hasattr(dist, "all_reduce_coalesced"):
            chk.run(f"all_reduce_coalesced {name} PREMUL_SUM", coalesced, modes=modes)

        for root in range(ws):
            for strided in (False, True):

                def reduce(
                    group: PG,
                    async_op: bool,
                    dtype: torch.dtype = dtype,
                    root: int = root,
                    strided: bool = strided,
                ) -> Any:
                    # Strided: the tensor is every other element of `base`.
                    base = make_input(ctx, dtype, (N, 2) if strided else (N,), salt=2)
                    op, (t,) = premul(group, base[:, 1] if strided else base)
                    work = dist.reduce(t, dst=root, op=op, group=group, async_op=async_op)
                    # The root's tensor holds the result (and its neighbours
                    # are untouched); the others keep their values.
                    if me == root:
                        return work, [t, base[:, 0]] if strided else [t]
                    return work, [base]

                # Not "future": the other ranks' future values are their
                # inputs, which gloo's reference has scaled.
                label = f"reduce {name} PREMUL_SUM root={root}{' strided' if strided else ''}"
                chk.run(label, reduce, modes=[m for m in modes if m != "future"])

        def scatter_list(group: PG, async_op: bool, dtype: torch.dtype = dtype) -> Any:
            inputs = [make_input(ctx, dtype, (N,), salt=j) for j in range(ws)]
            op, staged = premul(group, *inputs)
            out = torch.zeros(N, dtype=dtype)
            work = dist.reduce_scatter(out, staged, op=op, group=group, async_op=async_op)
            return work, [out, *inputs]  # the inputs keep their values

        chk.run(f"reduce_scatter (list) {name} PREMUL_SUM", scatter_list, modes=modes)

        for strided in (False, True):

            def scatter_tensor(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, strided: bool = strided
            ) -> Any:
                # Strided: the (ws, N) input is the transpose of an (N, ws) tensor.
                base = make_input(ctx, dtype, (N, ws) if strided else (ws, N), salt=5)
                op, (inp,) = premul(group, base.t() if strided else base)
                out = torch.zeros(N, dtype=dtype)
                work = dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=async_op)
                return work, [out, base]  # the input keeps its values

            label = f"reduce_scatter_tensor {name} PREMUL_SUM{' strided' if strided else ''}"
            chk.run(label, scatter_tensor, modes=modes)
    return chk.items


@pytest.mark.skipif(BACKEND == "gloo", reason="gloo has no PREMUL_SUM")
@pytest.mark.parametrize("world_size", world_size_params())
def test_premul_sum(world_size: int) -> None:
    """reduce, reduce_scatter (both forms) and all_reduce_coalesced with
    PREMUL_SUM: the backend scales the inputs and sums, as gloo does for SUM;
    inputs are kept (reduce's other ranks, the scattered input)."""
    assert_no_mismatches(run_ranks(_rank_premul_sum, world_size))


# --------------------------------------------------------------------------- #
# all_to_all / all_to_all_single
# --------------------------------------------------------------------------- #


def _split(i: int, j: int) -> int:
    """Elements rank i sends to rank j in the uneven tests (includes zeros)."""
    return (i + 2 * j) % 3


def _rank_all_to_all(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    ws, me = ctx.world_size, ctx.rank
    for dtype in ALL_DTYPES:
        for even in (True, False):

            def case(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, even: bool = even
            ) -> Any:
                send = [
                    make_input(ctx, dtype, (N if even else _split(me, j) + 1,), salt=j)
                    for j in range(ws)
                ]
                recv = [
                    torch.zeros(N if even else _split(j, me) + 1, dtype=dtype) for j in range(ws)
                ]
                return dist.all_to_all(recv, send, group=group, async_op=async_op), recv

            chk.run(
                f"all_to_all (list) {dtype_name(dtype)} {'even' if even else 'uneven'}",
                case,
                modes=_modes_for(dtype),
            )
    return chk.items


@pytest.mark.parametrize("world_size", world_size_params())
def test_all_to_all(world_size: int) -> None:
    """all_to_all (list form), equal and per-pair different sizes."""
    assert_no_mismatches(run_ranks(_rank_all_to_all, world_size))


def _rank_all_to_all_single(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    ws, me = ctx.world_size, ctx.rank
    for dtype in ALL_DTYPES:
        for trailing in [(), (3,)]:

            def case_even(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, trailing: Any = trailing
            ) -> Any:
                inp = make_input(ctx, dtype, (ws * 4, *trailing))
                out = torch.zeros(ws * 4, *trailing, dtype=dtype)
                return dist.all_to_all_single(out, inp, group=group, async_op=async_op), [out]

            chk.run(
                f"all_to_all_single even {dtype_name(dtype)} trailing={trailing}",
                case_even,
                modes=_modes_for(dtype),
            )

            def case_even_explicit(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, trailing: Any = trailing
            ) -> Any:
                inp = make_input(ctx, dtype, (ws * 2, *trailing))
                out = torch.zeros(ws * 2, *trailing, dtype=dtype)
                splits = [2] * ws
                return dist.all_to_all_single(
                    out, inp, splits, splits, group=group, async_op=async_op
                ), [out]

            chk.run(
                f"all_to_all_single even explicit splits {dtype_name(dtype)} trailing={trailing}",
                case_even_explicit,
                modes=FAST_MODES,
            )

            def case_uneven(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, trailing: Any = trailing
            ) -> Any:
                in_splits = [_split(me, j) for j in range(ws)]
                out_splits = [_split(j, me) for j in range(ws)]
                inp = make_input(ctx, dtype, (sum(in_splits), *trailing), salt=7)
                out = torch.zeros(sum(out_splits), *trailing, dtype=dtype)
                work = dist.all_to_all_single(
                    out, inp, out_splits, in_splits, group=group, async_op=async_op
                )
                return work, [out]

            chk.run(
                f"all_to_all_single uneven {dtype_name(dtype)} trailing={trailing}",
                case_uneven,
                modes=_modes_for(dtype),
            )

    def case_big(group: PG, async_op: bool) -> Any:
        inp = make_input(ctx, torch.float32, (ws * BIG // 4,), salt=8)
        out = torch.zeros(ws * BIG // 4)
        return dist.all_to_all_single(out, inp, group=group, async_op=async_op), [out]

    chk.run("all_to_all_single float32 BIG", case_big, modes=FAST_MODES)
    return chk.items


@pytest.mark.parametrize("world_size", world_size_params())
def test_all_to_all_single(world_size: int) -> None:
    """all_to_all_single: even (implicit/explicit) and uneven splits incl. zero-sized ones."""
    assert_no_mismatches(run_ranks(_rank_all_to_all_single, world_size))


# --------------------------------------------------------------------------- #
# gather / scatter
# --------------------------------------------------------------------------- #


def _rank_gather_scatter(ctx: RankContext) -> list[str]:
    chk = Checker(ctx)
    ws, me = ctx.world_size, ctx.rank
    for root in range(ws):
        for dtype in ALL_DTYPES:

            def case_g(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, root: int = root
            ) -> Any:
                t = make_input(ctx, dtype, (N,))
                gl = [torch.zeros(N, dtype=dtype) for _ in range(ws)] if me == root else None
                work = dist.gather(t, gl, dst=root, group=group, async_op=async_op)
                return work, gl or []

            chk.run(f"gather {dtype_name(dtype)} dst={root}", case_g, modes=_modes_for(dtype))

            def case_s(
                group: PG, async_op: bool, dtype: torch.dtype = dtype, root: int = root
            ) -> Any:
                out = torch.zeros(N, dtype=dtype)
                sl = (
                    [make_input(ctx, dtype, (N,), salt=j) for j in range(ws)]
                    if me == root
                    else None
                )
                return dist.scatter(out, sl, src=root, group=group, async_op=async_op), [out]

            chk.run(f"scatter {dtype_name(dtype)} src={root}", case_s, modes=_modes_for(dtype))
    return chk.items


@pytest.mark.parametrize("world_size", world_size_params())
def test_gather_scatter(world_size: int) -> None:
    """gather to and scatter from every root, every dtype."""
    assert_no_mismatches(run_ranks(_rank_gather_scatter, world_size))


# --------------------------------------------------------------------------- #
# Point to point, barrier (math reference)
# --------------------------------------------------------------------------- #


def _rank_send_recv(ctx: RankContext) -> list[str]:
    m = Mismatches(ctx)
    ws, me = ctx.world_size, ctx.rank
    nxt, prv = (me + 1) % ws, (me - 1) % ws
    for dtype in ALL_DTYPES:
        for shape in [(N,), (2, 3)] + ([(BIG,)] if dtype == torch.float32 else []):
            for mode in ("sync", "async"):
                label = f"send/recv ring {dtype_name(dtype)} shape={shape} {mode}"
                with m.case(label):
                    payload = make_input(ctx, dtype, shape, salt=9)
                    buf = torch.zeros(shape, dtype=dtype)
                    # Even ranks send first, odd ranks receive first: no cycle.
                    if mode == "sync":
                        if me % 2 == 0:
                            dist.send(payload, dst=nxt)
                            src = dist.recv(buf, src=prv)
                        else:
                            src = dist.recv(buf, src=prv)
                            dist.send(payload, dst=nxt)
                        if src != prv:
                            m.fail(label, f"recv returned {src}, expected {prv}")
                    else:
                        works = [dist.irecv(buf, src=prv), dist.isend(payload, dst=nxt)]
                        for w in works:
                            w.wait()
                    m.compare(label, buf, make_input(ctx, dtype, shape, salt=9, rank=prv))

    # Tags: two messages to the same peer with different tags, received in
    # the opposite order.
    label = "send/recv with tags (received in reverse order)"
    with m.case(label):
        a, b = (
            make_input(ctx, torch.float32, (N,), salt=10),
            make_input(ctx, torch.float32, (N,), salt=11),
        )
        ra, rb = torch.zeros(N), torch.zeros(N)
        works = [dist.isend(a, dst=nxt, tag=1), dist.isend(b, dst=nxt, tag=2)]
        rworks = [dist.irecv(rb, src=prv, tag=2), dist.irecv(ra, src=prv, tag=1)]
        for w in rworks + works:
            w.wait()
        m.compare(label + " tag=1", ra, make_input(ctx, torch.float32, (N,), salt=10, rank=prv))
        m.compare(label + " tag=2", rb, make_input(ctx, torch.float32, (N,), salt=11, rank=prv))
    return m.items


@pytest.mark.parametrize("world_size", world_size_params((2, 3, 4)))
def test_send_recv(world_size: int) -> None:
    """send/recv and isend/irecv around a ring, every dtype, with tags."""
    assert_no_mismatches(run_ranks(_rank_send_recv, world_size))


def _rank_recv_any_source(ctx: RankContext) -> list[str]:
    m = Mismatches(ctx)
    ws, me = ctx.world_size, ctx.rank
    for rnd in range(3):
        label = f"recv(src=None) round {rnd}"
        with m.case(label):
            if me == 0:
                seen = []
                for _ in range(ws - 1):
                    buf = torch.zeros(N, dtype=torch.int64)
                    src = dist.recv(buf, src=None)
                    seen.append(src)
                    if not isinstance(src, int) or not 0 < src < ws:
                        m.fail(label, f"recv returned source {src!r}")
                        continue
                    m.compare(
                        f"{label} from {src}",
                        buf,
                        make_input(ctx, torch.int64, (N,), salt=rnd, rank=src),
                    )
                if sorted(seen) != list(range(1, ws)):
                    m.fail(label, f"sources seen {seen}, expected each of 1..{ws - 1} once")
            else:
                dist.send(make_input(ctx, torch.int64, (N,), salt=rnd), dst=0)
            dist.barrier()
    return m.items


@pytest.mark.parametrize("world_size", world_size_params((2, 3, 4)))
def test_recv_any_source(world_size: int) -> None:
    """recv with src=None returns the actual sender; every sender seen once."""
    assert_no_mismatches(run_ranks(_rank_recv_any_source, world_size))


def _rank_batch_isend_irecv(ctx: RankContext) -> list[str]:
    m = Mismatches(ctx)
    ws, me = ctx.world_size, ctx.rank
    nxt, prv = (me + 1) % ws, (me - 1) % ws
    for dtype in (torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool):
        label = f"batch_isend_irecv ring {dtype_name(dtype)}"
        with m.case(label):
            payload = make_input(ctx, dtype, (N,), salt=12)
            buf = torch.zeros(N, dtype=dtype)
            ops = [dist.P2POp(dist.isend, payload, nxt), dist.P2POp(dist.irecv, buf, prv)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            m.compare(label, buf, make_input(ctx, dtype, (N,), salt=12, rank=prv))
    label = "batch_isend_irecv bidirectional (both neighbours)"
    with m.case(label):
        to_next, to_prev = (
            make_input(ctx, torch.float32, (N,), salt=13),
            make_input(ctx, torch.float32, (N,), salt=14),
        )
        from_prev, from_next = torch.zeros(N), torch.zeros(N)
        ops = [
            dist.P2POp(dist.irecv, from_prev, prv),
            dist.P2POp(dist.irecv, from_next, nxt),
            dist.P2POp(dist.isend, to_next, nxt),
            dist.P2POp(dist.isend, to_prev, prv),
        ]
        if ws == 2:  # prv == nxt: tags tell the two messages apart
            ops = [
                dist.P2POp(dist.irecv, from_prev, prv, tag=1),
                dist.P2POp(dist.irecv, from_next, nxt, tag=2),
                dist.P2POp(dist.isend, to_next, nxt, tag=1),
                dist.P2POp(dist.isend, to_prev, prv, tag=2),
            ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        m.compare(
            label + " from prev", from_prev, make_input(ctx, torch.float32, (N,), salt=13, rank=prv)
        )
        m.compare(
            label + " from next", from_next, make_input(ctx, torch.float32, (N,), salt=14, rank=nxt)
        )
    return m.items


@pytest.mark.parametrize("world_size", world_size_params((2, 3, 4)))
def test_batch_isend_irecv(world_size: int) -> None:
    """batch_isend_irecv: ring exchange per dtype, and both directions at once."""
    assert_no_mismatches(run_ranks(_rank_batch_isend_irecv, world_size))


def _rank_barrier(ctx: RankContext, delay: float) -> list[str]:
    m = Mismatches(ctx)
    for mode in ("sync", "async", "future"):
        label = f"barrier {mode}"
        with m.case(label):
            dist.barrier()  # align start times
            if ctx.rank == 0:
                time.sleep(delay)
            t0 = time.monotonic()
            if mode == "sync":
                dist.barrier()
            else:
                work = dist.barrier(async_op=True)
                if mode == "async":
                    work.wait()
                else:
                    work.get_future().wait()
            waited = time.monotonic() - t0
            if ctx.rank != 0 and waited < delay * 0.5:
                m.fail(label, f"returned after {waited:.3f}s although rank 0 entered {delay}s late")
    return m.items


@pytest.mark.parametrize("world_size", world_size_params())
def test_barrier(world_size: int) -> None:
    """barrier blocks until the late rank arrives (sync, async, future)."""
    assert_no_mismatches(run_ranks(_rank_barrier, world_size, 0.4))
