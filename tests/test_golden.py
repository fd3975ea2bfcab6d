"""Our float64 reference and the torch backend against FlashMLA's real outputs.

tests/data/flashmla_golden_small.pt holds FlashMLA's recorded ``out`` and ``lse_without_sink``
(H100, vllm 0.33.0 build) on 3 decode cases (MODEL1 caches, SWA + compressed scope, sink) and
2 prefill cases (bf16 kv, one scope, sink), trimmed by tests/data/make_flashmla_golden.py to
8 heads, a few tokens and only the cache rows those tokens read (exact: nothing recomputed).

FlashMLA writes bf16, so ``out`` agrees to bf16 rounding (relative L2 ~2e-3), its LSE is fp32.
FlashMLA reports lse = +inf for a row with no keys ("lonely" rows), ours -inf; both output 0.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from dsv4_attn import LayerKind, ModelSpec, SparseMLA, StepBatch
from dsv4_attn.common import reference

from kit.compare import assert_close, compare

DATA = Path(__file__).parent / "data" / "flashmla_golden_small.pt"
# the untrimmed recording the small file was cut from (not in the repository: 13.8 MB); set this
# variable to its path to check the trimming
FULL = os.environ.get("DSV4_ATTN_FLASHMLA_GOLDEN")
CASES = torch.load(DATA)
IDS = [f"{c['kind']}{i}" for i, c in enumerate(CASES)]


def _scopes(case):
    """(swa_cache, swa_rows, swa_lens, comp_cache, comp_rows, comp_lens, fmt) of a case."""
    if case["kind"] == "decode":
        return (case["swa_cache"], case["swa_rows"], case["swa_lens"], case["comp_cache"], case["comp_rows"],
                case["comp_lens"], "fp8_ds_mla")
    # prefill: kv [s_kv, 1, 512] bf16 is a BF16 cache of block size 1; indices are its slots
    return case["kv"], case["indices"], case["topk_length"], None, None, None, "bf16"


def _has_keys(rows, lens):
    col = torch.arange(rows.shape[1])[None, :]
    return ((col < lens[:, None].long()) & (rows >= 0)).any(dim=1)


def _check_against_flashmla(case, out, lse=None):
    swa_cache, swa_rows, swa_lens, _, comp_rows, comp_lens, _ = _scopes(case)
    gold = case["out"].double()
    err = compare(out, gold)
    # bf16 envelope: half an ulp of the largest output is 2^-8 of it; allow twice that
    assert_close(err, max_abs=False)
    assert err["max_abs"] < 2.0**-7 * gold.abs().max().item(), err
    keyed = _has_keys(swa_rows, swa_lens)
    if comp_rows is not None:
        keyed |= _has_keys(comp_rows, comp_lens)
    assert torch.equal(out[~keyed].double(), torch.zeros_like(gold[~keyed]))
    assert torch.equal(gold[~keyed], torch.zeros_like(gold[~keyed]))  # FlashMLA: lonely rows -> 0 too
    if lse is not None:
        flash_lse = case["lse_without_sink"].double()
        assert (flash_lse[~keyed] == math.inf).all() and (lse[~keyed] == -math.inf).all()
        assert (lse[keyed] - flash_lse[keyed]).abs().max() < 1e-5  # fp32 LSE (measured 6e-7)
    return err


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_matches_flashmla(case):
    swa_cache, swa_rows, swa_lens, comp_cache, comp_rows, comp_lens, fmt = _scopes(case)
    out, lse = reference.sparse_mla(case["q"], swa_cache, swa_rows, swa_lens, comp_cache, comp_rows, comp_lens,
                                    case["sink"], case["scale"], fmt)
    _check_against_flashmla(case, out, lse)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_backend_through_sparse_mla_matches_flashmla(case):
    """SparseMLA(backend="torch") on FlashMLA's rows. A plan derives its rows from a StepBatch;
    here the batch only fixes the shapes (T decode tokens, block sizes, widths) and the recorded
    rows are then written into the plan's buffers, as an engine's plan would hold them."""
    swa_cache, swa_rows, swa_lens, comp_cache, comp_rows, comp_lens, fmt = _scopes(case)
    T, H, _ = case["q"].shape
    zeros = torch.zeros(T, 1, dtype=torch.int32)
    if comp_cache is None:  # SWA-only layer with a W = top-k wide row, block size 1
        kind, spec = LayerKind.SWA, ModelSpec(num_heads=H, window=swa_rows.shape[1])
        batch = StepBatch.from_lists([1] * T, [1] * T, zeros, 1)
    else:  # C128A is the kind whose compressed rows the plan holds: width K = max_model_len / 128
        K, comp_bs = comp_rows.shape[1], comp_cache.shape[1]
        kind, spec = LayerKind.C128A, ModelSpec(num_heads=H, max_model_len=K * 128)
        batch = StepBatch.from_lists([1] * T, [1] * T, zeros, swa_cache.shape[1], {128: zeros},
                                     block_size=comp_bs * 128, max_model_len=K * 128)
    mla = SparseMLA(spec, fmt, backend="torch")
    plan = mla.plan(batch)
    plan.swa_rows.copy_(swa_rows)
    plan.swa_lens.copy_(swa_lens)
    if comp_cache is not None:
        assert plan.comp_rows[128][0].shape == comp_rows.shape
        plan.comp_rows[128][0].copy_(comp_rows)
        plan.comp_rows[128][1].copy_(comp_lens)
    out = torch.full_like(case["q"], math.nan)
    mla.forward(plan, kind, case["q"], swa_cache, comp_cache, sink=case["sink"], out=out, validate=True)
    assert not out.isnan().any(), "output not fully written"
    _check_against_flashmla(case, out)


def test_golden_data_is_small_and_covers_the_edges():
    assert DATA.stat().st_size < 3e6
    kinds = [c["kind"] for c in CASES]
    assert kinds.count("decode") == 3 and kinds.count("prefill") == 2
    sinks = torch.cat([c["sink"] for c in CASES])
    assert (sinks == -math.inf).sum() == 5  # head 0 of every case
    empty = [int((~_has_keys(c["indices"], c["topk_length"])).sum()) for c in CASES if c["kind"] == "prefill"]
    assert empty == [1, 1]
    assert any(c["kind"] == "decode" and c["comp_cache"].shape[1] == 2 for c in CASES)  # C128A-like


@pytest.mark.skipif(not FULL, reason="DSV4_ATTN_FLASHMLA_GOLDEN (the untrimmed flashmla-v4-golden.pt) is not set")
def test_trimmed_cases_compute_like_the_originals():
    """The trimming (token/head subset, cache compaction) leaves every output unchanged."""
    for small, full in zip(CASES, torch.load(FULL)):
        heads, tokens = small["heads"], small["tokens"]
        ours = reference.sparse_mla(small["q"], *_scopes(small)[:6], small["sink"], small["scale"], _scopes(small)[6])
        theirs = reference.sparse_mla(full["q"], *_scopes(full)[:6], full["sink"], full["scale"], _scopes(full)[6])
        assert torch.equal(ours[0], theirs[0][tokens][:, heads])
        assert torch.equal(full["out"][tokens][:, heads], small["out"])
