"""Backend `triton` against the float64 reference (docs/testing.md "Edge cases every backend meets",
small shapes).

On a machine without a GPU the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``
is set before the kernels are imported; the interpreter is process-wide, so these CPU tests are
skipped on GPU machines, where the same cases run compiled and are marked ``gpu``). Every test
draws fresh random inputs, poisons the output with NaN, checks every element was written and
reports max abs error, relative L2 and cosine against ``common.reference.sparse_mla``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

import dsv4_attn as dsv4  # noqa: E402
from dsv4_attn.common import layout, reference  # noqa: E402
from dsv4_attn.common import registry as backend_mod  # noqa: E402
from dsv4_attn.common.backend import Phase  # noqa: E402
from dsv4_attn.common.spec import V4_KINDS, LayerKind  # noqa: E402
from dsv4_attn.testing.steps import filled_cache, make_step  # noqa: E402

from kit.compare import assert_close, compare  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _backend(name: str, **cfg) -> str:
    """Register a TritonBackend with a small-tile KernelConfig (more tiles per row on tiny shapes)."""
    from dsv4_attn.portable.kernels.ops import KernelConfig
    from dsv4_attn.portable.triton_backend import TritonBackend

    backend_mod.register_backend(name, TritonBackend(KernelConfig(**cfg)))
    return name


# this file's cases: a smaller top-k and model length (the interpreter is slow), made on DEVICE
_make_step = functools.partial(make_step, topk=32, max_model_len=33280, device=DEVICE)
_filled_cache = functools.partial(filled_cache, device=DEVICE)


def run_and_check(mla, plan, kind, q, caches, topk, sink, fmt="fp8_ds_mla", kv_scale=1.0, swa_dialect="ocp"):
    comp = caches.get(kind)
    topk = topk if kind.uses_topk else None
    out = torch.full_like(q, float("nan"))
    mla.forward(plan, kind, q, caches["swa"], comp, topk=topk, sink=sink, out=out, kv_scale=kv_scale, validate=True)
    if HAS_CUDA:
        torch.cuda.synchronize()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements not written"
    rows, lens = plan.comp_scope(kind, topk)
    ref, _ = reference.sparse_mla(q, caches["swa"], plan.swa_rows, plan.swa_lens, comp, rows, lens, sink,
                                  mla.spec.scale, fmt, kv_scale=kv_scale if fmt == "fp8_e4m3" else None,
                                  swa_dialect=swa_dialect)
    err = compare(out, ref)
    print(f"{kind.name} {fmt}: max_abs {err['max_abs']:.2e} rel_l2 {err['rel_l2']:.2e} cos {err['cosine']:.6f}")
    if ref.abs().max() > 0:
        assert_close(err, max_abs=False)
    # bf16 output: one rounding of |out| (2^-8 relative) plus accumulation noise
    assert err["max_abs"] <= 1e-2 + 2**-7 * float(ref.abs().max()), err
    return out, ref


def _devices():
    return [pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only "
                                                                        "machines (the GPU run compiles)")),
            pytest.param("cuda", marks=[gpu, needs_gpu])]


# ---- every kind x format, mixed decode / MTP / prefill / short sequences ------------------------


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("kind", list(V4_KINDS))
def test_kinds_and_formats(device, kind, fmt, gen):
    name = _backend("triton-t16", block_n=16)
    # decode (long), MTP pair, a prefill chunk crossing the window start, a very short request
    # (pos < W, no compressed key yet for its first tokens), one long C128A request
    kv_scale = 0.5 if fmt == "fp8_e4m3" else 1.0
    spec, batch, caches, topk, q, sink = _make_step(gen, [1, 2, 6, 3, 1], [300, 131, 70, 3, 33000], fmt=fmt,
                                                    kv_scale=kv_scale if fmt == "fp8_e4m3" else None).v4_inputs()
    mla = dsv4.SparseMLA(spec, fmt, backend=name)
    plan = mla.plan(batch)
    run_and_check(mla, plan, kind, q, caches, topk, sink, fmt, kv_scale=kv_scale)


@pytest.mark.parametrize("device", _devices())
def test_sinks_padded_heads_and_split(device, gen):
    """±inf sinks, 20 real heads padded to 24 (sink -inf on the padding), and the split-KV path
    (partials + combine) against the unsplit kernel."""
    spec, batch, caches, topk, q, _ = _make_step(gen, [1, 1, 2], [200, 90, 41], heads=20).v4_inputs()
    H = 24
    q = torch.cat([q, torch.zeros(q.shape[0], 4, 512, dtype=q.dtype, device=q.device)], dim=1)
    sink = torch.randn(H, generator=gen).to(DEVICE)
    sink[1], sink[2], sink[20:] = math.inf, -math.inf, -math.inf
    for split in (1, 3):
        name = _backend(f"triton-s{split}", block_n=16, split=split)
        mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend=name)
        plan = mla.plan(batch)
        out, ref = run_and_check(mla, plan, LayerKind.C4A, q, caches, topk, sink)
        assert out[:, 1].abs().max() == 0  # +inf sink zeroes its head


@pytest.mark.parametrize("device", _devices())
def test_empty_rows_padding_tokens_and_fnuz(device, gen):
    """Padding tokens (graph-padded batch: rows all -1, lens 0) write 0; an FNUZ SWA cache."""
    name = _backend("triton-t16", block_n=16)
    spec, batch, caches, topk, q, sink = _make_step(gen, [1, 1], [5, 64], pad_tokens=3, swa_dialect="fnuz").v4_inputs()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend=name, swa_dialect="fnuz")
    plan = mla.plan(batch)
    out, _ = run_and_check(mla, plan, LayerKind.C128A, q, caches, topk, sink, swa_dialect="fnuz")
    assert out[2:].abs().max() == 0


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("swa_bs,block_size", [(1, 256), (2, 512), (256, 256), (48, 256), (64, 384)])
def test_block_sizes(device, swa_bs, block_size, gen):
    """SWA block sizes 1/2/256/48/64 and compressed blocks of 64/128/96 (C4A) and 2/4/3 (C128A)
    entries: powers of two (the Gluon kernel splits slots with shifts) and not (divisions)."""
    name = _backend("triton-t32", block_n=32)
    case = _make_step(gen, [1, 3], [700, 260], swa_bs=swa_bs, block_size=block_size)
    spec, batch, caches, topk, q, sink = case.v4_inputs()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend=name)
    plan = mla.plan(batch)
    for kind in (LayerKind.C4A, LayerKind.C128A):
        run_and_check(mla, plan, kind, q, caches, topk, sink)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("fmt,swa_dialect", [("fp8_ds_mla", "ocp"), ("mxfp8_ds_mla", "ocp"), ("mxfp8_ds_mla", "fnuz"),
                                             ("nvfp4_ds_mla", "ocp")])
def test_kernel_lse_and_all_invalid_rows(device, fmt, swa_dialect, gen):
    """The raw kernel entry in each packed record (V4; V4.1 MXFP8, FNUZ too; MXFP8 SWA + NVFP4
    compressed): natural-log lse without the sink, rows whose indices are all -1, interleaved -1
    entries, an SWA cache with a padded block stride (other layers' pages), a compressed cache of
    12-token blocks (not a power of two), and the split path."""
    from dsv4_attn.portable.kernels.ops import KernelConfig

    _check_raw_kernel(fmt, swa_dialect, 16, [KernelConfig(block_n=16, split=split) for split in (1, 4)], gen)


@pytest.mark.parametrize("device", _devices())
def test_combine_loads_several_splits_per_round_trip(device, gen):
    """The combine launch's partials loaded 1 / 4 splits per round trip (``KernelConfig.combine_chunk``,
    ``ops.combine_chunk``: 4 after the Gluon kernel, weights picked from the (m, l) loaded first),
    over 5 splits (a last chunk part past the split), tokens whose keys fill fewer splits and a
    token without keys."""
    from dsv4_attn.portable.kernels.ops import KernelConfig

    configs = [KernelConfig(block_n=16, split=5, combine_chunk=chunk) for chunk in (1, 4)]
    _check_raw_kernel("fp8_ds_mla", "ocp", 16, configs, gen)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("heads", [16, 24, 40])
@pytest.mark.parametrize("fmt,swa_dialect", [("nvfp4_ds_mla", "ocp"), ("fp8_ds_mla", "fnuz")])
def test_amd_tiles(device, heads, fmt, swa_dialect, gen):
    """AMD's tile (16 heads x 64 keys, 4 waves, P through the scratch), one launch and split
    (some splits empty), with 1-3 head blocks: in the V4 record as gfx942 writes it (FNUZ SWA
    cache) and in the two-record walk (MXFP8 SWA + NVFP4 compressed, pair order). gfx950's keys
    scaled in fp32 (one launch), gfx942's in the dot dtype (split)."""
    from dsv4_attn.portable.kernels.ops import KernelConfig

    want = (16, 64, 4, True)
    for arch in ("gfx942", "gfx950"):
        tile = KernelConfig().tile(arch, heads)
        assert (tile.block_h, tile.block_n, tile.num_warps, tile.p_scratch) == want, tile
        assert tile.f32_decode == (arch == "gfx950"), tile
    configs = [KernelConfig(block_h=16, block_n=want[1], num_warps=4, p_scratch=int(want[3]), split=split,
                            f32_decode=f32_decode) for split, f32_decode in ((1, 1), (3, 0))]
    _check_raw_kernel(fmt, swa_dialect, heads, configs, gen)


def _check_raw_kernel(fmt, swa_dialect, H, configs, gen):
    from dsv4_attn.portable.kernels.ops import sparse_mla_fwd

    T, W, K = 4, 24, 40
    records = layout.KVFormat.parse(fmt)
    stride = layout.default_block_stride(records.swa_record, 16) + 576
    swa = _filled_cache(records.swa_record, 6, 16, gen, block_stride=stride, dialect=swa_dialect)
    comp = _filled_cache(records.comp_record, 7, 12, gen)
    rows = torch.randint(0, 96, (T, W), generator=gen).int()
    rows[:, 5] = -1
    rows[2] = -1  # all invalid
    lens = torch.tensor([24, 7, 24, 0], dtype=torch.int32)
    crows = torch.randint(0, 80, (T, K), generator=gen).int()
    crows[0, ::3] = -1
    clens = torch.tensor([40, 0, 0, 13], dtype=torch.int32)
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen)
    args = [x.to(DEVICE) for x in (rows, lens, crows, clens, q, sink)]
    rows, lens, crows, clens, q, sink = args
    ref, ref_lse = reference.sparse_mla(q, swa, rows, lens, comp, crows, clens, sink, 512**-0.5, fmt,
                                        swa_dialect=swa_dialect)
    for config in configs:
        out = torch.full_like(q, float("nan"))
        lse = torch.full((T, H), float("nan"), device=DEVICE)
        sparse_mla_fwd(q, out, fmt, swa, rows, lens, comp, crows, clens, sink=sink, lse=lse,
                       swa_fnuz=swa_dialect == "fnuz", config=config)
        assert not out.isnan().any() and not lse.isnan().any()
        err = compare(out, ref)
        assert_close(err, max_abs=False, what=config)
        assert out[2].abs().max() == 0 and torch.isinf(lse[2]).all() and (lse[2] < 0).all()
        fin = torch.isfinite(ref_lse)
        assert (lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-3
        assert torch.equal(torch.isfinite(lse).cpu(), fin.cpu())


# ---- GPU front end (plan rows in one launch) --------------------------------------------------


@pytest.mark.parametrize("device", _devices())
def test_gpu_index_builder_matches_common(device, gen):
    from dsv4_attn.common import indices
    from dsv4_attn.portable.kernels.indices import build_step_rows

    spec, batch, *_ = _make_step(gen, [1, 2, 5, 1, 3], [300, 131, 70, 3, 33000], pad_tokens=2, swa_bs=2).v4_inputs()
    T, W, width = batch.num_tokens, 128, spec.c128a_width
    tok = indices.Tokens.of(batch)
    want_swa = indices.swa_rows_for(tok, batch.swa_block_table, batch.swa_block_size, W)
    want_c = indices.comp_rows_for(tok, LayerKind.C128A, batch.comp_block_tables[128], batch.comp_block_size(128),
                                   width)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    bufs = dict(positions=torch.full((T,), -7, dtype=torch.int64, device=DEVICE),
                token_to_req=torch.full((T,), -7, **i32), token_valid=torch.zeros(T, dtype=torch.bool, device=DEVICE),
                swa_rows=torch.full((T, W), -7, **i32), swa_lens=torch.full((T,), -7, **i32),
                # previous lengths = the whole row: every column is stale, so every one is rewritten
                # (the builder writes up to max(new, previous length): PlanBuffers' invariant)
                c128_rows=torch.full((T, width), -7, **i32), c128_lens=torch.full((T,), width, **i32))
    build_step_rows(batch.query_start_loc, batch.seq_lens, T, batch.swa_block_table, batch.swa_block_size, W,
                    bufs["positions"], bufs["token_to_req"], bufs["token_valid"], bufs["swa_rows"], bufs["swa_lens"],
                    batch.comp_block_tables[128], batch.comp_block_size(128), bufs["c128_rows"], bufs["c128_lens"])
    assert torch.equal(bufs["positions"], batch.positions)
    assert torch.equal(bufs["token_to_req"], batch.token_to_req)
    assert torch.equal(bufs["token_valid"], batch.token_valid)
    assert torch.equal(bufs["swa_rows"], want_swa[0]) and torch.equal(bufs["swa_lens"], want_swa[1])
    assert torch.equal(bufs["c128_rows"], want_c[0]) and torch.equal(bufs["c128_lens"], want_c[1])


# ---- refusals -----------------------------------------------------------------------------------


def test_refusal_reasons(monkeypatch):
    from dsv4_attn.common.layout import KVFormat
    from dsv4_attn.common.platform import Platform
    from dsv4_attn.portable import triton_backend as tb

    b = tb.TritonBackend()
    spec = dsv4.ModelSpec(num_heads=64)
    args = (spec, KVFormat.MODEL1_FP8, LayerKind.C4A, Phase.DECODE)
    ampere = Platform("cuda", "sm80", "A100", torch.__version__)
    assert any("sm_89" in r for r in b.unsupported_reasons(ampere, *args))
    assert b.unsupported_reasons(ampere, spec, KVFormat.BF16, LayerKind.C4A, Phase.DECODE) == []
    volta = Platform("cuda", "sm70", "V100", torch.__version__)
    assert any("sm_80" in r for r in b.unsupported_reasons(volta, *args))
    assert b.unsupported_reasons(Platform("cuda", "sm90", "H100", torch.__version__), *args) == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert any("needs a GPU" in r for r in b.unsupported_reasons(Platform("cpu", "cpu", "cpu", "x"), *args))
    monkeypatch.setattr(tb.importlib.util, "find_spec", lambda name: None)
    assert any("Triton is not installed" in r for r in b.unsupported_reasons(ampere, *args))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "mxfp8_ds_mla"])
def test_odd_block_stride_is_refused_before_launch(device, fmt, gen):
    # the kernel reads V4 RoPE values and MXFP8 values (as 16-bit words) through a 2-byte view
    name = _backend("triton-t16", block_n=16)
    spec, batch, caches, topk, q, sink = _make_step(gen, [1], [40]).v4_inputs()
    stride = layout.default_block_stride(layout.KVFormat.parse(fmt).swa_record, 64) + 1
    bad = layout.new_cache(layout.KVFormat.parse(fmt).swa_record, 2, 64, device=DEVICE, block_stride=stride)
    mla = dsv4.SparseMLA(spec, fmt, backend=name)
    plan = mla.plan(batch)
    with pytest.raises(ValueError, match="swa_cache"):
        mla.forward(plan, LayerKind.SWA, q, bad, sink=sink)


# ---- H100: production shapes, CUDA graphs, caches past 2^31 bytes --------------------------------


def _impls():
    """(name, KernelConfig kwargs) of the kernels the triton backend can run on this GPU."""
    out = [("portable", dict(impl="triton"))]
    if HAS_CUDA and torch.cuda.get_device_capability() == (9, 0):
        out.append(("gluon", dict(impl="gluon")))
    return out


@gpu
@needs_gpu
@pytest.mark.parametrize("impl", ["portable", "gluon"])
@pytest.mark.parametrize("cfg,batch,mtp,fmt", [
    ("h64-c4a512", 5, 1, "fp8_ds_mla"), ("h128-c4a1024", 3, 2, "fp8_ds_mla"), ("h64-c128a", 4, 1, "fp8_ds_mla"),
    ("h128-c4a1024", 40, 1, "fp8_ds_mla"),
    # V4.1 layers: the V4 record (SM90's), MXFP8, MXFP8 SWA + NVFP4 compressed (SM100's records)
    ("h64-c1a512", 3, 1, "fp8_ds_mla"), ("h128-c2a1024", 40, 1, "fp8_ds_mla"), ("h64-c1a512", 5, 2, "mxfp8_ds_mla"),
    ("h128-c2a1024", 40, 1, "mxfp8_ds_mla"), ("h64-c2a512", 3, 1, "nvfp4_ds_mla"),
    ("h128-c1a1024", 40, 1, "nvfp4_ds_mla")])
def test_gpu_production_shapes(impl, cfg, batch, mtp, fmt):
    """Production head counts / widths (the bench's cases) against the float64 reference, with a
    +inf and a -inf sink; small batches take the split-KV path, larger ones do not."""
    kw = dict(_impls()).get(impl)
    if kw is None:
        pytest.skip(f"{impl} kernel needs an sm_90 GPU")
    from dsv4_attn import bench

    name = _backend(f"triton-{impl}", **kw)
    case = bench.make_decode_case(bench.DECODE_CONFIGS[cfg], batch, mtp, torch.device("cuda"),
                                  layout.KVFormat.parse(fmt), seed=batch * 7 + mtp)
    case.sink[0], case.sink[1] = math.inf, -math.inf
    mla = dsv4.SparseMLA(case.spec, case.fmt, backend=name, max_tokens=case.q.shape[0])
    plan = mla.plan(case.batch)
    run_and_check(mla, plan, case.kind, case.q, {"swa": case.swa_cache, case.kind: case.comp_cache},
                  case.topk, case.sink, fmt)


@gpu
@needs_gpu
@pytest.mark.parametrize("impl", ["portable", "gluon"])
def test_gpu_cuda_graph_short_capture_long_replay(impl, gen):
    """Capture plan() + a C4A decode layer with short sequences, then rewrite the batch tensors in
    place (long sequences, new block tables, new top-k) and replay: the output must match the
    reference of the NEW step (nothing step-dependent may be baked into the graph)."""
    kw = dict(_impls()).get(impl)
    if kw is None:
        pytest.skip(f"{impl} kernel needs an sm_90 GPU")
    name = _backend(f"triton-{impl}", **kw)
    R, H, K, bs, max_len = 6, 64, 64, 64, 8192
    spec = dsv4.ModelSpec(num_heads=H, topk=K, max_model_len=max_len)
    cols, c4_cols = max_len // bs, max_len // 4 // 64
    swa_table = torch.zeros(R, cols, dtype=torch.int32, device=DEVICE)
    c4_table = torch.zeros(R, c4_cols, dtype=torch.int32, device=DEVICE)
    swa_cache = _filled_cache("fp8_ds_mla", R * cols, bs, gen)
    c4_cache = _filled_cache("fp8_ds_mla", R * c4_cols, 64, gen)
    seq = torch.zeros(R, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(R + 1, dtype=torch.int32, device=DEVICE)
    topk = torch.full((R, K), -1, dtype=torch.int32, device=DEVICE)
    q = torch.empty(R, H, 512, dtype=torch.bfloat16, device=DEVICE)
    sink = torch.randn(H, generator=gen).to(DEVICE)

    def fill(seq_lens):
        seq.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        swa_table.copy_(torch.randperm(R * cols, generator=gen).int().view(R, cols))
        c4_table.copy_(torch.randperm(R * c4_cols, generator=gen).int().view(R, c4_cols))
        t = torch.full((R, K), -1, dtype=torch.int32)
        for r, s in enumerate(seq_lens):
            n = s // 4
            t[r, : min(n, K)] = torch.randperm(max(n, 1), generator=gen)[: min(n, K)].int()
        topk.copy_(t)
        q.copy_(torch.randn(R, H, 512, generator=gen).bfloat16())

    def new_batch():  # the engine's persistent tensors; a fresh StepBatch derives its facts anew
        return dsv4.StepBatch(query_start_loc=qsl, seq_lens=seq, num_decode_tokens=R, swa_block_table=swa_table,
                              swa_block_size=bs, comp_block_tables={4: c4_table}, block_size=256,
                              max_model_len=max_len, num_tokens=R)

    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend=name, max_tokens=R, max_reqs=R)
    out = torch.full_like(q, float("nan"))
    fill([3, 5, 9, 40, 17, 2])  # short: few SWA keys, C4A rows mostly empty
    state = {}

    def step():
        state["plan"] = mla.plan(new_batch())
        mla.forward(state["plan"], LayerKind.C4A, q, swa_cache, c4_cache, topk=topk, sink=sink, out=out)

    from dsv4_attn.bench.timing import capture_graph

    graph = capture_graph(step)  # its warm-up call compiles outside the capture
    fill([8000, 4097, 300, 7777, 129, 6000])  # long: full windows, full top-k rows
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", max_tokens=R, max_reqs=R)
    eplan = eager.plan(new_batch())
    assert int(eplan.swa_lens.min()) >= 128 and int(eplan.comp_scope(LayerKind.C4A, topk)[1].min()) >= 32
    rows, lens = eplan.comp_scope(LayerKind.C4A, topk)
    ref, _ = reference.sparse_mla(q, swa_cache, eplan.swa_rows, eplan.swa_lens, c4_cache, rows, lens, sink,
                                  spec.scale, "fp8_ds_mla")
    assert not out.isnan().any()
    err = compare(out, ref)
    print("graph replay:", err)
    assert_close(err, max_abs=False)


@gpu
@needs_gpu
@pytest.mark.parametrize("impl", ["portable", "gluon"])
def test_gpu_cache_past_2gib(impl, gen):
    """A MODEL1 cache of > 2^31 bytes whose attended rows all lie past byte 2^31 (int64 offsets)."""
    kw = dict(_impls()).get(impl)
    if kw is None:
        pytest.skip(f"{impl} kernel needs an sm_90 GPU")
    free, _ = torch.cuda.mem_get_info()
    bs = 64
    page = layout.model1_page_bytes(bs)
    nb = (2**31 + 64 * page) // page + 8
    if free < nb * page + (1 << 30):
        pytest.skip("needs ~2.5 GB of free GPU memory")
    name = _backend(f"triton-{impl}", **kw)
    cache = layout.new_cache("fp8_ds_mla", nb, bs, device=DEVICE)
    assert cache.untyped_storage().nbytes() > 2**31
    first = 2**31 // page + 1  # every block used starts past byte 2^31
    R = 3
    table = torch.zeros(R, 4, dtype=torch.int32)
    table[:, :] = torch.arange(first, first + 4 * R, dtype=torch.int32).view(R, 4)
    slots = (table.long()[:, :, None] * bs + torch.arange(bs)[None, None, :]).reshape(-1)
    kv = (torch.randn(slots.numel(), 512, generator=gen) * 2).bfloat16()
    layout.insert(cache, "fp8_ds_mla", slots.to(DEVICE), kv.to(DEVICE))
    batch = dsv4.StepBatch.from_lists([1, 1, 2], [200, 256, 131], table, bs, block_size=256, max_model_len=1024,
                                      device=DEVICE)
    spec = dsv4.ModelSpec(num_heads=64, max_model_len=1024)
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend=name)
    plan = mla.plan(batch)
    used = plan.swa_rows[plan.swa_rows >= 0].long()
    assert int((used // bs).min()) * page > 2**31  # every attended row starts past byte 2^31
    q = torch.randn(batch.num_tokens, 64, 512, generator=gen).bfloat16().to(DEVICE)
    sink = torch.randn(64, generator=gen).to(DEVICE)
    run_and_check(mla, plan, LayerKind.SWA, q, {"swa": cache}, None, sink)


def _impl_configs(device):
    """KernelConfigs to run on ``device``: the portable kernel, and on a GPU the automatic choice
    (which must pick the portable kernel for FNUZ caches and V4.1 records)."""
    from dsv4_attn.portable.kernels.ops import KernelConfig

    configs = [KernelConfig(block_n=16, impl="triton")]
    if device == "cuda":
        configs.append(KernelConfig())
    return configs


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_e4m3", "mxfp8"])
def test_fnuz_extreme_bytes(device, fmt, gen):
    """FNUZ e4m3 bytes 0x7F / 0xFF are ±240 (NaN in OCP): caches holding them in the attended rows
    decode like the reference (torch's float8_e4m3fnuz) in the portable kernel (what AMD runs), and
    on a GPU through the automatic kernel choice (on sm_90 the Gluon kernel, which reads OCP only,
    must hand FNUZ caches to the portable kernel). Only the compiled run discriminates: Triton's
    interpreter decodes OCP 0x7F as 480, not NaN."""
    from dsv4_attn.portable.kernels.ops import sparse_mla_fwd

    from kit.reference import e4m3_value

    assert (e4m3_value(0x7F, "fnuz"), e4m3_value(0xFF, "fnuz")) == (240.0, -240.0)
    T, H, W = 3, 16, 20
    scale = 0.25 if fmt == "fp8_e4m3" else None
    swa = _filled_cache(fmt, 4, 16, gen, dialect="fnuz", scale=scale)
    flat = swa.view(torch.uint8).as_strided((swa.untyped_storage().nbytes(),), (1,), 0)
    # V4 blocks: data rows of 576 B, then scale rows; MXFP8: 528 B per token, values first
    row_bytes = {"fp8_ds_mla": 576, "fp8_e4m3": 512, "mxfp8": 528}[fmt]
    for slot, col, byte in ((3, 5, 0x7F), (7, 100, 0xFF), (18, 447, 0x7F), (30, 0, 0xFF)):
        flat[slot // 16 * swa.stride(0) + slot % 16 * row_bytes + col] = byte  # e4m3 bytes of attended rows
    rows = torch.arange(T * W, dtype=torch.int32).view(T, W) % 32
    lens = torch.tensor([W, 11, W], dtype=torch.int32)
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen)
    rows, lens, q, sink = (x.to(DEVICE) for x in (rows, lens, q, sink))
    ref, _ = reference.sparse_mla(q, swa, rows, lens, None, None, None, sink, 512**-0.5, fmt, kv_scale=scale,
                                  swa_dialect="fnuz")
    for config in _impl_configs(device):
        out = torch.full_like(q, float("nan"))
        sparse_mla_fwd(q, out, fmt, swa, rows, lens, sink=sink, kv_scale=scale or 1.0, swa_fnuz=True, config=config)
        assert not out.isnan().any(), f"FNUZ 0x7F/0xFF decoded as NaN ({config})"
        err = compare(out, ref)
        assert_close(err, max_abs=False, what=config)


@pytest.mark.parametrize("device", _devices())
def test_nvfp4_every_code_and_extreme_scales(device, gen):
    """Compressed NVFP4 rows holding every byte value (both nibbles: all 16 e2m1 codes, -0 and the
    subnormal 0.5 included) under the smallest e4m3 scale (0x01 = 2^-9, a subnormal), the largest
    (0x7E = 448) and random ones, beside an MXFP8 SWA cache: each token's output, compared on its
    own, like the reference's (token 0 reads only 2^-9-scaled rows, token 1 only 448-scaled ones)."""
    from dsv4_attn.portable.kernels.ops import sparse_mla_fwd

    T, H, W, K = 3, 16, 8, 24
    swa = _filled_cache("mxfp8", 2, 16, gen)
    comp = _filled_cache("nvfp4", 2, 16, gen)
    tokens = comp.view(-1, 288)  # the default stride: 16 tokens of 288 B fill 9 pages of 512 B exactly
    tokens[:16, :256] = torch.arange(256, dtype=torch.uint8).roll(7)[None, :] + torch.zeros(16, 1, dtype=torch.uint8)
    tokens[:4, 256:] = 0x01
    tokens[4:8, 256:] = 0x7E
    tokens[8:16, 256:] = torch.randint(0x01, 0x7F, (8, 32), generator=gen).to(torch.uint8)
    rows = torch.randint(0, 32, (T, W), generator=gen).int()
    lens = torch.tensor([0, 0, W], dtype=torch.int32)
    crows = torch.randperm(32, generator=gen)[:K].int().repeat(T, 1)
    crows[0, :4], crows[1, :4] = torch.arange(4), torch.arange(4, 8)
    clens = torch.tensor([4, 4, K], dtype=torch.int32)
    q = (torch.randn(T, H, 512, generator=gen) * 0.05).bfloat16()
    sink = torch.randn(H, generator=gen)
    rows, lens, crows, clens, q, sink = (x.to(DEVICE) for x in (rows, lens, crows, clens, q, sink))
    swa, comp = swa.to(DEVICE), comp.to(DEVICE)
    ref, _ = reference.sparse_mla(q, swa, rows, lens, comp, crows, clens, sink, 512**-0.5, "nvfp4_ds_mla")
    for config in _impl_configs(device):
        out = torch.full_like(q, float("nan"))
        sparse_mla_fwd(q, out, "nvfp4_ds_mla", swa, rows, lens, comp, crows, clens, sink=sink, config=config)
        assert not out.isnan().any()
        for t in range(T):
            err = compare(out[t], ref[t])
            assert_close(err, max_abs=False, what=(config, t))


def test_kernel_choice_is_visible_in_explain(monkeypatch):
    """Which Triton kernel and tile a layer gets, and why, from the arch alone: the Gluon kernel on
    sm_90 for V4 records in OCP e4m3, the records kernel (hopper_records) for V4.1 records in OCP
    e4m3; FNUZ caches on the portable kernel; AMD's
    own tiles (16 heads x 64 keys, 4 warps; 16 keys for NVFP4 caches); the choice shows in explain()."""
    from dsv4_attn.common.layout import Fp8Dialect, KVFormat
    from dsv4_attn.common.platform import Platform
    from dsv4_attn.portable.triton_backend import TritonBackend

    b = TritonBackend()
    ocp, fnuz = (Fp8Dialect.OCP,) * 2, (Fp8Dialect.FNUZ, Fp8Dialect.OCP)
    h100 = Platform("cuda", "sm90", "H100", torch.__version__)
    mi355 = Platform("rocm", "gfx950", "MI355X", torch.__version__)
    spec = dsv4.ModelSpec(num_heads=128)
    phase = Phase.DECODE
    v4 = b.choice(h100, spec, KVFormat.MODEL1_FP8, LayerKind.C4A, phase, ocp)
    assert v4.startswith("Gluon Hopper kernel: the 64-head kernel (hopper.py, 64 heads per program on wgmma M) (its "
                         "unsplit launches of 4096+ tokens: the key-tile ping-pong kernel, hopper_prefill.py); "
                         "64 keys per tile"), v4
    for fmt, want in ((KVFormat.MXFP8, "(mxfp8)"), (KVFormat.NVFP4, "(mxfp8/nvfp4)")):
        got = b.choice(h100, spec, fmt, LayerKind.C2A, phase, ocp)
        assert got.startswith("Gluon Hopper kernel: the V4.1 records' kernel (hopper_records.py") \
            and f"V4.1 records {want}" in got, got
    # an SWA-only layer of nvfp4_ds_mla reads the MXFP8 cache only
    assert "V4.1 records (mxfp8) in" in b.choice(h100, spec, KVFormat.NVFP4, LayerKind.SWA, phase, ocp)
    fnuz_mx = b.choice(h100, spec, KVFormat.MXFP8, LayerKind.C2A, phase, (Fp8Dialect.FNUZ,) * 2)
    assert fnuz_mx.startswith("portable kernel") and "not FNUZ" in fnuz_mx, fnuz_mx
    assert "not FNUZ" in b.choice(h100, spec, KVFormat.MODEL1_FP8, LayerKind.C4A, phase, fnuz)
    amd = b.choice(mi355, dsv4.ModelSpec(num_heads=32), KVFormat.MODEL1_FP8, LayerKind.C4A, phase, ocp)
    assert amd == "portable kernel, 16 heads x 64 keys per tile, 4 warps (the Gluon kernel is sm_90 only, " \
                  "this is gfx950)", amd
    # every record in AMD's one tile: a layer reading an NVFP4 cache too
    for kind in (LayerKind.C1A, LayerKind.SWA):
        amd = b.choice(mi355, dsv4.ModelSpec(num_heads=32), KVFormat.NVFP4, kind, phase, ocp)
        assert amd.startswith("portable kernel, 16 heads x 64 keys per tile, 4 warps"), amd
    mla = dsv4.SparseMLA(dsv4.ModelSpec(num_heads=16, layers=("swa", "c1a")), "nvfp4_ds_mla", backend="triton")
    assert "portable kernel, 16 heads x 64 keys per tile, 8 warps (Triton's CPU interpreter)" in mla.explain()
