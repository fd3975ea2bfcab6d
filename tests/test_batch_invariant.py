"""Batch-invariant mode (``SparseMLA(batch_invariant=True)``, docs/batch-invariance.md): a token's
output bytes do not depend on the other requests of its batch nor on the split decision. Checked
on the Triton kernels under the CPU interpreter (4 "SMs" there: a lone decode token splits its
keys 4 ways, a batch of 4 does not split), byte for byte.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.common.spec import LayerKind
from dsv4_attn.testing.steps import make_step

from kit.compare import assert_close, compare

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton missing")
KINDS = (LayerKind.SWA, LayerKind.C4A)
SEQ_LENS = [300, 41, 170, 96]


def _step(gen, device="cpu"):
    return make_step(gen, [1] * len(SEQ_LENS), SEQ_LENS, kinds=KINDS, topk=32, max_model_len=1024, swa_bs=32,
                     block_size=64, device=device)


@pytest.fixture
def case(gen):
    return _step(gen)


def _run(case, requests, batch_invariant):
    """Outputs of the decode step holding only ``requests`` (same tables, caches, q, top-k rows)."""
    b, idx = case.batch, torch.tensor(requests)
    sub = dsv4.StepBatch.from_lists([1] * len(requests), [SEQ_LENS[r] for r in requests], b.swa_block_table[idx],
                                    b.swa_block_size, {r: t[idx] for r, t in b.comp_block_tables.items()},
                                    b.block_size, b.max_model_len)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton", batch_invariant=batch_invariant)
    q = case.q[idx]
    out = torch.full_like(q, float("nan"))
    mla.forward(mla.plan(sub), LayerKind.C4A, q, case.caches["swa"], case.caches[LayerKind.C4A],
                topk=case.topks[LayerKind.C4A][idx], sink=case.sink, out=out)
    assert not out.isnan().any()
    return out


def test_a_tokens_bytes_do_not_depend_on_its_batch(case):
    full = _run(case, [0, 1, 2, 3], True)
    for r in range(4):
        assert torch.equal(_run(case, [r], True)[0], full[r]), f"request {r} alone"
    mixed = _run(case, [2, 0], True)
    assert torch.equal(mixed[0], full[2]) and torch.equal(mixed[1], full[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernels)")
def test_a_tokens_bytes_do_not_depend_on_its_batch_on_the_gpu(gen):
    test_a_tokens_bytes_do_not_depend_on_its_batch(_step(gen, "cuda"))


def test_without_the_mode_the_split_decision_changes_bytes_and_the_mode_costs_no_accuracy(case):
    """The control: by default a lone token splits its keys and its bytes differ from the batched
    run (within bf16 rounding); the invariant output is as close to the default as the two
    default runs are to each other."""
    full = _run(case, [0, 1, 2, 3], False)
    alone = torch.cat([_run(case, [r], False) for r in range(4)])
    assert not torch.equal(alone, full), "the interpreter's split decision should change some bytes"
    assert_close(compare(alone, full), what="split vs unsplit")
    assert_close(compare(_run(case, [0, 1, 2, 3], True), alone), what="invariant vs split")


def test_only_backends_that_promise_it_are_accepted():
    spec = dsv4.ModelSpec(num_heads=16, topk=32, max_model_len=1024, layers=KINDS)
    with pytest.raises(ValueError, match=r"^batch_invariant: got True, but backend 'torch' \(chosen for SWA decode\)"):
        dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", batch_invariant=True)
    with pytest.raises(ValueError, match=r"^batch_invariant: got 'yes'; allowed: True or False"):
        dsv4.SparseMLA(spec, "fp8_ds_mla", backend="triton", batch_invariant="yes")
