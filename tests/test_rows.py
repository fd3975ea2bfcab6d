"""The rows-level entry (StepRows): a plan from ready-made per-token rows, as SGLang and FlashMLA's
own interface hand them over, on the torch and Triton (interpreter) backends against the float64
reference, for V4 (SWA, C4A, C128A) and V4.1 (C1A, C2A) layers.

The expected rows are written out token by token from the step's definitions (tables, positions,
the indexer's local top-k) by this file, never by dsv4_attn's index builders; they are then handed
over the way engines do: rows in a wider buffer with more rows than tokens, entries in any order,
-1 holes inside the lengths and lengths clamped to at least one (SGLang's FlashMLA metadata).
Every output is NaN-poisoned first and checked to be fully written.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.common import reference
from dsv4_attn.common.spec import V4_KINDS, LayerKind
from dsv4_attn.testing.steps import make_step

from kit.compare import assert_close, compare

HAS_TRITON = importlib.util.find_spec("triton") is not None
V41_KINDS = (LayerKind.SWA, LayerKind.C1A, LayerKind.C2A)
# decode; decode at position 2 (no compressed entry yet); an MTP pair; a prefill chunk crossing the
# window; a fresh prefill
QUERY_LENS, SEQ_LENS = [1, 1, 2, 9, 5], [300, 3, 131, 700, 5]
PAD = 2  # CUDA-graph padding tokens after the real ones
NUM_DECODE_TOKENS = 4


def _tokens():
    """(request, position) of every real token, from the lists (not from dsv4_attn)."""
    return [(r, s - q + i) for r, (q, s) in enumerate(zip(QUERY_LENS, SEQ_LENS)) for i in range(q)]


def _slot(table, req, entry, bs):
    return int(table[req, entry // bs]) * bs + entry % bs


def expected_keys(case, kind):
    """Per real token: (SWA slots, compressed slots or None) from the definitions."""
    batch = case.batch
    keys = []
    for t, (r, p) in enumerate(_tokens()):
        swa = [_slot(batch.swa_block_table, r, k, batch.swa_block_size) for k in range(max(0, p - 127), p + 1)]
        comp = None
        if kind.has_comp_scope:
            table, bs = batch.comp_block_tables[kind.ratio], batch.block_size // kind.ratio
            visible = (p + 1) // kind.ratio
            if kind.uses_topk:
                local = [int(c) for c in case.topks[kind][t, : min(visible, case.spec.topk)]]
                comp = [_slot(table, r, c, bs) if 0 <= c < visible else -1 for c in local]
            else:
                comp = [_slot(table, r, c, bs) for c in range(visible)]
        keys.append((swa, comp))
    return keys


def engine_rows(key_lists, width, gen, *, shuffle=True, clamp1=False, extra_cols=3, extra_rows=4):
    """(rows, lens) as an engine hands them over: int32 views [T, width] of a wider buffer with
    more rows, entries of each row shuffled, padding tokens (PAD after the real ones) empty;
    ``clamp1`` gives empty rows length 1 over a -1 entry (SGLang's clamp_min(1))."""
    T = len(key_lists) + PAD
    buf = torch.randint(-10**6, 10**6, (T + extra_rows, width + extra_cols), generator=gen, dtype=torch.int32)
    lens = torch.zeros(T + extra_rows, dtype=torch.int32)
    buf[:T, :width] = -1
    for t, keys in enumerate(key_lists):
        order = torch.randperm(len(keys), generator=gen).tolist() if shuffle else range(len(keys))
        row = [keys[i] for i in order]
        buf[t, : len(row)] = torch.tensor(row, dtype=torch.int32) if row else buf[t, :0]
        lens[t] = max(len(row), 1) if clamp1 else len(row)
    return buf[:, :width], lens


def step_rows(case, gen, *, clamp1=False):
    """A StepRows giving every compressed ratio as GlobalRows, and the expected keys per kind."""
    spec = case.spec
    keys = {k: expected_keys(case, k) for k in spec.kinds}
    swa, swa_lens = engine_rows([s for s, _ in keys[LayerKind.SWA]], spec.window, gen)
    comp = {}
    for kind in spec.kinds:
        if kind.has_comp_scope:
            rows, lens = engine_rows([c for _, c in keys[kind]], spec.comp_width(kind), gen, clamp1=clamp1)
            comp[kind.ratio] = dsv4.GlobalRows(rows, lens)
    positions = torch.tensor([p for _, p in _tokens()] + [0] * PAD, dtype=torch.int32)
    rows = dsv4.StepRows(swa, swa_lens, positions, NUM_DECODE_TOKENS, comp, num_tokens=case.batch.num_tokens)
    return rows, keys


def reference_out(case, kind, keys, q):
    """float64 reference over ``keys`` written as plain rows (lengths = key counts)."""
    T, spec = q.shape[0], case.spec

    def pack(lists, width):
        rows = torch.full((T, max(width, 1)), -1, dtype=torch.int32)
        lens = torch.zeros(T, dtype=torch.int32)
        for t, ks in enumerate(lists):
            rows[t, : len(ks)] = torch.tensor(ks, dtype=torch.int32) if ks else rows[t, :0]
            lens[t] = len(ks)
        return rows, lens

    swa, swa_lens = pack([s for s, _ in keys], spec.window)
    comp = comp_lens = None
    if kind.has_comp_scope:
        comp, comp_lens = pack([c for _, c in keys], spec.comp_width(kind))
    out, _ = reference.sparse_mla(q, case.caches["swa"], swa, swa_lens, case.caches.get(kind), comp, comp_lens,
                                  case.sink, spec.scale, "fp8_ds_mla")
    return out


def run(mla, plan, case, kind, q):
    out = torch.full_like(q, float("nan"))
    mla.forward(plan, kind, q, case.caches["swa"], case.caches.get(kind), sink=case.sink, out=out, validate=True)
    assert not out.isnan().any(), "output not fully written"
    return out


def check(out, ref, what):
    err = compare(out, ref)
    assert_close(err, what=what)
    assert out[-PAD:].abs().max() == 0, f"{what}: padding tokens attend nothing"
    return err


BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="Triton missing"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kinds", [V4_KINDS, V41_KINDS], ids=["v4", "v41"])
def test_global_rows_match_reference_on_every_kind(gen, backend, kinds):
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=kinds, topk=32, max_model_len=4096,
                     pad_tokens=PAD)
    rows, keys = step_rows(case, gen, clamp1=True)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=backend, front_end="torch")
    plan = mla.plan(rows, validate=True)
    batch_mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch", front_end="torch")
    for kind in case.spec.kinds:
        ref = reference_out(case, kind, keys[kind], case.q)
        check(run(mla, plan, case, kind, case.q), ref, f"rows {kind.name}")
        if backend != "torch":
            continue
        # the same step through block tables (the expected keys are the ones a StepBatch means)
        bplan = batch_mla.plan(case.batch)
        out = torch.full_like(case.q, float("nan"))
        batch_mla.forward(bplan, kind, case.q, case.caches["swa"], case.caches.get(kind),
                               topk=case.topks.get(kind), sink=case.sink, out=out)
        check(out, ref, f"batch {kind.name}")


def test_rows_are_views_and_read_when_the_layer_runs(gen):
    """plan() copies no rows; a top-k layer's rows rewritten in place after plan() (SGLang's
    indexer writes each layer's rows into one buffer) are the ones that layer attends."""
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=V4_KINDS, topk=32, max_model_len=4096,
                     pad_tokens=PAD)
    rows, keys = step_rows(case, gen)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(rows)
    c4 = rows.comp[4]
    assert plan.swa_rows.data_ptr() == rows.swa_rows.data_ptr()
    assert plan.comp_rows[4][0].data_ptr() == c4.rows.data_ptr() and not plan.translates_topk(LayerKind.C4A)
    check(run(mla, plan, case, LayerKind.C4A, case.q), reference_out(case, LayerKind.C4A, keys[LayerKind.C4A], case.q),
          "first layer")
    # the next C4A layer: another top-k, same lengths (entries a token may see, reshuffled)
    other = [(s, [c for c in reversed(comp)]) for s, comp in keys[LayerKind.C4A]]
    second = other[:]
    for t, (s, comp) in enumerate(other):
        if len(comp) > 1:
            second[t] = (s, comp[1:] + [-1])  # drop one entry, keep the length
    new_rows, _ = engine_rows([c for _, c in second], case.spec.topk, gen)
    c4.rows.copy_(new_rows)
    check(run(mla, plan, case, LayerKind.C4A, case.q), reference_out(case, LayerKind.C4A, second, case.q),
          "rows rewritten in place")


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_table_translates_local_topk(gen, backend):
    """A ratio given as TopkTable: the layer's local top-k goes through the table, positions and
    requests of the StepRows (C1A and C2A of V4.1 with 64-token pages)."""
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=V41_KINDS, topk=32, max_model_len=4096, block_size=64,
                     pad_tokens=PAD)
    rows, keys = step_rows(case, gen)
    req = torch.tensor([r for r, _ in _tokens()] + [-1] * PAD, dtype=torch.int32)
    comp = {k.ratio: dsv4.TopkTable(case.batch.comp_block_tables[k.ratio], 64 // k.ratio)
            for k in (LayerKind.C1A, LayerKind.C2A)}
    table_rows = dsv4.StepRows(rows.swa_rows, rows.swa_lens, rows.positions, NUM_DECODE_TOKENS, comp, req,
                               num_tokens=rows.num_tokens)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=backend, front_end="torch")
    plan = mla.plan(table_rows, validate=True)
    for kind in (LayerKind.C1A, LayerKind.C2A):
        assert plan.translates_topk(kind)
        out = torch.full_like(case.q, float("nan"))
        mla.forward(plan, kind, case.q, case.caches["swa"], case.caches[kind], topk=case.topks[kind],
                    sink=case.sink, out=out, validate=True)
        assert not out.isnan().any()
        check(out, reference_out(case, kind, keys[kind], case.q), kind.name)


def test_phase_plans_view_the_rows(gen):
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=V4_KINDS, topk=32, max_model_len=4096,
                     pad_tokens=PAD)
    rows, _ = step_rows(case, gen)
    plan = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch").plan(rows)
    decode, prefill = plan.phase_plan("decode"), plan.phase_plan("prefill")
    assert decode.num_tokens == NUM_DECODE_TOKENS == decode.num_decode_tokens
    assert prefill.num_tokens == rows.num_tokens - NUM_DECODE_TOKENS and prefill.num_decode_tokens == 0
    assert torch.equal(prefill.comp_rows[128][0], rows.comp[128].rows[NUM_DECODE_TOKENS: rows.num_tokens])
    assert torch.equal(decode.positions, rows.positions[:NUM_DECODE_TOKENS].long())


# ---- bad input: a ValueError naming the argument, before anything runs -------------------------------
def _good(gen):
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=V4_KINDS, topk=32, max_model_len=4096,
                     pad_tokens=PAD)
    rows, _ = step_rows(case, gen)
    return case, rows


def _with(rows, **changes):
    fields = dict(swa_rows=rows.swa_rows, swa_lens=rows.swa_lens, positions=rows.positions,
                  num_decode_tokens=rows.num_decode_tokens, comp=dict(rows.comp), token_to_req=rows.token_to_req,
                  num_tokens=rows.num_tokens)
    fields.update(changes)
    return dsv4.StepRows(**fields)


CONSTRUCTION = [
    (lambda r: _with(r, swa_rows=r.swa_rows.long()), "swa_rows: got dtype torch.int64"),
    (lambda r: _with(r, swa_rows=r.swa_rows[:, :, None]), "swa_rows: got shape"),
    (lambda r: _with(r, swa_lens=r.swa_lens[:3]), r"swa_lens: got 3 rows; allowed: >= num_tokens"),
    (lambda r: _with(r, swa_rows=r.swa_rows.t().contiguous().t()), "swa_rows: got strides"),
    (lambda r: _with(r, positions=r.positions.float()), "positions: got dtype torch.float32"),
    (lambda r: _with(r, num_decode_tokens=99), r"num_decode_tokens: got 99; allowed: an int in \[0, num_tokens"),
    (lambda r: _with(r, num_tokens=-1), "num_tokens: got -1"),
    (lambda r: _with(r, comp={4: (r.comp[4].rows, r.comp[4].lens)}), r"comp\[4\]: got tuple; allowed: GlobalRows"),
    (lambda r: _with(r, comp={0: r.comp[4]}), "comp: got key 0"),
    (lambda r: _with(r, comp={4: dsv4.GlobalRows(r.comp[4].rows, r.comp[4].lens[:2])}),
     r"comp\[4\].lens: got 2 rows"),
    (lambda r: _with(r, comp={4: dsv4.TopkTable(torch.zeros(2, 2, dtype=torch.int32), 64)}),
     "token_to_req: got None beside a TopkTable"),
    (lambda r: _with(r, comp={4: dsv4.TopkTable(torch.zeros(2, 2, dtype=torch.int32), 0)},
                     token_to_req=r.positions.int()), r"comp\[4\].block_size: got 0"),
]


@pytest.mark.parametrize("make, match", CONSTRUCTION)
def test_construction_refuses_bad_rows(gen, make, match):
    _, rows = _good(gen)
    with pytest.raises(ValueError, match=match):
        make(rows)


PLAN = [
    (lambda r: _with(r, comp={**r.comp, 2: r.comp[4]}), r"comp: got ratio 2; allowed: the model's compression ratios"),
    (lambda r: _with(r, comp={128: dsv4.TopkTable(torch.zeros(2, 2, dtype=torch.int32), 2)},
                     token_to_req=r.positions.int()), r"comp\[128\]: got a TopkTable for C128A"),
    (lambda r: _with(r, comp={4: dsv4.GlobalRows(torch.zeros(r.num_tokens, 33, dtype=torch.int32),
                                                r.comp[4].lens)}), r"comp\[4\].rows: got 33 columns; allowed: <= 32"),
    (lambda r: _with(r, swa_rows=torch.full((r.num_tokens, 129), -1, dtype=torch.int32)),
     r"swa_rows: got 129 columns; allowed: <= spec.window \(128\)"),
]


@pytest.mark.parametrize("make, match", PLAN)
def test_plan_refuses_rows_that_do_not_fit_the_model(gen, make, match):
    case, rows = _good(gen)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    with pytest.raises(ValueError, match=match):
        mla.plan(make(rows))
    with pytest.raises(ValueError, match=r"batch.num_tokens: got 20; allowed: <= max_tokens \(8\)"):
        dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch", max_tokens=8).plan(rows)


def test_num_tokens_set_to_none_after_check_is_refused_until_check_defaults_it(gen):
    _, rows = _good(gen)
    rows.num_tokens = None
    for call in (rows.token_facts, rows.validate):
        with pytest.raises(ValueError, match=r"^num_tokens: got None since the last check\(\); allowed: an int"):
            call()
    T = len(_tokens()) + PAD
    assert _with(rows, swa_rows=rows.swa_rows[:T], num_tokens=None).checked_num_tokens == T  # the default


def test_validate_reads_the_values(gen):
    case, rows = _good(gen)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    bad_lens = rows.swa_lens.clone()
    bad_lens[3] = 129
    with pytest.raises(ValueError, match=r"swa_lens: got 129 at token 3; allowed: 0..128"):
        mla.plan(_with(rows, swa_lens=bad_lens), validate=True)
    bad_pos = rows.positions.clone()
    bad_pos[0] = -5
    with pytest.raises(ValueError, match="positions: got -5"):
        mla.plan(_with(rows, positions=bad_pos), validate=True)
    c4 = rows.comp[4]
    bad = c4.rows.clone()
    bad[0, 0] = -7
    with pytest.raises(ValueError, match=r"comp\[4\].rows: got -7 at token 0, column 0"):
        mla.plan(_with(rows, comp={**rows.comp, 4: dsv4.GlobalRows(bad, c4.lens)}), validate=True)
    req = torch.full((rows.num_tokens,), 9, dtype=torch.int32)
    table = {4: dsv4.TopkTable(case.batch.comp_block_tables[4], 64), 128: rows.comp[128]}
    with pytest.raises(ValueError, match=r"token_to_req: got 9 at token 0; allowed: -1 \(padding\) or a request 0..4"):
        mla.plan(_with(rows, comp=table, token_to_req=req), validate=True)
    # a slot past the cache: found by forward(validate=True), which knows the cache
    plan = mla.plan(rows)
    big = rows.swa_rows.clone()
    big[1, 0] = case.caches["swa"].shape[0] * case.caches["swa"].shape[1]
    plan = mla.plan(_with(rows, swa_rows=big, swa_lens=rows.swa_lens.clamp(min=1)))
    with pytest.raises(ValueError, match=r"swa_rows: got \d+ at token 1, column 0; allowed: -1 or a slot in \[0, "):
        mla.forward(plan, LayerKind.SWA, case.q, case.caches["swa"], sink=case.sink, validate=True)


def test_forward_refuses_topk_for_a_kind_given_as_global_rows(gen):
    case, rows = _good(gen)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(rows)
    with pytest.raises(ValueError, match=r"topk: got a tensor for a C4A layer whose global rows the plan holds"):
        mla.forward(plan, LayerKind.C4A, case.q, case.caches["swa"], case.caches[LayerKind.C4A],
                    topk=case.topks[LayerKind.C4A])
    only_swa = _with(rows, comp={})
    plan = mla.plan(only_swa)
    with pytest.raises(ValueError, match=r"comp: the step's StepRows has no GlobalRows for ratio 128"):
        mla.forward(plan, LayerKind.C128A, case.q, case.caches["swa"], case.caches[LayerKind.C128A])
