"""A CI subset of torch's DistributedTest suite: xcomm standing in for gloo.

The curated tests below pass on gloo (WORLD_SIZE=2). Each is run twice
through :mod:`xcomm_bench.conformance`: once on gloo, the reference, and once
in the ``standin`` mode, where every group the suite asks gloo for is an xcomm
group. A test that gloo passes must pass on xcomm, except the known xcomm
failures listed in ``KNOWN_XCOMM_FAILURES`` (strict xfails: they flip to
failures once xcomm is fixed, so the list is kept honest).

The suite's checks of profiler event names are on: each collective must be
exactly one ``xcomm:<op>`` event (the stand-in looks for xcomm's name where
the suite asks for ``gloo:<op>``; the inner Gloo's events must not count).
The full-suite numbers are in docs/conformance.md.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

pytest.importorskip("expecttest", reason="torch's DistributedTest suite needs expecttest")

from xcomm_bench import conformance

# every_case: each case is one of torch's own tests, which change with its
# version; one run of the suite (a fixture) serves them all.
pytestmark = [pytest.mark.slow, pytest.mark.every_case]

#: Tests gloo passes at WORLD_SIZE=2, one or more per family of the suite.
CURATED = [
    # all_reduce
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_max",
    "test_all_reduce_product",
    "test_all_reduce_full_group_min",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_complex_unsupported_ops",
    "test_sparse_all_reduce_sum",
    # reduce / broadcast
    "test_reduce_sum",
    "test_reduce_max",
    "test_reduce_sum_twice",
    "test_broadcast",
    "test_broadcast_full_group",
    # all_gather / gather / scatter (+ object collectives)
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_object_default_pg",
    "test_gather",
    "test_gather_checks",
    "test_scatter",
    "test_scatter_checks",
    "test_scatter_object_list",
    # point to point
    "test_send_recv",
    "test_send_recv_any_source",
    "test_send_recv_with_tag",
    # their profiler events by name: "recvAnySource", and names compared
    # with the one asked for (both failed before af6cc72)
    "test_send_recv_any_source_torch_profiler",
    "test_send_recv_with_tag_autograd_profiler",
    "test_isend",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    # all_gather_coalesced, monitored_barrier, TORCH_DISTRIBUTED_DEBUG=DETAIL
    # (xcomm raised on each of these before the build of issue 12)
    "test_all_gather_coalesced_simple",
    "test_monitored_barrier_gloo",
    "test_all_gather_object_subgroup",
    # groups and barriers
    "test_get_backend",
    "test_get_rank_size_group",
    "test_destroy_group",
    "test_barrier",
    "test_barrier_timeout_global",
    # DDP on CPU
    "test_DistributedDataParallelCPU",
    "test_accumulate_gradients_no_sync",
    "test_ddp_create_graph",
    "test_static_graph_api_cpu",
    "test_get_future",
]

#: Tests gloo passes and xcomm (standing in for gloo) does not, with why.
KNOWN_XCOMM_FAILURES = {
    "test_ddp_logging_data_cpu": (
        "DDP logging reports backend_name 'custom' for xcomm (torch's "
        "ProcessGroup::getBackendName names a plugin backend by its BackendType), "
        "where the suite expects the group's backend name"
    ),
}

_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, dict[str, Any]]]:
    names = CURATED + sorted(KNOWN_XCOMM_FAILURES)
    kw: dict[str, Any] = {"timeout": _TIMEOUT_S, "progress": False}
    return {
        "gloo": conformance.run_tests("gloo", names, **kw),
        "standin": conformance.run_tests("standin", names, **kw),
    }


def _check_gloo_passes_and_xcomm_too(
    runs: dict[str, Any], name: str, which: str = "standin"
) -> None:
    ref = runs["gloo"][name]
    assert ref["status"] == "pass", f"the reference (gloo) does not pass {name}: {ref}"
    got = runs[which][name]
    assert got["status"] == "pass", f"xcomm {got['status']}s {name}: {got['reason']}"


@pytest.mark.parametrize("name", CURATED)
def test_xcomm_passes_what_gloo_passes(runs: dict[str, Any], name: str) -> None:
    _check_gloo_passes_and_xcomm_too(runs, name)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=r))
        for n, r in KNOWN_XCOMM_FAILURES.items()
    ],
)
def test_known_xcomm_failures(runs: dict[str, Any], name: str) -> None:
    _check_gloo_passes_and_xcomm_too(runs, name)


def test_the_standin_really_routes_through_xcomm(runs: dict[str, Any]) -> None:
    """Every rank of every curated test had an XcommBackend as its default
    group's CPU backend, and xcomm counted the collectives' ops."""
    standin = runs["standin"]
    for name in CURATED:
        assert standin[name].get("backend_types") == ["XcommBackend"], (name, standin[name])
        assert standin[name].get("ranks") == 2, (name, standin[name])
    p = conformance.proof("standin", standin)
    assert p["ok"], p
    for name in ("test_all_reduce_sum", "test_broadcast", "test_all_gather", "test_send_recv"):
        assert standin[name]["xcomm_calls"] > 0, (name, standin[name])
    # The reference really is gloo: no proof records, xcomm not imported.
    assert all("backend_types" not in r for r in runs["gloo"].values())


@pytest.mark.first_torch_only  # the runner's own behaviour, not torch's
def test_a_hung_test_is_killed_at_its_hard_timeout_and_the_next_one_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XCOMM_CONFORMANCE_HANG_TEST", "test_get_backend")
    start = time.monotonic()
    res = conformance.run_tests(
        "gloo", ["test_get_backend", "test_get_rank_size_group"], timeout=8.0, progress=False
    )
    hung = res["test_get_backend"]
    assert hung["status"] == "timeout", hung
    assert "hard timeout" in hung["reason"]
    with pytest.raises(ProcessLookupError):  # the worker's session, ranks included, is gone
        os.killpg(hung["killed_session"], 0)
    assert res["test_get_rank_size_group"]["status"] == "pass", res
    assert time.monotonic() - start < 120


@pytest.mark.first_torch_only  # the runner's own behaviour, not torch's
def test_a_rank_that_dies_is_named_with_its_exit_status_and_stderr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XCOMM_CONFORMANCE_DIE_TEST", "test_get_rank_size_group")
    res = conformance.run_tests("gloo", ["test_get_rank_size_group"], timeout=60, progress=False)
    rec = res["test_get_rank_size_group"]
    assert rec["status"] == "fail", rec
    assert rec["rank_exits"][0] == -9, rec
    # (rank 1 then times out in the suite's file barrier: it is named too)
    assert "rank 0 wrote no result: it was killed by SIGKILL; its stderr ends: " in rec["reason"]
    assert "rank 0 dies on purpose" in rec["reason"], rec


def test_reasons_name_the_ranks_exception_and_where_the_suite_raised_it() -> None:
    text = (
        "Traceback (most recent call last):\n"
        '  File "/x/common_distributed.py", line 1, in _check_return_codes\n'
        "    raise RuntimeError(error)\n"
        "RuntimeError: Process 0 exited with error code 10 and exception:\n"
        "Traceback (most recent call last):\n"
        '  File "/x/distributed_test.py", line 2627, in call_dist_op\n'
        "    self.assertEqual(len(events), len(op_calls))\n"
        "AssertionError: Scalars are not equal!\n"
        "\n"
        "Expected 1 but got 0.\n"
        "To execute this test, run the following from the base repo dir:\n"
    )
    assert conformance.one_line_reason(text) == (
        "AssertionError: Scalars are not equal! Expected 1 but got 0. "
        "[distributed_test.py:2627 call_dist_op: self.assertEqual(len(events), len(op_calls))]"
    )
