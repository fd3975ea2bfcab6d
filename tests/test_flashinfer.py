"""Backend `flashinfer-trtllm`: CONTRACT TESTS ONLY (no SM100 GPU here).

A stand-in for ``flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4`` checks every argument
the adapter passes against the documented contract (docs/nvidia.md: shapes, dtypes, strides,
16-byte alignment, the 128-column SWA region, storage-offset indices, lengths, Python-float
scales, caller-owned counters) and computes the documented math (SWA window from ``seq_lens``,
sink in the denominator), so the whole adapter path runs on CPU and is compared with the float64
reference, for DeepSeek-V4's and V4.1's layer kinds. What the kernel does with a -1 inside what
it attends is not documented, so the stand-in has both readings: ``skip`` (FlashInfer's own test
reference) and ``zero`` (a key of zeros that still enters the softmax, as SGLang reports); the
adapter must give the reference's answer under both. The merged-row layout is also checked by
running the reference on the merged rows.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.api import SparseMLA
from dsv4_attn.common import reference
from dsv4_attn.common.layout import KVFormat
from dsv4_attn.common.platform import LibraryInfo, Platform
from dsv4_attn.common.spec import V4_KINDS, LayerKind, ModelSpec, round_up
from dsv4_attn.cuda import flashinfer as fi

from kit.compare import FP8_Q, assert_close, metrics
from kit.layers import run_layer
from kit.steps import nvidia_step

SM100 = Platform("cuda", "sm100", "fake B200", "2.x")


def _need(cond, what):
    if not cond:
        raise AssertionError(f"trtllm_batch_decode_sparse_mla_dsv4 contract violated: {what}")


def _pool_rows(pool, offsets, name):
    """Rows float64 [n, k, 512] at storage offsets of a 3-D HND pool; -1 -> 0."""
    pages, page, d = pool.shape
    _need(pool.dim() == 3 and d == 512, f"{name} shape {tuple(pool.shape)}")
    _need(pool.stride(2) == 1 and (page == 1 or pool.stride(1) == 512), f"{name} token stride must be 512")
    _need(pool.stride(0) % 512 == 0, f"{name} page stride {pool.stride(0)} not a multiple of the token stride")
    _need(pool.data_ptr() % 16 == 0, f"{name} base not 16-byte aligned")
    span = pool.stride(0) // 512
    valid = offsets >= 0
    o = offsets.long().clamp(min=0)
    _need(bool(((o // span < pages) & (o % span < page) | ~valid).all()),
          f"{name}: an index is not a storage offset of a token of the pool")
    flat = pool.as_strided((pages * span, 512), (512, 1))
    return flat[o].double() * valid[..., None], valid


class FakeFlashInfer:
    """``trtllm_batch_decode_sparse_mla_dsv4`` of flashinfer-python 0.7.2.post1, as a CPU double.
    ``minus_one``: "skip" (a -1 the kernel attends is no key) or "zero" (a key of zeros, score 0,
    that enters the softmax)."""

    def __init__(self, minus_one="skip"):
        self.minus_one = minus_one
        self.calls = []

    def trtllm_batch_decode_sparse_mla_dsv4(
        self, query, swa_kv_cache, workspace_buffer, sparse_indices=None, compressed_kv_cache=None,
        sparse_topk_lens=None, seq_lens=None, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
        kv_layout="HND", cum_seq_lens_q=None, max_q_len=None, enable_pdl=None, swa_topk_lens=None,
        extra_sparse_indices=None, extra_sparse_topk_lens=None, backend="auto",
        remapped_sparse_indices_buffer=None, sparse_indices_are_storage_offsets=None,
        dsv4_inv_rope_cos_sin_cache=None, dsv4_output_scale=None, sparse_topk_lens_offset=0,
        multi_ctas_kv_counter_buffer=None, *, kv_cache_format="fp8",
    ):
        _need(backend == "trtllm-gen" and kv_layout == "HND" and kv_cache_format == "fp8", "backend / layout")
        _need(cum_seq_lens_q is None and max_q_len is None, "dense query form (no varlen host max_q_len)")
        _need(swa_topk_lens is None and extra_sparse_indices is None and extra_sparse_topk_lens is None,
              "SM120-only arguments")
        _need(sparse_indices_are_storage_offsets is True, "indices into strided pools must be storage offsets")
        B, Q, H, D = query.shape
        _need(query.dtype in (torch.bfloat16, torch.float8_e4m3fn) and D == 512, "query bf16/e4m3 [B, Q, H, 512]")
        _need(H in (64, 128), f"h_q {H} not padded to 64/128")
        _need(query.is_contiguous(), "query contiguous")
        for name, pool in (("swa_kv_cache", swa_kv_cache), ("compressed_kv_cache", compressed_kv_cache)):
            _need(pool is not None and pool.dtype == query.dtype, f"{name} dtype must match query")
        _need(workspace_buffer.dtype == torch.uint8 and workspace_buffer.dim() == 1
              and workspace_buffer.numel() >= 128 << 20, "workspace uint8 >= 128 MiB")
        N = sparse_indices.shape[-1]
        _need(sparse_indices.dtype == torch.int32 and sparse_indices.shape == (B * Q, N)
              and sparse_indices.is_contiguous(), f"sparse_indices int32 [{B * Q}, N] contiguous")
        _need(N >= 128 and N % 4 == 0, f"sparse_indices width {N}: >= 128 and a multiple of 4")
        _need(sparse_topk_lens.dtype == torch.int32 and sparse_topk_lens.shape == (B * Q,)
              and sparse_topk_lens.is_contiguous(), "sparse_topk_lens int32 [sum_q]")
        _need(bool(((sparse_topk_lens >= 128) & (sparse_topk_lens <= N)).all()), "sparse_topk_lens in [128, N]")
        _need(seq_lens.dtype == torch.int32 and seq_lens.shape == (B,) and bool((seq_lens >= Q).all()),
              "seq_lens int32 [B] >= q_len")
        _need(out.dtype == torch.bfloat16 and out.shape == (B, Q, H, 512) and out.is_contiguous(), "out")
        _need(type(bmm1_scale) is float and type(bmm2_scale) is float, "scales as Python floats (scalar path)")
        _need(sinks is None or (sinks.dtype == torch.float32 and sinks.shape == (H,) and sinks.is_contiguous()),
              "sinks f32 [H]")
        c = multi_ctas_kv_counter_buffer
        _need(c is not None and c.dtype == torch.uint8 and c.numel() >= round_up(max(B * H, 1), 8) * 4
              and not bool(c.any()), "caller-owned zeroed counters")
        self.calls.append(dict(B=B, H=H, indices=sparse_indices, workspace=workspace_buffer, query=query.clone(),
                               bmm1=bmm1_scale, bmm2=bmm2_scale, lens=sparse_topk_lens.clone(),
                               seq_lens=seq_lens.clone()))
        # the documented math
        idx = sparse_indices.view(B, Q, N)
        q_off = torch.arange(Q)[None, :]
        swa_len = (seq_lens[:, None].long() - (Q - 1 - q_off)).clamp(0, 128)  # [B, Q]
        col = torch.arange(N)
        live = torch.where(col < 128, col < swa_len[..., None], col < sparse_topk_lens.view(B, Q, 1).long())
        ks, vs = _pool_rows(swa_kv_cache, torch.where(live[..., :128], idx[..., :128], -1), "swa_kv_cache")
        kc, vc = _pool_rows(compressed_kv_cache, torch.where(live[..., 128:], idx[..., 128:], -1),
                            "compressed_kv_cache")
        keys, valid = torch.cat([ks, kc], -2).flatten(0, 1), torch.cat([vs, vc], -1).flatten(0, 1)
        if self.minus_one == "zero":
            valid = live.flatten(0, 1)
        s = bmm1_scale * torch.einsum("nhd,nkd->nhk", query.flatten(0, 1).double(), keys)
        s = s.masked_fill(~valid[:, None, :], -math.inf)
        m = s.amax(-1, keepdim=True)
        if sinks is not None:
            m = torch.maximum(m, sinks.double()[None, :, None])
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        den = p.sum(-1, keepdim=True) + (0 if sinks is None else torch.exp(sinks.double()[None, :, None] - m))
        o = torch.einsum("nhk,nkd->nhd", p, keys) * bmm2_scale
        o = torch.where((den > 0) & torch.isfinite(den), o / den.clamp(min=1e-300), torch.zeros_like(o))
        out.copy_(o.view(B, Q, H, 512).to(out.dtype))
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch, request):
    fake = FakeFlashInfer(getattr(request, "param", "skip"))
    monkeypatch.setattr(fi, "load_flashinfer", lambda: (fake.trtllm_batch_decode_sparse_mla_dsv4, "0.7.2.post1", ()))
    monkeypatch.setattr("dsv4_attn.api.platform_for_device", lambda device: SM100)
    return fake


def _attended(indices, seq_lens, lens):
    """bool [T, N]: the columns the kernel attends (the first seq_len SWA columns, the compressed
    columns up to lens)."""
    col = torch.arange(indices.shape[1])[None, :]
    return torch.where(col < 128, col < seq_lens[:, None].long(), col < lens[:, None].long())


def _mla(case):
    return SparseMLA(case.spec, case.fmt, backend="flashinfer-trtllm")


V41 = (LayerKind.SWA, LayerKind.C1A, LayerKind.C2A)


@pytest.mark.parametrize("fake_flashinfer", ["skip", "zero"], indirect=True)
@pytest.mark.parametrize("kinds, fmt, kv_scale, heads", [
    (V4_KINDS, "bfloat16", None, 16), (V4_KINDS, "fp8_e4m3", 0.25, 64), (V4_KINDS, "bfloat16", None, 128),
    (V41, "bfloat16", None, 64), (V41, "fp8_e4m3", 0.25, 16), (V41, "fp8_e4m3", 0.25, 128)])
def test_every_kind_matches_reference(fake_flashinfer, gen, kinds, fmt, kv_scale, heads):
    # decodes (pos < W, pos + 1 < 4), an MTP pair, prefill crossing the window, padding tokens,
    # strided pools (storage offsets != slots) and a top-k row that is all -1 (-1 inside its lens)
    # compressed pages of 64 entries: V4's C4A at block_size 256, V4.1's C1A at 64 (vLLM on SM90)
    case = nvidia_step(gen, [1, 1, 2, 7, 3], [1, 300, 131, 140, 9], kinds=kinds, heads=heads, topk=62, fmt=fmt,
                       block_size=256 if kinds == V4_KINDS else 64, num_decode_tokens=4, pad_tokens=2,
                       swa_block_stride=64 * 512 * 2, comp_block_stride=64 * 512 + 512, empty_topk_tokens=(1,),
                       kv_scale=kv_scale)
    case.sink[0], case.sink[1] = math.inf, -math.inf
    mla = _mla(case)
    plan = mla.plan(case.batch, validate=True)
    q_seen = case.q if fmt == "bfloat16" else case.q.to(torch.float8_e4m3fn).to(torch.bfloat16)
    for kind in kinds:
        # fp8: the kernel sees q cast to e4m3 (as in vLLM), so the tight check uses that q...
        m = run_layer(mla, plan, case, kind, q=case.q)
        ref, _ = reference.sparse_mla(q_seen, case.caches["swa"], plan.swa_rows, plan.swa_lens,
                                      case.caches.get(kind) if kind.has_comp_scope else None,
                                      *plan.comp_scope(kind, case.topk_for(kind)),
                                      case.sink, case.spec.scale, fmt, kv_scale=case.kv_scale)
        assert_close(metrics(m["out"], ref))
        # ... and against the bf16-q reference the quantization of q costs a few percent at most
        assert_close(m, FP8_Q)
        assert m["out"][:, 0].abs().max() == 0 and m["out"][-2:].abs().max() == 0
    calls = fake_flashinfer.calls
    assert {c["H"] for c in calls} == {fi.padded_heads(heads)}
    scale_kv = 1.0 if kv_scale is None else kv_scale
    assert all(c["bmm1"] == case.spec.scale * fi.Q_SCALE * scale_kv and c["bmm2"] == scale_kv for c in calls)


def test_decode_and_prefill_launched_separately_with_own_workspaces(fake_flashinfer, gen):
    case = nvidia_step(gen, [1, 2, 5], [40, 80, 200], heads=64, fmt="bfloat16", num_decode_tokens=3)
    mla = _mla(case)
    plan = mla.plan(case.batch)
    assert_close(run_layer(mla, plan, case, LayerKind.C4A))
    decode, prefill = fake_flashinfer.calls
    assert (decode["B"], prefill["B"]) == (3, 5)
    assert decode["workspace"].data_ptr() != prefill["workspace"].data_ptr()


def test_two_models_in_one_process_own_their_workspaces(fake_flashinfer, gen):
    """Two SparseMLA objects for two models (128 and 16 heads, top-k 62 and 32), their steps and
    layers interleaved: each runs on its own backend instance with its own workspaces, and each
    result stays the reference's."""
    cases = [nvidia_step(gen, [1, 1, 1], [300, 700, 1000], heads=128, topk=62, fmt="bfloat16"),
             nvidia_step(gen, [1, 1], [50, 900], heads=16, topk=32, fmt="bfloat16")]
    mlas = [_mla(case) for case in cases]
    plans = [mla.plan(case.batch) for mla, case in zip(mlas, cases)]
    for kind in (LayerKind.C4A, LayerKind.SWA, LayerKind.C128A):
        for mla, plan, case in zip(mlas, plans, cases):
            assert_close(run_layer(mla, plan, case, kind))
    backends = [mla._backend("flashinfer-trtllm") for mla in mlas]
    assert backends[0] is not backends[1]
    workspaces = [{c["workspace"].data_ptr() for c in fake_flashinfer.calls if c["H"] == hp} for hp in (128, 64)]
    assert len(workspaces[0]) == len(workspaces[1]) == 1 and workspaces[0].isdisjoint(workspaces[1])
    assert {w.data_ptr() for w in backends[0]._workspaces.values()} == workspaces[0]


def test_c128a_and_swa_rows_built_once_per_step_c4a_per_layer(fake_flashinfer, gen):
    case = nvidia_step(gen, [1, 1, 1], [300, 700, 1000], heads=64, fmt="bfloat16")
    mla = _mla(case)
    plan = mla.plan(case.batch)
    kinds = [LayerKind.C128A, LayerKind.C4A, LayerKind.SWA] * 2
    for kind in kinds:
        assert_close(run_layer(mla, plan, case, kind))
    ptr = {}
    for kind, call in zip(kinds, fake_flashinfer.calls):
        ptr.setdefault(kind, []).append(call["indices"].data_ptr())
    assert ptr[LayerKind.C128A][0] == ptr[LayerKind.C128A][1]
    assert ptr[LayerKind.SWA][0] == ptr[LayerKind.SWA][1]
    assert len({id(c["indices"]) for k, c in zip(kinds, fake_flashinfer.calls) if k is LayerKind.C4A}) == 2


@pytest.mark.parametrize("kind", [LayerKind.C4A, LayerKind.C128A])
def test_merged_rows_give_the_reference_result(gen, kind):
    """Run the float64 reference on the merged rows the kernel gets (plain pools: storage offsets
    == slots): SWA columns [0, 128) with the seq_lens window rule, compressed columns after."""
    case = nvidia_step(gen, [1, 4, 1], [3, 150, 900], heads=8, topk=61, fmt="bfloat16")
    mla = SparseMLA(case.spec, case.fmt, backend="torch")
    plan = mla.plan(case.batch)
    layer = mla.layer_inputs(plan, kind, case.q, case.caches["swa"], case.caches[kind], case.topk_for(kind),
                             case.sink)
    rows, lens, seq_lens = fi.FlashInferTRTLLMBackend._rows(plan, kind, layer.topk, layer.swa_geo, layer.comp_geo)
    assert rows.shape[1] == 128 + round_up(plan.comp_scope(kind, layer.topk)[0].shape[1], 4)
    assert seq_lens.tolist() == (plan.positions + 1).clamp(max=128).tolist()  # clean tables: every window slot
    assert bool((rows[_attended(rows, seq_lens, lens)] >= 0).all()), "a -1 inside what the kernel attends"
    got, _ = reference.sparse_mla(case.q, case.caches["swa"], rows[:, :128], seq_lens, case.caches[kind],
                                  rows[:, 128:], lens - 128, case.sink, case.spec.scale, "bfloat16")
    want, _ = reference.sparse_mla(case.q, case.caches["swa"], plan.swa_rows, plan.swa_lens, case.caches[kind],
                                   *plan.comp_scope(kind, layer.topk), case.sink, case.spec.scale, "bfloat16")
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)  # same keys; padding may reorder sums


@pytest.mark.parametrize("fake_flashinfer", ["skip", "zero"], indirect=True)
def test_minus_one_never_inside_the_attended_lengths(fake_flashinfer, gen):
    """Holes the kernel might count as zero keys: a SWA block past the cache (a -1 inside the
    window), top-k lanes -1 or out of the cache inside the valid prefix, a token whose whole
    window is out of the cache. The adapter's answer is the reference's under both readings of
    -1; what the kernel attends holds keys only."""
    case = nvidia_step(gen, [1, 1, 1, 2], [200, 700, 90, 1000], kinds=V41, heads=64, topk=64, fmt="bfloat16",
                       block_size=64)
    table = case.batch.swa_block_table
    table[0, 1] = case.caches["swa"].shape[0] + 5  # positions 64..127 of request 0: past the cache
    table[2, 1] = case.caches["swa"].shape[0]  # request 2's window (positions 64..89): all past the cache
    table[2, 0] = case.caches["swa"].shape[0]
    topk = case.topks[LayerKind.C1A]
    topk[1, 3], topk[1, 10] = -1, -1
    case.batch.comp_block_tables[1][3, 0] = case.caches[LayerKind.C1A].shape[0] + 1  # entries 0..63 past the cache
    mla = _mla(case)
    plan = mla.plan(case.batch)  # no validate: these are the garbage the kernels must never read
    for kind in V41:
        out = torch.full_like(case.q, math.nan)
        mla.forward(plan, kind, case.q, case.caches["swa"], case.caches.get(kind), topk=case.topk_for(kind),
                    sink=case.sink, out=out)
        ref, _ = reference.sparse_mla(case.q, case.caches["swa"], plan.swa_rows, plan.swa_lens, case.caches.get(kind),
                                      *plan.comp_scope(kind, case.topk_for(kind)), case.sink, case.spec.scale,
                                      "bfloat16", validate=False)
        assert_close(metrics(out, ref))
        decode = fake_flashinfer.calls[-2]  # then the prefill launch of request 3
        holes = _attended(decode["indices"], decode["seq_lens"], decode["lens"]) & (decode["indices"] < 0)
        assert holes.nonzero()[:, 0].unique().tolist() in ([], [2]), holes.nonzero()  # only request 2's empty window
    swa_slots = case.caches["swa"].shape[0] * case.caches["swa"].shape[1]
    inside = (plan.swa_rows >= 0) & (plan.swa_rows < swa_slots) & (torch.arange(128)[None, :] < plan.swa_lens[:, None])
    assert decode["seq_lens"].tolist() == inside.sum(1).clamp(min=1)[:3].tolist() == [72, 128, 1]


def test_storage_offsets_of_strided_pools():
    from dsv4_attn.common.layout import CacheGeometry

    geo = CacheGeometry(num_blocks=4, block_size=3, block_stride=5 * 512)  # 2 foreign token slots per page
    rows = torch.tensor([[0, 2, 3, 11, -1]], dtype=torch.int32)
    assert fi.storage_offsets(rows, geo).tolist() == [[0, 2, 5, 17, -1]]
    plain = CacheGeometry(4, 3, 3 * 512)
    assert fi.storage_offsets(rows, plain) is rows


def test_unsupported_reasons(monkeypatch):
    b = fi.FlashInferTRTLLMBackend()
    spec = ModelSpec(num_heads=64)
    sm90 = Platform("cuda", "sm90", "H100", "2.x", libraries={"flashinfer": LibraryInfo("flashinfer", False)})
    r = b.unsupported_reasons(sm90, spec, KVFormat.BF16, LayerKind.C4A, dsv4.Phase.DECODE)
    assert r == ["needs an NVIDIA SM100-family GPU (TRTLLM-gen has no SM90 path); this is cuda/sm90 "
                 "(flashinfer not installed)"]
    r = b.unsupported_reasons(SM100, ModelSpec(num_heads=64, window=64), KVFormat.MODEL1_FP8, LayerKind.SWA,
                              dsv4.Phase.PREFILL)
    assert any("fp8_ds_mla" in x for x in r) and any("128-token sliding window" in x for x in r)
    missing = (None, None, ("flashinfer (flashinfer-python) is not installed",))
    monkeypatch.setattr(fi, "load_flashinfer", lambda: missing)
    assert b.unsupported_reasons(SM100, spec, KVFormat.FP8_TENSOR, LayerKind.C128A, dsv4.Phase.DECODE) == [
        "flashinfer (flashinfer-python) is not installed"]


def _install_fake_flashinfer(monkeypatch, fn):
    top, dec = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.decode")
    top.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    dec.trtllm_batch_decode_sparse_mla_dsv4 = fn
    monkeypatch.setitem(sys.modules, "flashinfer", top)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", dec)


def test_loader_refuses_missing_cubins_jit_and_old_signature(monkeypatch, tmp_path):
    _install_fake_flashinfer(monkeypatch, FakeFlashInfer().trtllm_batch_decode_sparse_mla_dsv4)
    monkeypatch.delenv("FLASHINFER_CUBIN_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    fi.load_flashinfer.cache_clear()
    try:
        fn, _, reasons = fi.load_flashinfer()
        assert fn is None
        assert any("cubins missing" in r for r in reasons) and any("no nvcc" in r for r in reasons)
        (tmp_path / "cubins").mkdir()
        (tmp_path / "cubins" / "checksums.txt").write_text("x")
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "nvcc").write_text("")
        monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(tmp_path / "cubins"))
        fi.load_flashinfer.cache_clear()
        fn, _, reasons = fi.load_flashinfer()
        assert fn is not None and reasons == ()

        def old(query, swa_kv_cache, workspace_buffer, sparse_indices, compressed_kv_cache, sparse_topk_lens,
                seq_lens, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None, kv_layout="HND"):
            pass

        _install_fake_flashinfer(monkeypatch, old)
        fi.load_flashinfer.cache_clear()
        fn, _, reasons = fi.load_flashinfer()
        assert fn is None and "lacks parameters" in reasons[0] and "sparse_indices_are_storage_offsets" in reasons[0]
    finally:
        fi.load_flashinfer.cache_clear()


def test_bad_cache_layout_is_a_value_error(fake_flashinfer, gen):
    case = nvidia_step(gen, [1], [50], heads=64, fmt="bfloat16", swa_block_stride=64 * 512 + 8)
    mla = _mla(case)
    plan = mla.plan(case.batch)
    with pytest.raises(ValueError, match="swa_cache: got block stride 32776 elements; allowed: a multiple of 512"):
        mla.forward(plan, "swa", case.q, case.caches["swa"])
