"""C128A rows as wide as the step needs (issue 24 item 7): with ``StepBatch.max_seq_len`` (an
engine's host bound of the lengths, vLLM's ``max_seq_len``) a short-context step's rows of an
"all" kind are a power of two >= 128 columns wide instead of the model's ``max_model_len / 128``,
so no kernel launches splits over empty columns; inside a CUDA-graph capture they keep the
model's width, since the captured kernels replay for every later step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.common import plan as plan_module
from dsv4_attn.common import reference
from dsv4_attn.common.spec import LayerKind
from dsv4_attn.testing.steps import make_step

from kit.compare import compare

C128A = LayerKind.C128A
MAX_LEN = 1 << 20  # the model's C128A width: 8192 columns


def c128a_step(gen):
    return make_step(gen, [1, 2, 5], [300, 1000, 2000], kinds=("swa", "c128a"), max_model_len=MAX_LEN)


def run(case, batch, front_end: str):
    """(C128A rows, lens), the torch backend's output, and the float64 reference on those rows."""
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch", max_tokens=16, front_end=front_end)
    plan = mla.plan(batch)
    out = torch.full_like(case.q, float("nan"))
    mla.forward(plan, C128A, case.q, case.caches["swa"], case.caches[C128A], sink=case.sink, out=out)
    rows, lens = plan.comp_rows[C128A.ratio]
    ref, _ = reference.sparse_mla(case.q, case.caches["swa"], plan.swa_rows, plan.swa_lens, case.caches[C128A], rows,
                                  lens, case.sink, case.spec.scale, "fp8_ds_mla")
    return (rows, lens), out, ref


@pytest.mark.parametrize("front_end", ["torch", "triton"])
def test_rows_follow_the_longest_request(gen, front_end):
    case = c128a_step(gen)
    assert case.spec.all_width(C128A.ratio) == 8192
    (rows, lens), out, ref = run(case, dataclasses.replace(case.batch, max_seq_len=2000), front_end)
    (full_rows, full_lens), _, full_ref = run(case, case.batch, front_end)
    assert rows.shape[1] == 128 and full_rows.shape[1] == 8192  # 2000 // 128 = 15 entries -> 128 columns
    assert torch.equal(rows, full_rows[:, :128]) and torch.equal(lens, full_lens)
    assert (full_rows[:, 128:] == -1).all()  # nothing the narrow rows leave out
    assert torch.equal(ref, full_ref)  # the same keys: the float64 answer of the model's width
    assert not out.isnan().any()
    err = compare(out, full_ref)
    assert err["rel_l2"] < 1e-2 and err["cosine"] > 0.9999, err


@pytest.mark.parametrize("max_seq_len, width", [(127, 128), (128 * 200, 256), (MAX_LEN - 1, 8192), (MAX_LEN, 8192)])
def test_width_is_a_power_of_two_of_the_entries(gen, max_seq_len, width):
    case = c128a_step(gen)
    batch = dataclasses.replace(case.batch, max_seq_len=max_seq_len)
    assert plan_module.active_width(case.spec, batch, C128A) == width


def test_a_capture_keeps_the_models_width(gen, monkeypatch):
    """Logic only on this CPU machine: the capture test itself (torch.cuda) is stubbed."""
    case = c128a_step(gen)
    monkeypatch.setattr(plan_module, "capturing", lambda device: True)
    (rows, _), _, _ = run(case, dataclasses.replace(case.batch, max_seq_len=2000), "torch")
    assert rows.shape[1] == 8192


def test_a_bound_below_a_length_is_refused(gen):
    case = c128a_step(gen)
    with pytest.raises(ValueError, match=r"max_seq_len: got 1999 < seq_lens\[2\] = 2000"):
        dataclasses.replace(case.batch, max_seq_len=1999).validate()
    with pytest.raises(ValueError, match="max_seq_len: got 0; allowed: a positive int"):
        dataclasses.replace(case.batch, max_seq_len=0)
