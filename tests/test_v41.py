"""DeepSeek-V4.1 layer kinds through the whole stack on CPU: C1A / C2A rows from the top-k with
each ratio's page size (against a brute-force loop), plans for a mix of ratios, compressed caches
shared by several layers, and the torch and Triton (interpreter) backends against the float64
reference on fresh random inputs with NaN-poisoned outputs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.common import indices, reference
from dsv4_attn.common.spec import LayerKind
from dsv4_attn.testing.steps import make_step

from kit.compare import assert_close, compare

V41 = (LayerKind.SWA, LayerKind.C1A, LayerKind.C2A)
HAS_TRITON = importlib.util.find_spec("triton") is not None
# mixed step: decodes, an MTP pair, a prefill chunk crossing the window, pos + 1 < 2 (no C2A entry yet)
QUERY_LENS, SEQ_LENS = [1, 2, 9, 1, 1], [300, 131, 140, 1, 1000]


def _brute_topk_rows(batch, ratio, local):
    """Rows of a top-k layer token by token from the definitions: entry c of request r is visible
    while c < (pos+1)//ratio; slot = table[r, c // bs] * bs + c % bs with bs = block_size // ratio."""
    bs = batch.block_size // ratio
    table = batch.comp_block_tables[ratio]
    T, K = local.shape
    rows = torch.full((T, K), -1, dtype=torch.int32)
    lens = torch.zeros(T, dtype=torch.int32)
    for t in range(T):
        req, pos = int(batch.token_to_req[t]), int(batch.positions[t])
        if req < 0:
            continue
        visible = (pos + 1) // ratio
        lens[t] = min(visible, K)
        for j in range(int(lens[t])):
            c = int(local[t, j])
            if 0 <= c < visible:
                rows[t, j] = int(table[req, c // bs]) * bs + c % bs
    return rows, lens


@pytest.mark.parametrize("block_size", [256, 64])  # vLLM: 256 tokens per compressed page; 64 on SM90 for V4.1
def test_topk_rows_of_every_ratio_match_a_loop(gen, block_size):
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=V41, block_size=block_size, pad_tokens=2)
    for kind in (LayerKind.C1A, LayerKind.C2A):
        topk = case.topks[kind]
        want = _brute_topk_rows(case.batch, kind.ratio, topk)
        got = indices.topk_rows(case.batch, kind, topk)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), kind
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch", front_end="torch")
        plan_rows = mla.plan(case.batch).comp_scope(kind, topk)
        assert torch.equal(plan_rows[0], want[0]) and torch.equal(plan_rows[1], want[1])


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_triton_front_end_gives_the_same_rows(gen):
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=(LayerKind.SWA, LayerKind.C2A, LayerKind.C128A))
    plans = {fe: dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch", front_end=fe).plan(case.batch)
             for fe in ("torch", "triton")}
    for name in ("positions", "swa_rows", "swa_lens"):
        assert torch.equal(getattr(plans["torch"], name), getattr(plans["triton"], name)), name
    for i in (0, 1):  # C128A rows, lens
        assert torch.equal(plans["torch"].comp_rows[128][i], plans["triton"].comp_rows[128][i])
    got = [plans[fe].comp_scope(LayerKind.C2A, case.topks[LayerKind.C2A]) for fe in ("torch", "triton")]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def _run(mla, plan, case, kind, fmt):
    out = torch.full_like(case.q, float("nan"))
    mla.forward(plan, kind, case.q, case.caches["swa"], case.caches.get(kind), topk=case.topk_for(kind),
                sink=case.sink, out=out, validate=True)
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements not written"
    rows, lens = plan.comp_scope(kind, case.topk_for(kind))
    ref, _ = reference.sparse_mla(case.q, case.caches["swa"], plan.swa_rows, plan.swa_lens, case.caches.get(kind),
                                  rows, lens, case.sink, mla.spec.scale, fmt)
    err = compare(out, ref)
    assert_close(err, max_abs=False, what=kind)
    assert err["max_abs"] <= 1e-2 + 2**-7 * float(ref.abs().max()), (kind, err)
    return out


BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bfloat16", "mxfp8_ds_mla", "nvfp4_ds_mla"])
def test_every_v41_kind_matches_the_reference(backend, fmt, gen):
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=V41, fmt=fmt, topk=32, max_model_len=4096)
    mla = dsv4.SparseMLA(case.spec, fmt, backend=backend)
    plan = mla.plan(case.batch, validate=True)
    for kind in V41:
        out = _run(mla, plan, case, kind, fmt)
        if kind is LayerKind.C2A:  # request 3 (pos 0): no ratio-2 entry yet, only its own SWA row
            assert int(plan.comp_scope(kind, case.topks[kind])[1][sum(QUERY_LENS[:3])]) == 0
    assert out.shape == case.q.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_layers_sharing_a_compressed_cache_read_it_in_place(backend, gen):
    """Two C2A layers read one cache tensor with different top-k rows (KV sharing): each matches
    the reference, and the cache is neither copied into the plan nor changed."""
    layers = [dsv4.Layer(0, LayerKind.SWA), dsv4.Layer(1, LayerKind.C2A, 1), dsv4.Layer(2, LayerKind.C2A, 1)]
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=(LayerKind.SWA, LayerKind.C2A), topk=32, max_model_len=4096)
    spec = dsv4.ModelSpec(num_heads=16, topk=32, max_model_len=4096, layers=layers)
    assert spec.layers[2].shares_comp_cache
    cache = case.caches[LayerKind.C2A]
    before = cache.clone()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend=backend)
    plan = mla.plan(case.batch)
    second = torch.flip(case.topks[LayerKind.C2A], dims=[1]).contiguous()  # another layer's top-k
    for topk in (case.topks[LayerKind.C2A], second):
        case.topks[LayerKind.C2A] = topk
        _run(mla, plan, case, LayerKind.C2A, "fp8_ds_mla")
    assert torch.equal(cache, before)


def test_v41_refusals_name_the_argument(gen):
    case = make_step(gen, [1, 1], [40, 60], kinds=V41, topk=32, max_model_len=4096)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(case.batch)
    q, swa, c1 = case.q, case.caches["swa"], case.caches[LayerKind.C1A]
    with pytest.raises(ValueError, match=r"^kind: got C4A; allowed: this model's kinds \['SWA', 'C1A', 'C2A'\]"):
        mla.forward(plan, LayerKind.C4A, q, swa, c1, topk=case.topks[LayerKind.C1A])
    with pytest.raises(ValueError, match=r"^topk: got None; allowed: int32 \[T, K\] local top-k for C1A layers"):
        mla.forward(plan, "c1a", q, swa, c1)
    with pytest.raises(ValueError, match=r"^comp_cache: got block size 256; allowed: batch.block_size // 2 = 128"):
        mla.forward(plan, "c2a", q, swa, c1, topk=case.topks[LayerKind.C2A])
    v4 = make_step(gen, [1, 1], [40, 60], topk=32, max_model_len=4096)
    v4_mla = dsv4.SparseMLA(v4.spec, "fp8_ds_mla", backend="torch")
    v4_plan = v4_mla.plan(v4.batch)
    with pytest.raises(ValueError, match=r"^topk: got a tensor for a C128A layer, which attends every compressed "
                                         r"entry; allowed: None"):
        v4_mla.forward(v4_plan, "c128a", v4.q, v4.caches["swa"], v4.caches[LayerKind.C128A],
                       topk=v4.topks[LayerKind.C4A])
    with pytest.raises(ValueError, match=r"^batch.comp_block_tables: got ratio\(s\) \[4, 128\]; allowed: the "
                                         r"model's compression ratios \[1, 2\]"):
        mla.plan(v4.batch)
