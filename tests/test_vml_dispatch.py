"""MKL's VML kernel choice settled on one thread before a model is built (loom/model/vml_dispatch.py): the list of
functions matches what torch hands to VML, each is called on one element of both float types, and building a model
does it before the model's own first float math (its RoPE table)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import loom.model.loader
from loom.model.linear import make_matmul
from loom.model.llama import LlamaModel
from loom.model.vml_dispatch import VML_FUNCTIONS, settle_vml_dispatch


def test_the_list_is_what_torch_hands_to_vml():
    """torch's own header names the functions it calls VML for (IMPLEMENT_VML_MKL(op, MklOp), not commented out)."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    if not header.exists():
        pytest.skip("this torch ships no headers")
    routed = re.findall(r"^IMPLEMENT_VML_MKL\((\w+),", header.read_text(), flags=re.MULTILINE)
    assert routed and sorted(routed) == sorted(VML_FUNCTIONS)


def test_each_function_is_called_on_one_element_of_both_float_types(monkeypatch):
    """One element: torch runs the call on the calling thread alone (no chunks for other threads to race with)."""
    calls = []
    for name in VML_FUNCTIONS:
        original = getattr(torch, name)

        def spy(x, _name=name, _original=original):
            calls.append((_name, x.dtype, x.numel()))
            return _original(x)

        monkeypatch.setattr(torch, name, spy)
    settle_vml_dispatch()
    expected = {(name, dtype, 1) for name in VML_FUNCTIONS for dtype in (torch.float32, torch.float64)}
    assert set(calls) == expected and len(calls) == len(expected)


def test_building_a_model_settles_the_dispatch_first(tiny_llama, monkeypatch):
    """Before the model is constructed, so before its RoPE table's cos."""
    order = []
    monkeypatch.setattr(loom.model.loader, "settle_vml_dispatch", lambda: order.append("settle"))
    original_init = LlamaModel.__init__

    def init(self, *args, **kwargs):
        order.append("model")
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(LlamaModel, "__init__", init)
    tiny_llama.build(torch.float32, make_matmul("torch"))
    assert order == ["settle", "model"]
