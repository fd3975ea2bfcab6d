"""The AITER emulator itself (dsv4_attn/emulation/): the kernel behaviours it models, read
from AITER 0.1.20's code objects (docs/rocm.md "Evidence"), and the contract it enforces.

These pin the model that the adapter tests (tests/test_aiter.py) rely on: if a behaviour here
changes, the adapter's proofs change with it. EMULATED: nothing here ran on AMD hardware.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attn import emulation
from dsv4_attn.common import layout
from dsv4_attn.emulation import AiterContractError, AiterEmulator, attend, releases
from dsv4_attn.emulation.releases import ROW
from dsv4_attn.rocm.aiter_api import call_by_keyword
from dsv4_attn.rocm.aiter_paths import nm_pack
from dsv4_attn.rocm.scratch import ScopeBuffers, compact, write_indices

I32 = dict(dtype=torch.int32)


def _rows(gen, n, dtype=torch.bfloat16, width=ROW, tail_zero=True):
    kv = torch.randn(n, 1, 1, width, generator=gen)
    if tail_zero:
        kv[..., 512:] = 0  # the RoPE tail the adapter leaves 0
    return kv.to(dtype)


def _softmax(q, k, scale, p_dtype=None):
    """float64 q [H, D] over keys k [n, D]: (out [H, 512] with V = k[:, :512], lse [H])."""
    s = scale * q.double() @ k.double().T
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    pv = p.float().to(p_dtype).double() if p_dtype is not None else p
    return pv @ k.double()[:, :512] / p.sum(-1, keepdim=True), (m.squeeze(-1) + torch.log(p.sum(-1)))


def _split_call(em, q, kv, indptr, indices, splits, return_lse=True, **scales):
    B, H = q.shape[:2]
    o = torch.full((B, H, 512), math.nan, dtype=torch.bfloat16)
    _, lse = em.mla_decode_fwd(q, kv, o, torch.arange(B + 1, **I32), indptr, indices, torch.ones(B, **I32), 1,
                               sm_scale=0.05, num_kv_splits=splits,
                               num_kv_splits_indptr=torch.arange(B + 1, **I32) * splits, return_lse=return_lse,
                               **scales)
    return o, lse


def test_split_mode_reads_576_wide_rows_and_marks_keyless_rows(gen):
    em = AiterEmulator("gfx950")
    kv, q = _rows(gen, 20), _rows(gen, 3 * 16).view(3, 16, ROW)
    q[..., 512:] = 0
    indptr, indices = torch.tensor([0, 3, 4, 4], **I32), torch.tensor([0, 5, 7, 3], **I32)
    o, lse = _split_call(em, q, kv, indptr, indices, 2)
    ref, ref_lse = _softmax(q[0].float(), kv[[0, 5, 7], 0, 0].float(), 0.05)
    assert torch.allclose(o[0].double(), ref, atol=2e-2) and torch.allclose(lse[0].double(), ref_lse, atol=1e-4)
    assert torch.isnan(o[2]).all() and (lse[2] == -math.inf).all()  # stage 2 over no split: 0/0, log 0
    assert em.calls[-1] == ("mla_decode_fwd", "split2 mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co")


def test_512_wide_rows_are_misread(gen):
    """The code objects' per-head q stride and KV rows are 576 elements: with 512-wide ones every
    head is misread (and the last ones read past q, an error here where q's storage ends)."""
    em = AiterEmulator("gfx950")
    kv = _rows(gen, 20, width=512, tail_zero=False)
    staged = _rows(gen, 4 * 16, width=512, tail_zero=False).view(4, 16, 512)  # a scratch for 4 tokens
    q = staged[:1]
    indptr, keys = torch.tensor([0, 3], **I32), torch.tensor([0, 5, 7], **I32)
    o, _ = _split_call(em, q, kv, indptr, keys, 2)
    ref, _ = _softmax(q[0].float(), kv[[0, 5, 7], 0, 0].float(), 0.05)
    # every score also takes the next head's first 64 q values times the next row's first 64
    # values; heads 1.. read shifted q rows as well
    assert ((o[0].double() - ref).abs().amax(dim=1) > 0.1).all()
    with pytest.raises(AiterContractError, match="q: got a read of elements"):
        _split_call(em, staged[3:].clone(), kv, indptr, keys, 2)


def test_contract_violations():
    em = AiterEmulator("gfx950")
    gen = torch.Generator().manual_seed(1)
    kv, q = _rows(gen, 20), _rows(gen, 48).view(3, 16, ROW)
    indptr = torch.tensor([0, 2, 3, 3], **I32)
    with pytest.raises(AiterContractError, match="no -1 sentinel"):
        _split_call(em, q, kv, indptr, torch.tensor([0, -1, 3], **I32), 2)
    with pytest.raises(AiterContractError, match="no -1 sentinel"):  # past the buffer: read, not skipped
        _split_call(em, q, kv, indptr, torch.tensor([0, 20, 3], **I32), 2)
    with pytest.raises(AiterContractError, match=r"head_size == q.shape\[2\]"):
        _split_call(em, q, kv[..., :512].contiguous(), indptr, torch.tensor([0, 1, 3], **I32), 2)
    kv8, q8 = kv.to(em.fp8), q.to(em.fp8)
    with pytest.raises(AiterContractError, match="q_scale.*not a python number"):
        _split_call(em, q8, kv8, indptr, torch.tensor([0, 1, 3], **I32), 2, q_scale=1.0, kv_scale=torch.ones(1))
    with pytest.raises(AiterContractError, match="cannot get heuristic kernel"):
        _split_call(em, q[:, :8].contiguous(), kv, indptr, torch.tensor([0, 1, 3], **I32), 2)


def test_fp8_split_cap_one_split_lse_and_p_rounding(gen):
    """FP8 split kernels: 16 heads run one split per 128 keys while stage 2 reads one per 64;
    a single split skips stage 2 (its LSE is never written); P is rounded to fp8 before P·V."""
    em = AiterEmulator("gfx942")
    kv, q = _rows(gen, 300).to(em.fp8), (_rows(gen, 16) * 0.5).view(1, 16, ROW).to(em.fp8)
    one = torch.ones(1)
    indptr = torch.tensor([0, 100], **I32)
    keys = torch.arange(100, **I32)
    o, lse = _split_call(em, q, kv, indptr, keys, 2, q_scale=one, kv_scale=one)
    assert torch.isnan(o).all() and torch.isnan(lse).all()  # split 1 never written, stage 2 reads it
    o, lse = _split_call(em, q, kv, indptr, keys, 1, q_scale=one, kv_scale=one)
    assert (lse == releases.STALE).all()
    ref, _ = _softmax(q[0].float(), kv[:100, 0, 0].float(), 0.05, em.fp8)
    unrounded, _ = _softmax(q[0].float(), kv[:100, 0, 0].float(), 0.05)
    assert torch.allclose(o[0].double(), ref, atol=2e-2, rtol=1e-2)
    assert (ref - unrounded).abs().max() > 1e-2  # the rounding is visible
    o, lse = _split_call(em, q, kv, torch.tensor([0, 300], **I32), torch.arange(300, **I32), 2, q_scale=one,
                         kv_scale=one)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()  # 300 keys: 2 splits of 128+ each


def test_row_addressing_wraps_on_24_bit_code_objects():
    idx = torch.tensor([5, (1 << 24) + 5, -1], **I32)
    assert attend.row_starts(idx, 1152, 2, wide=True).tolist() == [5 * 576, ((1 << 24) + 5) * 576,
                                                                       (2**32 - 1) * 576]
    narrow = attend.row_starts(idx, 1152, 2, wide=False).tolist()
    assert narrow[:2] == [5 * 576, 5 * 576]  # row numbers wrap at 2^24
    assert narrow[2] == ((0xFFFFFF * 1152) % 2**32) // 2  # byte offsets wrap at 2^32
    objects = AiterEmulator("gfx942").stage1_object
    assert not objects(16, False, False, False).wide and not objects(64, True, True, True).wide
    assert AiterEmulator("gfx950").stage1_object(16, True, True, True).wide


def _persistent(em, q, kv, indptr, indices, topk, heads):
    B = q.shape[0]
    meta = [torch.empty(s, dtype=d) for s, d in em.get_mla_metadata_info_v1(8, 1, heads, em.fp8, em.fp8, True)]
    qo, last = torch.arange(B + 1, **I32), torch.ones(B, **I32)
    em.get_mla_metadata_v1(qo, indptr, last, heads, 1, True, meta[0], meta[2], meta[1], *meta[3:], topk=topk)
    names = dict(work_meta_data=meta[0], work_indptr=meta[1], work_info_set=meta[2], reduce_indptr=meta[3],
                 reduce_final_map=meta[4], reduce_partial_map=meta[5])
    o = torch.empty(B, heads, 512, dtype=torch.bfloat16)
    one = torch.ones(1)
    _, lse = em.mla_decode_fwd(q, kv, o, qo, indptr, indices, last, 1, sm_scale=0.05, q_scale=one, kv_scale=one,
                               return_lse=True, **names)
    return o, lse, names


def test_persistent_lse_objects_sentinels_and_stale_plans(gen):
    em = AiterEmulator("gfx950")
    kv = _rows(gen, 20).to(em.fp8)
    indptr = torch.tensor([0, 3, 4, 4], **I32)
    fixed = torch.tensor([0, 5, 7, -1, 3, -1, -1, -1, -1, -1, -1, -1], **I32)  # -1 only past each range
    for heads, writes in ((16, True), (32, False), (64, True), (128, True)):
        q = _rows(gen, 3 * heads).view(3, heads, ROW).to(em.fp8)
        o, lse, names = _persistent(em, q, kv, indptr, fixed, 4, heads)
        ref, ref_lse = _softmax(q[0].float(), kv[[0, 5, 7], 0, 0].float(), 0.05, em.fp8)
        assert torch.allclose(o[0].double(), ref, atol=3e-2, rtol=2e-2)
        if writes:
            assert torch.allclose(lse[0].double(), ref_lse, atol=1e-3) and (lse[2] == math.inf).all()
        else:  # the 32-head "lse" object is the non-LSE one: the final LSE stays as allocated
            assert (lse == releases.STALE).all()
    with pytest.raises(AiterContractError, match="no -1 sentinel"):  # a hole inside a range is read
        _persistent(em, q, kv, indptr, torch.tensor([0, -1, 7, -1, 3] + [-1] * 7, **I32), 4, 128)
    stale = indptr.clone()
    stale[2:] += 1
    with pytest.raises(AiterContractError, match="stale work plan"):
        em.mla_decode_fwd(q, kv, torch.empty(3, 128, 512, dtype=torch.bfloat16), torch.arange(4, **I32), stale,
                          fixed, torch.ones(3, **I32), 1, q_scale=torch.ones(1), kv_scale=torch.ones(1),
                          return_lse=True, **names)
    with pytest.raises(AiterContractError, match="cannot get heuristic kernel"):
        AiterEmulator("gfx942").stage1_object(16, True, True, True)  # gfx942: a 64-head LSE object only


def test_first_module_use_inside_a_capture_is_refused(gen):
    em = AiterEmulator("gfx950")
    kv, q = _rows(gen, 20), _rows(gen, 16).view(1, 16, ROW)
    args = (q, kv, torch.tensor([0, 3], **I32), torch.tensor([0, 5, 7], **I32), 2)
    _split_call(em, *args)
    em.simulate_capture = True
    _split_call(em, *args)  # loaded: fine
    with pytest.raises(AiterContractError, match="first use of mla_dec_stage1_bf16_a16w16_subQ128"):
        _split_call(em, _rows(gen, 128).view(1, 128, ROW), *args[1:])


def test_017_leaves_final_lse_unwritten_and_call_maps_old_metadata_names(gen):
    em = AiterEmulator("gfx950", "0.1.7")
    kv, q = _rows(gen, 20), _rows(gen, 48).view(3, 16, ROW)
    o = torch.empty(3, 16, 512, dtype=torch.bfloat16)
    qo, last = torch.arange(4, **I32), torch.ones(3, **I32)
    indptr = torch.tensor([0, 2, 3, 3], **I32)
    _, lse = em.mla_decode_fwd(q, kv, o, qo, indptr, torch.tensor([0, 1, 3], **I32), last, 1)
    assert (lse == releases.STALE).all()
    meta = [torch.empty(s, dtype=d) for s, d in em.get_mla_metadata_info_v1(8, 1, 16, torch.bfloat16,
                                                                            torch.bfloat16, True)]
    # 0.1.7 order is (..., work_indptr, work_info, ...) and has no kv_last_page_lens: by keyword it works
    call_by_keyword(em.get_mla_metadata_v1, seqlens_qo_indptr=qo, seqlens_kv_indptr=indptr, kv_last_page_lens=last,
          num_heads_per_head_k=16, num_heads_k=1, is_causal=True, work_metadata_ptrs=meta[0], work_info_set=meta[2],
          work_indptr=meta[1], reduce_indptr=meta[3], reduce_final_map=meta[4], reduce_partial_map=meta[5],
          page_size=1, topk=4, dtype_q=torch.bfloat16)
    assert meta[2][:3, 4:6].tolist() == [[0, 2], [2, 3], [3, 3]]


def test_work_buffer_sizes_follow_the_batch():
    """get_mla_metadata_info_v1 (v0.1.20): the partials AITER allocates per call grow with the
    batch the buffers were sized for (1280 rows at 1024 tokens, 287 at 31, 128 heads)."""
    em = AiterEmulator("gfx950")
    for batch, rows in ((1024, 1280), (31, 287)):
        shapes = em.get_mla_metadata_info_v1(batch, 1, 128, em.fp8, em.fp8, True, max_split_per_batch=16)
        assert shapes[5][0] == rows


def test_sparse_mla_fwd_contract(gen):
    with pytest.raises(AiterContractError, match="gfx950"):
        AiterEmulator("gfx942", "sparse").sparse_mla_fwd(torch.zeros(1, 16, 512, dtype=torch.bfloat16),
                                                         torch.zeros(1, 64, 512, dtype=torch.bfloat16),
                                                         torch.zeros(2, **I32), torch.zeros(0, **I32), 0.04)
    em = AiterEmulator("gfx950", "sparse")
    q = torch.randn(3, 16, 512, generator=gen).bfloat16()
    cache = layout.new_cache("fp8_e4m3", 2, 64)
    indptr, indices = torch.zeros(4, **I32), torch.zeros(0, **I32)
    with pytest.raises(AiterContractError, match="kv_buffer scale"):
        em.sparse_mla_fwd(q, cache, indptr, indices, 0.04, kv_lora_rank=512, qk_rope_head_dim=0)
    with pytest.raises(AiterContractError, match="gfx950's OCP"):
        em.sparse_mla_fwd(q, layout.new_cache("fp8_e4m3", 2, 64, dialect="fnuz"), indptr, indices, 0.04,
                          kv_scale=torch.ones(1), kv_lora_rank=512, qk_rope_head_dim=0)
    with pytest.raises(AiterContractError, match="C \\+ 1"):
        em.sparse_mla_fwd(q, cache, indptr[:-1], indices, 0.04, kv_scale=torch.ones(1), kv_lora_rank=512,
                          qk_rope_head_dim=0)
    with pytest.raises(TypeError):  # everything after softmax_scale is keyword-only
        em.sparse_mla_fwd(q, cache, indptr, indices, 0.04, torch.ones(1))
    assert AiterEmulator("gfx950").sparse_mla_fwd is None  # in no AITER release


def _nm_inputs(gen, T, H, P):
    """Packed v4 nm operands from bf16 rows via the MODEL1 quantizer (the adapter's packing)."""
    q_bf = (torch.randn(T * H, 512, generator=gen)).bfloat16()
    kv_bf = (torch.randn(P, 512, generator=gen) * 2).bfloat16()
    q_pack, q_rope = nm_pack(layout.quantize_model1(q_bf))
    kv_pack, kv_rope = nm_pack(layout.quantize_model1(kv_bf))
    fp8 = torch.float8_e4m3fn
    return (q_pack.view(fp8).view(T, H, 512), q_rope.view(T, H, 64), kv_pack.view(fp8).view(P, 1, 1, 512),
            kv_rope.view(P, 1, 1, 64), layout.dequantize_model1(layout.quantize_model1(q_bf)).view(T, H, 512),
            layout.dequantize_model1(layout.quantize_model1(kv_bf)))


@pytest.mark.parametrize("splits", [None, 1, 3])
def test_v4_nm_packing_sink_and_splits(gen, splits):
    em = AiterEmulator("gfx950")
    T, H, P = 3, 16, 200
    q, qr, kv, kvr, qf, kf = _nm_inputs(gen, T, H, P)
    indptr = torch.tensor([0, 150, 150, 190], **I32)
    indices = torch.randperm(P, generator=gen)[:190].int()
    sink = torch.randn(H, generator=gen)
    sink[0] = -math.inf
    out = torch.full((T, H, 512), math.nan, dtype=torch.bfloat16)
    em.mla_decode_fwd_v4_nm(q, qr, kv, kvr, out, torch.arange(T + 1, **I32), indptr, indices, 1, sink=sink,
                            num_kv_splits=splits, sm_scale=123.0)  # sm_scale is ignored: fixed 1/sqrt(512)
    resolved = splits or emulation.meta_splits(T, 190, H, True, em.cu_num, ignore_total_kv=True)
    assert resolved > 1 or splits == 1
    for t, (a, b) in enumerate(((0, 150), (150, 150), (150, 190))):
        if a == b:  # no key: one pass divides by the sink alone, stage 2 by nothing
            if resolved == 1:
                assert (out[t, 1:] == 0).all() and torch.isnan(out[t, 0]).all()
            else:
                assert torch.isnan(out[t]).all()
            continue
        k = kf[indices[a:b].long()]
        s = qf[t].double() @ k.double().T / 512**0.5
        full = torch.cat([s, sink.double()[:, None]], dim=1)
        ref = torch.softmax(full, dim=1)[:, :-1] @ k.double()
        assert torch.allclose(out[t].double(), ref, atol=3e-2, rtol=2e-2), t


def test_v4_nm_reads_each_tiles_scale_twice_and_is_gfx950_only(gen):
    em = AiterEmulator("gfx950")
    q, qr, kv, kvr, qf, kf = _nm_inputs(gen, 1, 16, 40)
    raw = kv.view(torch.uint8).view(40, 512)
    once = raw.clone()
    once[:, 448:462] = 0
    once[:, 448:455] = raw[:, 448:462:2]  # the 7 scale bytes once, as a MODEL1 record stores them
    args = (q, qr, None, kvr, torch.empty(1, 16, 512, dtype=torch.bfloat16), torch.arange(2, **I32),
            torch.tensor([0, 40], **I32), torch.arange(40, **I32), 1)
    outs = []
    for rows in (raw, once):
        call = list(args)
        call[2] = rows.view(torch.float8_e4m3fn).view(40, 1, 1, 512)
        em.mla_decode_fwd_v4_nm(*call, sink=torch.full((16,), -math.inf), num_kv_splits=1)
        outs.append(call[4].clone())
    s = qf[0].double() @ kf.double().T / 512**0.5
    ref = torch.softmax(s, dim=1) @ kf.double()
    assert torch.allclose(outs[0].double()[0], ref, atol=3e-2, rtol=2e-2)
    assert not torch.allclose(outs[1].double()[0], ref, atol=0.1)
    with pytest.raises(AiterContractError, match="gfx950"):
        AiterEmulator("gfx942").mla_decode_fwd_v4_nm(*args[:2], kv, *args[3:], sink=torch.zeros(16))
    assert AiterEmulator("gfx942").mla_decode_fwd_v4_nm is not None  # the Python entry point exists...
    assert releases.V4_NM_OBJECT not in AiterEmulator("gfx942").asm_objects  # ...its code object does not


def test_capture_path_equals_eager_path(gen):
    """_attend's fixed-shape chunked sums (used under a graph capture) equal its padded ones."""
    q = torch.randn(4, 8, ROW, generator=gen)
    k = torch.randn(50, ROW, generator=gen)
    idx = torch.randint(0, 50, (90,), generator=gen)
    seg = torch.randint(0, 6, (90,), generator=gen)
    ok = torch.rand(90, generator=gen) > 0.2
    seg_row = torch.tensor([0, 1, 2, 3, 0, 1])
    sink = torch.randn(6, 8, generator=gen)
    sink[5] = -math.inf
    results = []
    for part in (attend.attend_padded, attend.attend_flat):
        m = sink.clone()
        results.append(part(q[seg_row], lambda i: k[i], idx, seg, ok, 0.05, torch.float8_e4m3fn, m) + (m,))
    for a, b in zip(*results):
        assert torch.allclose(a.float(), b.float(), atol=1e-5, equal_nan=True)


def test_compaction_layouts():
    rows = torch.tensor([[4, -1, 9, 2], [7, 8, 99, -1]], **I32)
    lens = torch.tensor([3, 3], **I32)

    def scope():
        return ScopeBuffers(4, torch.zeros(3, **I32), torch.full((9,), -1, **I32), torch.full((8,), -1, **I32),
                            torch.zeros(8, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.ones(1))

    keep, pos, counts = compact([(rows, lens, 50)], 4)  # 99 >= capacity 50: not a key
    assert counts.tolist() == [2, 2] and pos[keep].tolist() == [0, 1, 4, 5]
    for layout_name, indices in (("slots", [4, 9, 7, 8]), ("ragged", [0, 1, 4, 5]), ("fixed", [0, 1, -1, -1, 4, 5])):
        s = scope()
        write_indices(s, keep, pos, counts, rows, layout_name)
        assert s.kv_indptr.tolist() == [0, 2, 4]
        assert s.kv_indices[: len(indices)].tolist() == indices, layout_name
        assert s.slots.tolist() == [4, -1, 9, -1, 7, 8, -1, -1]
