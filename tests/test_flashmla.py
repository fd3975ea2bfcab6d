"""Backend `flashmla`.

CPU (CI): the adapter runs end to end through ``SparseMLA(backend="flashmla")`` against a stand-in
for FlashMLA's two ops that enforces their documented argument contract (dtypes, shapes, strides,
top-k granularity, index validity, the scheduler-metadata reuse rule; on SM100 the row addressing
and record pairs of the V4.1 caches, as FlashMLA's interface and vLLM 0.33's build state them)
and computes the documented math; results are compared with the float64 reference. V4's and
V4.1's layer kinds on the V4 record (SM90) and the V4.1 MXFP8 / NVFP4 records (SM100: CONTRACT
TESTS ONLY, no SM100 GPU here). The loader, the schema check and the refusal reasons are tested
with fake libraries, and the schemas of vLLM 0.33.0's FlashMLA build are read from the binary
when it is at hand (``.flashmla/`` or ``DSV4_ATTN_FLASHMLA_LIB``).

GPU (``-m gpu``, H100 with ``DSV4_ATTN_FLASHMLA_LIB``): the real FlashMLA on every edge case of
V4's and V4.1's layer kinds on the V4 record, a 32k-token prefill chunk with bounded memory,
CUDA-graph capture and replay of a decode step. ``DSV4_ATTN_FLASHMLA_TABLE=path`` also writes the
error table there.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from pathlib import Path

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.api import SparseMLA
from dsv4_attn.common import registry as bm
from dsv4_attn.common.layout import KVFormat, Record
from dsv4_attn.common.platform import Platform
from dsv4_attn.common.spec import V4_KINDS, LayerKind, ModelSpec
from dsv4_attn.cuda import flashmla
from dsv4_attn.testing.steps import redrawn_topk

from kit.compare import BF16, assert_close, metrics
from kit.flashmla_standin import FakeFlashMLA, Op
from kit.garbage import garbage_step
from kit.layers import forward_poisoned, reference_out, run_layer
from kit.steps import nvidia_step

SM90 = Platform("cuda", "sm90", "fake H100", "2.x")
SM100 = Platform("cuda", "sm100", "fake B200", "2.x")
V41 = (LayerKind.SWA, LayerKind.C1A, LayerKind.C2A)


def _install(monkeypatch, fake: FakeFlashMLA, platform: Platform) -> FakeFlashMLA:
    """Route the `flashmla` backend to ``fake`` and make SparseMLA see ``platform``'s GPU."""
    lib = flashmla.FlashMLALib(flashmla.FlashMLAOps(flashmla._DIALECTS[0], fake), "fake", "0", "test")
    monkeypatch.setattr(flashmla, "load_flashmla", lambda: lib)
    monkeypatch.setattr(flashmla, "_is_sm100", lambda device: platform is SM100)
    monkeypatch.setattr("dsv4_attn.api.platform_for_device", lambda device: platform)
    return fake


@pytest.fixture
def fake_flashmla(monkeypatch):
    return _install(monkeypatch, FakeFlashMLA("sm90"), SM90)


@pytest.fixture
def fake_flashmla_sm100(monkeypatch):
    return _install(monkeypatch, FakeFlashMLA("sm100"), SM100)


def _mla(case, **kw):
    return SparseMLA(case.spec, case.fmt, backend="flashmla", **kw)


def _every_kind_matches_reference(case, pad_tokens: int) -> None:
    """Every kind of the case's model through `flashmla`, +inf / -inf sinks on heads 0 / 1."""
    case.sink[0], case.sink[1] = math.inf, -math.inf
    mla = _mla(case)
    plan = mla.plan(case.batch, validate=True)
    for kind in case.spec.kinds:
        m = run_layer(mla, plan, case, kind)
        assert_close(m)
        assert m["out"][:, 0].abs().max() == 0  # +inf sink zeroes the head
        assert m["out"][-pad_tokens:].abs().max() == 0  # padding tokens have no keys


# ---------------------------------------------------------------------------------------------
# CPU contract tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [16, 64, 100])
def test_every_kind_decode_prefill_mtp_padding_matches_reference(fake_flashmla, gen, heads):
    # decodes (pos < W, pos + 1 < 4, long), an MTP pair, a prefill chunk crossing the window, a
    # prefill request whose first tokens see no compressed entry yet, then 2 padding tokens
    case = nvidia_step(gen, [1, 1, 1, 2, 9, 5], [1, 3, 300, 131, 140, 7], heads=heads, topk=96,
                       num_decode_tokens=5, pad_tokens=2, empty_topk_tokens=(2,))
    _every_kind_matches_reference(case, pad_tokens=2)
    # decode went through sparse_decode_fwd with heads padded to 64/128, prefill through prefill
    assert {c["h"] for c in fake_flashmla.decode_calls} == {flashmla.padded_heads(heads)}
    assert len(fake_flashmla.prefill_calls) == 3


def test_odd_page_sizes_block_strides_and_widths(fake_flashmla, gen):
    # SWA block size 1 with a foreign-page stride, C4A block size 53 (block_size 212), top-k 100
    # (not a multiple of the kernels' blocks), window 96 (decode pads the SWA row to 128 columns)
    case = nvidia_step(gen, [1, 1, 4], [90, 400, 260], heads=64, topk=100, window=96, swa_bs=1,
                       block_size=212, swa_block_stride=2 * 584 + 576)
    mla = _mla(case)
    plan = mla.plan(case.batch, validate=True)
    for kind in (LayerKind.SWA, LayerKind.C4A):
        assert_close(run_layer(mla, plan, case, kind))


@pytest.mark.parametrize("swa_bs, block_size", [(2, 256), (256, 512)])
def test_block_sizes(fake_flashmla, gen, swa_bs, block_size):
    case = nvidia_step(gen, [1, 3, 1], [700, 520, 1030], heads=32, swa_bs=swa_bs, block_size=block_size,
                       num_decode_tokens=1)
    mla = _mla(case)
    plan = mla.plan(case.batch, validate=True)
    for kind in V4_KINDS:
        assert_close(run_layer(mla, plan, case, kind))


def test_scheduler_metadata_planned_once_per_kind_and_step(fake_flashmla, gen):
    case = nvidia_step(gen, [1, 1, 1], [100, 900, 2000], heads=64)
    mla = _mla(case)
    for step in range(2):
        plan = mla.plan(case.batch)
        start = len(fake_flashmla.decode_calls)
        for kind in [LayerKind.SWA, LayerKind.C4A, LayerKind.C128A] * 3:  # three layers of each kind
            assert_close(run_layer(mla, plan, case, kind))
        calls = fake_flashmla.decode_calls[start:]
        tiles = {}
        for c in calls:
            tiles.setdefault(c["config"], set()).add(id(c["tile"]))
        assert len(tiles) == 3 and all(len(t) == 1 for t in tiles.values())  # one schedule per kind
        if step == 0:
            first = {k: next(iter(v)) for k, v in tiles.items()}
        else:  # a new step plans afresh (the stand-in refuses reuse with changed lengths anyway)
            assert all(next(iter(tiles[k])) != first[k] for k in tiles)


def test_prefill_workspace_holds_distinct_selected_rows_within_budget(fake_flashmla, gen):
    case = nvidia_step(gen, [40, 30], [300, 1500], heads=64, topk=128)
    budget = 96 * 1024  # 96 rows of bf16: forces the chunk to be halved several times
    bm.register_backend("flashmla-small", flashmla.FlashMLABackend(workspace_bytes=budget, index_keys=4096))
    try:
        mla = SparseMLA(case.spec, case.fmt, backend="flashmla-small")
        plan = mla.plan(case.batch, validate=True)
        assert_close(run_layer(mla, plan, case, LayerKind.C4A))
    finally:
        bm.unregister_backend("flashmla-small")
    calls = fake_flashmla.prefill_calls
    assert len(calls) > 2 and sum(c["s"] for c in calls) == case.batch.num_tokens
    for c in calls:
        rows_used = c["idx"][c["idx"] >= 0].unique()
        assert c["kv"].shape[0] * 512 * 2 <= budget or c["s"] == 1
        # every workspace row but a possible leading zero row (the -1 key) is referenced: only
        # selected rows, each once
        assert c["kv"].shape[0] - rows_used.numel() in (0, 1)


def test_cuda_graph_style_reuse_refused_across_steps_is_not_needed(fake_flashmla, gen):
    """Two steps with different lengths: each step's first layer plans anew (no stale schedule)."""
    mla = SparseMLA(ModelSpec(num_heads=64, topk=64), "fp8_ds_mla", backend="flashmla")
    for seq in ([100, 200], [300, 400]):
        case = nvidia_step(gen, [1, 1], seq, heads=64)
        plan = mla.plan(case.batch)
        assert_close(run_layer(mla, plan, case, LayerKind.C128A))
    tiles = [id(c["tile"]) for c in fake_flashmla.decode_calls]
    assert len(set(tiles)) == 2


# ---------------------------------------------------------------------------------------------
# The top-k translation in one Triton launch (TRITON_INTERPRET=1 on CPU) vs the torch ops it replaces
# ---------------------------------------------------------------------------------------------
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@needs_triton
@pytest.mark.parametrize("kinds", [V4_KINDS, V41], ids=["v4", "v41"])
def test_fused_topk_translation_matches_the_torch_ops_on_garbage(kinds):
    """Every garbage class in the block tables and the top-k rows (tests/kit/garbage.py), top-k
    32 (padded to 128 columns), the cache's slot count and bounds that cut valid slots: the fused
    kernel writes what translation + bound + padding in torch write, lens too."""
    from dsv4_attn.common.indices import Tokens, bounded_rows, comp_rows_for
    from dsv4_attn.portable.kernels.indices import topk_rows

    step = garbage_step(torch.Generator().manual_seed(29), kinds=kinds)
    case, tokens = step.case, Tokens.of(step.case.batch)
    for kind in (k for k in kinds if k.uses_topk):
        table, bs = case.batch.comp_block_tables[kind.ratio], case.batch.comp_block_size(kind)
        local = case.topks[kind]
        rows, lens = comp_rows_for(tokens, kind, table, bs, local)
        slots = case.caches[kind].shape[0] * bs
        valid = rows[rows >= 0]
        for num_slots in (slots, int(valid.median()), int(valid.min()) + 1, 1):
            got_rows, got_lens = topk_rows(tokens, kind.ratio, table, bs, local, num_slots, flashmla.TOPK_BLOCK)
            want = bounded_rows(rows, num_slots, multiple=flashmla.TOPK_BLOCK)
            assert got_rows.shape == want.shape == (rows.shape[0], 128) and got_rows.is_contiguous()
            assert torch.equal(got_rows, want), (kind, num_slots)
            assert torch.equal(got_lens, lens), kind
        dropped = int(((rows >= 0) & (rows < slots)).sum()) - int((want >= 0).sum())
        assert dropped > 0  # the last bound (1) cut valid slots: the bound is exercised
        # without a bound or padding: the front end's rows (slots that fit int32), unchanged
        got_rows, got_lens = topk_rows(tokens, kind.ratio, table, bs, local)
        assert torch.equal(got_rows, rows) and torch.equal(got_lens, lens)


@needs_triton
@pytest.mark.parametrize("kinds", [V4_KINDS, V41], ids=["v4", "v41"])
def test_adapter_translates_each_top_k_layer_in_one_kernel(fake_flashmla, monkeypatch, kinds):
    """With the Triton index front end the adapter's top-k rows come from ONE fused launch per
    decode layer (none of the torch ops), and the garbage step's outputs are its clean twin's
    float64 reference (decode and prefill tokens)."""
    from dsv4_attn.common import reference
    from dsv4_attn.portable.kernels import indices as kernel_indices

    fused, torch_widths = [], []
    real_fused, real_rows = kernel_indices.topk_rows, flashmla.bounded_rows
    monkeypatch.setattr(kernel_indices, "topk_rows", lambda *a, **k: fused.append(a[5:]) or real_fused(*a, **k))
    def torch_rows(r, *a, **k):  # the decode kernel's rows made by torch ops (padded: multiple given)
        if k.get("multiple", 1) > 1:
            torch_widths.append(r.shape[1])
        return real_rows(r, *a, **k)

    monkeypatch.setattr(flashmla, "bounded_rows", torch_rows)
    step = garbage_step(torch.Generator().manual_seed(31), kinds=kinds)
    case, clean = step.case, step.clean
    mla = SparseMLA(case.spec, "fp8_ds_mla", backend="flashmla", front_end="triton")
    plan = mla.plan(case.batch)  # no validation: the garbage goes through
    clean_plan = SparseMLA(clean.spec, "fp8_ds_mla", backend="torch", front_end="torch").plan(clean.batch)
    for kind in case.spec.kinds:
        out = torch.full_like(case.q, float("nan"))
        mla.forward(plan, kind, case.q, case.caches["swa"], case.caches.get(kind), topk=case.topk_for(kind),
                    sink=case.sink, out=out)
        rows, lens = clean_plan.comp_scope(kind, clean.topk_for(kind))
        rows = None if rows is None else torch.where(rows >= 0, rows, torch.full_like(rows, -1))
        swa = torch.where(clean_plan.swa_rows >= 0, clean_plan.swa_rows, torch.full_like(clean_plan.swa_rows, -1))
        want, _ = reference.sparse_mla(clean.q, clean.caches["swa"], swa, clean_plan.swa_lens, clean.caches.get(kind),
                                       rows, lens, clean.sink, clean.spec.scale, "fp8_ds_mla")
        assert not out.isnan().any(), kind
        m = metrics(out, want)
        assert m["rel_l2"] < 1e-2 and m["cosine"] > 0.9999, (kind, m)
    topk_kinds = [k for k in kinds if k.uses_topk]
    slots = [case.caches[k].shape[0] * case.batch.comp_block_size(k) for k in topk_kinds]
    bounded = [f for f in fused if f and f[0] is not None]  # (num_slots, multiple) of the decode launches
    assert bounded == [(n, flashmla.TOPK_BLOCK) for n in slots]  # one per top-k layer
    assert case.spec.topk not in torch_widths  # only SWA / C128A rows went through the torch ops


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4.1: its layer kinds on the V4 record (SM90), its records on SM100 (contract tests)
# ---------------------------------------------------------------------------------------------
# decodes (pos + 1 < 2: no C2A entry yet), an MTP pair, a prefill chunk crossing the window, a
# prefill request whose first token sees no C2A entry, padding
V41_QUERY_LENS, V41_SEQ_LENS = [1, 1, 1, 2, 9, 3], [1, 3, 300, 131, 140, 3]


@pytest.mark.parametrize("heads, block_size", [(16, 64), (64, 256), (128, 64)])  # vLLM on SM90: 64-token blocks
def test_v41_kinds_on_the_v4_record(fake_flashmla, gen, heads, block_size):
    case = nvidia_step(gen, V41_QUERY_LENS, V41_SEQ_LENS, kinds=V41, heads=heads, topk=96, block_size=block_size,
                       num_decode_tokens=5, pad_tokens=2, empty_topk_tokens=(2,))
    _every_kind_matches_reference(case, pad_tokens=2)
    calls = fake_flashmla.decode_calls
    assert {c["records"] for c in calls} == {(Record.V4_FP8, None), (Record.V4_FP8, Record.V4_FP8)}
    # each ratio's compressed page holds block_size // ratio entries, and each kind plans its own schedule
    pages = {c["config"][5] for c in calls}
    assert pages == {None, block_size, block_size // 2}
    assert len({id(c["tile"]) for c in calls}) == 3
    assert len(fake_flashmla.prefill_calls) == 3


def test_v41_layers_sharing_a_compressed_cache(fake_flashmla, gen):
    """Two C2A layers read one cache with their own top-k rows: one schedule serves both (the
    lengths derive from positions only), the cache is read in place and left unchanged."""
    case = nvidia_step(gen, [1, 1, 1], [90, 600, 2000], kinds=(LayerKind.SWA, LayerKind.C2A), heads=64, topk=64)
    spec = ModelSpec(num_heads=64, topk=64, max_model_len=4096,
                     layers=[dsv4.Layer(0, LayerKind.SWA), dsv4.Layer(1, LayerKind.C2A, 1),
                             dsv4.Layer(2, LayerKind.C2A, 1)])
    cache = case.caches[LayerKind.C2A]
    before = cache.clone()
    mla = SparseMLA(spec, case.fmt, backend="flashmla")
    plan = mla.plan(case.batch, validate=True)
    for topk in (case.topks[LayerKind.C2A], redrawn_topk(gen, case, LayerKind.C2A)):
        case.topks[LayerKind.C2A] = topk
        assert_close(run_layer(mla, plan, case, LayerKind.C2A))
    assert len({id(c["tile"]) for c in fake_flashmla.decode_calls}) == 1
    assert torch.equal(cache, before)


@pytest.mark.parametrize("fmt, kinds, heads", [("mxfp8_ds_mla", V41, 16), ("nvfp4_ds_mla", V41, 64),
                                               ("mxfp8_ds_mla", V4_KINDS, 128)])
def test_v41_records_on_sm100(fake_flashmla_sm100, gen, fmt, kinds, heads):
    """CONTRACT TEST (no SM100 GPU): decode reads the V4.1 records in place (528 B SWA; 528 or 288 B
    compressed), prefill dequantizes the selected rows; every kind against the reference."""
    # pages of whole 512 B multiples (vLLM's V4.1 pages): block_size 4096 gives C128A 32-entry pages
    case = nvidia_step(gen, V41_QUERY_LENS, V41_SEQ_LENS, kinds=kinds, heads=heads, fmt=fmt, topk=64,
                       block_size=256 if kinds == V41 else 4096, num_decode_tokens=5, pad_tokens=1,
                       empty_topk_tokens=(2,))
    mla = _mla(case)
    plan = mla.plan(case.batch, validate=True)
    for kind in kinds:
        m = run_layer(mla, plan, case, kind)
        assert_close(m)
        assert m["out"][-1:].abs().max() == 0
    swa_rec, comp_rec = KVFormat.parse(fmt).swa_record, KVFormat.parse(fmt).comp_record
    assert {c["records"] for c in fake_flashmla_sm100.decode_calls} == {(swa_rec, None), (swa_rec, comp_rec)}
    assert fake_flashmla_sm100.prefill_calls


def test_sm100_block_strides(fake_flashmla_sm100, gen):
    """FlashMLA's SM100 kernels address each V4.1 cache as rows of its token bytes: a block stride
    that is not a multiple of them is a ValueError naming the cache; vLLM's shared block stride,
    a multiple of lcm(528, 288), serves both caches."""
    shared = 3168 * 6  # lcm(528, 288) * 6 >= 64 * 288 and >= 32 * 528
    case = nvidia_step(gen, [1, 1, 3], [90, 700, 260], kinds=V41, heads=64, fmt="nvfp4_ds_mla", topk=64, swa_bs=32,
                       block_size=64, swa_block_stride=shared, comp_block_stride=shared)
    mla = _mla(case)
    plan = mla.plan(case.batch, validate=True)
    for kind in V41:
        assert_close(run_layer(mla, plan, case, kind))
    bad = nvidia_step(gen, [1], [90], kinds=V41, heads=64, fmt="nvfp4_ds_mla", topk=64, block_size=64,
                      comp_block_stride=64 * 528)  # a multiple of 528, not of 288
    mla = _mla(bad)
    plan = mla.plan(bad.batch)
    with pytest.raises(ValueError, match=r"^comp_cache: got block stride 33792 B; allowed on SM100: a multiple of "
                                         r"288 B \(FlashMLA reads nvfp4 caches as rows of 288 B"):
        mla.forward(plan, "c1a", bad.q, bad.caches["swa"], bad.caches[LayerKind.C1A], topk=bad.topks[LayerKind.C1A])
    odd = nvidia_step(gen, [1], [90], kinds=V41, heads=64, fmt="mxfp8_ds_mla", topk=64, swa_bs=1)  # page 1024 B
    mla = _mla(odd)
    plan = mla.plan(odd.batch)
    with pytest.raises(ValueError, match=r"^swa_cache: got block stride 1024 B; allowed on SM100: a multiple of 528 B"):
        mla.forward(plan, "swa", odd.q, odd.caches["swa"])


def test_v41_records_refused_off_sm100_and_on_older_flashmla(monkeypatch):
    b = flashmla.FlashMLABackend()
    spec = ModelSpec(num_heads=64, layers=V41)
    fake = _install(monkeypatch, FakeFlashMLA("sm90"), SM90)
    for fmt in flashmla.V41_FORMATS:
        reasons = b.unsupported_reasons(SM90, spec, fmt, LayerKind.C1A, dsv4.Phase.DECODE)
        assert reasons == [f"reads {fmt.value} (V4.1 records) only on SM100: FlashMLA's SM90 kernels decode the V4 "
                           "record (fp8_ds_mla), which vLLM 0.33 keeps for V4.1 there"]
        assert b.unsupported_reasons(SM100, spec, fmt, LayerKind.C1A, dsv4.Phase.PREFILL) == []
    assert b.unsupported_reasons(SM90, spec, KVFormat.MODEL1_FP8, LayerKind.C2A, dsv4.Phase.DECODE) == []
    del fake.fused_norm_rope_attn_rope_cast_decode  # a FlashMLA from before the interleaved V4.1 records
    reasons = b.unsupported_reasons(SM100, spec, KVFormat.MXFP8, LayerKind.SWA, dsv4.Phase.DECODE)
    assert len(reasons) == 1 and "predates the interleaved V4.1 records" in reasons[0]
    old = flashmla.FlashMLALib(flashmla.FlashMLAOps(flashmla._DIALECTS[1], FakeFlashMLA()), "flash_mla", "1.0", "x")
    monkeypatch.setattr(flashmla, "load_flashmla", lambda: old)
    reasons = b.unsupported_reasons(SM100, spec, KVFormat.NVFP4, LayerKind.C2A, dsv4.Phase.DECODE)
    assert len(reasons) == 1 and "upstream dialect" in reasons[0]
    with pytest.raises(dsv4.BackendUnavailableError, match="only on SM100"):
        SparseMLA(spec, "mxfp8_ds_mla", backend="flashmla", device="cpu")


def _vllm_flashmla_binary() -> bytes:
    path = os.environ.get(flashmla.ENV_LIB) or str(Path(__file__).resolve().parents[1] / ".flashmla" /
                                                   "_flashmla_C.abi3.so")
    if not os.path.isfile(path):
        pytest.skip(f"vLLM 0.33.0's FlashMLA build not at hand ({path}; docs/nvidia.md \"Getting FlashMLA\")")
    return Path(path).read_bytes()


def test_vllm_033_flashmla_build_binds_and_reads_v41_records():
    """The op schemas registered by vLLM 0.33.0's ``_flashmla_C`` (read from the binary, no GPU
    needed) are the ones the adapter binds; the build knows the V4.1 records and carries the op
    that marks their release."""
    blob = _vllm_flashmla_binary()
    for op, expected in (("sparse_decode_fwd", flashmla._VLLM_DECODE), ("sparse_prefill_fwd", flashmla._VLLM_PREFILL)):
        found = re.findall(rb"\x00(" + op.encode() + rb"\(Tensor q[^\x00]*)\x00", blob)
        assert len(found) == 1, (op, found)
        assert flashmla._schema_key(torch._C.parse_schema(found[0].decode())) == \
            flashmla._schema_key(torch._C.parse_schema(expected)), found[0]
    assert b"\x00" + flashmla.V41_RELEASE_OP.encode() + b"(Tensor q" in blob
    for name in (b"ModelType::V41]", b"ModelType::V41_FP4]", b"DecodeFeatures::V41_KVCACHE_FORMAT]"):
        assert name in blob, name


# ---------------------------------------------------------------------------------------------
# loader, schema check, refusal reasons
# ---------------------------------------------------------------------------------------------
def _namespace(decode_schema, prefill_schema):
    ns = FakeFlashMLA()
    ns.sparse_decode_fwd = Op(ns._decode, decode_schema)
    ns.sparse_prefill_fwd = Op(ns._prefill, prefill_schema)
    return ns


def test_schema_mismatch_is_a_refusal_naming_the_expected_schema():
    wrong = flashmla._VLLM_DECODE.replace("float sm_scale", "float sm_scale, int extra")
    ops, why = flashmla.bind_ops(_namespace(wrong, flashmla._VLLM_PREFILL), "_flashmla_C")
    assert ops is None
    assert "not the vllm dialect" in why and flashmla._VLLM_DECODE in why and "int extra" in why
    ops, why = flashmla.bind_ops(_namespace(flashmla._UPSTREAM_DECODE, flashmla._UPSTREAM_PREFILL), "_flashmla_C")
    assert ops is not None and ops.dialect.name == "upstream" and not ops.dialect.has_out
    ops, why = flashmla.bind_ops(object(), "_flashmla_C")
    assert ops is None and "sparse_decode_fwd is missing" in why


def test_loader_order_and_reasons(monkeypatch, tmp_path):
    present = {"vllm._flashmla_C": _namespace(flashmla._VLLM_DECODE.replace("int d_v", "int dv"),
                                              flashmla._VLLM_PREFILL),
               "sgl_kernel.flash_mla": _namespace(flashmla._SGL_DECODE, flashmla._UPSTREAM_PREFILL)}
    namespaces = {"_flashmla_C": present["vllm._flashmla_C"], "sgl_kernel": present["sgl_kernel.flash_mla"]}
    monkeypatch.setattr(flashmla, "_module_exists", lambda m: m in present)
    monkeypatch.setattr(flashmla.importlib, "import_module", lambda m: type("M", (), {"__file__": m})())
    monkeypatch.setattr(flashmla, "_op_namespace", lambda name: namespaces[name])
    monkeypatch.setenv(flashmla.ENV_LIB, str(tmp_path / "missing.so"))
    flashmla.load_flashmla.cache_clear()
    try:
        lib = flashmla.load_flashmla()
        assert lib.source == "sgl_kernel" and lib.ops.dialect.kv_format
        assert lib.notes[0] == "flash_mla: not installed" and "int dv" in lib.notes[1]
        del present["sgl_kernel.flash_mla"]
        flashmla.load_flashmla.cache_clear()
        lib = flashmla.load_flashmla()
        assert lib.ops is None
        text = lib.describe()
        assert "vllm: not the vllm dialect" in text and "missing.so: no such file" in text
    finally:
        flashmla.load_flashmla.cache_clear()


def test_unsupported_reasons(monkeypatch):
    b = flashmla.FlashMLABackend()
    spec = ModelSpec(num_heads=64)
    cpu = Platform("cpu", "cpu", "cpu", "2.x")
    assert any("needs an NVIDIA SM90" in r for r in b.unsupported_reasons(cpu, spec, KVFormat.MODEL1_FP8,
                                                                       LayerKind.C4A, dsv4.Phase.DECODE))
    sm80 = Platform("cuda", "sm80", "A100", "2.x")
    assert any("this is cuda/sm80" in r for r in b.unsupported_reasons(sm80, spec, KVFormat.MODEL1_FP8,
                                                                       LayerKind.SWA, dsv4.Phase.PREFILL))
    missing = flashmla.FlashMLALib(None, notes=("vllm: not installed",))
    monkeypatch.setattr(flashmla, "load_flashmla", lambda: missing)
    assert b.unsupported_reasons(SM90, spec, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.DECODE) == [
        "FlashMLA not loaded: vllm: not installed"]
    reasons = b.unsupported_reasons(Platform("cuda", "sm100", "B200", "2.x"), spec, KVFormat.BF16,
                                    LayerKind.C4A, dsv4.Phase.DECODE)
    assert any("not bfloat16" in r for r in reasons)


def test_explain_on_cpu_lists_flashmla_reason():
    mla = SparseMLA(ModelSpec(num_heads=64), "fp8_ds_mla", backend="torch", device="cpu")
    assert "flashmla" in mla.explain() and "needs an NVIDIA SM90" in mla.explain()


def test_fnuz_cache_is_refused(fake_flashmla):
    with pytest.raises(dsv4.BackendUnavailableError, match="reads ocp fp8 only; the SWA cache is fnuz"):
        SparseMLA(ModelSpec(num_heads=64), "fp8_ds_mla", backend="flashmla", swa_dialect="fnuz")


# ---------------------------------------------------------------------------------------------
# GPU (H100): the real FlashMLA
# ---------------------------------------------------------------------------------------------
_TABLE: list[str] = []
GPU = "cuda"


def _real_lib():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    lib = flashmla.load_flashmla()
    if lib.ops is None:
        if os.environ.get(flashmla.ENV_LIB):
            pytest.fail(lib.describe())  # asked for a library that does not load: a failure
        pytest.skip(lib.describe())
    return lib


@pytest.fixture(scope="module")
def table():
    yield _TABLE
    if _TABLE:
        text = "\n".join(["| case | kind | max abs | rel L2 | cosine |", "|---|---|---|---|---|", *_TABLE])
        print("\n" + text)
        if os.environ.get("DSV4_ATTN_FLASHMLA_TABLE"):
            with open(os.environ["DSV4_ATTN_FLASHMLA_TABLE"], "w") as f:
                f.write(text + "\n")


def _record(table, name, kind, m):
    table.append(f"| {name} | {LayerKind.parse(kind).name} | {m['max_abs']:.3e} | {m['rel_l2']:.3e} | "
                 f"{m['cosine']:.6f} |")
    assert_close(m, dataclasses.replace(BF16, max_abs=0.1))  # outputs reach |8|: bf16 steps there are 0.03


# name -> (query_lens, seq_lens, nvidia_step keyword arguments)
_GPU_CASES = {
    "decode H64 C4A512 b64": ([1] * 64, None, dict(heads=64, topk=512)),
    "decode H128 C4A1024 b32": ([1] * 32, None, dict(heads=128, topk=1024)),
    "decode H16 padded, C128A bs2": ([1] * 24, None, dict(heads=16, max_model_len=65536)),
    "decode H32 padded": ([1] * 8, None, dict(heads=32, topk=512)),
    "decode H100 padded to 128": ([1] * 8, None, dict(heads=100, topk=512)),
    "MTP 2-3 tokens/request": ([2, 3, 2, 2], None, dict(heads=64, topk=512, num_decode_tokens=9)),
    "odd pages: swa bs1, c4a bs53": ([1] * 6, None, dict(heads=64, topk=512, swa_bs=1, block_size=212)),
    "swa bs2, c128a bs3 (block 384)": ([1] * 6, None, dict(heads=64, swa_bs=2, block_size=384)),
    "swa bs256, foreign page stride": ([1] * 6, None, dict(heads=64, swa_bs=256, block_size=512,
                                                          swa_block_stride=256 * 584 + 2 * 576)),
    "empty rows, +-inf sinks, padding": ([1, 1, 1, 1], [1, 2, 3, 500], dict(heads=64, pad_tokens=3,
                                                                            empty_topk_tokens=(3,))),
    "mixed decode+prefill": ([1, 1, 2, 37, 130], [5, 900, 400, 160, 3000], dict(heads=64, topk=512,
                                                                                 num_decode_tokens=4)),
    "prefill H128 C4A1024": ([300, 200], [4000, 200], dict(heads=128, topk=1024, num_decode_tokens=0)),
    "prefill H16 padded, long": ([257], [9000], dict(heads=16, topk=512, max_model_len=16384)),
    # DeepSeek-V4.1's kinds (SWA, C1A, C2A) on the V4 record, as vLLM 0.33 runs them on SM90 (64-token
    # compressed blocks: C1A pages of 64 entries, C2A of 32)
    "V4.1 decode H64 topk512 b64": ([1] * 64, None, dict(kinds=V41, heads=64, topk=512, block_size=64)),
    "V4.1 decode H128 topk1024 b32": ([1] * 32, None, dict(kinds=V41, heads=128, topk=1024, block_size=64)),
    "V4.1 decode H16 padded, block 256": ([1] * 24, None, dict(kinds=V41, heads=16, topk=512)),
    "V4.1 decode H100 padded to 128": ([1] * 8, None, dict(kinds=V41, heads=100, topk=512, block_size=64)),
    "V4.1 MTP 2-3 tokens/request": ([2, 3, 2, 2], None, dict(kinds=V41, heads=64, topk=512, block_size=64,
                                                             num_decode_tokens=9)),
    "V4.1 empty rows, +-inf sinks, padding": ([1, 1, 1, 1], [1, 2, 3, 500],
                                              dict(kinds=V41, heads=64, block_size=64, pad_tokens=3,
                                                   empty_topk_tokens=(3,))),
    "V4.1 mixed decode+prefill": ([1, 1, 2, 37, 130], [5, 900, 400, 160, 3000],
                                  dict(kinds=V41, heads=64, topk=512, block_size=64, num_decode_tokens=4)),
    "V4.1 prefill H128 topk1024": ([300, 200], [4000, 200], dict(kinds=V41, heads=128, topk=1024, block_size=64,
                                                                 num_decode_tokens=0)),
    "V4.1 prefill H16 padded, long": ([257], [9000], dict(kinds=V41, heads=16, topk=512, block_size=64,
                                                          max_model_len=16384)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_GPU_CASES))
def test_gpu_parity(name, table):
    _real_lib()
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    qlens, seqs, kw = _GPU_CASES[name]
    if seqs is None:
        seqs = [int(x) for x in torch.randint(1, 6000, (len(qlens),), generator=gen)]
        seqs = [max(s, q) for s, q in zip(seqs, qlens)]
    kw = {"max_model_len": 8192, **kw}
    case = nvidia_step(gen, qlens, seqs, device=GPU, **kw)
    case.sink[0], case.sink[1] = math.inf, -math.inf
    mla = SparseMLA(case.spec, case.fmt, backend="flashmla", device=GPU)
    plan = mla.plan(case.batch, validate=True)
    for kind in case.spec.kinds:
        if kind.has_comp_scope and kind not in case.caches:
            continue
        m = run_layer(mla, plan, case, kind)
        _record(table, name, kind, m)
        assert m["out"][:, 0].abs().max() == 0
        if "padding" in name:
            assert m["out"][-3:].abs().max() == 0


@pytest.mark.gpu
def test_gpu_v41_layers_sharing_a_compressed_cache(table):
    """Two C2A layers of one step read one compressed cache with their own top-k rows, then a C1A
    layer: every result against the reference; the shared cache is read in place, unchanged."""
    _real_lib()
    gen = torch.Generator().manual_seed(41)
    seqs = [int(x) for x in torch.randint(1, 6000, (32,), generator=gen)]
    case = nvidia_step(gen, [1] * 32, seqs, kinds=V41, heads=64, topk=512, block_size=64, max_model_len=8192,
                       device=GPU)
    spec = ModelSpec(num_heads=64, topk=512, max_model_len=8192,
                     layers=[dsv4.Layer(0, LayerKind.SWA), dsv4.Layer(1, LayerKind.C1A, 1),
                             dsv4.Layer(2, LayerKind.C2A, 2), dsv4.Layer(3, LayerKind.C2A, 2)])
    mla = SparseMLA(spec, case.fmt, backend="flashmla", device=GPU)
    plan = mla.plan(case.batch, validate=True)
    cache = case.caches[LayerKind.C2A]
    before = cache.clone()
    first, second = case.topks[LayerKind.C2A], redrawn_topk(gen, case, LayerKind.C2A)
    for name, kind, topk in (("layer 2", LayerKind.C2A, first), ("layer 3 (shares layer 2's cache)", LayerKind.C2A,
                                                                 second), ("layer 1", LayerKind.C1A, None)):
        if topk is not None:
            case.topks[kind] = topk
        _record(table, f"V4.1 shared compressed cache: {name}", kind, run_layer(mla, plan, case, kind))
    assert torch.equal(cache, before)


@pytest.mark.gpu
def test_gpu_prefill_32k_chunk_bounded(table, monkeypatch):
    _real_lib()
    launches = []
    prefill = flashmla.FlashMLAOps.prefill
    monkeypatch.setattr(flashmla.FlashMLAOps, "prefill",
                        lambda self, q, kv, *a: (launches.append((q.shape[0], kv.shape[0])), prefill(self, q, kv, *a)))
    gen = torch.Generator().manual_seed(32768)
    case = nvidia_step(gen, [32768], [40000], heads=64, topk=512, max_model_len=65536, num_decode_tokens=0,
                       device=GPU)
    mla = SparseMLA(case.spec, case.fmt, backend="flashmla", device=GPU, max_tokens=32768)
    plan = mla.plan(case.batch)
    sample = torch.cat([torch.arange(64), torch.randperm(32768, generator=gen)[:448], torch.arange(32704, 32768)])
    for kind in (LayerKind.C4A, LayerKind.C128A):
        launches.clear()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = forward_poisoned(mla, plan, case, kind, validate=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
        idx = sample.to(GPU)  # the reference on 576 of the 32768 tokens (first, last and random ones)
        m = dict(metrics(out[idx], reference_out(plan, case, kind, tokens=idx)),
                 written=not bool(out.isnan().any()))
        rows = max(r for _, r in launches)
        _record(table, f"prefill 32k tokens: {len(launches)} launches, <= {rows} ws rows, peak +{peak >> 20} MiB",
                kind, m)
        # a per-token workspace would be 32768 x 640 rows x 1 KiB = 20 GiB; ours stays under the bounds
        assert rows * 1024 <= bm.get_backend("flashmla").workspace_bytes and peak < 4 << 30, (rows, peak)


def _graph_case(gen, device, kinds):
    """16 decode tokens; the longest request is fixed so block tables and caches keep their shapes."""
    seqs = [4000] + [int(x) for x in torch.randint(1, 4000, (15,), generator=gen)]
    return nvidia_step(gen, [1] * 16, seqs, kinds=kinds, heads=64, topk=512, device=device,
                       block_size=256 if kinds == V4_KINDS else 64)


def _refill(case, new):
    """Write ``new``'s step into ``case``'s tensors in place (what an engine does between steps)."""
    for name in ("query_start_loc", "seq_lens", "swa_block_table"):
        getattr(case.batch, name).copy_(getattr(new.batch, name))
    for ratio, table in case.batch.comp_block_tables.items():
        table.copy_(new.batch.comp_block_tables[ratio])
    for key, cache in case.caches.items():
        cache.copy_(new.caches[key])
    for kind, topk in case.topks.items():
        topk.copy_(new.topks[kind])
    case.q.copy_(new.q)
    case.sink.copy_(new.sink)
    b = case.batch
    return dsv4.StepBatch(b.query_start_loc, b.seq_lens, b.num_decode_tokens, b.swa_block_table, b.swa_block_size,
                          b.comp_block_tables, b.block_size, b.max_model_len, num_tokens=b.num_tokens)


def _decode_step(mla, plan, case, outs):
    for kind, out in outs.items():
        mla.forward(plan, kind, case.q, case.caches["swa"], case.caches.get(kind) if kind.has_comp_scope else None,
                    topk=case.topk_for(kind), sink=case.sink, out=out)


def _check_step(table, name, mla, plan, case, outs):
    for kind, out in outs.items():
        _record(table, name, kind, metrics(out, reference_out(plan, case, kind)))


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", [V4_KINDS, V41], ids=["V4", "V4.1"])
def test_gpu_cuda_graph_decode_replay(table, kinds):
    _real_lib()
    gen = torch.Generator().manual_seed(11)
    case = _graph_case(gen, GPU, kinds)
    mla = SparseMLA(case.spec, case.fmt, backend="flashmla", device=GPU, max_tokens=16)
    outs = {kind: torch.empty_like(case.q) for kind in kinds}
    _decode_step(mla, mla.plan(case.batch), case, outs)  # warm-up outside the capture; that plan is dropped
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    plan = mla.plan(case.batch)  # a fresh plan: its schedules are planned inside the capture
    with torch.cuda.graph(graph):
        _decode_step(mla, plan, case, outs)
    prefix = "" if kinds == V4_KINDS else "V4.1 "
    for step in range(2):  # replay on new contents, same shapes, twice
        plan = mla.plan(_refill(case, _graph_case(gen, GPU, kinds)))  # rewrites the buffers the graph reads
        for out in outs.values():
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_step(table, f"{prefix}CUDA graph replay {step + 1}, new contents", mla, plan, case, outs)


@pytest.mark.gpu
def test_gpu_library_and_schema():
    lib = _real_lib()
    assert lib.ops.dialect.name == "vllm", lib.describe()
    wrong = flashmla._VLLM_PREFILL.replace("Tensor? topk_length", "Tensor topk_length")
    ops, why = flashmla.bind_ops(_namespace(flashmla._VLLM_DECODE, wrong), "_flashmla_C")
    assert ops is None and flashmla._VLLM_PREFILL in why
    print(lib.describe())


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", [V4_KINDS, V41], ids=["V4", "V4.1"])
def test_gpu_huge_slots(table, kinds):
    """Last on purpose: if the kernel computed byte offsets in int32 this could fault the context."""
    _real_lib()
    gen = torch.Generator().manual_seed(2**31 % 1000)
    case = nvidia_step(gen, [1, 1, 1, 3], [4000, 5000, 300, 3000], kinds=kinds, heads=64, topk=512, block_base=60000,
                       num_decode_tokens=3, max_model_len=8192, block_size=256 if kinds == V4_KINDS else 64,
                       device=GPU)
    assert case.caches["swa"].shape[0] * case.caches["swa"].stride(0) > 2**31
    mla = SparseMLA(case.spec, case.fmt, backend="flashmla", device=GPU)
    plan = mla.plan(case.batch, validate=True)
    prefix = "" if kinds == V4_KINDS else "V4.1 "
    for kind in kinds:
        _record(table, f"{prefix}huge slots: SWA byte offsets > 2^31", kind, run_layer(mla, plan, case, kind))


def test_a_steps_plan_is_freed_without_a_garbage_collection_on_flashmla(fake_flashmla, gen):
    """The flashmla adapter's per-step metadata (index rows, tile scheduler metadata: GPU tensors on
    a GPU) does not keep its plan alive: the step's plan goes with its last reference."""
    from kit.layers import assert_plan_freed_without_collection

    case = nvidia_step(gen, [1, 1, 4], [90, 400, 260], heads=64, topk=100)
    assert_plan_freed_without_collection(_mla(case), case, case.spec.kinds)

