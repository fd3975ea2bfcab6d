"""The failure classes users of vLLM, SGLang, FlashInfer and AITER reported in 2026
(collected in issue 26), pinned on every backend that runs here: torch, triton
(CPU interpreter), aiter (through the AITER emulator, labelled emulated) on the CPU; triton and
flashmla on a CUDA GPU (marked ``gpu``; flashmla needs the library: ``DSV4_ATTN_FLASHMLA_LIB``).

* padded CUDA-graph requests and tokens carrying garbage or stale metadata are empty;
* a step of padding only (zero-length metadata, as at capture time) runs, and the next real step
  on the same SparseMLA is unaffected;
* a plan captured at a short context and replayed (re-planned in the same tensors) at a long one
  gives the long step's answer, for every layer kind (each per-step branch);
* NaN bytes in cache rows no token selects never leak through P.V;
* a prefix-cache hit whose block table still names stale blocks below the window reads none;
* the split count (Triton 1 / 8 / 16 / 32; AITER's split mode 2 / 8 / 16 / 32 through the
  emulator): no NaN, deterministic bytes, the reference's answer.

Every expected answer comes from a clean twin of the step (same bytes where it matters) run the
same way, or from the float64 reference; never from the garbage itself.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn import envs
from dsv4_attn.common import layout, reference
from dsv4_attn.common.registry import unregister_backend
from dsv4_attn.common.spec import V4_KINDS, LayerKind
from dsv4_attn.testing.steps import make_step

from kit.compare import assert_close, compare

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a GPU")]
_NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="Triton missing")
BACKENDS = [pytest.param("torch", "cpu", id="torch"),
            pytest.param("triton", "cpu", marks=_NEEDS_TRITON, id="triton"),
            pytest.param("aiter", "cpu", marks=pytest.mark.skipif(CUDA, reason="the emulator's run is the CPU one"),
                         id="aiter"),
            pytest.param("triton", "cuda", marks=[*_ON_GPU, _NEEDS_TRITON], id="triton-cuda"),
            pytest.param("flashmla", "cuda", marks=_ON_GPU, id="flashmla-cuda")]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a GPU")])]
SEQ_LENS = [300, 41, 170]  # decode tokens: one with every scope, one short, one in between
SHAPE = dict(kinds=V4_KINDS, topk=32, max_model_len=1024, swa_bs=32, block_size=256)


@pytest.fixture
def backend_on(request):
    """Make ``backend`` runnable here: the AITER emulator on for aiter (off afterwards); for
    flashmla on a GPU, the real library (a skip naming why it did not load, a failure where
    ``DSV4_ATTN_FLASHMLA_LIB`` names one that does not load)."""
    from dsv4_attn import emulation

    def on(name):
        if name == "aiter":
            emulation.enable()
        elif name == "flashmla":
            from dsv4_attn.cuda import flashmla

            lib = flashmla.load_flashmla()
            if lib.ops is None:
                (pytest.fail if envs.FLASHMLA_LIB.raw else pytest.skip)(lib.describe())

    yield on
    emulation.disable()


def _batch_like(b, seq_lens, tables=None, num_tokens=None, query_lens=None):
    query_lens = query_lens or [1] * len(seq_lens)
    tables = tables or {"swa": b.swa_block_table, **b.comp_block_tables}
    real = sum(query_lens)
    return dsv4.StepBatch.from_lists(query_lens, seq_lens, tables["swa"], b.swa_block_size,
                                     {r: t for r, t in tables.items() if r != "swa"}, b.block_size, b.max_model_len,
                                     num_decode_tokens=num_tokens or real, num_tokens=num_tokens)


def _forward(mla, plan, case, kind, q=None, topk=None, caches=None):
    q = case.q if q is None else q
    caches = caches or case.caches
    out = torch.full_like(q, float("nan"))
    topk = topk if topk is not None else case.topks.get(kind)
    mla.forward(plan, kind, q, caches["swa"], caches.get(kind), topk=topk[: q.shape[0]] if topk is not None else None,
                sink=case.sink, out=out)
    return out


def _mla(case, backend, **kwargs):
    return dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=backend, device=case.q.device, **kwargs)


# ---- padded CUDA-graph requests / tokens ----------------------------------------------------------
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_padded_graph_requests_and_tokens_with_stale_metadata_are_empty(gen, backend, device, backend_on):
    """vLLM pads a graph batch with requests of no query token (stale seq_lens, stale or garbage
    block-table rows) and tokens past the last request (stale top-k rows): the real tokens' answer
    is the unpadded step's, the padding tokens' output is 0."""
    backend_on(backend)
    case = make_step(gen, [1] * 3, SEQ_LENS, **SHAPE, device=device)
    b = case.batch
    stale = {k: torch.cat([t, torch.full((2, t.shape[1]), 10**6, dtype=torch.int32, device=device)]) for k, t in
             {"swa": b.swa_block_table, **b.comp_block_tables}.items()}
    for t in stale.values():
        t[3, ::2] = t[0, ::2]  # a stale row: another request's blocks
        t[4, 0] = -7
    padded = _batch_like(b, SEQ_LENS + [999, 5], stale, num_tokens=5, query_lens=[1, 1, 1, 0, 0])
    topk = torch.cat([case.topks[LayerKind.C4A], torch.randint(-10**6, 10**6, (2, 32), generator=gen).int().to(device)])
    q = torch.cat([case.q, torch.randn(2, *case.q.shape[1:], generator=gen).bfloat16().to(device)])
    for kind in (LayerKind.C4A, LayerKind.C128A):  # both read the SWA rows too
        mla = _mla(case, backend)
        got = _forward(mla, mla.plan(padded), case, kind, q=q, topk=topk if kind.uses_topk else None)
        clean = _mla(case, backend)
        want = _forward(clean, clean.plan(b), case, kind)
        assert_close(compare(got[:3], want), what=f"{backend} {kind.name} real tokens")
        assert got[3:].abs().max() == 0, f"{backend} {kind.name}: padding tokens attend nothing"


# ---- zero-length metadata at capture -------------------------------------------------------------
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_a_step_of_padding_only_runs_and_leaves_the_next_step_alone(gen, backend, device, backend_on):
    backend_on(backend)
    case = make_step(gen, [1] * 3, SEQ_LENS, **SHAPE, device=device)
    b = case.batch
    empty = dsv4.StepBatch.from_lists([], [], b.swa_block_table, b.swa_block_size, b.comp_block_tables,
                                      b.block_size, b.max_model_len, num_decode_tokens=3, num_tokens=3)
    for kind in case.spec.kinds:
        mla = _mla(case, backend)
        out = _forward(mla, mla.plan(empty), case, kind)
        assert out.abs().max() == 0, f"{backend} {kind.name}: a padding-only step outputs 0"
        got = _forward(mla, mla.plan(b), case, kind)  # the same object, after the empty plan
        fresh = _mla(case, backend)
        assert torch.equal(got, _forward(fresh, fresh.plan(b), case, kind)), f"{backend} {kind.name}"


# ---- capture short, replay long -------------------------------------------------------------------
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_plan_captured_short_and_replayed_long_gives_the_long_answer(gen, backend, device, backend_on):
    """The engine's graph pattern without the graph: plan + forward at a short context (no
    compressed entry yet, windows not full), then the same tensors rewritten in place for a long
    step and planned again: every layer kind equals a fresh SparseMLA's long step, byte for byte."""
    backend_on(backend)
    case = make_step(gen, [1] * 3, SEQ_LENS, **SHAPE, device=device)
    b = case.batch
    topk_buf = case.topks[LayerKind.C4A].clone()
    long_lens = b.seq_lens.clone()
    for kind in case.spec.kinds:
        live = _batch_like(b, [2, 3, 1])  # short: the tensors the "graph" keeps
        mla = _mla(case, backend)
        topk_buf.fill_(-1)
        _forward(mla, mla.plan(live), case, kind, topk=topk_buf if kind.uses_topk else None)
        live.seq_lens.copy_(long_lens)  # replay: new contents, same tensors
        topk_buf.copy_(case.topks[LayerKind.C4A])
        got = _forward(mla, mla.plan(live), case, kind, topk=topk_buf if kind.uses_topk else None)
        fresh = _mla(case, backend)
        assert torch.equal(got, _forward(fresh, fresh.plan(b), case, kind)), f"{backend} {kind.name}"


# ---- NaN in rows nobody selects -------------------------------------------------------------------
def _selected_slots(plan, kind, topk, num_slots):
    """bool [num_slots] per scope: the slots some token reads."""
    used = {}
    rows, lens = plan.comp_scope(kind, topk) if kind.has_comp_scope else (None, None)
    for name, r, n in (("swa", plan.swa_rows, plan.swa_lens), (kind, rows, lens)):
        if r is None:
            continue
        mask = torch.zeros(num_slots[name], dtype=torch.bool, device=r.device)
        live = (torch.arange(r.shape[1], device=r.device)[None, :] < n[:, None]) & (r >= 0) & (r < num_slots[name])
        mask[r[live].long()] = True
        used[name] = mask
    return used


def _nan_cache(cache, used: torch.Tensor, record):
    """A cache whose every byte is 0xFF (NaN in e4m3 values and ue8m0 scales, NaN in bf16) except
    the records of the ``used`` slots, which hold the same rows as ``cache``."""
    geo = layout.check_cache(cache, record, "cache")
    out = torch.full_like(cache, 0xFF) if cache.dtype == torch.uint8 else \
        torch.full_like(cache.view(torch.uint8), 0xFF).view(cache.dtype)
    slots = used.nonzero().flatten().int()
    kv = layout.gather_rows(cache, record, geo, slots.long()[None, :], 1.0, layout.Fp8Dialect.OCP)[0]
    layout.insert(out, record, slots, kv.bfloat16())
    return out


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_nan_bytes_in_unselected_cache_rows_do_not_leak(gen, backend, device, backend_on):
    backend_on(backend)
    case = make_step(gen, [1] * 3, SEQ_LENS, **SHAPE, device=device)
    fmt = layout.KVFormat.parse("fp8_ds_mla")
    for kind in (LayerKind.C4A, LayerKind.C128A):  # each reads the SWA cache and a compressed one
        plan = _mla(case, "torch").plan(case.batch)
        caches = {"swa": case.caches["swa"], kind: case.caches.get(kind)}
        num_slots = {k: layout.check_cache(c, fmt.swa_record if k == "swa" else fmt.comp_record, "c").num_slots
                     for k, c in caches.items() if c is not None}
        used = _selected_slots(plan, kind, case.topks.get(kind), num_slots)
        # both caches hold the selected rows re-encoded the same way; only the unselected ones differ
        twins = {k: _nan_cache(caches[k], used[k], fmt.swa_record if k == "swa" else fmt.comp_record) for k in used}
        clean = {k: t.clone() for k, t in twins.items()}
        for k, t in clean.items():  # unselected rows: finite random rows instead of NaN
            record = fmt.swa_record if k == "swa" else fmt.comp_record
            others = (~used[k]).nonzero().flatten().int()
            layout.insert(t, record, others, (torch.randn(len(others), 512, generator=gen) * 2).bfloat16().to(device))
        mla = _mla(case, backend)
        p = mla.plan(case.batch)
        got = _forward(mla, p, case, kind, caches=twins)
        want = _forward(mla, p, case, kind, caches=clean)
        assert not got.isnan().any(), f"{backend} {kind.name}: NaN from a row no token selects"
        assert torch.equal(got, want), f"{backend} {kind.name}"


# ---- prefix-cache hit, stale blocks below the window -----------------------------------------------
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_prefix_hit_with_stale_blocks_below_the_window_reads_none(gen, backend, device, backend_on):
    """After a prefix-cache hit the SWA block table's columns below every token's window may name
    freed blocks, since reused by another request (vLLM frees SWA blocks outside the window): the
    answer is the one with those columns -1 and with their true blocks alike."""
    backend_on(backend)
    case = make_step(gen, [1] * 3, SEQ_LENS, **SHAPE, device=device)
    b = case.batch
    bs = b.swa_block_size
    stale = b.swa_block_table.clone()
    dropped = stale.clone()
    for r, n in enumerate(SEQ_LENS):
        below = max(0, n - case.spec.window) // bs  # columns entirely below the token's window
        stale[r, :below] = stale[(r + 1) % 3, :below]  # another request's blocks
        dropped[r, :below] = -1
    outs = []
    for table in (stale, dropped, b.swa_block_table):  # the window is every kind's: the SWA layer reads it
        mla = _mla(case, backend)
        outs.append(_forward(mla, mla.plan(_batch_like(b, SEQ_LENS, {"swa": table, **b.comp_block_tables})), case,
                             LayerKind.SWA))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2]), backend


# ---- split counts -------------------------------------------------------------------------------
@pytest.mark.skipif(not HAS_TRITON, reason="Triton missing")
@pytest.mark.parametrize("device", DEVICES)
def test_split_counts_give_no_nan_and_deterministic_bytes(gen, device):
    """C128A rows 512 wide (32 tiles of 16 keys) with few used entries: at 8, 16 and 32 splits most
    splits of a token are empty (AITER returned all-NaN in half its calls at 16 splits). Each
    split count: no NaN, the same bytes on a second call, the float64 reference's answer."""
    from dsv4_attn.portable.kernels.ops import KernelConfig
    from dsv4_attn.portable.triton_backend import TritonBackend

    case = make_step(gen, [1], [5000], kinds=(LayerKind.SWA, LayerKind.C128A), topk=32,
                     max_model_len=512 * 128, swa_bs=32, block_size=256, device=device)
    kind = LayerKind.C128A
    outs = {}
    for split in (1, 8, 16, 32):
        dsv4.register_backend(f"triton-split{split}", TritonBackend(KernelConfig(block_n=16, split=split)))
        try:
            mla = _mla(case, f"triton-split{split}")
            plan = mla.plan(case.batch)
            first, second = (_forward(mla, plan, case, kind) for _ in range(2))
        finally:
            unregister_backend(f"triton-split{split}")
        assert not first.isnan().any(), f"split {split}: NaN"
        assert torch.equal(first, second), f"split {split}: not deterministic"
        outs[split] = first
    rows, lens = plan.comp_scope(kind)
    ref, _ = reference.sparse_mla(case.q, case.caches["swa"], plan.swa_rows, plan.swa_lens, case.caches[kind], rows,
                                  lens, case.sink, case.spec.scale, "fp8_ds_mla")
    for split, out in outs.items():
        assert_close(compare(out, ref), what=f"split {split}")


@pytest.mark.skipif(CUDA, reason="the emulator's run is the CPU one")
def test_aiter_split_counts_give_no_nan_and_deterministic_bytes(gen):
    """EMULATED: AITER's split mode (mla_decode_fwd + stage-2 merge, AITER 0.1.20 on gfx950 as the
    emulator models it) at 2, 8, 16 and 32 splits per row, 128 heads (16 keys per split unit):
    the C128A row has 40 entries, so stage 1 writes 3 partials and most of the 16 or 32 splits
    are empty (both stage-1 partitions: tests/test_aiter_contract.py N4). Each split count: no
    NaN, the same bytes on a second call, the reference's answer."""
    from dsv4_attn import emulation
    from dsv4_attn.rocm.aiter import AiterBackend

    em = emulation.enable("gfx950", "0.1.20")
    case = make_step(gen, [1], [5000], kinds=(LayerKind.SWA, LayerKind.C128A), heads=128, topk=32,
                     max_model_len=512 * 128, swa_bs=32, block_size=256)
    kind = LayerKind.C128A
    for splits in (2, 8, 16, 32):
        name = f"aiter-split{splits}"
        dsv4.register_backend(name, AiterBackend(name=name, max_splits=splits, max_decode_tokens=1))
        try:
            mla = _mla(case, name)
            plan = mla.plan(case.batch)
            em.calls.clear()
            first, second = (_forward(mla, plan, case, kind) for _ in range(2))
        finally:
            unregister_backend(name)
        assert ("mla_decode_fwd", f"split{splits} ") in {(f, d[: len(f"split{splits} ")]) for f, d in em.calls}, \
            (splits, em.calls)
        assert not first.isnan().any(), f"{splits} splits: NaN"
        assert torch.equal(first, second), f"{splits} splits: not deterministic"
        rows, lens = plan.comp_scope(kind)
        ref, _ = reference.sparse_mla(case.q, case.caches["swa"], plan.swa_rows, plan.swa_lens, case.caches[kind],
                                      rows, lens, case.sink, case.spec.scale, "fp8_ds_mla")
        assert_close(compare(first, ref), what=f"{splits} splits")
