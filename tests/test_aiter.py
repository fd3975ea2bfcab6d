"""The `aiter` backend on CPU through the AITER EMULATOR (dsv4_attn/rocm/emulate.py).

No AMD GPU here: every AITER call goes to the emulator, which implements AITER's documented
semantics and validates every argument. Numbers are compared with the float64 reference on
fresh random inputs with NaN-poisoned outputs. Edge cases in every batch: pos < W, pos+1 < r
(no compressed key yet), a padding token (no key at all), MTP (two query tokens of one
request), +inf / -inf sinks, permuted block tables.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.common import layout, reference
from dsv4_attn.common.backend import BackendUnavailableError, register_backend, unregister_backend
from dsv4_attn.common.spec import V4_KINDS, LayerKind
from dsv4_attn.rocm import emulate
from dsv4_attn.rocm.aiter import AiterBackend, _call, describe_aiter, load_aiter
from dsv4_attn.rocm.emulate import AiterContractError, AiterEmulator
from dsv4_attn.rocm.scratch import write_indices

from conftest import compare

# bf16 q/kv operands: only bf16 output rounding; fp8 q/kv operands (persistent mode, FP8_TENSOR):
# e4m3 has 3 mantissa bits, so q quantization alone costs ~3% (AITER's FP8/FP8 kernels do this).
EXACT = {"rel_l2": 1e-2, "cosine": 0.9999}
FP8_Q = {"rel_l2": 6e-2, "cosine": 0.998}


@pytest.fixture(autouse=True)
def _no_emulator_leak():
    yield
    emulate.disable()


def make_case(gen, fmt, heads, query_lens=(1, 1, 1, 2, 1), seq_lens=(3, 130, 700, 1501, 4000), num_pad=1,
              device="cpu", swa_bs=64, block_size=256, topk=64, max_model_len=8192, swa_dialect="ocp",
              comp_dialect="ocp", kv_scale=1.0, swa_stride=None):
    """A decode batch (every token, MTP included, is a decode token) plus ``num_pad`` padding
    tokens, caches of ``fmt`` filled with random rows, C4A top-k with garbage past the prefix."""
    R = len(query_lens)
    spec = dsv4.ModelSpec(num_heads=heads, c4a_topk=topk, max_model_len=max_model_len)
    nb = {"swa": -(-max(seq_lens) // swa_bs), 4: -(-(max(seq_lens) // 4) // (block_size // 4)) + 1,
          128: -(-(max(seq_lens) // 128) // (block_size // 128)) + 1}
    tables = {k: torch.randperm(R * n, generator=gen).int().view(R, n) for k, n in nb.items()}
    real = sum(query_lens)
    batch = dsv4.StepBatch.from_lists(list(query_lens), list(seq_lens), tables["swa"], swa_bs,
                                      {4: tables[4], 128: tables[128]}, block_size, max_model_len,
                                      num_decode_tokens=real, num_tokens=real + num_pad)
    batch = dsv4.StepBatch(batch.query_start_loc.to(device), batch.seq_lens.to(device), batch.num_decode_tokens + num_pad,
                           batch.swa_block_table.to(device), swa_bs, {k: v.to(device) for k, v in
                                                                       batch.comp_block_tables.items()},
                           block_size, max_model_len, real + num_pad)
    T = batch.num_tokens
    n4 = (batch.positions.cpu() + 1) // 4
    c4a_topk = torch.randint(-5, 10**6, (T, topk), generator=gen).int()
    for t in range(T):
        k = min(int(n4[t]), topk)
        c4a_topk[t, :k] = torch.randperm(int(n4[t]), generator=gen)[:k].int()

    def cache(num_blocks, bs, dialect, stride=None):
        c = layout.new_cache(fmt, num_blocks, bs, device, block_stride=stride, dialect=dialect)
        n = num_blocks * bs
        kv = (torch.randn(n, 512, generator=gen) * 2).bfloat16().to(device)
        scale = kv_scale if fmt == "fp8_e4m3" else None
        layout.insert(c, fmt, torch.arange(n, dtype=torch.int32, device=device), kv, scale, dialect)
        return c

    caches = {"swa": cache(R * nb["swa"], swa_bs, swa_dialect, swa_stride),
              LayerKind.C4A: cache(R * nb[4], block_size // 4, comp_dialect),
              LayerKind.C128A: cache(R * nb[128], block_size // 128, comp_dialect)}
    q = torch.randn(T, heads, 512, generator=gen).bfloat16().to(device)
    sink = torch.randn(heads, generator=gen)
    sink[0], sink[-1] = math.inf, -math.inf
    return dict(spec=spec, batch=batch, caches=caches, topk=c4a_topk.to(device), q=q, sink=sink.to(device),
                fmt=fmt, swa_dialect=swa_dialect, comp_dialect=comp_dialect, kv_scale=kv_scale)


def run_layer(mla, plan, case, kind, out=None):
    comp = case["caches"].get(kind)
    topk = case["topk"] if kind is LayerKind.C4A else None
    if out is None:
        out = torch.full_like(case["q"], math.nan)
    mla.forward(plan, kind, case["q"], case["caches"]["swa"], comp, topk, case["sink"], out=out,
                kv_scale=case["kv_scale"])
    return out


def reference_for(plan, case, kind):
    comp = case["caches"].get(kind)
    rows, lens = plan.comp_scope(kind, case["topk"] if kind is LayerKind.C4A else None)
    ref, _ = reference.sparse_mla(case["q"], case["caches"]["swa"], plan.swa_rows, plan.swa_lens, comp, rows, lens,
                                  case["sink"], plan.spec.scale, case["fmt"], kv_scale=case["kv_scale"],
                                  swa_dialect=case["swa_dialect"], comp_dialect=case["comp_dialect"])
    return ref


def _backend(name="aiter-test", **kwargs):
    backend = AiterBackend(name=name, max_decode_tokens=64, **kwargs)
    register_backend(name, backend)
    return backend


# (arch, backend kwargs, fmt, heads, dialects, expected AITER call, tolerance)
CASES = [
    ("gfx950", {}, "fp8_ds_mla", 64, ("ocp", "ocp"), "sparse_mla_fwd", EXACT),
    ("gfx950", {}, "fp8_e4m3", 16, ("ocp", "ocp"), "sparse_mla_fwd", EXACT),
    ("gfx950", {"path": "mla_decode_fwd"}, "fp8_ds_mla", 8, ("ocp", "ocp"), "persistent", FP8_Q),
    ("gfx950", {"path": "mla_decode_fwd", "persistent_max_batch": 0}, "fp8_ds_mla", 64, ("ocp", "ocp"), "split",
     EXACT),
    ("gfx950", {"path": "mla_decode_fwd"}, "bfloat16", 16, ("ocp", "ocp"), "split", EXACT),
    ("gfx950", {"path": "mla_decode_fwd"}, "fp8_e4m3", 32, ("ocp", "ocp"), "persistent", FP8_Q),
    ("gfx942", {}, "fp8_ds_mla", 64, ("fnuz", "ocp"), "split", EXACT),  # SWA FNUZ, compressed OCP
    ("gfx942", {}, "fp8_e4m3", 16, ("fnuz", "fnuz"), "sparse_mla_fwd", EXACT),
]


@pytest.mark.parametrize("arch,kwargs,fmt,heads,dialects,expect,tol", CASES,
                         ids=[f"{c[0]}-{c[2]}-h{c[3]}-{c[5]}" for c in CASES])
def test_parity_through_emulator(gen, arch, kwargs, fmt, heads, dialects, expect, tol):
    em = emulate.enable(arch)
    _backend(**kwargs)
    case = make_case(gen, fmt, heads, swa_dialect=dialects[0], comp_dialect=dialects[1],
                     kv_scale=0.5 if fmt == "fp8_e4m3" else 1.0)
    mla = dsv4.SparseMLA(case["spec"], fmt, backend="aiter-test", swa_dialect=dialects[0], comp_dialect=dialects[1])
    plan = mla.plan(case["batch"])  # no validate(): the padding token sits in the decode range, as in graph-padded batches
    try:
        for kind in V4_KINDS:
            em.calls.clear()
            out = run_layer(mla, plan, case, kind)
            assert torch.isfinite(out).all(), f"{kind.name}: unwritten or non-finite output"
            ref = reference_for(plan, case, kind)
            err = compare(out, ref)
            assert err["rel_l2"] < tol["rel_l2"] and err["cosine"] > tol["cosine"], (kind.name, err)
            assert torch.all(out[:, 0] == 0), "sink +inf must zero head 0"
            assert torch.all(out[-1] == 0), "the padding token has no key: output 0"
            modes = {m for f, m in em.calls if f in ("mla_decode_fwd", "sparse_mla_fwd")}
            called = {f for f, _ in em.calls}
            assert (expect in called) if expect == "sparse_mla_fwd" else all(m.startswith(expect) for m in modes), \
                em.calls
    finally:
        unregister_backend("aiter-test")


def test_mixed_decode_prefill_uses_aiter_for_decode_only(gen):
    em = emulate.enable("gfx950")
    case = make_case(gen, "fp8_ds_mla", 16, query_lens=(1, 1, 5), seq_lens=(200, 9, 300), num_pad=0)
    batch = case["batch"]
    batch = dsv4.StepBatch(batch.query_start_loc, batch.seq_lens, 2, batch.swa_block_table, batch.swa_block_size,
                           batch.comp_block_tables, batch.block_size, batch.max_model_len, batch.num_tokens)
    mla = dsv4.SparseMLA(case["spec"], "fp8_ds_mla", backend="aiter")
    assert mla.backend_for(LayerKind.C4A, "decode") == "aiter"
    assert mla.backend_for(LayerKind.C4A, "prefill") == "torch"  # AITER is decode only
    plan = mla.plan(batch)
    for kind in V4_KINDS:
        em.calls.clear()
        out = run_layer(mla, plan, case, kind)
        err = compare(out, reference_for(plan, case, kind))
        assert err["rel_l2"] < EXACT["rel_l2"], (kind.name, err)
        assert [c[0] for c in em.calls] == ["sparse_mla_fwd"]


def test_persistent_threshold_is_a_parameter(gen):
    em = emulate.enable("gfx950")
    case = make_case(gen, "fp8_ds_mla", 16)  # 7 decode tokens
    for threshold, expect in ((8, "persistent"), (7, "split"), (0, "split")):
        _backend(path="mla_decode_fwd", persistent_max_batch=threshold)
        try:
            mla = dsv4.SparseMLA(case["spec"], "fp8_ds_mla", backend="aiter-test")
            em.calls.clear()
            run_layer(mla, mla.plan(case["batch"]), case, LayerKind.C128A)
            modes = [m for f, m in em.calls if f == "mla_decode_fwd"]
            assert len(modes) == 2 and all(m.startswith(expect) for m in modes), (threshold, em.calls)
        finally:
            unregister_backend("aiter-test")


def test_work_plans_built_once_per_step_and_scratch_is_stable(gen):
    em = emulate.enable("gfx950")
    backend = _backend(path="mla_decode_fwd")
    case = make_case(gen, "fp8_ds_mla", 16)
    try:
        mla = dsv4.SparseMLA(case["spec"], "fp8_ds_mla", backend="aiter-test")
        pointers = None
        for step in range(2):
            plan = mla.plan(case["batch"])
            em.calls.clear()
            for kind in (LayerKind.C4A, LayerKind.C128A, LayerKind.SWA, LayerKind.C4A, LayerKind.C128A):
                run_layer(mla, plan, case, kind)
            plans = [m for f, m in em.calls if f == "get_mla_metadata_v1"]
            assert sorted(plans) == ["topk=128", "topk=128", "topk=64"], plans  # swa, c128a, c4a: once each
            assert len(backend._scratch) == 1
            now = next(iter(backend._scratch.values())).pointers()
            assert pointers is None or now == pointers, "scratch buffers moved between steps"
            pointers = now
    finally:
        unregister_backend("aiter-test")


def test_padded_block_pitch_read_in_place(gen):
    """Plain caches with other layers' pages interleaved (block stride > block size): slots are
    remapped to fixed-stride rows, never copied."""
    emulate.enable("gfx950")
    _backend(path="mla_decode_fwd")
    case = make_case(gen, "bfloat16", 16, swa_bs=64, swa_stride=3 * 64 * 512)
    try:
        mla = dsv4.SparseMLA(case["spec"], "bfloat16", backend="aiter-test")
        plan = mla.plan(case["batch"])
        out = run_layer(mla, plan, case, LayerKind.C4A)
        assert compare(out, reference_for(plan, case, LayerKind.C4A))["rel_l2"] < EXACT["rel_l2"]
    finally:
        unregister_backend("aiter-test")


# ---- refusals ---------------------------------------------------------------------------------
def test_refused_without_rocm_or_emulator():
    mla_spec = dsv4.ModelSpec(num_heads=16)
    with pytest.raises(BackendUnavailableError, match="needs a ROCm GPU.*DSV4_ATTN_AITER_EMULATOR"):
        dsv4.SparseMLA(mla_spec, "fp8_ds_mla", backend="aiter")
    assert not describe_aiter()["found"]


def test_old_aiter_refused_by_signature_not_version():
    emulate.enable("gfx950", "0.1.7")
    with pytest.raises(BackendUnavailableError) as info:
        dsv4.SparseMLA(dsv4.ModelSpec(num_heads=16), "fp8_ds_mla", backend="aiter")
    text = str(info.value)
    assert "sparse_mla_fwd not found" in text and "no return_lse" in text
    paths = describe_aiter()["paths"]
    assert all(v != "enabled" for v in paths.values())


def test_gfx942_refuses_packed_cache_on_sparse_path():
    emulate.enable("gfx942")
    with pytest.raises(BackendUnavailableError, match="gfx950 only"):
        _backend(path="sparse_mla_fwd")
        try:
            dsv4.SparseMLA(dsv4.ModelSpec(num_heads=16), "fp8_ds_mla", backend="aiter-test")
        finally:
            unregister_backend("aiter-test")
    assert "persistent" in describe_aiter()["paths"]["mla_decode_fwd (persistent)"]


def test_wrong_fp8_dialect_is_refused_with_reasons(gen):
    emulate.enable("gfx942")  # reads FNUZ in place
    with pytest.raises(dsv4.BackendUnavailableError, match="swa_dialect: got ocp; allowed: fnuz"):
        dsv4.SparseMLA(dsv4.ModelSpec(num_heads=16), "fp8_e4m3", backend="aiter")
    auto = dsv4.SparseMLA(dsv4.ModelSpec(num_heads=16), "fp8_e4m3", device="cpu")
    assert "swa_dialect: got ocp; allowed: fnuz" in auto.explain()
    # called directly (no selection), the backend still refuses before any AITER call
    case = make_case(gen, "fp8_e4m3", 16, swa_dialect="ocp", comp_dialect="ocp")
    mla = dsv4.SparseMLA(case["spec"], "fp8_e4m3", backend="torch")
    plan = mla.plan(case["batch"])
    layer = dsv4.LayerInputs(LayerKind.SWA, case["q"], case["caches"]["swa"], None, None, case["sink"],
                             dsv4.KVFormat.FP8_TENSOR, case["spec"].scale, case["kv_scale"])
    out = torch.full_like(case["q"], float("nan"))
    with pytest.raises(ValueError, match="swa_dialect: got ocp; allowed: fnuz"):
        dsv4.common.backend.get_backend("aiter").forward(plan.phase_plan("decode"), layer, out)


def test_bad_backend_arguments():
    for kwargs, arg in (({"path": "fast"}, "path"), ({"persistent_max_batch": -1}, "persistent_max_batch"),
                        ({"max_decode_tokens": 0}, "max_decode_tokens")):
        with pytest.raises(ValueError, match=arg):
            AiterBackend(**kwargs)


def test_emulator_switch_by_environment(monkeypatch):
    monkeypatch.setenv(emulate.ENV_EMULATOR, "gfx942:0.1.7")
    api = load_aiter()
    assert api.emulated and api.arch == "gfx942" and api.sparse_mla_fwd is None
    assert AiterBackend().label().startswith("aiter [EMULATED gfx942")
    monkeypatch.setenv(emulate.ENV_EMULATOR, "0")
    assert not load_aiter().emulated


# ---- the emulator itself: documented semantics and argument checks -------------------------------
def _decode_args(em, B=3, H=16, width=4, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(1)
    kv = (torch.randn(20, 1, 1, 512, generator=gen)).to(dtype)
    q = torch.randn(B, H, 512, generator=gen).to(dtype)
    rows = torch.tensor([[0, 5, 7, -1], [3, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)[:B, :width]
    lens = torch.tensor([3, 1, 0], dtype=torch.int32)[:B]
    return kv, q, rows, lens


def test_emulator_split_decode_matches_softmax_and_flags_empty_rows():
    em = AiterEmulator("gfx950")
    kv, q, rows, lens = _decode_args(em)
    indptr = torch.tensor([0, 3, 4, 4], dtype=torch.int32)
    indices = torch.tensor([0, 5, 7, 3], dtype=torch.int32)
    o = torch.empty(3, 16, 512, dtype=torch.bfloat16)
    _, lse = em.mla_decode_fwd(q, kv, o, torch.arange(4, dtype=torch.int32), indptr, indices,
                               torch.ones(3, dtype=torch.int32), 1, sm_scale=0.05, num_kv_splits=2, return_lse=True)
    k = kv.float()[[0, 5, 7], 0, 0]
    s = 0.05 * q[0].float() @ k.T
    assert torch.allclose(lse[0], torch.logsumexp(s, -1), atol=1e-4)
    assert torch.allclose(o[0].float(), torch.softmax(s, -1) @ k, atol=3e-2)
    assert torch.isnan(o[2]).all() and torch.isnan(lse[2]).all()  # AITER can return NaN for keyless rows


def test_emulator_rejects_contract_violations():
    em = AiterEmulator("gfx950")
    kv, q, _, _ = _decode_args(em)
    ones, qo = torch.ones(3, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    o = torch.empty(3, 16, 512, dtype=torch.bfloat16)
    indptr = torch.tensor([0, 2, 3, 3], dtype=torch.int32)
    with pytest.raises(AiterContractError, match="no -1 sentinel"):
        em.mla_decode_fwd(q, kv, o, qo, indptr, torch.tensor([0, -1, 3], dtype=torch.int32), ones, 1,
                          return_lse=True)
    kv8, q8 = kv.to(em.fp8), q.to(em.fp8)
    with pytest.raises(AiterContractError, match="q_scale.*not a python number"):
        em.mla_decode_fwd(q8, kv8, o, qo, indptr, torch.tensor([0, 1, 3], dtype=torch.int32), ones, 1, q_scale=1.0,
                          kv_scale=torch.ones(1))
    with pytest.raises(AiterContractError, match="heads"):
        em.mla_decode_fwd(q[:, :8].contiguous(), kv, o[:, :8].contiguous(), qo, indptr,
                          torch.tensor([0, 1, 3], dtype=torch.int32), ones, 1)
    with pytest.raises(AiterContractError, match="kv_buffer"):
        em.mla_decode_fwd(q, kv.view(20, 512)[:, None, None, :].expand(20, 1, 1, 512).transpose(0, 0)[::2], o, qo,
                          indptr, torch.tensor([0, 1, 3], dtype=torch.int32), ones, 1)


def test_emulator_persistent_plan_must_be_current_and_lse_needs_fp8():
    em = AiterEmulator("gfx950")
    kv, q, rows, lens = _decode_args(em)
    kv8, q8, one = kv.to(em.fp8), q.to(em.fp8), torch.ones(1)
    shapes = em.get_mla_metadata_info_v1(8, 1, 16, em.fp8, em.fp8, True)
    meta = [torch.empty(s, dtype=d) for s, d in shapes]
    qo, last = torch.arange(4, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    indptr = torch.zeros(4, dtype=torch.int32)
    indptr[1:] = lens.cumsum(0)
    em.get_mla_metadata_v1(qo, indptr, last, 16, 1, True, meta[0], meta[2], meta[1], *meta[3:], topk=4)
    names = dict(work_meta_data=meta[0], work_indptr=meta[1], work_info_set=meta[2], reduce_indptr=meta[3],
                 reduce_final_map=meta[4], reduce_partial_map=meta[5])
    o = torch.empty(3, 16, 512, dtype=torch.bfloat16)
    _, lse = em.mla_decode_fwd(q8, kv8, o, qo, indptr, rows.reshape(-1).contiguous(), last, 1, q_scale=one,
                               kv_scale=one, return_lse=True, **names)
    assert torch.isfinite(lse[:2]).all() and torch.isnan(lse[2]).all()
    stale = indptr.clone()
    stale[2:] += 1
    with pytest.raises(AiterContractError, match="stale work plan"):
        em.mla_decode_fwd(q8, kv8, o, qo, stale, rows.reshape(-1).contiguous(), last, 1, q_scale=one, kv_scale=one,
                          return_lse=True, **names)
    with pytest.raises(AiterContractError, match="FP8/FP8 on gfx950 only"):
        em.mla_decode_fwd(q, kv, o, qo, indptr, rows.reshape(-1).contiguous(), last, 1, return_lse=True, **names)


def test_emulator_017_leaves_final_lse_unwritten_and_call_maps_old_metadata_names():
    em = AiterEmulator("gfx950", "0.1.7")
    kv, q, _, _ = _decode_args(em)
    o = torch.empty(3, 16, 512, dtype=torch.bfloat16)
    qo, last = torch.arange(4, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    indptr = torch.tensor([0, 2, 3, 3], dtype=torch.int32)
    _, lse = em.mla_decode_fwd(q, kv, o, qo, indptr, torch.tensor([0, 1, 3], dtype=torch.int32), last, 1)
    assert torch.isnan(lse).all()
    meta = [torch.empty(s, dtype=d) for s, d in em.get_mla_metadata_info_v1(8, 1, 16, torch.bfloat16,
                                                                            torch.bfloat16, True)]
    # 0.1.7 order is (..., work_indptr, work_info, ...) and has no kv_last_page_lens: by keyword it works
    _call(em.get_mla_metadata_v1, seqlens_qo_indptr=qo, seqlens_kv_indptr=indptr, kv_last_page_lens=last,
          num_heads_per_head_k=16, num_heads_k=1, is_causal=True, work_metadata_ptrs=meta[0], work_info_set=meta[2],
          work_indptr=meta[1], reduce_indptr=meta[3], reduce_final_map=meta[4], reduce_partial_map=meta[5],
          page_size=1, topk=4, dtype_q=torch.bfloat16)
    assert meta[2][:3, 4:6].tolist() == [[0, 2], [2, 3], [3, 3]]


def test_emulator_sparse_mla_fwd_contract(gen):
    em = AiterEmulator("gfx942")
    case = make_case(gen, "fp8_e4m3", 16, swa_dialect="fnuz", comp_dialect="fnuz")
    q, cache = case["q"], case["caches"]["swa"]
    T = q.shape[0]
    indptr, indices = torch.zeros(T + 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    with pytest.raises(AiterContractError, match="kv_buffer scale"):
        em.sparse_mla_fwd(q, cache, indptr, indices, 0.04, kv_lora_rank=512, qk_rope_head_dim=0)
    ocp = layout.new_cache("fp8_e4m3", 2, 64)
    with pytest.raises(AiterContractError, match="native fp8 encoding"):
        em.sparse_mla_fwd(q, ocp, indptr, indices, 0.04, kv_scale=torch.ones(1), kv_lora_rank=512,
                          qk_rope_head_dim=0)
    with pytest.raises(AiterContractError, match="C \\+ 1"):
        em.sparse_mla_fwd(q, cache, indptr[:-1], indices, 0.04, kv_scale=torch.ones(1), kv_lora_rank=512,
                          qk_rope_head_dim=0)
    with pytest.raises(TypeError):  # everything after softmax_scale is keyword-only
        em.sparse_mla_fwd(q, cache, indptr, indices, 0.04, torch.ones(1))


def test_write_indices_layouts():
    rows = torch.tensor([[4, -1, 9, 2], [7, 8, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    from dsv4_attn.rocm.scratch import ScopeBuffers

    def scope():
        return ScopeBuffers(4, torch.zeros(3, dtype=torch.int32), torch.full((9,), -1, dtype=torch.int32),
                            torch.full((9,), -1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), torch.ones(1))
    s = scope()
    write_indices(s, rows, lens, "ragged", None, False)
    assert s.kv_indptr.tolist() == [0, 2, 4] and s.kv_indices[:4].tolist() == [4, 9, 7, 8]
    s = scope()
    write_indices(s, rows, lens, "fixed", None, False)
    assert s.kv_indptr.tolist() == [0, 3, 5]
    assert s.kv_indices[:8].tolist() == [4, -1, 9, -1, 7, 8, -1, -1]  # -1 sentinels, entry 3 past lens
    s = scope()
    write_indices(s, rows, lens, "ragged", None, True)
    assert s.slots[:4].tolist() == [4, 9, 7, 8] and s.kv_indices[:4].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_packaged_parity_matrix_through_emulator(arch):
    """The packaged parity matrix's decode cases (every kind x format x batch mix x length at 64
    heads, the FNUZ sweeps, odd page strides, block sizes) on the emulated `aiter` backend: no
    fail or error cell; skips only for prefill-only cases and caches in the arch's foreign dialect."""
    from dsv4_attn import parity

    emulate.enable(arch)
    matrix = parity.load_matrix()
    cases = [c for c in matrix.cases if c.name.split(".")[0] != "core" or ".h64." in c.name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI does on CPU
    try:
        report = parity.run(matrix, ["aiter"], "cpu", cases=cases, progress=False)
    finally:
        torch.set_num_threads(threads)
    cells = {rec["name"]: rec["cells"]["aiter"] for rec in report["cases"]}
    bad = {n: c.get("reasons") for n, c in cells.items() if c["status"] in ("fail", "error")}
    assert not bad, bad
    passed = [n for n, c in cells.items() if c["status"] == "pass"]
    assert len(passed) >= 60 and all(cells[n]["emulated"] for n in passed)
    for name, cell in cells.items():
        if cell["status"] == "skip":
            assert any("decode only" in r or "prefill tokens only" in r or "allowed: " in r
                       for r in cell["reasons"]), (name, cell["reasons"])
