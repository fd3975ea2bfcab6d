"""Bad input never crashes or silently corrupts (docs/bad-input.md).

* Every class of garbage index (tests/kit/garbage.py: -1 between valid entries, < -1, int32
  extremes, the capacity itself, past it) in every scope (SWA, C4A and C128A block tables, top-k
  rows, global slot rows) gives the answer of the step's CLEAN twin (garbage replaced by -1),
  computed by the float64 reference on rows built from the clean inputs; ``validate=True``
  raises a ValueError instead. Backends: torch, and triton (its portable kernel under
  TRITON_INTERPRET=1 on CPU; portable and Gluon compiled on a GPU, marked ``gpu``), decode and
  prefill tokens in one step; the index front ends (torch and Triton) alike.
* API defects a bad-input sweep found (narrow top-k rows, stale StepBatch values, refused plans,
  empty steps, device strings, ...): each test here failed on the code before its fix.
* NaN conventions: a NaN sink gives NaN on its head, a NaN in a selected key row gives NaN on the
  tokens that read it; nothing is silently zeroed.
* LSE precision: the kernels' LSE against a float32 reference on the same bf16 inputs at
  FlashMLA's own tolerance (abs 1e-6 or rel 8/65536 per element).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

import dsv4_attn as dsv4  # noqa: E402
from dsv4_attn.common import layout, reference  # noqa: E402
from dsv4_attn.common import registry as backend_mod  # noqa: E402
from dsv4_attn.common.backend import Phase  # noqa: E402
from dsv4_attn.common.spec import V4_KINDS, LayerKind  # noqa: E402
from dsv4_attn.testing.steps import filled_cache, make_step  # noqa: E402

from kit.compare import assert_close, compare  # noqa: E402
from kit.garbage import CLASSES, clean_rows, garbage_rows, garbage_step, garbage_value, raw_rows_case  # noqa: E402
from kit.reference import within_flashmla_lse_tolerance  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def _devices():
    """The CPU run (interpreter) on machines without a GPU; the compiled run on a GPU."""
    return [pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only "
                                                                        "machines (the GPU run compiles)")),
            pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]


def _impls():
    """The Triton kernels: portable everywhere, Gluon on sm_90 only."""
    return [pytest.param("portable"),
            pytest.param("gluon", marks=[pytest.mark.gpu, pytest.mark.skipif(not IS_SM90, reason="Gluon kernel: "
                                                                                              "sm_90 GPUs only")])]


@pytest.fixture(autouse=True, scope="module")
def _unregister_test_backends():
    """The backends registered here leave the registry with this module (the README support
    matrix is rendered from it)."""
    yield
    for name in backend_mod.backend_names():
        if name.startswith("triton-guards-"):
            backend_mod.unregister_backend(name)


def _triton_backend(impl: str) -> str:
    """A registered triton backend running ``impl`` (small tiles for the portable kernel: more tile
    boundaries on small shapes)."""
    from dsv4_attn.portable.kernels.ops import KernelConfig
    from dsv4_attn.portable.triton_backend import TritonBackend

    cfg = KernelConfig(impl="gluon") if impl == "gluon" else KernelConfig(impl="triton", block_n=16)
    name = f"triton-guards-{impl}"
    backend_mod.register_backend(name, TritonBackend(cfg))
    return name


def _check_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 output against the float64 reference (every element written, no NaN)."""
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements NaN or not written"
    err = compare(out, ref)
    if ref.abs().max() > 0:
        assert_close(err, max_abs=False)
    assert err["max_abs"] <= 1e-2 + 2**-7 * float(ref.abs().max()), err


def _clean_reference(step, kind):
    """float64 (out, lse) of the clean twin: its rows built by the torch front end from the clean
    tables and top-k, read with validate=True (the twin holds nothing out of range)."""
    clean = step.clean
    mla = dsv4.SparseMLA(clean.spec, "fp8_ds_mla", backend="torch", front_end="torch",
                         max_tokens=clean.batch.num_tokens, device=clean.q.device)
    plan = mla.plan(clean.batch)  # (validate would refuse its -1 block ids: they are what is tested)
    rows, lens = plan.comp_scope(kind, clean.topk_for(kind))

    def minus_one(r):  # a -1 block id is no row, whatever slot number a builder writes for it
        return None if r is None else torch.where(r >= 0, r, torch.full_like(r, -1))

    comp = clean.caches.get(kind)
    swa_rows, rows = minus_one(plan.swa_rows), minus_one(rows)
    return reference.sparse_mla(clean.q, clean.caches["swa"], swa_rows, plan.swa_lens, comp, rows, lens,
                                clean.sink, clean.spec.scale, "fp8_ds_mla"), (swa_rows, plan.swa_lens), rows, lens


def _dropped_keys(rows: torch.Tensor, lens: torch.Tensor) -> int:
    """-1 entries inside the lens (every key of an unpoisoned step is valid)."""
    col = torch.arange(rows.shape[1], device=rows.device)[None, :]
    return int(((col < lens[:, None]) & (rows < 0)).sum())


# ---- the float64 reference defines the masked answer --------------------------------------------


def test_reference_skips_every_out_of_range_entry_like_minus_one(gen):
    T, H = 6, 4
    swa = filled_cache("fp8_ds_mla", 5, 16, gen)
    comp = filled_cache("fp8_ds_mla", 3, 8, gen)
    rows = torch.randint(0, 80, (T, 24), generator=gen).int()
    crows = torch.randint(0, 24, (T, 16), generator=gen).int()
    lens = torch.tensor([24, 20, 1, 24, 9, 0], dtype=torch.int32)
    clens = torch.tensor([16, 3, 16, 0, 16, 16], dtype=torch.int32)
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen)
    bad, cbad = garbage_rows(gen, rows, lens, 80), garbage_rows(gen, crows, clens, 24)
    want = reference.sparse_mla(q, swa, clean_rows(bad, 80), lens, comp, clean_rows(cbad, 24), clens, sink, 0.05,
                                "fp8_ds_mla")
    got = reference.sparse_mla(q, swa, bad, lens, comp, cbad, clens, sink, 0.05, "fp8_ds_mla", validate=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert _dropped_keys(clean_rows(bad, 80), lens) >= len(CLASSES) - 1  # (t=2 has one key: maybe the -1 one)
    for cls in CLASSES[1:]:  # -1 is valid input; every other class is refused under validation
        one = rows.clone()
        one[0, 3] = garbage_value(cls, 80)
        with pytest.raises(ValueError, match=r"^swa_rows: got values in .*allowed: -1"):
            reference.sparse_mla(q, swa, one, lens, comp, crows, clens, sink, 0.05, "fp8_ds_mla")


# ---- every garbage class, every scope, every kind, decode + prefill: the masked answer -----------


def _run_garbage_step(device, backend: str, front_end: str, kinds=V4_KINDS):
    step = garbage_step(torch.Generator().manual_seed(19), kinds=kinds, device=device)
    case = step.case
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=backend, front_end=front_end,
                         max_tokens=case.batch.num_tokens, device=device)
    plan = mla.plan(case.batch)  # no validation: the garbage goes through
    assert plan.num_decode_tokens == 5 and plan.num_tokens - plan.num_decode_tokens == 16
    for kind in case.spec.kinds:
        (want, _), clean_swa, clean_c, clean_cl = _clean_reference(step, kind)
        dropped = _dropped_keys(*clean_swa)
        if kind.has_comp_scope:
            dropped_c = _dropped_keys(clean_c, clean_cl)
            assert dropped_c >= len(CLASSES), (kind, dropped_c)  # the poison hit keys some token reads
        assert dropped >= len(CLASSES), dropped
        args = (plan, kind, case.q, case.caches["swa"], case.caches.get(kind))
        out = torch.full_like(case.q, float("nan"))
        mla.forward(*args, topk=case.topk_for(kind), sink=case.sink, out=out)
        if HAS_CUDA:
            torch.cuda.synchronize()
        _check_close(out, want)
        # the reference reads the garbage plan's rows the same way
        rows, lens = plan.comp_scope(kind, case.topk_for(kind))
        got_ref, _ = reference.sparse_mla(case.q, case.caches["swa"], plan.swa_rows, plan.swa_lens,
                                          case.caches.get(kind), rows, lens, case.sink, case.spec.scale, "fp8_ds_mla",
                                          validate=False)
        assert torch.equal(got_ref, want), kind
        with pytest.raises(ValueError, match=r"(swa_block_table|comp_block_tables\[\d+\]|topk|_cache): "):
            mla.forward(*args, topk=case.topk_for(kind), sink=case.sink, validate=True)


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])])
def test_torch_backend_gives_the_masked_answer_for_every_garbage_class(device):
    """Before: an IndexError from inside torch on CPU (a device assert, i.e. a dead CUDA context,
    on a GPU) for block ids past the cache; int32-wrapped slots read other rows."""
    _run_garbage_step(device, "torch", "torch")


def test_torch_backend_masked_answer_for_v41_kinds():
    _run_garbage_step("cpu", "torch", "torch", kinds=(LayerKind.SWA, LayerKind.C1A, LayerKind.C2A))


@needs_triton
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("impl", _impls())
def test_triton_kernels_give_the_masked_answer_for_every_garbage_class(device, impl):
    """Through the Triton front end (its index kernels) and the Triton attention kernel. Before:
    out-of-bounds reads (an illegal memory access on the H100: the CUDA context is lost)."""
    _run_garbage_step(device, _triton_backend(impl), "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_flashmla_adapter_masks_garbage():
    """The flashmla backend's index preparation (decode rows, prefill workspace rows): FlashMLA's
    kernels read every entry that is not -1."""
    reasons = backend_mod.reasons_for("flashmla", dsv4.probe(), dsv4.ModelSpec(num_heads=16), dsv4.KVFormat.MODEL1_FP8,
                                      LayerKind.C4A, Phase.DECODE)
    if reasons:
        pytest.skip("; ".join(reasons))
    _run_garbage_step("cuda", "flashmla", "triton")


@needs_triton
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("impl", _impls())
def test_raw_kernel_rows_and_lens_out_of_range(device, impl):
    """The kernel entry with global slot rows (SWA rows, compressed rows) holding every garbage
    class and lens outside [0, row width], unsplit and split: the clean twin's answer and lse."""
    from dsv4_attn.portable.kernels.ops import KernelConfig, sparse_mla_fwd

    case = raw_rows_case(16, device)
    bad, cbad, lens, clens, q, sink = (x.to(device) for x in (case.rows, case.comp_rows, case.lens, case.comp_lens,
                                                              case.q, case.sink))
    for split in (1, 3):
        cfg = KernelConfig(impl="gluon", split=split) if impl == "gluon" else \
            KernelConfig(impl="triton", block_n=16, split=split)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), device=device)
        sparse_mla_fwd(q, out, "fp8_ds_mla", case.swa, bad, lens, case.comp, cbad, clens, sink=sink, lse=lse,
                       config=cfg)
        if HAS_CUDA:
            torch.cuda.synchronize()
        _check_close(out.cpu(), case.want)
        want_lse = case.want_lse
        fin = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse).cpu(), fin)
        assert (lse.cpu().double()[fin] - want_lse[fin]).abs().max() < 1e-3


# ---- index front ends ---------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("device", _devices())
def test_front_ends_agree_on_garbage_and_never_read_past_a_table(device):
    """Both front ends build the same rows from a poisoned step; a position whose block-table
    column does not exist (a table shorter than the sequence) is -1 (before: the last column was
    read instead, i.e. another block's rows), and so are negative and int32-wrapping block ids."""
    step = garbage_step(torch.Generator().manual_seed(21), device=device)
    case = step.case
    short = case.batch.swa_block_table[:, :3].contiguous()  # request 1 (700 tokens) needs 11 columns
    batch = dsv4.StepBatch(case.batch.query_start_loc, case.batch.seq_lens, case.batch.num_decode_tokens, short,
                           case.batch.swa_block_size, case.batch.comp_block_tables, case.batch.block_size,
                           case.batch.max_model_len, case.batch.num_tokens)
    got = {}
    for front_end in ("torch", "triton"):
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch", front_end=front_end, device=device,
                             max_tokens=batch.num_tokens)
        plan = mla.plan(batch)
        c4a = plan.comp_scope(LayerKind.C4A, case.topk_for(LayerKind.C4A))
        got[front_end] = [plan.positions, plan.swa_rows, plan.swa_lens, *plan.comp_scope(LayerKind.C128A), *c4a]
    for a, b in zip(got["torch"], got["triton"]):
        assert torch.equal(a, b)
    pos, swa_rows = got["torch"][0].cpu(), got["torch"][1].cpu()
    bs = batch.swa_block_size
    t = int(case.batch.query_start_loc[2]) - 1  # request 1's token, at position 699
    start = max(0, int(pos[t]) - 127)
    logical = torch.arange(start, int(pos[t]) + 1)
    assert (swa_rows[t, : logical.numel()][logical // bs >= 3] == -1).all()
    assert (swa_rows[t, : logical.numel()][logical // bs < 3] >= 0).any() or start // bs >= 3
    for row in (got["torch"][3].cpu(), got["torch"][5].cpu(), swa_rows):  # nothing wrapped to a valid slot
        assert ((row == -1) | (row >= 0)).all()


# ---- API defects found by a bad-input sweep --------------------------------------------------------


def _v4_case(seed=9, query_lens=(1, 1), seq_lens=(50, 60), **kw):
    return make_step(torch.Generator().manual_seed(seed), list(query_lens), list(seq_lens), **kw).v4_inputs()


def test_topk_width_must_be_the_models():
    """Before: a top-k of width 10 with topk=64 declared was accepted (10 entries attended); width
    0 dropped the scope."""
    spec, batch, caches, topk, q, sink = _v4_case()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(batch)
    for width in (10, 0, 65):
        narrow = torch.zeros(topk.shape[0], width, dtype=torch.int32)
        with pytest.raises(ValueError, match=rf"^topk: got torch.int32 \(2, {width}\); allowed: .*, 64\]"):
            mla.forward(plan, LayerKind.C4A, q, caches["swa"], caches[LayerKind.C4A], topk=narrow, sink=sink)
        with pytest.raises(ValueError, match=r"^topk: got .*allowed: .*64 = the model's top-k width"):
            plan.comp_scope(LayerKind.C4A, narrow)


def test_validate_refuses_negative_past_and_wrapping_block_ids():
    """forward(validate=True): before, only rows.max() was checked, so a block id of -2 was
    accepted (its keys dropped silently) and 2**26 (slot 2**32 + offset wraps to a small int32
    slot) passed as a valid row."""
    spec, batch, caches, topk, q, sink = _v4_case()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    nb = caches["swa"].shape[0]
    for value, match in ((-2, r"^swa_block_table: got block id -2 at request 0, column 0 .*allowed: block ids >= 0"),
                         (nb, (rf"^swa_cache: too small for this step: swa_block_table holds block id {nb} .*"
                              rf"allowed: block ids < {nb}")),
                         (2**26, rf"^swa_cache: too small for this step: .*block id {2**26}")):
        bad = batch.swa_block_table.clone()
        bad[0, 0] = value
        b = dsv4.StepBatch(batch.query_start_loc, batch.seq_lens, batch.num_decode_tokens, bad, batch.swa_block_size,
                           batch.comp_block_tables, batch.block_size, batch.max_model_len)
        plan = mla.plan(b)
        with pytest.raises(ValueError, match=match):
            mla.forward(plan, LayerKind.SWA, q, caches["swa"], validate=True)
        out = mla.forward(plan, LayerKind.SWA, q, caches["swa"], sink=sink)  # without validation: no crash
        assert torch.isfinite(out).all()
    bad = topk.clone()
    bad[1, 1] = (int(batch.positions[1]) + 1) // 4  # == the visible count
    with pytest.raises(ValueError, match=r"^topk: got 15 at token 1, lane 1 .*allowed: -1 or a visible"):
        mla.forward(mla.plan(batch), LayerKind.C4A, q, caches["swa"], caches[LayerKind.C4A], topk=bad,
                    validate=True)


def test_slots_are_64_bit_until_they_are_checked():
    """A block id whose slot passes 2**31 gives -1 (before: the int32 cast wrapped it into an
    ordinary slot of another block)."""
    from dsv4_attn.common import indices

    table = torch.tensor([[0, 2**26]], dtype=torch.int32)  # 2**26 * 64 = 2**32: wraps to 0..63
    batch = dsv4.StepBatch.from_lists([1], [100], table, 64)
    rows, lens = indices.swa_rows(batch)
    assert int(lens[0]) == 100 and (rows[0, :64] >= 0).all() and (rows[0, 64:100] == -1).all()


def test_step_batch_tensors_updated_in_place_plan_fresh_positions():
    """Engines rewrite their persistent tensors in place. Before: StepBatch cached positions at
    first use, so the next plan() used the previous step's positions."""
    spec, batch, *_ = _v4_case(query_lens=(1, 1), seq_lens=(50, 60))
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    first = mla.plan(batch)
    assert first.positions.tolist() == [49, 59]
    batch.seq_lens.copy_(torch.tensor([90, 61], dtype=torch.int32))
    assert mla.plan(batch).positions.tolist() == [89, 60]
    assert batch.positions.tolist() == [89, 60]


def test_num_tokens_is_re_read_when_it_was_not_given():
    spec, batch, *_ = _v4_case(query_lens=(1, 2), seq_lens=(50, 60))
    assert batch.num_tokens == 3
    batch.query_start_loc.copy_(torch.tensor([0, 1, 2], dtype=torch.int32))
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    assert mla.plan(batch).num_tokens == 2


def test_a_refused_plan_leaves_the_previous_plan_valid():
    """Before: the step counter moved before the checks, so a refused plan() (here: past
    max_tokens) made the previous, untouched plan fail with 'its buffers were overwritten'."""
    spec, batch, caches, _, q, sink = _v4_case()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", max_tokens=4)
    plan = mla.plan(batch)
    too_big = _v4_case(seed=3, query_lens=(5,), seq_lens=(40,))[1]
    with pytest.raises(ValueError, match="max_tokens"):
        mla.plan(too_big)
    out = mla.forward(plan, LayerKind.SWA, q, caches["swa"], sink=sink)
    assert torch.isfinite(out).all()


def test_zero_requests_and_padding_tokens_give_zero_rows():
    """A CUDA-graph padding shape: 0 requests, 4 padding tokens, block tables with 0 rows. Before:
    an IndexError inside the index builder."""
    spec = dsv4.ModelSpec(num_heads=8, topk=16, max_model_len=4096)
    empty = torch.zeros(0, 4, dtype=torch.int32)
    batch = dsv4.StepBatch(torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0, empty, 64,
                           {4: empty, 128: empty}, 256, 4096, num_tokens=4)
    mla = dsv4.SparseMLA(spec, "bf16", backend="torch")
    plan = mla.plan(batch, validate=True)
    assert (plan.swa_rows == -1).all() and (plan.swa_lens == 0).all()
    cache = layout.new_cache("bf16", 2, 64)
    comp = layout.new_cache("bf16", 2, 64)
    topk = torch.randint(-3, 9, (4, 16), dtype=torch.int32)
    rows, lens = plan.comp_scope(LayerKind.C4A, topk)
    assert (rows == -1).all() and (lens == 0).all()
    q = torch.randn(4, 8, 512).bfloat16()
    out = mla.forward(plan, LayerKind.C4A, q, cache, comp, topk=topk)
    assert torch.equal(out, torch.zeros_like(out))


def test_num_decode_tokens_past_the_batch_is_refused_without_num_tokens():
    """Before: accepted when num_tokens was omitted (checked only against an explicit one)."""
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^num_decode_tokens: got 5; allowed: <= num_tokens \(4"):
        dsv4.StepBatch(qsl, torch.tensor([10, 3], dtype=torch.int32), 5, torch.zeros(2, 2, dtype=torch.int32), 64)


def test_device_strings_are_checked_at_construction():
    """Before: 'nonsense' raised torch's RuntimeError; 'cuda' without CUDA was accepted until the
    first plan failed."""
    spec = dsv4.ModelSpec(num_heads=8)
    with pytest.raises(ValueError, match=r"^device: got 'nonsense'; allowed"):
        dsv4.SparseMLA(spec, "bf16", backend="torch", device="nonsense")
    missing = "cuda:99" if HAS_CUDA else "cuda"
    with pytest.raises(ValueError, match=rf"^device: got '{missing}'(, but torch sees no GPU .*)?; allowed"):
        dsv4.SparseMLA(spec, "bf16", backend="torch", device=missing)
    assert dsv4.SparseMLA(spec, "bf16", backend="torch", device="cpu")._device == torch.device("cpu")


# ---- NaN is never hidden ------------------------------------------------------------------------


def _nan_backends(device):
    names = ["torch"]
    if HAS_TRITON and (device == "cuda" or not HAS_CUDA):
        names.append(_triton_backend("portable"))
        if device == "cuda" and IS_SM90:
            names.append(_triton_backend("gluon"))
    return names


@pytest.mark.parametrize("device", _devices())
def test_nan_sink_gives_nan_on_its_head_not_zeros(device):
    """Before: the torch backend (and apply_sink) turned a NaN sink into an all-zero head."""
    spec, batch, caches, topk, q, sink = _v4_case(query_lens=(1, 3), seq_lens=(300, 90), pad_tokens=2,
                                                  device=device)
    sink[3] = float("nan")
    plan = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", front_end="torch").plan(batch)
    rows, lens = plan.comp_scope(LayerKind.C4A, topk)
    ref, _ = reference.sparse_mla(q, caches["swa"], plan.swa_rows, plan.swa_lens, caches[LayerKind.C4A], rows, lens,
                                  sink, spec.scale, "fp8_ds_mla")
    keys = torch.arange(6, device=device) < 4  # tokens 4, 5 are padding: no keys, output 0
    assert ref[keys][:, 3].isnan().all() and (ref[~keys] == 0).all()
    for name in _nan_backends(device):
        mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend=name)
        plan = mla.plan(batch)
        out = mla.forward(plan, LayerKind.C4A, q, caches["swa"], caches[LayerKind.C4A], topk=topk, sink=sink)
        assert out[keys][:, 3].isnan().all(), name
        assert (out[~keys] == 0).all(), name
        others = torch.arange(q.shape[1], device=device) != 3
        _check_close(out[:, others].cpu(), ref[:, others].cpu())
        with pytest.raises(ValueError, match=r"^sink: got NaN at head 3; allowed"):
            mla.forward(plan, LayerKind.C4A, q, caches["swa"], caches[LayerKind.C4A], topk=topk, sink=sink,
                        validate=True)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("where", ["rope", "nope"])
def test_nan_in_one_selected_row_makes_its_readers_nan(device, where):
    """The convention (docs/bad-input.md): a NaN in a selected key row makes the output of every
    token that reads it NaN on every head (FlashMLA's kernel propagates it the same way); tokens
    that do not read it are unaffected. Before: the torch backend and the reference returned all
    zeros for those tokens (silently)."""
    spec, batch, caches, _, q, sink = _v4_case(query_lens=(1, 4), seq_lens=(300, 90), device=device)
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", front_end="torch")
    plan = mla.plan(batch)
    slot = int(plan.swa_rows[2, int(plan.swa_lens[2]) - 1])  # request 1's token at position 87
    swa = caches["swa"].clone()  # contiguous [nb, bs, 584]: the same split layout, stride(0) = bs * 584
    bs = swa.shape[1]
    row = (slot // bs) * swa.stride(0) + (slot % bs) * 576
    if where == "rope":  # a bf16 NaN (0x7FC0, little-endian) as RoPE dim 448
        swa.view(-1)[row + 448: row + 450] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8, device=device)
    else:  # an e4m3 NaN byte as NoPE dim 5
        swa.view(-1)[row + 5] = 0x7F
    col = torch.arange(plan.swa_rows.shape[1], device=device)[None, :]
    readers = ((plan.swa_rows == slot) & (col < plan.swa_lens[:, None])).any(1)
    assert readers.tolist() == [False, False, True, True, True]
    ref, lse = reference.sparse_mla(q, swa, plan.swa_rows, plan.swa_lens, None, None, None, sink, spec.scale,
                                    "fp8_ds_mla")
    assert ref[readers].isnan().all() and lse[readers].isnan().all() and torch.isfinite(ref[~readers]).all()
    for name in _nan_backends(device):
        if where == "nope" and name != "torch" and device == "cpu":
            continue  # Triton's interpreter decodes the e4m3 byte 0x7F as 480, not NaN (GPUs: NaN)
        m = dsv4.SparseMLA(spec, "fp8_ds_mla", backend=name)
        out = m.forward(m.plan(batch), LayerKind.SWA, q, swa, sink=sink)
        assert out[readers].isnan().all(), name
        _check_close(out[~readers].cpu(), ref[~readers].cpu())


# ---- LSE at FlashMLA's tolerance ----------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("impl", _impls())
def test_kernel_lse_meets_flashmla_tolerance(device, impl):
    """The kernels' natural-log LSE (sink excluded) against a float32 reference on the same bf16
    q and cache, FlashMLA-like inputs (q in [-1, 1], keys ~ N(0, 0.01) clipped, so small scores
    and small LSEs, where the absolute bound 1e-6 rules), one key up to a full row, both scopes,
    unsplit and split."""
    from dsv4_attn.portable.kernels.ops import KernelConfig, sparse_mla_fwd

    gen = torch.Generator().manual_seed(5)
    T, H, W, K, bs = 8, 64, 128, 256, 64
    swa = layout.new_cache("fp8_ds_mla", 8, bs)
    comp = layout.new_cache("fp8_ds_mla", 8, bs)
    for cache in (swa, comp):
        kv = (torch.randn(8 * bs, 512, generator=gen) / 10).clamp(-1, 1).bfloat16()
        layout.insert(cache, "fp8_ds_mla", torch.arange(8 * bs, dtype=torch.int32), kv)
    rows = torch.stack([torch.randperm(8 * bs, generator=gen)[:W] for _ in range(T)]).int()
    crows = torch.stack([torch.randperm(8 * bs, generator=gen)[:K] for _ in range(T)]).int()
    lens = torch.tensor([1, 2, 7, 64, 100, 128, 128, 0], dtype=torch.int32)
    clens = torch.tensor([0, 1, 33, 256, 0, 200, 256, 0], dtype=torch.int32)
    q = torch.randn(T, H, 512, generator=gen).clamp(-1, 1).bfloat16()
    scale = 576**-0.5
    _, want = reference.sparse_mla(q, swa, rows, lens, comp, crows, clens, None, scale, "fp8_ds_mla",
                                   dtype=torch.float32)
    args = [x.to(device) for x in (q, swa, rows, lens, comp, crows, clens)]
    q, swa, rows, lens, comp, crows, clens = args
    worst = 0.0
    for split in (1, 4):
        cfg = KernelConfig(impl="gluon", split=split) if impl == "gluon" else KernelConfig(impl="triton", split=split)
        out = torch.empty_like(q)
        lse = torch.full((T, H), float("nan"), device=device)
        sparse_mla_fwd(q, out, "fp8_ds_mla", swa, rows, lens, comp, crows, clens, scale=scale, lse=lse, config=cfg)
        ok = within_flashmla_lse_tolerance(lse, want)
        fin = torch.isfinite(want)
        worst = max(worst, float((lse.cpu().double() - want.double())[fin].abs().max()))
        assert ok.all(), (split, int((~ok).sum()), worst)
    print(f"{impl} on {device}: worst LSE error {worst:.2e}")
