"""The one table of compression methods (csrc/common/Methods.hpp, read by
python/xcomm/hooks/_methods.py) against the code that accepts or refuses a method: the C++ backend's names,
``xcomm.Options``, ``AutoState``, FSDP2's state and DiLoCo. Single process,
no group."""

from __future__ import annotations

import pytest
import torch

import xcomm
from xcomm import _C
from xcomm.diloco import DiLoCo
from xcomm.hooks import AutoState, FsdpCompressionState
from xcomm.hooks._methods import METHODS, method_names


def test_the_backend_methods_are_the_tables_in_its_order() -> None:
    # "auto" is the backend's chooser, not a method of its own.
    assert _C.compression_names() == [*method_names("backend"), "auto"]
    assert xcomm.options.COMPRESSIONS == (None, *method_names("backend")[1:], "auto")
    assert [m.name for m in METHODS] == [row["name"] for row in _C.methods()]


@pytest.mark.parametrize("name", method_names("backend")[1:])
def test_options_take_every_backend_method_and_name_them_when_refusing(name: str) -> None:
    assert xcomm.Options(compression=name).compression == name
    with pytest.raises(ValueError) as err:
        xcomm.Options(compression="topk")
    for known in method_names("backend")[1:]:
        assert f"'{known}'" in str(err.value)


def test_auto_state_takes_exactly_the_ddp_methods() -> None:
    assert AutoState(methods=method_names("ddp")).methods == method_names("ddp")
    assert AutoState().methods == method_names("ddp", default_only=True)
    with pytest.raises(ValueError, match="randomk"):
        AutoState(methods=("none", "randomk"))


@pytest.mark.parametrize("name", [m.name for m in METHODS])
def test_fsdp_and_diloco_take_their_methods_and_refuse_the_rest(name: str) -> None:
    if "fsdp" in next(m for m in METHODS if m.name == name).surfaces:
        assert FsdpCompressionState(method=name).method == name
    else:
        with pytest.raises(ValueError, match=name):
            FsdpCompressionState(method=name)
    model = torch.nn.Linear(4, 2)
    if name not in method_names("diloco"):
        with pytest.raises(ValueError, match="method must be one of"):
            DiLoCo(model, method=name)


def test_lossless_and_default_sets() -> None:
    assert method_names("ddp", lossless_only=True) == ("none",)
    # auto's default: bf16 and int8 (bounded error per entry) and top-k, which
    # it uses only where it drops at most max_lost_share, and PowerSGD behind
    # its step gate; fp16 only when named.
    assert method_names("ddp", default_only=True) == ("none", "bf16", "int8", "topk", "powersgd")
    # A GPU bucket without xcomm's CUDA codecs: the casts only.
    assert method_names("ddp", device_capable_only=True) == ("none", "bf16", "fp16")
    with pytest.raises(ValueError, match="unknown surface"):
        method_names("nccl")  # type: ignore[arg-type]
