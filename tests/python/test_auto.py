"""The ``auto`` hook: its cost model (math), the choice it makes on slow and
fast links, agreement between ranks, a link that changes mid-run, method
switches that keep the error feedback, and checkpoint-resume (bitwise)."""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import checkpoint_resume, flat_params, train
from dist_harness import RankContext, run_ranks

xcomm = pytest.importorskip("xcomm")
from xcomm import hooks
from xcomm.hooks import _measure
from xcomm.hooks.auto import compression_errors, predict_seconds

# Fixed codec costs (seconds per element, or per m*n*r for PowerSGD's products).
COSTS = {
    "bf16": 1e-9,
    "fp16": 1e-9,
    "int8": 5e-9,
    "topk": 8e-9,
    "powersgd_mnr": 1e-10,
    "powersgd_pass": 1e-9,
}
FAST = hooks.LinkModel(latency_s=1e-5, bandwidth_bytes_per_s=1e13)
SLOW = hooks.LinkModel(latency_s=1e-3, bandwidth_bytes_per_s=1e6)
# Latency-heavy: small buckets go uncompressed, large ones compress.
MIXED = hooks.LinkModel(latency_s=2e-3, bandwidth_bytes_per_s=2e6)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 5),
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g)


def test_the_cost_model_is_the_documented_formula() -> None:
    """The hook's model against its formula; for none, the casts and int8
    it is the backend's own, for every method C++'s (``_C.predict_allreduce``)."""
    n, w, link = 1 << 20, 4, hooks.LinkModel(2e-4, 1e8)
    kw: dict[str, Any] = {"density": 0.01, "rank": 4}
    none = predict_seconds("none", n, [(1024, 1024)], w, link, COSTS, **kw)
    assert none == pytest.approx(2e-4 + 2 * 3 / 4 * 4 * n / 1e8)
    bf16 = predict_seconds("bf16", n, [(1024, 1024)], w, link, COSTS, **kw)
    assert bf16 == pytest.approx(1e-9 * n + 2e-4 + 2 * 3 / 4 * 2 * n / 1e8)
    int8 = predict_seconds("int8", n, [(1024, 1024)], w, link, COSTS, **kw)
    assert int8 == pytest.approx(5e-9 * n + 2 * 2e-4 + 2 * 3 / 4 * n * (1 + 4 / 1024) / 1e8)
    topk = predict_seconds("topk", n, [(1024, 1024)], w, link, COSTS, **kw)
    k = -(-n // 100)
    assert topk == pytest.approx(8e-9 * n + 2e-4 + 3 * k * 8 / 1e8)
    # PowerSGD: P (1024x4) and Q (1024x4) allreduced; the bias (1-D) goes with P.
    ps = predict_seconds("powersgd", n + 1024, [(1024, 1024), (1024,)], w, link, COSTS, **kw)
    p_elems, q_elems = 1024 * 4 + 1024, 1024 * 4
    expected = 1e-10 * 1024 * 1024 * 4 + 1e-9 * (n + 1024)
    expected += 2 * 2e-4 + 2 * 3 / 4 * 4 * (p_elems + q_elems) / 1e8
    assert ps == pytest.approx(expected)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"methods": ("none", "zstd")}, "methods"),
        ({"methods": ()}, "methods"),
        ({"methods": ("int8",), "lossless_only": True}, "lossless_only"),
        ({"start_iter": 1}, "start_iter"),
        ({"interval": 0}, "interval"),
        ({"objective": "loss"}, "objective must be one of"),
        ({"min_density": 0.0}, "min_density"),
        ({"powersgd_rank": 0}, "powersgd_rank"),
        ({"powersgd_steps": 0.5}, "powersgd_steps"),
        ({"max_lost_share": 1.5}, "max_lost_share"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hooks.AutoState(**kwargs)


def test_bad_link_and_unknown_method_are_refused() -> None:
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s > 0"):
        hooks.LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        hooks.LinkModel(latency_s=-1.0, bandwidth_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="unknown method 'zstd'"):
        predict_seconds("zstd", 10, [], 2, FAST, COSTS, density=0.01, rank=4)
    from xcomm import _C

    with pytest.raises(ValueError, match="allreduce link's bandwidth must be > 0"):
        _C.predict_allreduce("none", 10, 4, 2, 1e-4, 0.0, {})
    with pytest.raises(ValueError, match="no calibrated cost for 'int8'"):
        predict_seconds("int8", 10, [], 2, FAST, {}, density=0.01, rank=4)


def _run(
    ctx: RankContext,
    links: dict[int, hooks.LinkModel | None],
    steps: int,
    cap_mb: float,
    state_kwargs: dict,
) -> tuple[torch.Tensor, list[dict[int, str]], str, dict]:
    """Trains with auto; ``links`` maps a step to the link from then on.
    Returns the parameters, the methods per bucket after each step, the
    explanation and the residual/PowerSGD state at the end."""
    model = DDP(make_model(), bucket_cap_mb=cap_mb)
    state = hooks.AutoState(
        link=links.get(0), codec_costs=COSTS, observe=False, model=model, **state_kwargs
    )
    model.register_comm_hook(state, hooks.auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    history = []
    for step in range(steps):
        if step in links:
            state.link = links[step]
        train(model, opt, batch, ctx.rank, range(step, step + 1))
        history.append({k: d["method"] for k, d in state.decisions.items()})
    errors = [state._powersgd._codec.param_state(k)[0] for k in state._powersgd._codec.state_keys()]
    leftovers = {
        "residuals": len(state.feedback.feedback.state()),
        "powersgd_errors": sum(e is not None and bool(e.abs().sum() > 0) for e in errors),
    }
    return flat_params(model), history, state.explain(), leftovers


def test_slow_link_compresses_fast_link_does_not_and_ranks_agree() -> None:
    for link, expect_none in ((FAST, True), (SLOW, False)):
        results = run_ranks(_run, 2, {0: link}, 5, 25, {})
        params0, history0, explain, _ = results[0]
        for params, history, _, _ in results[1:]:
            assert torch.equal(params, params0)
            assert history == history0
        final = history0[-1]
        assert final, "no decision was made"
        assert all((m == "none") == expect_none for m in final.values()), final
        assert "predicted ms" in explain


def _reference(ctx: RankContext) -> torch.Tensor:
    model = DDP(make_model())
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(model, opt, batch, ctx.rank, range(5))
    return flat_params(model)


def test_lossless_only_is_plain_averaging_bit_for_bit() -> None:
    got = run_ranks(_run, 2, {0: SLOW}, 5, 25, {"lossless_only": True})
    want = run_ranks(_reference, 2)
    assert all(m == "none" for m in got[0][1][-1].values())
    assert torch.equal(got[0][0], want[0])


def test_mixed_methods_across_buckets_keep_three_ranks_in_step() -> None:
    # Small buckets: latency makes the small ones go uncompressed (one
    # collective), the large ones int8 (two, the second issued from a
    # callback); their collectives interleave.
    results = run_ranks(_run, 3, {0: MIXED}, 6, 0.001, {"methods": ("none", "int8")})
    params0, history0, _, _ = results[0]
    assert len(set(history0[-1].values())) >= 2, history0[-1]
    for params, history, _, _ in results[1:]:
        assert torch.equal(params, params0)
        assert history == history0
    assert torch.isfinite(params0).all()


def test_a_link_that_changes_mid_run_switches_within_an_interval_and_back() -> None:
    links = {0: FAST, 6: SLOW, 14: FAST}
    results = run_ranks(_run, 2, links, 20, 25, {"interval": 3})
    params0, history, _, leftovers = results[0]
    assert torch.equal(results[1][0], params0)
    methods = [set(h.values()) for h in history]
    assert methods[5] == {"none"}
    slow_from = next(s for s in range(6, 20) if "none" not in methods[s])
    assert slow_from <= 6 + 3, methods  # the next re-evaluation
    back = next(s for s in range(14, 20) if methods[s] == {"none"})
    assert back <= 14 + 3, methods
    # Back on "none", whatever the lossy methods kept was sent.
    assert leftovers == {"residuals": 0, "powersgd_errors": 0}


def _switching(ctx: RankContext) -> list[float]:
    model = DDP(make_model())
    state = hooks.AutoState(link=SLOW, codec_costs=COSTS, observe=False, model=model, interval=1)
    model.register_comm_hook(state, hooks.auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    norms = []
    for step, allowed in enumerate(
        [("int8",)] * 4 + [("topk",)] * 2 + [("powersgd",)] * 2 + [("none",)]
    ):
        state.allowed = allowed
        train(model, opt, batch, ctx.rank, range(step, step + 1))
        res = state.feedback.feedback.state()
        norms.append(float(sum(r.abs().sum() for r in res.values())))
    return norms


def test_methods_switching_keeps_residuals_across_int8_topk_and_powersgd() -> None:
    """Restricting the set per phase forces int8 -> top-k -> PowerSGD: the
    residual moves with the bucket (the store is shared; nothing resets)."""

    norms = run_ranks(_switching, 2)[0]
    assert norms[3] > 0  # int8 kept a residual ...
    assert norms[4] > 0 and norms[4] != norms[3]  # ... which top-k took over and updated
    assert norms[-1] == 0  # "none" sent everything owed


def _resume(ctx: RankContext, methods: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    def fresh() -> tuple[DDP, torch.optim.Optimizer, Any]:
        model = DDP(make_model())
        state = hooks.AutoState(
            link=MIXED, codec_costs=COSTS, observe=False, model=model, interval=2, methods=methods
        )
        model.register_comm_hook(state, hooks.auto_hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state

    return checkpoint_resume(fresh, batch, ctx.rank, range(5), range(5, 10))


@pytest.mark.parametrize("methods", [("none", "int8"), ("topk",), ("bf16", "powersgd")])
def test_checkpoint_resume_of_an_auto_run_is_bitwise(methods: tuple[str, ...]) -> None:
    # One bucket (DDP's default cap): a fresh DDP's first buckets equal the
    # rebuilt ones only then (FeedbackStore: other groupings resume inexactly).
    for uninterrupted, resumed in run_ranks(_resume, 2, methods):
        assert torch.equal(uninterrupted, resumed)


def _measured(ctx: RankContext) -> tuple[dict, str, dict, list]:
    model = DDP(make_model())
    state = hooks.AutoState(model=model, interval=2)
    model.register_comm_hook(state, hooks.auto_hook)
    xcomm.reset_stats()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, opt, batch, ctx.rank, range(6))
    link = state.link_estimate
    auto_ops = {k: v["calls"] for k, v in xcomm.stats().items() if k.startswith("AUTO:")}
    return (
        state.decisions,
        state.explain(),
        auto_ops,
        [link.latency_s, link.bandwidth_bytes_per_s],
    )


def test_measured_link_agrees_across_ranks_and_is_explained() -> None:
    results = run_ranks(_measured, 2)
    decisions0, explain, auto_ops, link0 = results[0]
    assert decisions0 and results[1][0] == decisions0  # the same inputs on every rank
    assert results[1][3] == link0
    assert link0[0] > 0 and link0[1] > 0
    assert "Gbit/s" in explain
    # 4 compressed steps, one bucket each.
    assert sum(auto_ops.values()) == 4 * len(decisions0)


def _alone(ctx: RankContext) -> tuple[dict, list, list]:
    model, ref = DDP(make_model()), DDP(make_model())
    state = hooks.AutoState(model=model, interval=2)
    model.register_comm_hook(state, hooks.auto_hook)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    train(model, opt, batch, ctx.rank, range(6))
    train(ref, ref_opt, batch, ctx.rank, range(6))
    methods = {i: d["method"] for i, d in state.decisions.items()}
    return methods, flat_params(model).tolist(), flat_params(ref).tolist()


def test_a_group_of_one_sends_nothing_and_trains_as_without_the_hook() -> None:
    """World size 1 (a one-GPU run, a smoke test): no link to measure. The
    probes move 0 bytes, and the link must not be read as infinitely slow:
    auto picks 'none' and the run equals plain DDP bit for bit."""
    methods, params, ref = run_ranks(_alone, 1)[0]
    assert methods and set(methods.values()) == {"none"}, methods
    assert params == ref


def _rank_round_spacing(ctx: RankContext, link_bytes_per_s: float) -> dict[str, int]:
    """MeasuredLink on one rank with a probe that takes as long as a link of
    ``link_bytes_per_s`` would, and 20 ms steps."""
    import time as _time

    from xcomm.hooks._measure import MeasuredLink

    def probe(nbytes: int) -> float:
        # A fast link's probe takes no time at all: a sleep of tens of
        # microseconds overshoots by a millisecond on a loaded machine, past
        # the round's 1 ms share (a CI run read next_round 16 for 15).
        if link_bytes_per_s < 1e10:
            _time.sleep(nbytes / link_bytes_per_s)
        return float(nbytes)

    m = MeasuredLink(("allreduce",), (), probe_fraction=0.01, interval=5)
    m.step_times = [0.02] * 5
    m.agree(None, {"allreduce": probe}, dict, step=10)
    return {"next_round": m.next_round, "probe_bytes": m.probe_bytes}


def test_rounds_are_spaced_so_probes_take_about_their_share_of_the_time() -> None:
    """A fast link: every ``interval`` steps. A slow one, where even the
    smallest probe outweighs 1% of 5 steps of 20 ms: rounds spaced so they
    take about 1% of the time (two 64 kB probes at 1 MB/s: ~0.13 s, i.e.
    one round per ~640 steps of 20 ms)."""
    fast = run_ranks(_rank_round_spacing, 1, 1e11)[0]
    assert fast["next_round"] == 15, fast
    slow = run_ranks(_rank_round_spacing, 1, 1e6)[0]
    assert slow["probe_bytes"] == 64_000, slow
    assert 10 + 500 <= slow["next_round"] <= 10 + 900, slow


class _FakeLink:
    """A link of a given rate and latency, timed by a fake clock: probes and
    the agreement advance it, so MeasuredLink's rounds read exactly the rate
    (no processes; one rank, whose readings are the agreed ones)."""

    LATENCY = 7e-4

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, stall: float = 0.0, hidden: float = 0.0
    ) -> None:
        from xcomm.hooks import _measure

        self.now = 0.0
        self.bits_per_s = 10e9
        self.stall = stall  # seconds each round's first probe waits to line the ranks up
        # Seconds a step with a round takes beyond the round (the buckets'
        # collectives queued behind it), which the round cannot time.
        self.hidden = hidden
        self._probes = 0
        self.round_seconds = 0.0  # what the rounds took, all together
        clock = type("Clock", (), {"perf_counter": staticmethod(lambda: self.now)})
        monkeypatch.setattr(_measure, "time", clock)
        monkeypatch.setattr(_measure.dist, "all_reduce", lambda *a, **k: self._advance(0))
        self.measure = _measure.MeasuredLink(("allreduce",), (), probe_fraction=0.01, interval=5)

    def _advance(self, nbytes: float) -> float:
        self.now += self.LATENCY + nbytes * 8 / self.bits_per_s
        if nbytes:
            self._probes += 1
            self.now += self.stall if self._probes % 2 else 0.0
        return nbytes

    def step(self, step: int, matters: Any = None) -> bool:
        """One 130 ms training step; whether it ran a round."""
        self.measure.step_started()
        ran = step >= self.measure.next_round or self.measure.agreed is None
        if ran:
            start = self.now
            self.measure.agree(None, {"allreduce": self._advance}, dict, step=step, matters=matters)
            self.now += self.hidden
            self.round_seconds += self.now - start
        self.now += 0.13
        return ran

    def gbit(self) -> float:
        assert self.measure.agreed is not None
        return self.measure.agreed[0]["allreduce"].bandwidth_bytes_per_s * 8 / 1e9

    def run(
        self, steps: int, bits_per_s: Any, matters: Any = None
    ) -> tuple[list[int], dict[int, float]]:
        """``steps`` steps with the link at ``bits_per_s(step, due, rounds)``
        (``due``: a round is due this step; ``rounds``: the steps that ran
        one so far); the rounds' steps and the agreed Gbit/s after each step."""
        rounds: list[int] = []
        seen: dict[int, float] = {}
        for step in range(steps):
            due = step >= self.measure.next_round
            self.bits_per_s = bits_per_s(step, due, rounds)
            if self.step(step, matters):
                rounds.append(step)
            seen[step] = self.gbit()
        return rounds, seen


def test_a_changed_link_is_confirmed_at_the_next_step_and_followed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rounds, seen = _FakeLink(monkeypatch).run(
        40, lambda step, due, rounds: 0.1e9 if 12 <= step < 26 else 10e9
    )
    # Slowed after step 11: the first round after it reads it, the round at
    # the next step confirms it, and the agreed link follows.
    first = next(s for s in rounds if s >= 12)
    assert first + 1 in rounds
    assert seen[first + 1] == pytest.approx(0.1, rel=0.05)
    assert first + 1 - 12 <= 5
    # Sped up again after step 25: probes grow out of the latency (4x a
    # round, rounds at once while readings disagree) until the link reads fast.
    back = next(s for s in rounds if s >= 26)
    fast = next(s for s in range(back, 40) if seen[s] > 5)
    assert fast - back <= 4 and all(s in rounds for s in range(back, fast + 1))
    # Between changes, rounds are spaced again (no round at every step).
    assert len(rounds) < 20


def test_one_noisy_reading_is_outvoted_at_the_cost_of_one_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    def rate(step: int, due: bool, rounds: list[int]) -> float:
        # One probe crosses a moment of congestion: only the round at the
        # first step after 15 that has one reads 0.1 Gbit/s.
        noisy = due and step >= 15 and not any(r >= 15 for r in rounds)
        return 0.1e9 if noisy else 10e9

    rounds, seen = _FakeLink(monkeypatch).run(30, rate)
    noise = next(s for s in rounds if s >= 15)
    assert noise + 1 in rounds  # confirmed at once
    assert noise + 2 not in rounds  # and no more: the confirmation agreed with the rest
    assert min(seen[s] for s in range(noise, 30)) > 1  # the choice never saw the noise


def test_a_changed_reading_that_would_change_no_choice_is_not_confirmed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[float] = []

    def matters(links: dict[str, Any], costs: dict[str, float]) -> bool:
        asked.append(links["allreduce"].bandwidth_bytes_per_s * 8 / 1e9)
        return False  # every choice stays what it is at either rate

    rounds, _ = _FakeLink(monkeypatch).run(
        30, lambda step, due, rounds: 0.1e9 if step >= 12 else 10e9, matters
    )
    # Asked about the slow reading (the newest, not the median), and no
    # round followed at the next step: rounds stay spaced.
    assert any(g == pytest.approx(0.1, rel=0.05) for g in asked)
    assert all(b - a > 1 for a, b in itertools.pairwise(rounds)), rounds


def test_the_first_round_keeps_its_probe_size_until_a_step_was_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No step has been timed at the first round, so there is no budget to
    size the next probe from: it keeps its size (a 64 kB probe at the next
    round read an emulated 10 Gbit/s link as 0.13 Gbit/s and chose PowerSGD
    over top-k for the MLP's first 8 steps), and is sized from the budget once
    steps are timed."""
    link = _FakeLink(monkeypatch)
    first = link.measure.probe_bytes
    assert link.step(0)  # the first round: no step timed yet
    assert link.measure.probe_bytes == first
    link.measure.next_round = 1
    assert link.step(1)  # step 0 had a round: its time does not count
    assert link.measure.probe_bytes == first
    for step in range(2, 4):
        link.step(step)
    link.measure.next_round = 4
    assert link.step(4)
    # 1% of 5 steps of 130 ms over two runs at 10 Gbit/s: 3.25 ms, 4.06 MB.
    assert link.measure.probe_bytes == pytest.approx(0.01 * 5 * 0.13 / 2 * 10e9 / 8, rel=0.01)


def test_rounds_that_take_longer_than_their_bytes_are_spaced_by_what_they_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a busy host a round's collectives wait for longer than their bytes
    take (on 2 cores a round on an emulated 10 Gbit/s link took 1-13 ms, not
    the 0.5-1.5 ms its bytes and latency predict), and the backward pass waits
    for the round. Spaced by the prediction alone, rounds took 2-3x their
    ``probe_fraction``; spaced by what the recent rounds took, about their
    share. Here each round's untimed probe also waits 10 ms to line the
    ranks up, on 130 ms steps."""
    spaced_by_bytes = _FakeLink(monkeypatch)
    rounds_bytes, _ = spaced_by_bytes.run(200, lambda step, due, rounds: 10e9)
    stalled = _FakeLink(monkeypatch, stall=10e-3)
    rounds, _ = stalled.run(200, lambda step, due, rounds: 10e9)
    # Without the stall the bytes set the spacing (probes sized to 1% of 5
    # steps; with the latencies a round is due every 7 steps).
    assert {b - a for a, b in itertools.pairwise(rounds_bytes[3:])} == {7}, rounds_bytes
    # With it, the rounds after the first few are further apart (the 10 ms
    # are ~8 more steps' worth of 1%), and all of them together take about
    # probe_fraction (1%) of the training time, as without the stall.
    gaps = [b - a for a, b in itertools.pairwise(rounds[3:])]
    assert gaps and min(gaps) >= 14, rounds
    for link in (spaced_by_bytes, stalled):
        share = link.round_seconds / (200 * 0.13 + link.round_seconds)
        assert 0.007 <= share <= 0.013, share


def test_a_rounds_hidden_cost_in_its_step_spaces_the_next_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round delays the buckets' collectives behind it: its step takes
    longer than the round itself (on the DDP sweep's MLP at 0.1 Gbit/s about
    87 ms a round where the rounds' own durations predicted 14 ms, and
    rounds took 5.5% of the run). What a round's step took beyond the
    median step and the round is added to the next round's cost, so rounds
    are spaced to take about probe_fraction (1%) of the run with it; steps
    the caller calls not comparable (a trial's) add nothing."""
    hidden = _FakeLink(monkeypatch, hidden=65e-3)  # half a 130 ms step
    rounds, _ = hidden.run(400, lambda step, due, rounds: 10e9)
    assert hidden.measure.round_step_hidden, "no round's step was measured"
    assert max(hidden.measure.round_step_hidden) == pytest.approx(65e-3, rel=0.01)
    share = hidden.round_seconds / (400 * 0.13 + hidden.round_seconds)
    assert 0.006 <= share <= 0.02, (share, rounds)
    gaps = [b - a for a, b in itertools.pairwise(rounds[3:])]
    assert gaps and min(gaps) >= 40, rounds  # 7 steps apart without the hidden cost

    # A caller that says its round steps do not compare with the steps
    # before them (a trial of uncompressed steps): none is measured.
    other = _FakeLink(monkeypatch, hidden=65e-3)
    step_started = other.measure.step_started
    monkeypatch.setattr(other.measure, "step_started", lambda: step_started(comparable=False))
    rounds, _ = other.run(60, lambda step, due, rounds: 10e9)
    assert other.measure.round_step_hidden == []
    assert {b - a for a, b in itertools.pairwise(rounds[3:])} == {7}, rounds


def test_the_agreed_latency_is_the_least_over_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first rank at an agreement also waits for the others to finish the
    probe (milliseconds apart at 0.1 Gbit/s), which no collective pays by
    itself: the latency every rank uses is the last-arriving rank's reading,
    agreed in the same one allreduce MAX as the rest (negated)."""
    from xcomm.hooks import _measure

    m = _measure.MeasuredLink(("allreduce",), ("topk",), probe_fraction=0.01, interval=5)
    m.latencies = [2e-3, 2.5e-3]  # this rank waited at its agreements

    def with_other_rank(t: torch.Tensor, **kw: Any) -> None:
        other = t.clone()
        other[0] = -3e-4  # the other rank's least agreement: 0.3 ms
        other[-1] = 2 * t[-1]  # and a slower codec
        torch.maximum(t, other, out=t)

    monkeypatch.setattr(_measure.dist, "all_reduce", with_other_rank)
    links, costs = m.agree(None, {"allreduce": float}, lambda: {"topk": 1e-9}, step=0)
    assert links["allreduce"].latency_s == pytest.approx(3e-4)
    assert costs["topk"] == pytest.approx(2e-9)  # every other input: the MAX


def test_gpu_buckets_choose_only_among_methods_that_run_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without xcomm's CUDA codec kernels a GPU bucket's int8 and top-k would
    run on the host: there auto offers only none and the casts, and says so
    when nothing is left. With them, every allowed method."""
    from xcomm import _C

    monkeypatch.setattr(_C, "cuda_codecs", False)
    state = hooks.AutoState()
    assert state.candidates("cpu") == state.allowed
    assert state.candidates("cuda") == ("none", "bf16")  # the default methods
    every = hooks.AutoState(methods=("none", "bf16", "fp16", "int8", "topk", "powersgd"))
    assert every.candidates("cuda") == ("none", "bf16", "fp16")
    assert hooks.AutoState(methods=("none", "int8")).candidates("cuda") == ("none",)
    with pytest.raises(ValueError, match="built without its CUDA codec kernels"):
        hooks.AutoState(methods=("int8", "topk")).candidates("cuda")
    link = hooks.LinkModel(latency_s=1e-3, bandwidth_bytes_per_s=1e6)  # slow: compress
    predicted = every._predict(0, 1 << 20, [(1024, 1024)], 4, "cuda", 2, link, COSTS)
    assert set(predicted) == {"none", "bf16", "fp16"}
    assert min(predicted, key=predicted.get) in ("bf16", "fp16")

    monkeypatch.setattr(_C, "cuda_codecs", True)
    assert every.candidates("cuda") == every.allowed
    assert hooks.AutoState(methods=("int8", "topk")).candidates("cuda") == ("int8", "topk")
    predicted = every._predict(0, 1 << 20, [(1024, 1024)], 4, "cuda", 2, link, COSTS)
    assert set(predicted) == set(every.allowed)
    assert min(predicted, key=predicted.get) in ("topk", "powersgd")


def test_a_method_that_fails_to_issue_raises_and_fails_the_next_turn() -> None:
    """A bucket whose collective fails to start (its turn already came, so it
    is issued at once) raises the method's own error from the hook, and the
    next bucket's turn, which waits on it, fails with the same error rather
    than issuing out of order or waiting forever."""
    from types import SimpleNamespace

    from xcomm.hooks._common import IssueOrder
    from xcomm.hooks.auto import _ordered

    state = SimpleNamespace(order=IssueOrder())
    bucket = SimpleNamespace(buffer=lambda: torch.zeros(4))

    def refuse() -> torch.futures.Future:
        raise RuntimeError("allgather refused: peer gone")

    with pytest.raises(RuntimeError, match="allgather refused: peer gone"):
        _ordered(state, bucket, refuse)  # type: ignore[arg-type]
    issued: list[bool] = []

    def never() -> torch.futures.Future:
        issued.append(True)
        raise AssertionError("issued after a failed turn")

    fut = _ordered(state, bucket, never)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="allgather refused: peer gone"):
        fut.wait()
    assert not issued


def test_observed_costs_correct_the_model_and_are_bounded() -> None:
    """The closed loop's arithmetic: an uncompressed reduction corrects the
    link every method's wire time uses; a compressed one corrects its method;
    a method never run takes the least factor of those that ran (its
    calibration before any has); a key's first reading is its factor, later
    ones are averaged in geometrically; readings are bounded to [FLOOR,
    CEILING]; a factor keeps its value while unseen; the state round-trips."""
    from xcomm.hooks._measure import ObservedCosts

    o = ObservedCosts(("none", "bf16", "int8", "topk"))
    assert o.local() == [0.0, 0.0, 0.0, 0.0]  # nothing seen
    o.record("link", observed_s=0.002, predicted_s=0.008)  # the link is 4x faster
    # Only the link seen: a compressed method keeps its calibration.
    o.update(o.local())
    assert o.factor("int8") == 1.0 and o.inherited_from("int8") is None
    assert "int8 x1.00 (never run; uncorrected" in o.explain()
    o.record("topk", observed_s=0.030, predicted_s=0.003)  # top-k 10x slower
    o.update(o.local())
    assert o.factors == {"link": 0.25, "bf16": 1.0, "int8": 1.0, "topk": pytest.approx(10.0)}
    assert o.predict("none", codec_s=0.0, wire_s=0.008) == pytest.approx(0.002)
    # A method: its factor times (codec + the corrected link).
    assert o.predict("topk", codec_s=0.001, wire_s=0.004) == pytest.approx(0.02)
    assert o.base("topk", codec_s=0.001, wire_s=0.004) == pytest.approx(0.002)
    # int8 never ran: top-k's correction, not its calibration's 0.002.
    assert o.inherited_from("int8") == "topk"
    assert o.predict("int8", codec_s=0.001, wire_s=0.004) == pytest.approx(0.02)
    assert "int8 x10.00 (never run; corrected by topk's)" in o.explain()
    o.record("bf16", observed_s=0.004, predicted_s=0.002)  # bf16 ran: 2x
    o.update(o.local())
    assert o.inherited_from("int8") == "bf16" and o.factor("int8") == pytest.approx(2.0)
    assert o.inherited_from("topk") is None and o.factor("topk") == pytest.approx(10.0)
    restored = ObservedCosts(("none", "bf16", "int8", "topk"))
    restored.load_state_dict(o.state_dict())
    assert restored.factors == o.factors and restored.seen == o.seen
    # A seen key's later readings are averaged in geometrically: one noisy
    # round moves it by its square root, a lasting change within a few.
    o.update([0.0, 0.0, 0.0, 1e6])  # unseen keep their factor; readings are bounded
    assert o.factors["link"] == 0.25
    assert o.factors["topk"] == pytest.approx(math.sqrt(10.0 * o.CEILING))
    for _ in range(20):
        o.update([0.0, 0.0, 0.0, 1e6])
    assert o.factors["topk"] == pytest.approx(o.CEILING, rel=1e-5)
    o.record("topk", observed_s=0.001, predicted_s=0.001)  # one round at its prediction
    o.update(o.local())
    assert o.factors["topk"] == pytest.approx(10.0, rel=1e-5)
    o.record("int8", 1e-9, 1.0)
    o.update(o.local())
    assert o.factors["int8"] == o.FLOOR and o.factor("int8") == o.FLOOR  # its own now


def test_the_link_factor_is_dropped_when_the_reading_it_corrects_moves() -> None:
    """The link's factor corrects the reading it was seen against. On the
    MLP at 10 Gbit/s a factor of 0.29 learned on a 1.3 Gbit/s reading,
    applied to a later 6.0 Gbit/s one, predicted uncompressed buckets at an
    impossible 21 Gbit/s, and they ran uncompressed for 13 steps: a reading
    over 2x off drops the factor; within 2x it is kept."""
    from xcomm import _C
    from xcomm.hooks._measure import ObservedCosts

    assert _C.ObservedFactors.RELEARN == 2.0
    slow, fast = 8 / 1.3e9, 8 / 6.0e9  # seconds per byte
    o = ObservedCosts(("none", "int8", "topk"))
    assert not o.set_link(slow)
    o.record("link", observed_s=0.029, predicted_s=0.1)
    o.update(o.local())
    assert o.factor("none") == pytest.approx(0.29)
    assert not o.set_link(slow * 1.5)  # within 2x: noise, or a change the factor follows
    assert o.predict("none", codec_s=0.0, wire_s=0.055) == pytest.approx(0.29 * 0.055)
    restored = ObservedCosts(("none", "int8", "topk"))
    restored.load_state_dict(o.state_dict())
    o.update(o.local())  # a round in which only compressed methods ran
    assert o.set_link(fast)
    assert o.factor("none") == 1.0 and "link" not in o.seen
    assert o.predict("none", codec_s=0.0, wire_s=0.055) == pytest.approx(0.055)
    assert "link x1.00 (dropped: the reading moved over 2x" in o.explain(), o.explain()
    # The checkpoint kept the reading the factor was seen against.
    assert restored.set_link(fast) and restored.factor("none") == 1.0
    # Seen again against the new reading: learned again, and explained so.
    o.record("link", observed_s=0.09, predicted_s=0.1)
    o.update(o.local())
    assert not o.set_link(fast) and o.factor("none") == pytest.approx(0.9)
    assert "link x0.90" in o.explain() and "dropped" not in o.explain()
    # Uncompressed reductions seen in the round just ended are newer evidence
    # than a probe 3x off: the factor is rescaled, the corrected link kept.
    o.record("link", observed_s=0.09, predicted_s=0.1)
    o.update(o.local())
    assert not o.set_link(fast * 3) and "link" in o.seen
    assert o.predict("none", codec_s=0.0, wire_s=3.0) == pytest.approx(0.9)


def _relinked(ctx: RankContext) -> dict[str, Any]:
    """auto with its link given (``link=``), then given 10x faster between
    rounds; every round's fold and link reading are recorded."""
    torch.manual_seed(0)
    model = DDP(make_model())
    state = hooks.AutoState(
        link=hooks.LinkModel(1e-4, 1e6), codec_costs=COSTS, model=model, interval=1
    )
    model.register_comm_hook(state, hooks.auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    observed = state._observed
    rounds: list[dict[str, Any]] = []
    update, set_link = observed.update, observed.set_link

    def folded(agreed: Any) -> None:
        # Whether this period's uncompressed reductions were seen (C++'s rule
        # keys on it), and the link factor before the reading arrives.
        rounds.append({"fresh": agreed[0] > 0})
        update(agreed)
        rounds[-1]["factor"] = observed.factors["link"]

    def counted(seconds_per_byte: float) -> bool:
        dropped = set_link(seconds_per_byte)
        rounds[-1].update(
            reading=seconds_per_byte,
            dropped=dropped,
            after=observed.factors["link"],
            seen_at=observed._factors.link_seen_at,
        )
        return dropped

    observed.update = folded  # type: ignore[method-assign]
    observed.set_link = counted  # type: ignore[method-assign]
    train(model, opt, batch, ctx.rank, range(6))
    before = (dict(observed.factors), sorted(observed.seen), len(rounds))
    state.link = hooks.LinkModel(1e-4, 1e7)
    train(model, opt, batch, ctx.rank, range(6, 8))
    return {"before": before, "rounds": rounds, "explain": state.explain()}


def test_auto_tells_the_link_factor_each_rounds_link_reading() -> None:
    """In the hook: every round tells the closed loop its agreed link, and a
    reading 10x off the one the factor was seen against drops the factor, or,
    where uncompressed reductions were seen in the round just folded,
    rescales it so the corrected link stays where they ran; on every rank
    alike. (Which of the two happens depends on whether the whole-step check
    ran uncompressed steps in that round; C++'s test covers both.)"""
    results = run_ranks(_relinked, 2)
    (factors, seen, count), rounds = results[0]["before"], results[0]["rounds"]
    assert results[1]["rounds"] == rounds
    # Uncompressed steps on loopback ran far faster than 1 MB/s predicts.
    assert "link" in seen and factors["link"] < 0.5, factors
    assert count >= 3 and all(r["reading"] == 1e-6 for r in rounds[:count]), rounds
    # No drop while the reading held.
    assert not any(r["dropped"] for r in rounds[:count]), rounds
    first = rounds[count]
    assert first["reading"] == 1e-7, first
    if first["fresh"]:
        from xcomm.hooks._measure import ObservedCosts

        ceiling = ObservedCosts.CEILING
        assert not first["dropped"] and first["seen_at"] == 1e-7, first
        assert first["after"] == pytest.approx(min(first["factor"] * 10, ceiling)), first
    else:
        assert first["dropped"] and first["after"] == 1.0 and first["seen_at"] == 0.0, first
        assert "link x1.00 (dropped" in results[0]["explain"], results[0]["explain"]
    assert sum(r["dropped"] for r in rounds) <= 1, rounds


def test_a_method_predicted_slower_than_none_is_never_kept() -> None:
    """Hysteresis keeps a method against a slightly faster rival, but not
    against sending the bucket uncompressed."""
    from xcomm.hooks._measure import MethodChoices

    c = MethodChoices(switch_margin=0.1)
    assert c.choose(0, 100, 0, {"none": 1.0, "int8": 0.5}) == "int8"
    assert c.choose(0, 100, 1, {"none": 1.0, "int8": 0.95, "bf16": 0.9}) == "int8"  # margin
    assert c.choose(0, 100, 2, {"none": 1.0, "int8": 1.05, "bf16": 2.0}) == "none"
    assert c.switches == 1


def test_would_switch_asks_the_rule_choose_follows() -> None:
    """The confirmation's question (would this reading move a key?) and the
    choice are one C++ rule: on random predictions, ``would_switch`` is true
    exactly where ``choose`` then moves the key, and the move goes to the
    least unless the kept method is within the margin and not slower than none."""
    import random

    from xcomm.hooks._measure import MethodChoices

    rng = random.Random(7)
    names = ("none", "bf16", "int8", "topk")
    moved = kept = 0
    for trial in range(500):
        c = MethodChoices(switch_margin=0.1)
        first = {m: rng.uniform(0.5, 2.0) for m in names}
        start = c.choose(0, 100, 0, first)
        assert start == min(first, key=lambda m: first[m])
        later = {m: first[m] * rng.uniform(0.8, 1.25) for m in names}
        switches = c.would_switch(0, later)
        after = c.choose(0, 100, 1, later)
        assert switches == (after != start), (trial, first, later)
        best = min(later, key=lambda m: later[m])
        keep = later[best] >= 0.9 * later[start] and later[start] <= later["none"]
        assert after == (start if keep else best), (trial, first, later)
        moved += after != start
        kept += after == start and best != start
    assert moved > 20 and kept > 20  # both branches ran


def _wide_batch(n: int) -> Any:
    """Batches of 8 ``n``-wide inputs over 8 classes, per rank and step."""

    def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 10 + rank)
        return torch.randn(8, n, generator=g), torch.randint(0, 8, (8,), generator=g)

    return batch


def _misjudged(ctx: RankContext, observe: bool) -> tuple[list[tuple[str, int]], str]:
    """One 16 MiB bucket; top-k's codec cost given as a tenth of what it
    takes on this machine (as a calibration on other data would), and each
    top-k reduction made 150 ms slower still (on zero-heavy gradients it was
    seen at several times its randn cost), so it is certainly slower than
    sending uncompressed, even where a loaded machine reads the link several
    times slower than it is (30 ms was not: a CI run kept top-k to the end
    while a build ran beside it); the link is measured. Returns each step's (method,
    step of the next round) and the explanation."""
    import time as _time

    from xcomm.hooks import auto
    from xcomm.hooks.auto import calibrate_codecs

    plain_topk = auto.topk_allreduce

    def slow_topk(state: Any, bucket: Any, step: int, density: Any = None) -> Any:
        _time.sleep(0.15)
        return plain_topk(state, bucket, step, density)

    auto.topk_allreduce = slow_topk
    torch.manual_seed(0)
    n = 2048
    model = DDP(torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Linear(n, 8)))
    costs = calibrate_codecs(numel=n * n)
    costs["topk"] /= 10  # real cost = 10x the calibrated one
    state = hooks.AutoState(
        methods=("none", "topk"),
        objective="step_time",  # the closed loop on time per step alone
        codec_costs=costs,
        model=model,
        interval=2,
        probe_fraction=0.05,  # rounds every few steps, not spaced out by their cost
        observe=observe,
    )
    model.register_comm_hook(state, hooks.auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    history = []
    for step in range(30):
        train(model, opt, _wide_batch(n), ctx.rank, range(step, step + 1))
        history.append((state.decisions.get(0, {}).get("method", "-"), state.next_round))
    return history, state.explain()


def test_a_codec_ten_times_slower_than_calibrated_is_left_within_two_rounds() -> None:
    """auto picks top-k from its calibrated cost, sees it take over 10x that
    (and more than sending uncompressed), and moves the bucket to ``none``
    at one of the next two rounds, the same step on every rank. Without the
    closed loop (``observe=False``) it keeps top-k: the test's premise holds."""
    results = run_ranks(_misjudged, 2, True)
    history, explain = results[0]
    assert results[1][0] == history  # the same choices at the same steps
    methods = [m for m, _ in history]
    first = methods.index("topk")  # chosen from the calibrated cost
    rounds = sorted({r for _, r in history[first:]})  # the rounds due after it
    left = next((s for s in range(first, len(methods)) if methods[s] == "none"), None)
    assert left is not None, (history, explain)  # what it saw, should it ever keep top-k
    assert left <= rounds[min(1, len(rounds) - 1)], (history, explain)
    assert all(m == "none" for m in methods[left:]), history  # and does not return
    assert "topk x" in explain, explain
    topk_factor = float(explain.split("topk x")[1].split()[0].rstrip(","))
    assert topk_factor > 5, explain

    kept, _ = run_ranks(_misjudged, 2, False)[0]
    assert [m for m, _ in kept][-1] == "topk", kept


def _untried(ctx: RankContext, inherit: bool) -> tuple[list[str], dict[str, int], str]:
    """One 16 MiB bucket, auto among top-k and int8 (no ``none``: the choice
    is between the two alone). Top-k's codec cost is given as a few ms it
    really exceeds (each reduction also sleeps 20 ms), int8's as 1.5x
    top-k's, but each int8 reduction sleeps 80 ms: on its calibration int8
    is second, on the real buckets it is far slower. Once top-k has run and
    been seen at several times its prediction, int8, never run, looks
    cheaper on its calibration alone. ``inherit=False`` puts back the rule
    before never-run methods were corrected (their own factor, 1). Returns
    each step's method, the calls each method's hook got, and the
    explanation."""
    import time as _time

    from xcomm.hooks import _measure, auto

    calls = {"topk": 0, "int8": 0}
    plain_topk, plain_int8 = auto.topk_allreduce, auto.int8_allreduce

    def slow_topk(state: Any, bucket: Any, step: int, density: Any = None) -> Any:
        calls["topk"] += 1
        _time.sleep(0.02)
        return plain_topk(state, bucket, step, density)

    def slower_int8(state: Any, bucket: Any, step: int, order: Any) -> Any:
        calls["int8"] += 1
        _time.sleep(0.08)
        return plain_int8(state, bucket, step, order)

    auto.topk_allreduce, auto.int8_allreduce = slow_topk, slower_int8
    if not inherit:
        plain_predict = _measure.ObservedCosts.predict

        def calibrated_until_run(self: Any, method: str, codec_s: float, wire_s: float) -> float:
            # A method never run keeps its calibration: no factor lent to it.
            if method != "none" and self.key(method) not in self.seen:
                return float(self.base(method, codec_s, wire_s))
            return float(plain_predict(self, method, codec_s, wire_s))

        _measure.ObservedCosts.predict = calibrated_until_run  # type: ignore[method-assign]
    torch.manual_seed(0)
    n = 2048
    model = DDP(torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Linear(n, 8)))
    numel = sum(p.numel() for p in model.parameters())
    costs = dict(COSTS)
    costs["topk"] = 4e-3 / numel  # 4 ms predicted; it takes 20 ms more than its codec
    costs["int8"] = 6e-3 / numel  # 6 ms predicted; it takes 80 ms more
    state = hooks.AutoState(
        methods=("int8", "topk"),
        objective="step_time",  # the closed loop on time per step alone
        codec_costs=costs,
        model=model,
        interval=2,
        probe_fraction=0.05,  # rounds every few steps, not spaced out by their cost
    )
    model.register_comm_hook(state, hooks.auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    history = []
    for step in range(24):
        train(model, opt, _wide_batch(n), ctx.rank, range(step, step + 1))
        history.append(state.decisions.get(0, {}).get("method", "-"))
    calls["buckets"] = len(state.decisions)
    return history, calls, state.explain()


def test_a_method_never_run_is_predicted_with_the_correction_of_those_that_ran() -> None:
    """auto picks top-k on the calibrations and sees it take several times
    its prediction. int8 has never run: predicted with top-k's correction it
    stays slower, so auto keeps top-k to the end and never calls int8's hook,
    the same on every rank, and says why int8 was not tried. With the rule
    from before (a never-run method keeps its calibration) the same run trips
    to int8 at a round: the test's premise holds."""
    results = run_ranks(_untried, 2, True)
    history, calls, explain = results[0]
    assert results[1][0] == history  # the same choices at the same steps
    first = history.index("topk")  # chosen on the calibrations
    assert set(history[first:]) == {"topk"}, history
    assert calls["int8"] == 0, calls
    assert calls["topk"] == (len(history) - first) * calls["buckets"] > 0, calls
    topk_factor = float(explain.split("topk x")[1].split()[0].rstrip(","))
    assert topk_factor > 2, explain  # the premise: top-k seen well above its model
    assert f"int8 x{topk_factor:.2f} (never run; corrected by topk's)" in explain, explain
    assert "int8 not tried (never run here)" in explain, explain
    assert "corrected by topk's" in explain, explain

    tripped, tripped_calls, _ = run_ranks(_untried, 2, False)[0]
    assert "int8" in tripped[tripped.index("topk") :], tripped
    assert tripped_calls["int8"] > 0, tripped_calls


def _calibrated_on_the_bucket(ctx: RankContext) -> dict[str, Any]:
    """Records every calibration auto makes, and the bucket DDP hands the hook
    at the last uncompressed step (before the hook averages it in place)."""
    from xcomm.hooks import auto

    calls: list[dict[str, Any]] = []
    plain_calibrate = auto.calibrate_codecs

    def recording(*args: Any, **kwargs: Any) -> dict[str, float]:
        sample = kwargs.get("sample")
        calls.append(
            {
                "numel": args[0] if args else kwargs.get("numel"),
                "sample": None if sample is None else sample.clone(),
            }
        )
        return plain_calibrate(*args, **kwargs)

    auto.calibrate_codecs = recording
    model = DDP(make_model(), bucket_cap_mb=0.01)  # several buckets: the largest is taken
    state = hooks.AutoState(model=model, interval=2)
    seen: dict[int, torch.Tensor] = {}

    def hook(s, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations
        if s.iter == s.start_iter - 1:
            seen[bucket.index()] = bucket.buffer().clone()
        return hooks.auto_hook(s, bucket)

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, opt, batch, ctx.rank, range(5))
    largest = max(seen.values(), key=lambda t: t.numel())
    return {"calls": calls, "largest": largest, "buckets": len(seen), "explain": state.explain()}


def test_codecs_are_timed_on_the_models_own_largest_bucket() -> None:
    """A codec's cost depends on its input (top-k's on a bucket of zeros, as
    an embedding's gradient is): auto times the codecs on a small stand-in
    before anything is compressed, then, at the round that starts
    compression, on a copy of this rank's largest bucket of the last
    uncompressed step, and says so in explain()."""
    for r in run_ranks(_calibrated_on_the_bucket, 2):
        assert r["buckets"] > 1, r["buckets"]
        calls = r["calls"]
        assert len(calls) == 2, [c["numel"] for c in calls]
        assert calls[0]["sample"] is None and calls[0]["numel"] == 1 << 16
        assert torch.equal(calls[1]["sample"], r["largest"])
        assert f"this model's largest bucket, {r['largest'].numel()} elements" in r["explain"]


def _embedding_and_dense() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.EmbeddingBag(20_000, 16, mode="mean"),
        torch.nn.Linear(16, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 64),
    )


def _bag_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    # 16 bags of 8 ids: at most 128 of the table's 20,000 rows get a gradient.
    return torch.randint(20_000, (16, 8), generator=g), torch.randint(64, (16,), generator=g)


def _by_objective(
    ctx: RankContext, objective: str, methods: tuple[str, ...] | None = ("none", "int8", "topk")
) -> dict[str, Any]:
    # 0.25 MiB: the table (320,000 entries) is a bucket of its own.
    model = DDP(_embedding_and_dense(), bucket_cap_mb=0.25)
    chosen_from = {} if methods is None else {"methods": methods}
    state = hooks.AutoState(
        link=SLOW, codec_costs=COSTS, observe=False, objective=objective, **chosen_from
    )
    model.register_comm_hook(state, hooks.auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, opt, _bag_batch, ctx.rank, range(6))
    table = model.module[0].weight.numel()

    def name(index: int) -> str:  # the bucket with the embedding table (and the first Linear)
        numel = state.decisions[index]["numel"]
        return "table" if numel >= table else f"dense {numel}"

    return {
        "methods": {name(k): d["method"] for k, d in state.decisions.items()},
        "lost_share": {name(k): v for k, v in state.lost_share.items()},
        "charged_s": state.charged_step_seconds,
        "explain": state.explain(),
        "params": flat_params(model),
    }


def test_time_to_accuracy_charges_what_a_method_loses_so_top_k_keeps_only_a_sparse_bucket() -> None:
    """On a link so slow that top-k at 1% is the fastest reduction of every
    bucket, time per step picks it everywhere; time to accuracy leaves top-k
    out of the dense buckets and charges each method the share of the
    gradient it drops times the step time, so the dense bucket takes int8 and
    only the bucket of the embedding table, mostly zeros, whose gradient
    top-k keeps whole (the table's 128 rows x 16 of 320,000 entries), stays
    on top-k. Both ranks measure, agree and choose alike."""
    by_step = run_ranks(_by_objective, 2, "step_time")
    assert set(by_step[0]["methods"].values()) == {"topk"}, by_step[0]["methods"]
    assert by_step[0]["lost_share"] == {}  # nothing measured without the charge
    assert "objective: time per step" in by_step[0]["explain"]

    got = run_ranks(_by_objective, 2, "time_to_accuracy")
    r0, r1 = got
    assert r0["methods"] == r1["methods"] and r0["lost_share"] == r1["lost_share"]
    assert torch.equal(r0["params"], r1["params"])
    methods = r0["methods"]
    assert methods.pop("table") == "topk", r0["explain"]
    assert methods and set(methods.values()) == {"int8"}, r0["explain"]
    share = r0["lost_share"]
    assert share["table"]["topk"] == 0.0  # 1% covers the rows a batch touches
    # Dense: not a candidate (its share is infinite, whatever it drops).
    assert all(math.isinf(v["topk"]) for k, v in share.items() if k != "table"), share
    assert all(v["int8"] < 1e-3 for v in share.values())
    # Charged by at least the buckets' predicted uncompressed time on SLOW (seconds).
    assert r0["charged_s"] > 1.0
    assert "accuracy charge" in r0["explain"] and "objective: time to accuracy" in r0["explain"]


def test_the_default_methods_take_top_k_only_on_the_mostly_zero_bucket() -> None:
    """auto's defaults include top-k on mostly zero buckets under the loss
    bound: on a link where top-k is every bucket's fastest reduction, the
    embedding table's bucket (over 99% exact zeros; top-k drops nothing
    there) takes it, and the dense buckets are refused it, which explain()
    says."""
    r0 = run_ranks(_by_objective, 2, "time_to_accuracy", None)[0]
    methods = r0["methods"]
    assert methods.pop("table") == "topk", r0["explain"]
    assert methods and "topk" not in methods.values(), r0["explain"]
    assert "topk not chosen: more than 50% of the bucket's entries are non-zero" in r0["explain"]


def _covering(ctx: RankContext) -> dict[str, Any]:
    def run(with_auto: bool) -> tuple[torch.Tensor, Any]:
        model = DDP(_embedding_and_dense(), bucket_cap_mb=0.25)  # the table: a bucket alone
        state = None
        if with_auto:
            # min_density 0.1%: under the table's share of non-zero entries (128 rows x 16 of
            # 320,000: 0.64%), so top-k at min_density would drop most of them.
            state = hooks.AutoState(
                link=SLOW,
                codec_costs=COSTS,
                observe=False,
                methods=("none", "topk"),
                min_density=0.001,
            )
            model.register_comm_hook(state, hooks.auto_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        train(model, opt, _bag_batch, ctx.rank, range(8))
        return flat_params(model), state

    exact, _ = run(False)
    params, state = run(True)
    (table,) = [k for k, d in state.decisions.items() if d["numel"] == 320_000]
    return {
        "exact": exact,
        "params": params,
        "method": state.decisions[table]["method"],
        "ran": state.ran[table],
        "density": state.topk_density(table),
        "explain": state.explain(),
    }


def test_top_k_sends_every_non_zero_entry_of_a_mostly_zero_bucket() -> None:
    """Held-back entries cost a loss floor even where they are a sliver of
    the gradient (an embedding model's loss settled 0.4-0.6% above
    uncompressed training's with top-k at 1%, which held back 0.1-0.2% of
    its gradient): on a mostly zero bucket whose non-zero share is above
    ``min_density``, auto raises top-k's density to the share the rank with
    the most measured, so it sends every non-zero entry of a step like that
    one, and training matches uncompressed DDP's to rounding (no later step
    here touches more rows than the measured one). Every rank agrees on the
    density."""
    r0, r1 = run_ranks(_covering, 2)
    assert r0["method"] == r0["ran"] == "topk", r0["explain"]
    assert r0["density"] == pytest.approx(0.0064, rel=1e-9, abs=0), r0["density"]
    assert r0["density"] == r1["density"]
    assert "every non-zero one" in r0["explain"], r0["explain"]
    assert torch.allclose(r0["params"], r0["exact"], rtol=0, atol=1e-6)
    assert torch.equal(r0["params"], r1["params"])


def test_a_lossy_method_dropping_more_than_the_bound_is_not_a_candidate() -> None:
    """Under time to accuracy, ``max_lost_share`` (1%) bounds what a chosen
    method may drop of the step's gradient on a bucket; under it a method is
    charged its share x the step time; if every allowed method drops more,
    the one that drops least; ``step_time`` neither bounds nor charges."""
    predicted = {"none": 0.5, "int8": 0.2, "topk": 0.01}
    shares = {0: {"int8": 1e-4, "topk": 0.2}, 1: {"int8": 1e-4, "topk": 0.002}}

    def charged(index: int, **kwargs: Any) -> dict[str, float]:
        state = hooks.AutoState(**{"methods": ("none", "int8", "topk"), **kwargs})
        state.lost_share, state.charged_step_seconds = shares, 0.1
        return state._charged(index, {m: predicted[m] for m in state.allowed})

    dense = charged(0)  # top-k drops 20% of the step's gradient here
    assert dense == pytest.approx({"none": 0.5, "int8": 0.2 + 1e-5})
    sparse = charged(1)  # 0.2% here: a candidate, charged 0.2% of 100 ms
    assert sparse == pytest.approx({"none": 0.5, "int8": 0.2 + 1e-5, "topk": 0.01 + 2e-4})
    assert charged(0, max_lost_share=1.0)["topk"] == pytest.approx(0.01 + 0.02)
    assert charged(0, methods=("topk",)) == pytest.approx({"topk": 0.01 + 0.02})
    assert charged(0, objective="step_time") == predicted
    # A bucket on a method that is no longer a candidate must move.
    choices = _measure.MethodChoices(0.1)
    choices.choose(0, 100, 5, predicted)
    assert choices.decisions[0]["method"] == "topk"
    assert choices.would_switch(0, dense)
    assert choices.choose(0, 100, 10, dense) == "int8"


def _gate(
    state: hooks.AutoState, link: hooks.LinkModel, rest_s: float
) -> tuple[bool, float, float]:
    """Evaluates PowerSGD's gate for one 1024 x 1024 bucket now on ``none``,
    on a step of ``rest_s`` seconds of compute plus its reduction."""
    shapes = [(1024, 1024)]
    state._agreed = (link, COSTS)
    state._bucket_inputs = {0: (1 << 20, shapes, 4, "cpu")}
    state.lost_share = {0: {"bf16": 1e-5, "int8": 1e-4, "topk": 0.3}}
    none_s = predict_seconds("none", 1 << 20, shapes, 2, link, COSTS, density=0.01, rank=4)
    state.charged_step_seconds = rest_s + none_s
    # The bucket ran "none" since the round before (the gate waits for one).
    state._choices.decisions[0] = {"method": "none", "since": 2, "round": 2, "numel": 1 << 20}
    state._evaluate_powersgd_gate(2)
    assert state.powersgd_gate is not None
    return state.powersgd_gate


def test_powersgd_is_a_candidate_only_while_its_whole_step_is_m_times_faster() -> None:
    """The gate compares whole steps, not reductions: on a slow link PowerSGD's
    reduction of a 1024 x 1024 bucket is far faster than int8's (the best other
    method under the loss bound; top-k drops 30% here); with little compute
    beside it the step is more than M = 2.5 times faster and the gate opens;
    with enough compute that the step is not, it stays closed although the
    reduction alone still is. Once open it closes only past the switch margin.
    Closed, PowerSGD is not a candidate; open, it is, uncharged."""
    kw = {"density": 0.01, "rank": 4}
    shapes = [(1024, 1024)]
    int8_s = predict_seconds("int8", 1 << 20, shapes, 2, SLOW, COSTS, **kw)
    psgd_s = predict_seconds("powersgd", 1 << 20, shapes, 2, SLOW, COSTS, **kw)
    assert int8_s > 10 * psgd_s  # the reduction alone: a per-bucket gate would open at any rest

    state = hooks.AutoState(link=SLOW, codec_costs=COSTS, observe=False)
    assert "powersgd" in state.allowed  # a default method
    predicted = {"none": 9.0, "int8": int8_s, "powersgd": psgd_s}
    assert "powersgd" not in state._charged(0, predicted)  # closed before it is evaluated
    # The round that starts compression (no bucket has run a method) does not open it.
    state._agreed = (SLOW, COSTS)
    state._bucket_inputs = {0: (1 << 20, shapes, 4, "cpu")}
    state.charged_step_seconds = 0.01
    state._evaluate_powersgd_gate(2)
    assert state.powersgd_gate is None and "powersgd" not in state._charged(0, predicted)
    assert "evaluated from the first round after compression starts" in state._objective_line()

    is_open, with_s, without_s = _gate(state, SLOW, rest_s=0.01)
    assert is_open and with_s == pytest.approx(0.01 + psgd_s)
    assert without_s == pytest.approx(0.01 + int8_s)
    assert state._charged(0, predicted)["powersgd"] == psgd_s  # a candidate, uncharged
    assert "powersgd gate open" in state._objective_line()

    # Compute such that M x S_with is just above S_without: closed from closed...
    m = state.powersgd_steps
    assert m == 2.5
    rest = (1.05 * int8_s - m * psgd_s) / (m - 1)  # M (rest + psgd) = rest + 1.05 int8
    fresh = hooks.AutoState(link=SLOW, codec_costs=COSTS, observe=False)
    assert not _gate(fresh, SLOW, rest)[0]
    assert "powersgd" not in fresh._charged(0, predicted)
    assert "powersgd gate closed" in fresh._objective_line()
    assert "opens below that by 10% (switch_margin)" in fresh._objective_line()
    # ...but kept open from open (within the 10% switch margin), closed beyond it.
    assert _gate(state, SLOW, rest)[0]
    assert not _gate(state, SLOW, 2 * int8_s)[0]
    # Closed, it opens only on a win by the margin: M x S_with 5% below
    # S_without (a noisy step time's worth) leaves it closed; 15% opens it.
    for win, opens in ((1.05, False), (1.15, True)):
        rest = (int8_s - win * m * psgd_s) / (win * m - 1)  # win M (rest + psgd) = rest + int8
        fresh = hooks.AutoState(link=SLOW, codec_costs=COSTS, observe=False)
        is_open, with_s, without_s = _gate(fresh, SLOW, rest)
        assert m * with_s * win == pytest.approx(without_s)
        assert is_open == opens, win
    # M = inf never opens; step_time does not gate (PowerSGD is a plain candidate).
    never = hooks.AutoState(link=SLOW, codec_costs=COSTS, observe=False, powersgd_steps=math.inf)
    assert not _gate(never, SLOW, 0.0)[0]
    by_step = hooks.AutoState(link=SLOW, codec_costs=COSTS, observe=False, objective="step_time")
    assert by_step._charged(0, predicted) == predicted
    # Named alone, it runs whatever the gate says.
    only = hooks.AutoState(methods=("powersgd",), link=SLOW, codec_costs=COSTS, observe=False)
    assert only._charged(0, {"powersgd": psgd_s}) == {"powersgd": psgd_s}


def test_powersgd_gate_takes_the_measured_step_of_a_side_that_has_run() -> None:
    """The side of the gate a run is on is measured; the other is predicted
    until it has run on a like link, then measured too. A predicted saving
    larger than the measured one opened the gate from int8's steps and closed
    it from PowerSGD's, round after round; with both sides measured it
    settles (here closed: PowerSGD's steps are 2.2x faster, short of M = 2.5),
    and a link 2x faster or slower sends it back to the prediction."""
    shapes = [(1024, 1024)]
    state = hooks.AutoState(link=SLOW, codec_costs=COSTS, observe=True)
    state._agreed = (SLOW, COSTS)
    state._bucket_inputs = {0: (1 << 20, shapes, 4, "cpu")}
    state.lost_share = {0: {"bf16": 1e-5, "int8": 1e-4, "topk": 0.3}}
    kw = {"density": 0.01, "rank": 4}
    int8_s = predict_seconds("int8", 1 << 20, shapes, 2, SLOW, COSTS, **kw)
    psgd_s = predict_seconds("powersgd", 1 << 20, shapes, 2, SLOW, COSTS, **kw)
    saving = int8_s - psgd_s  # predicted

    def evaluate(method: str, step_s: float, link: hooks.LinkModel = SLOW) -> bool:
        state._agreed = (link, COSTS)
        state._choices.decisions[0] = {"method": method, "since": 2, "round": 2, "numel": 1 << 20}
        state._measure.agreed_step_seconds = step_s
        state.charged_step_seconds = state._step_seconds(2)
        state._evaluate_powersgd_gate(2)
        assert state.powersgd_gate is not None
        return state.powersgd_gate[0]

    # int8's measured step, with a predicted saving that makes PowerSGD's
    # step 3x faster: the prediction opens the gate.
    int8_step = 1.5 * saving
    assert evaluate("int8", int8_step)
    assert state.powersgd_gate[1] == pytest.approx(int8_step - saving)
    # PowerSGD's steps measure 2.2x faster, not 3x: the measured int8 step
    # (not PowerSGD's step plus the predicted saving) closes it.
    psgd_step = int8_step / 2.2
    assert 2.5 * psgd_step <= 1.1 * (psgd_step + saving)  # the prediction would keep it open
    assert not evaluate("powersgd", psgd_step)
    assert state.powersgd_gate[1:] == pytest.approx((psgd_step, int8_step))
    # Back on int8 it stays closed: PowerSGD's side is measured now.
    for _ in range(3):
        assert not evaluate("int8", int8_step)
        assert state.powersgd_gate[1] == pytest.approx(psgd_step)
    line = state._objective_line()
    assert "ms (measured) x 2.5" in line and "without it (measured)" in line, line
    # The round that ends a check's trial (its recent steps partly
    # uncompressed) keeps neither side's measurement.
    kept = dict(state._gate_steps)
    state._choices.decisions[0] = {"method": "int8", "since": 2, "round": 2, "numel": 1 << 20}
    state._measure.agreed_step_seconds = 5 * int8_step
    state._evaluate_powersgd_gate(2, record=False)
    assert state._gate_steps == kept
    # A checkpoint keeps both sides.
    resumed = hooks.AutoState(link=SLOW, codec_costs=COSTS, observe=True)
    resumed.load_state_dict(state.state_dict())
    assert resumed._gate_steps == state._gate_steps
    # On a link 2x slower the old measurements no longer say what a step
    # takes: the prediction decides again (and, with its larger saving, opens).
    slower = hooks.LinkModel(SLOW.latency_s, SLOW.bandwidth_bytes_per_s / 2)
    assert evaluate("int8", 2 * int8_step, slower)
    assert "ms (predicted) x 2.5" in state._objective_line()
    # observe=False: nothing measured decides (a rerun chooses bit for bit alike).
    fixed = hooks.AutoState(link=SLOW, codec_costs=COSTS, observe=False)
    fixed._bucket_inputs = state._bucket_inputs
    fixed.lost_share = state.lost_share
    fixed._agreed = (SLOW, COSTS)
    fixed._choices.decisions[0] = {"method": "powersgd", "since": 2, "round": 2, "numel": 1 << 20}
    fixed._measure.agreed_step_seconds = psgd_step
    fixed.charged_step_seconds = fixed._step_seconds(2)
    fixed._evaluate_powersgd_gate(2)
    assert fixed._gate_steps == {}


def test_what_each_method_drops_is_measured_without_touching_the_callers_random_stream() -> None:
    g = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    methods = ("none", "bf16", "int8", "topk", "powersgd")
    lost = compression_errors(g.reshape(-1), [g], methods, density=0.01, rank=4)
    assert torch.equal(torch.rand(4), want)  # svd_lowrank's draws did not reach it
    share = {m: v / float(g.square().sum()) for m, v in lost.items()}
    assert "none" not in share
    assert share["bf16"] < 1e-4 and share["int8"] < 1e-3
    # A random matrix: 1% of its entries and a rank-4 approximation keep little.
    assert 0.8 < share["topk"] < 1.0 and 0.8 < share["powersgd"] < 1.0
    # A rank-2 matrix loses nothing to rank 4; a bucket of a few non-zeros nothing to top-k.
    low = torch.randn(256, 2) @ torch.randn(2, 128)
    rank2 = compression_errors(low.reshape(-1), [low], ("powersgd",), density=0.01, rank=4)
    assert rank2["powersgd"] < 1e-6 * float(low.square().sum())
    sparse = torch.zeros(256, 128)
    sparse[3, :100] = 1.0  # 100 non-zeros; top-k sends ceil(1% of 32,768) = 328
    assert compression_errors(sparse.reshape(-1), [sparse], ("topk",), density=0.01, rank=4) == {
        "topk": 0.0
    }


def _charged_with_pauses(ctx: RankContext, pause_s: float) -> dict[str, Any]:
    model = DDP(make_model())
    state = hooks.AutoState(link=FAST, codec_costs=COSTS, observe=False, interval=2)
    model.register_comm_hook(state, hooks.auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def paused(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(pause_s)  # a slower machine: longer measured steps
        return batch(rank, step)

    train(model, opt, paused, ctx.rank, range(8))
    return {
        "charged_s": state.charged_step_seconds,
        "lost_share": state.lost_share,
        "decisions": {k: d["method"] for k, d in state.decisions.items()},
        "params": flat_params(model),
    }


def test_with_observe_off_no_measured_step_time_decides() -> None:
    """``observe=False`` promises that no timing decides anything (a copy of
    the state in a spawned process computes bit for bit what the original
    does): the accuracy charge then uses the predicted reduction time, not
    the measured steps, which a slower machine (steps paused 0.2 s here)
    makes longer."""
    quick = run_ranks(_charged_with_pauses, 2, 0.0)[0]
    slow = run_ranks(_charged_with_pauses, 2, 0.2)[0]
    assert quick["lost_share"], "the charge was never measured: the test would prove nothing"
    assert 0 < quick["charged_s"] < 0.05, quick["charged_s"]
    assert slow["charged_s"] == quick["charged_s"]
    assert slow["decisions"] == quick["decisions"]
    assert torch.equal(slow["params"], quick["params"])


def test_a_pause_between_steps_does_not_decide_the_uncompressed_check() -> None:
    """A trial step that holds a pause between steps (an evaluation, another
    model's turn) is left out of its side's median. Three of the five
    compressed steps at 2.2 s (a benchmark that trains several models in
    turn) made the compressed median 2.2 s against 0.1 s uncompressed,
    every bucket uncompressed, and the next check 12,000 steps away."""
    from xcomm.hooks._measure import UncompressedCheck

    c = UncompressedCheck()
    assert c.at_round(2, 0.1, compressing=True, none_can_win=True) is None
    start = c.next_check
    end = c.at_round(start, 0.090, compressing=True, none_can_win=True)
    assert end == start + c.TRIAL_STEPS and c.trial == "none"
    paused = 0
    for s in range(start + 1, end):
        if c.runs_none(s):
            c.record(s, 0.103)
        else:
            c.record(s, 2.2 if paused < 3 else 0.090)  # the first three hold a pause
            paused += 1
    trial_s = c.local_trial_seconds(end)
    assert trial_s == [0.103, 0.090, 0.0, 0.0]
    c.at_round(end, 0.09, compressing=True, none_can_win=True, trial_s=trial_s)
    assert c.verdict == "compress" and c.next_check < end + 1000, c.explain()
    # A side whose every timed step is over the bound decides nothing: the
    # verdict (the side that ran before the trial at 0.09 s) is kept.
    start = c.next_check
    end = c.at_round(start, 0.090, compressing=True, none_can_win=True)
    for s in range(start + 1, end):
        c.record(s, 0.5 if c.runs_none(s) else 0.090)
    trial_s = c.local_trial_seconds(end)
    assert trial_s == [0.0, 0.090, 0.0, 0.0]
    c.at_round(end, 0.09, compressing=True, none_can_win=True, trial_s=trial_s)
    assert c.verdict == "compress" and "verdict kept" in c.note


def test_a_trial_within_the_noise_goes_on_before_it_decides() -> None:
    """Sides whose medians differ by less than the noise of five steps each
    do not decide the check: the trial is extended, and decides on all its
    steps. On the CNN at 10 Gbit/s, five steps a side read 34.1 ms
    compressed against 34.7 ms uncompressed where top-k's steps are 1.21x
    faster, and the verdict sent every bucket uncompressed."""
    from xcomm.hooks._measure import UncompressedCheck

    c = UncompressedCheck()
    assert c.at_round(2, 0.035, compressing=True, none_can_win=True) is None
    start = c.next_check
    end = c.at_round(start, 0.032, compressing=True, none_can_win=True)
    assert end == start + c.TRIAL_STEPS and c.trial == "none"
    # Five noisy steps a side: medians 35.0 and 34.5 ms, apart by less than the spread.
    none_steps = iter([0.030, 0.042, 0.034, 0.038, 0.035])
    compressed_steps = iter([0.028, 0.040, 0.0345, 0.024, 0.036])
    for s in range(start + 1, end):
        c.record(s, next(none_steps) if c.runs_none(s) else next(compressed_steps))
    trial_s = c.local_trial_seconds(end)
    assert trial_s[:2] == [0.035, 0.0345] and min(trial_s[2:]) > 0.002, trial_s
    # The margin alone (2%) would send every bucket uncompressed on these.
    assert not trial_s[1] < (1 - c.margin) * trial_s[0]
    extended = c.at_round(end, 0.032, compressing=True, none_can_win=True, trial_s=trial_s)
    assert extended == end + c.TRIAL_STEPS and c.trial == "none" and c.checks == 0
    assert "within the noise" in c.explain() and c.extensions == 1
    # The round's step runs the side on trial untimed; then the pairs go on.
    sides = [c.side(s) for s in range(end, extended)]
    assert sides == ["none"] + ["compress", "none"] * c.TRIAL_PAIRS, sides
    restored = UncompressedCheck()
    restored.load_state_dict(c.state_dict())
    assert restored.state_dict() == c.state_dict()
    none_steps = iter([0.037, 0.036, 0.040, 0.035, 0.036])
    compressed_steps = iter([0.030, 0.029, 0.031, 0.033, 0.030])
    for s in range(end + 1, extended):
        c.record(s, next(none_steps) if c.runs_none(s) else next(compressed_steps))
    trial_s = c.local_trial_seconds(extended)
    assert trial_s[:2] == [0.036, 0.030], trial_s  # all ten steps of each side
    assert c.at_round(extended, 0.03, compressing=True, none_can_win=True, trial_s=trial_s) is None
    assert c.verdict == "compress" and c.trial is None and c.checks == 1, c.explain()
    assert c.last == (extended, 0.030, 0.036) and c.extensions == 0
    # A trial within the noise every time is extended MAX_EXTENSIONS times,
    # then decided by the margin.
    start = c.next_check
    end = c.at_round(start, 0.03, compressing=True, none_can_win=True)
    noisy = (0.035, 0.0345, 0.003, 0.003)
    for _ in range(c.MAX_EXTENSIONS):
        end = c.at_round(end, 0.03, compressing=True, none_can_win=True, trial_s=noisy)
        assert end is not None and c.trial == "none"
    assert c.at_round(end, 0.03, compressing=True, none_can_win=True, trial_s=noisy) is None
    assert c.verdict == "none" and c.checks == 2 and c.trial is None


def test_the_uncompressed_check_decides_by_measured_steps() -> None:
    """:class:`UncompressedCheck` alone: a trial alternating ``none`` and
    compressed steps after compression has run, compression kept only when
    its steps are faster by the margin, trials against a verdict of
    ``none``, the spacing of checks, skipping where uncompressed reductions
    cannot fit a step, and checking again at once where the verdict's steps
    slow down."""
    from xcomm.hooks._measure import UncompressedCheck

    def run_trial(c: UncompressedCheck, none_s: float, compressed_s: float) -> int:
        """Times the trial's steps as a host would (a spell that slows
        every step 2x from its middle on) and returns its end."""
        for s in range(c.trial_start, c.trial_end):
            spell = 2.0 if s >= (c.trial_start + c.trial_end) // 2 else 1.0
            c.record(s, spell * (none_s if c.runs_none(s) else compressed_s))
        return c.trial_end

    c = UncompressedCheck(margin=0.05)
    assert c.at_round(2, 0.1, compressing=False, none_can_win=True) is None  # nothing compressed
    assert c.at_round(7, 0.1, compressing=True, none_can_win=True) is None
    assert c.next_check == 7 + c.FIRST_AFTER and not c.forces_none
    assert c.at_round(12, 0.1, compressing=True, none_can_win=True) is None  # not due yet
    end = c.at_round(17, 0.100, compressing=True, none_can_win=True)
    assert end == 17 + c.TRIAL_STEPS and c.trial == "none" and not c.forces_none
    # The round's step runs the side on trial; then the sides alternate.
    sides = [c.side(s) for s in range(17, end)]
    assert sides == ["none"] + ["none", "compress"] * c.TRIAL_PAIRS, sides
    assert c.at_round(20, 0.2, compressing=True, none_can_win=True) == end  # mid-trial
    assert c.local_trial_seconds(20) == []  # agreed only at the round that ends it
    run_trial(c, none_s=0.103, compressed_s=0.100)
    # The spell doubled the second half's steps on both sides: medians of
    # the sides still 0.103 s against 0.100 s (the upper half's median, x2).
    none_s, compressed_s, *_ = c.local_trial_seconds(end)
    assert none_s / compressed_s == pytest.approx(1.03)
    # Compression is not 5% faster.
    assert (
        c.at_round(end, 0.5, compressing=True, none_can_win=True, trial_s=(none_s, compressed_s))
        is None
    )
    assert c.verdict == "none" and c.forces_none and c.checks == 1 and c.runs_none(end)
    assert c.last == (end, compressed_s, none_s) and c.next_check == end + c.FIRST_BACKOFF
    assert "every bucket uncompressed" in c.explain()
    # Where the model itself chooses none everywhere, a trial compares nothing.
    trial = c.next_check
    assert c.at_round(trial, 0.103, compressing=False, none_can_win=True) is None
    assert c.trial is None and "nothing is compressed" in c.note and c.verdict == "none"
    # The next check is a trial of compression (the model's choice, kept
    # under the verdict): its steps are 20% faster.
    trial = c.next_check
    assert c.at_round(trial, 0.103, compressing=True, none_can_win=True) == trial + c.TRIAL_STEPS
    assert c.trial == "compress" and not c.forces_none and not c.runs_none(trial)
    assert c.runs_none(trial + 2) and not c.runs_none(trial + 3)
    end = run_trial(c, none_s=0.103, compressed_s=0.080)
    assert c.at_round(end, 0.1, compressing=True, none_can_win=True, trial_s=(0.103, 0.080)) is None
    assert c.verdict == "compress" and not c.forces_none and not c.runs_none(end)
    # 6 steps on the slower side x a 29% gap must cost at most 1% of the steps between.
    gap = (0.103 - 0.080) / 0.080
    assert c.next_check == end + max(
        c.FIRST_BACKOFF * 2, math.ceil((c.TRIAL_PAIRS + 1) * gap / c.TRIAL_FRACTION)
    )
    # Due, but uncompressed reductions alone are predicted longer than a step: skipped.
    skipped = c.next_check
    assert c.at_round(skipped, 0.08, compressing=True, none_can_win=False) is None
    assert c.trial is None and c.next_check == skipped + c.backoff and "not checked" in c.note
    # Compressed steps become slower than the uncompressed ones measured at
    # the last check (0.103 s) by more than the margin: a trial at once.
    early = skipped + 1
    assert c.at_round(early, 0.105, compressing=True, none_can_win=True) is None  # within it
    assert c.at_round(early, 0.110, compressing=True, none_can_win=True) == early + c.TRIAL_STEPS
    assert c.trial == "none" and "checked again" in c.note
    restored = UncompressedCheck()
    restored.load_state_dict(c.state_dict())
    assert restored.state_dict() == c.state_dict()
    # A trial whose timed steps of a side all ran rounds decides nothing.
    checks, verdict = c.checks, c.verdict
    assert (
        c.at_round(c.trial_end, 0.1, compressing=True, none_can_win=True, trial_s=(0.0, 0.1))
        is None
    )
    assert (c.checks, c.verdict, c.trial) == (checks, verdict, None) and "verdict kept" in c.note


def _checked(ctx: RankContext, slow: str) -> tuple[list[str], str]:
    """One 4 MiB bucket, auto between ``none`` and int8, every round's link
    agreed as 1 Gbit/s (so the model prefers int8 by far, and predicts 34 ms
    for an uncompressed reduction, whatever the host's load does to a probe:
    on a loaded host loopback's probes read 0.06 Gbit/s, predicted 550 ms
    uncompressed, longer than a step, and the check was skipped) and the
    per-reduction corrections held off: only the whole steps can move the
    choice. Every step takes 100 ms more (the
    compute of a larger model: uncompressed reductions, as predicted, fit
    in a step, so a check is worth its trial), and each step whose
    reductions were ``slow`` ("compressed" or "none") 80 ms more still, as
    a codec that takes cores from the backward pass makes it. Returns the
    method of each step and the explanation."""
    torch.manual_seed(0)
    n = 1024
    model = DDP(torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Linear(n, 8)))
    state = hooks.AutoState(
        methods=("none", "int8"),
        codec_costs=dict(COSTS, int8=1e-12),
        model=model,
        probe_fraction=0.05,  # rounds every interval, not spaced out by their cost
    )
    state._observed.update = lambda agreed: None  # type: ignore[method-assign]
    agree = state._measure.agree

    def agree_on_one_gbit(*args: Any, **kwargs: Any) -> Any:
        kwargs["fixed"] = {"allreduce": hooks.LinkModel(1e-4, 125e6)}
        return agree(*args, **kwargs)

    state._measure.agree = agree_on_one_gbit  # type: ignore[method-assign]
    model.register_comm_hook(state, hooks.auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    methods = []
    for step in range(36):
        train(model, opt, _wide_batch(n), ctx.rank, range(step, step + 1))
        ran = state.ran[0]
        methods.append(ran)
        time.sleep(0.1 + (0.08 if (ran != "none") == (slow == "compressed") else 0.0))
    return methods, state.explain()


@pytest.mark.parametrize("slow", ["compressed", "none"])
def test_compression_is_kept_only_where_its_whole_steps_are_faster(slow: str) -> None:
    """The model prefers int8 by far; some steps after it starts, a trial
    runs every bucket uncompressed on alternate steps and times whole steps. Where compressed
    steps are the slower (a codec taking cores from the backward pass),
    every bucket stays uncompressed after the trial; where uncompressed
    ones are, int8 returns. Every rank switches at the same steps."""
    results = run_ranks(_checked, 2, slow)
    methods, explain = results[0]
    assert results[1][0] == methods
    check = hooks._measure.UncompressedCheck
    first = methods.index("int8")
    start = methods.index("none", first)  # the trial
    assert start - first >= check.FIRST_AFTER, methods
    # The trial alternates: a slow spell of the host falls on both sides.
    trial = methods[start : start + check.TRIAL_STEPS]
    assert trial == ["none"] + ["none", "int8"] * check.TRIAL_PAIRS, methods
    after = methods[start + check.TRIAL_STEPS :]
    assert len(after) >= 3, methods
    if slow == "compressed":
        assert all(m == "none" for m in after), methods
        assert "every bucket uncompressed" in explain, explain
    else:
        assert all(m == "int8" for m in after), methods
        assert "compressing" in explain and "every bucket uncompressed" not in explain, explain
    assert "uncompressed check at step" in explain, explain
