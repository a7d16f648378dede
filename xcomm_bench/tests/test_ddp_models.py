"""The DDP benchmark's model families outside its default sweep (``embedding``, ``deep``)."""

from __future__ import annotations

import pytest
import torch

from xcomm_bench.ddp import ALL_MODELS, EXTRA_MODELS, MODELS, DDPBenchConfig, build_model


def _grads(name: str, *, smoke: bool = False) -> tuple[int, torch.Tensor]:
    spec = build_model(name, smoke=smoke)
    model = spec.build()
    x, y = spec.batch(torch.Generator().manual_seed(0))
    out = model(x)
    assert out.shape == (y.shape[0], 10)
    torch.nn.functional.cross_entropy(out, y).backward()
    params = sum(p.numel() for p in model.parameters())
    return params, torch.cat([p.grad.flatten() for p in model.parameters()])


def test_extra_models_have_the_documented_sizes() -> None:
    assert _grads("embedding")[0] == 200_000 * 64 + 64 * 256 + 256 + 256 * 10 + 10
    assert _grads("deep")[0] == 24 * (512 * 512 + 512) + 512 * 10 + 10


def test_embedding_gradients_are_dense_and_almost_all_zeros() -> None:
    """The case auto was never tuned on: DDP reduces the whole table, and a
    step's 16 bags of 32 ids touch at most 512 of its 200,000 rows."""
    _, g = _grads("embedding")
    zeros = (g == 0).double().mean().item()
    assert 0.99 < zeros < 1.0
    _, g = _grads("deep")
    assert (g == 0).double().mean().item() < 0.9  # not zero-heavy: the contrast


@pytest.mark.parametrize("name", EXTRA_MODELS)
def test_extra_models_shrink_for_smoke(name: str) -> None:
    assert _grads(name, smoke=True)[0] < 10_000


def test_default_sweep_is_unchanged_and_extra_models_are_accepted() -> None:
    assert MODELS == ("mlp", "cnn", "transformer")
    assert DDPBenchConfig().models == list(MODELS)
    assert ALL_MODELS == MODELS + EXTRA_MODELS
    DDPBenchConfig(models=["embedding", "deep"], nodes=0, ranks_per_node=2).validate()
    with pytest.raises(ValueError, match="unknown models"):
        DDPBenchConfig(models=["wide"]).validate()
    with pytest.raises(ValueError, match="unknown model"):
        build_model("wide")


def test_auto_changes_are_recorded_once_per_change_with_their_explanation() -> None:
    """An excursion of auto to another method shows in ``DDPResult.changes``:
    the timed step it was first seen after, the methods, and ``explain()``."""
    from xcomm_bench import ddp

    class FakeAuto:
        def __init__(self) -> None:
            self.methods = ["topk", "topk"]

        def methods_by_bucket(self) -> list[str]:
            return list(self.methods)

        def explain(self) -> str:
            return "why: " + ",".join(self.methods)

    runner = object.__new__(ddp._Runner)
    runner.state, runner.times, runner.changes = FakeAuto(), [], []
    for methods in (["topk", "topk"], ["topk", "topk"], ["fp16", "topk"], ["topk", "topk"]):
        runner.state.methods = methods
        runner.times.append(0.05)
        runner._note_change()
    assert runner.changes == [
        {"step": 0, "chosen": "topk,topk", "explain": "why: topk,topk"},
        {"step": 2, "chosen": "fp16,topk", "explain": "why: fp16,topk"},
        {"step": 3, "chosen": "topk,topk", "explain": "why: topk,topk"},
    ]
