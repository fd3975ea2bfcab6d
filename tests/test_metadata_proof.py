"""``checks.MetadataProof``: what a repeated layer call trusts instead of its inputs' signatures
(issue 24 item 6). True only while every tensor keeps its type, shape, strides, dtype and device;
the same on torch's C++ check (``TensorGuards``) and on the Python signatures a torch without it
falls back to. In CI's torch-next subset: a torch that changed ``TensorGuards`` fails here."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn.common import checks


class _Subclass(torch.Tensor):
    pass


@pytest.fixture(params=["torch TensorGuards", "python signatures"])
def proof_kind(request, monkeypatch):
    if request.param == "torch TensorGuards":
        assert checks._TensorGuards is not None, "this torch has no torch._C._dynamo.guards.TensorGuards"
    else:
        monkeypatch.setattr(checks, "_TensorGuards", None)
    return request.param


def _inputs(gen):
    """q, a cache, None (no compressed cache), top-k, sink, out: fresh random values."""
    return (torch.randn(6, 8, 512, generator=gen).to(torch.bfloat16),
            torch.randint(0, 255, (4, 64, 584), generator=gen, dtype=torch.uint8), None,
            torch.randint(-1, 100, (6, 16), generator=gen, dtype=torch.int32),
            torch.randn(8, generator=gen), torch.empty(6, 8, 512, dtype=torch.bfloat16))


def _changes():
    """name -> (position, a tensor with one piece of metadata changed)."""
    def restrided(t):
        return t.as_strided(t.shape, (*t.stride()[:-2], 1, t.shape[-2])) if t.dim() > 1 else t.as_strided(t.shape, (0,))

    return {
        "q one token fewer": lambda a: (0, a[0][:-1]),
        "q restrided": lambda a: (0, restrided(a[0])),
        "q as float16 (same bytes)": lambda a: (0, a[0].view(torch.float16)),
        "q as a subclass": lambda a: (0, a[0].as_subclass(_Subclass)),
        "q as a Parameter": lambda a: (0, torch.nn.Parameter(a[0], requires_grad=False)),
        "cache one block more": lambda a: (1, torch.empty(5, 64, 584, dtype=torch.uint8)),
        "cache on another device": lambda a: (1, torch.empty_like(a[1], device="meta")),
        "topk as int64": lambda a: (3, a[3].long()),
        "topk restrided": lambda a: (3, restrided(a[3])),
        "sink one head fewer": lambda a: (4, a[4][:-1]),
        "sink strided": lambda a: (4, torch.randn(16)[::2]),
        "out resized": lambda a: (5, a[5].view(6, 4, 1024)),
    }


def test_the_same_or_equal_metadata_tensors_are_proven(gen, proof_kind):
    inputs = _inputs(gen)
    proof = checks.MetadataProof(inputs)
    assert proof(inputs)
    others = tuple(None if t is None else torch.empty_like(t) for t in inputs)  # other memory, same metadata
    assert proof(others)
    offset = torch.empty(7, 8, 512, dtype=torch.bfloat16)[1:]  # a view at an offset: same shape and strides
    assert proof((*inputs[:5], offset))


@pytest.mark.parametrize("change", list(_changes()))
def test_a_changed_tensor_is_not_proven(gen, proof_kind, change):
    inputs = _inputs(gen)
    proof = checks.MetadataProof(inputs)
    position, changed = _changes()[change](inputs)
    assert checks.tensor_signature(changed)[2:] != checks.tensor_signature(inputs[position])[2:] \
        or type(changed) is not type(inputs[position])  # the change is real
    assert not proof((*inputs[:position], changed, *inputs[position + 1:]))


def test_a_tensor_changed_in_place_is_not_proven(gen, proof_kind):
    inputs = _inputs(gen)
    proof = checks.MetadataProof(inputs)
    inputs[3].resize_(6, 15)
    assert not proof(inputs)


def test_what_is_not_a_tensor_is_not_proven(gen, proof_kind):
    inputs = _inputs(gen)
    proof = checks.MetadataProof(inputs)
    assert not proof((inputs[0].tolist(), *inputs[1:]))


class _RefusesItsOwnTensor:
    def __init__(self, *tensors, **keywords):
        pass

    def check(self, *tensors):
        return False


class _ProvesEverything(_RefusesItsOwnTensor):
    def check(self, *tensors):
        return True


class _NeedsAnotherKeyword:
    def __init__(self, *tensors, dynamic_dims_sizes, dynamic_dims_strides, another):
        pass


@pytest.mark.parametrize("stand_in", [_RefusesItsOwnTensor, _ProvesEverything, _NeedsAnotherKeyword])
def test_a_tensor_guards_that_does_not_work_as_used_is_not_used(monkeypatch, stand_in):
    """A torch whose private TensorGuards changed (another signature, another verdict) leaves the
    proof to Python signatures instead of breaking or fooling every repeated layer call."""
    from torch._C._dynamo import guards

    monkeypatch.setattr(guards, "TensorGuards", stand_in)
    assert checks.working_tensor_guards() is None
