"""The shared error-feedback store: the invariant across method switches,
residuals following parameters through a bucket rebuild, and its checkpoint
format (versioned; the earlier unversioned one still loads)."""

from __future__ import annotations

import pytest
import torch

from xcomm import _C
from xcomm.hooks import FeedbackStore


class FakeBucket:
    """The parts of ``dist.GradBucket`` the store reads."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], grads: list[torch.Tensor]):
        self._index = index
        self._params = params
        self._buffer = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        self._grads, offset = [], 0
        for g in grads:
            self._grads.append(self._buffer.narrow(0, offset, g.numel()).view_as(g))
            offset += g.numel()

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 40))


def _bucket(model: torch.nn.Module, names: list[str], index: int, seed: int) -> FakeBucket:
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(params[n].shape, generator=g) for n in names]
    return FakeBucket(index, [params[n] for n in names], grads)


def _sent_int8(store: FeedbackStore, view) -> torch.Tensor:  # type: ignore[no-untyped-def]
    codec = _C.Int8Codec(64)
    packed = codec.pack_shards_with_feedback(view.tensor, 1, store.feedback, view.key)
    out = torch.empty_like(view.tensor)
    codec.unpack_all(packed.reshape(-1), codec.shard_elems(view.tensor.numel(), 1), out)
    return out


def _sent_topk(store: FeedbackStore, view) -> torch.Tensor:  # type: ignore[no-untyped-def]
    codec = _C.TopKCodec(False, False)
    k = _C.TopKCodec.k_for(view.tensor.numel(), 0.05)
    packed = codec.encode_with_feedback(view.key, view.tensor, k, store.feedback)
    out = torch.empty_like(view.tensor)
    codec.decode(packed.reshape(1, -1), k, out, 1.0)
    return out


def _sent_randomk(store: FeedbackStore, view, step: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    codec = _C.RandomKCodec(7, False)
    pos = codec.positions(view.key, step, view.tensor.numel(), 0.1)
    values = codec.encode_with_feedback(view.key, view.tensor, pos, store.feedback)
    out = torch.zeros_like(view.tensor)
    out[pos] = values
    return out


def test_switching_methods_keeps_sent_plus_residual_equal_to_input() -> None:
    model = _model()
    store = FeedbackStore(model)
    names = [n for n, _ in model.named_parameters()]
    old = torch.zeros(sum(p.numel() for p in model.parameters()))
    for step, method in enumerate(["int8", "topk", "randomk", "int8", "topk", "flush"]):
        bucket = _bucket(model, names, 0, seed=step)
        view = store.view(bucket)
        before = view.tensor.clone()
        if method == "flush":
            store.flush(view)
            torch.testing.assert_close(view.tensor, before + old, rtol=0, atol=1e-6)
            assert store.residual(view.key) is None
            continue
        if method == "int8":
            sent = _sent_int8(store, view)
        elif method == "topk":
            sent = _sent_topk(store, view)
        else:
            sent = _sent_randomk(store, view, step)
        residual = store.residual(view.key)
        assert residual is not None
        # sent + residual = input + old residual, per element, for every method.
        torch.testing.assert_close(sent + residual, before + old, rtol=1e-6, atol=1e-6)
        assert not torch.equal(residual, torch.zeros_like(residual)), "nothing was kept"
        old = residual.clone()


def test_residuals_follow_parameters_through_a_bucket_rebuild() -> None:
    model = _model()
    store = FeedbackStore(model)
    first = {0: ["0.weight", "0.bias"], 1: ["1.weight", "1.bias"]}
    pieces: dict[str, torch.Tensor] = {}
    for index, names in first.items():
        view = store.view(_bucket(model, names, index, seed=index))
        _sent_topk(store, view)
        residual, offset = store.residual(view.key), 0
        for n in names:
            numel = dict(model.named_parameters())[n].numel()
            pieces[n] = residual.narrow(0, offset, numel).clone()
            offset += numel
    # DDP's rebuild: other groupings and orders under the same indices.
    rebuilt = {0: ["1.bias", "0.weight"], 1: ["1.weight", "0.bias"]}
    for index, names in rebuilt.items():
        view = store.view(_bucket(model, names, index, seed=10 + index))
        expected = torch.cat([pieces[n] for n in names])
        assert torch.equal(store.residual(view.key), expected)


def test_state_dict_is_versioned_and_round_trips_by_parameter() -> None:
    model = _model()
    store = FeedbackStore(model)
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    view = store.view(_bucket(model, names, 0, seed=1))
    _sent_int8(store, view)
    saved = store.state_dict()
    assert saved["version"] == 2 and saved["by"] == "parameter"
    assert set(saved["residuals"]) == set(names)

    fresh = FeedbackStore(model)
    fresh.load_state_dict(saved)
    # A resumed DDP's first layout differs: the saved order is kept (a copy).
    view2 = fresh.view(_bucket(model, list(reversed(names)), 3, seed=1))
    assert view2.key == 0
    assert torch.equal(fresh.residual(view2.key), store.residual(0))


def test_the_unversioned_format_of_earlier_hooks_loads() -> None:
    model = _model()
    numel = {n: p.numel() for n, p in model.named_parameters()}
    old = {
        "by": "parameter",
        "residuals": {n: torch.full((k,), float(i)) for i, (n, k) in enumerate(numel.items())},
        "layouts": {"0": [[n, k] for n, k in numel.items()]},
    }
    store = FeedbackStore(model)
    store.load_state_dict(old)
    view = store.view(_bucket(model, list(numel), 0, seed=0))
    assert torch.equal(store.residual(view.key), torch.cat(list(old["residuals"].values())))

    by_bucket = FeedbackStore()
    by_bucket.load_state_dict({"by": "bucket", "residuals": {0: torch.ones(4)}})
    bucket = FakeBucket(0, [torch.nn.Parameter(torch.zeros(4))], [torch.zeros(4)])
    assert torch.equal(by_bucket.residual(by_bucket.view(bucket).key), torch.ones(4))


def test_an_unknown_version_is_refused() -> None:
    with pytest.raises(ValueError, match="version 9"):
        FeedbackStore().load_state_dict({"version": 9, "by": "parameter", "residuals": {}})
