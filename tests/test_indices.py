"""common/indices.py: every row builder against an independent per-token Python loop.

The loop walks the requests token by token (pos = seq_len - query_len + i) and writes each
token's keys straight from the definitions (docs/semantics.md "SWA rows", "Compressed visibility"):
SWA keys = positions max(0, pos-W+1) .. pos; compressed entry c visible iff c < (pos+1)//r;
slot(p) = block_table[req, p // bs] * bs + p % bs. Batches mix decode, MTP and prefill requests,
include pos < W, tokens with no compressed entry yet, padding tokens, permuted block tables with
garbage in unused columns, and garbage in the unused C4A top-k lanes.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from dsv4_attn import SparseMLA
from dsv4_attn.common import indices
from dsv4_attn.common.batch import StepBatch
from dsv4_attn.common.spec import LayerKind, ModelSpec

I32 = dict(dtype=torch.int32)


def _rand(gen, lo, hi, shape=(1,)):
    return torch.randint(lo, hi, shape, generator=gen)


def _block_table(gen, seq_lens, entries_per_token, block_size, huge=False):
    """Permuted block ids per request (cdiv(len, bs) used columns), garbage in unused columns."""
    need = [-(-(s // entries_per_token) // block_size) for s in seq_lens]
    cols = max(need + [1]) + 2
    total = sum(need) + 3
    ids = torch.randperm(total, generator=gen).int()
    if huge:  # slots up to 2**31 - 1: the largest block id whose slots still fit int32
        ids = (2**31 // block_size - 1) - ids
    table = _rand(gen, -1, 10**6, (len(seq_lens), cols)).int()  # garbage by default
    k = 0
    for r, n in enumerate(need):
        table[r, :n] = ids[k:k + n]
        k += n
    return table


def _batch(gen, block_sizes=(64, 256), huge=False, num_pad=3, max_model_len=4096):
    """Mixed step: 3 plain decodes (one at pos 0), 2 MTP requests (2 and 3 tokens), prefills
    (one from pos 0 across the window, one chunk mid-sequence, one tiny)."""
    swa_bs, block_size = block_sizes
    query_lens = [1, 1, 1, 2, 3, 150, 7, 2]
    seq_lens = [1, 129, int(_rand(gen, 130, 700)), 3, int(_rand(gen, 4, 600)), 150,
                int(_rand(gen, 300, 900)), 2]
    comp = {}
    for ratio in (4, 128):
        if block_size % ratio == 0:
            comp[ratio] = _block_table(gen, seq_lens, ratio, block_size // ratio, huge)
    batch = StepBatch.from_lists(query_lens, seq_lens, _block_table(gen, seq_lens, 1, swa_bs, huge), swa_bs,
                                 comp, block_size=block_size, max_model_len=max_model_len,
                                 num_decode_tokens=1 + 1 + 1 + 2 + 3, num_tokens=sum(query_lens) + num_pad)
    return batch.validate(), query_lens, seq_lens


def _tokens(query_lens, seq_lens):
    """(token index, request, pos) of every real token, by walking the requests."""
    t = 0
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for i in range(q):
            yield t, r, s - q + i
            t += 1


def _slot(table, r, p, bs):
    return int(table[r, p // bs]) * bs + p % bs


def _check(got, rows, lens):
    got_rows, got_lens = got
    assert got_rows.dtype == torch.int32 and got_lens.dtype == torch.int32
    assert got_rows.tolist() == rows
    assert got_lens.tolist() == lens


def _empty(T, width):
    return [[-1] * width for _ in range(T)], [0] * T


BLOCK_SIZES = [1, 2, 64, 256]


@pytest.mark.parametrize("swa_bs", BLOCK_SIZES)
@pytest.mark.parametrize("window", [128, 5])
def test_swa_rows_match_loop(gen, swa_bs, window):
    batch, ql, sl = _batch(gen, (swa_bs, 256))
    rows, lens = _empty(batch.num_tokens, window)
    table = batch.swa_block_table
    for t, r, pos in _tokens(ql, sl):
        keys = [_slot(table, r, p, swa_bs) for p in range(max(0, pos - window + 1), pos + 1)]
        rows[t][:len(keys)] = keys
        lens[t] = len(keys)
    _check(indices.swa_rows(batch, window), rows, lens)


def _with_window_starts(gen, batch, ql, sl):
    """The batch with a per-request window start (vLLM's SWA bounded replay): 0, or a random
    position up to the request's first query position."""
    starts = [0 if int(_rand(gen, 0, 3)) == 0 else int(_rand(gen, 0, s - q + 1)) for q, s in zip(ql, sl)]
    starts[4] = sl[4] - ql[4]  # the latest allowed start: the first query token sees only itself
    starts[6] = sl[6] - ql[6] - 5  # a start inside the first query token's window
    return dataclasses.replace(batch, swa_start=torch.tensor(starts + [7], **I32)), starts  # [>= R]


@pytest.mark.parametrize("front_end", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"))])
def test_swa_rows_start_at_each_requests_window_start(gen, front_end):
    batch, ql, sl = _batch(gen, (32, 256))
    batch, starts = _with_window_starts(gen, batch, ql, sl)
    window = 128
    rows, lens = _empty(batch.num_tokens, window)
    for t, r, pos in _tokens(ql, sl):
        keys = [_slot(batch.swa_block_table, r, p, 32) for p in range(max(0, pos - window + 1, starts[r]), pos + 1)]
        rows[t][:len(keys)] = keys
        lens[t] = len(keys)
    _check(indices.swa_rows(batch.validate(), window), rows, lens)
    spec = ModelSpec(num_heads=16, topk=64, max_model_len=4096, window=window)
    plan = SparseMLA(spec, "fp8_ds_mla", backend="torch", front_end=front_end).plan(batch)
    _check((plan.swa_rows, plan.swa_lens), rows, lens)


def _c4a_local_topk(gen, batch, ql, sl, K):
    """Indexer-like local top-k [T, K]: a prefix of distinct visible entries (in random order),
    garbage (negatives, huge, and visible-looking values) in every lane after it."""
    topk = _rand(gen, -3, 10**6, (batch.num_tokens, K)).int()
    topk[:, ::3] = _rand(gen, 0, 4, (batch.num_tokens, len(range(0, K, 3)))).int()  # plausible garbage
    for t, _, pos in _tokens(ql, sl):
        n = (pos + 1) // 4
        k = min(n, K)
        topk[t, :k] = torch.randperm(n, generator=gen)[:k].int()
    return topk


@pytest.mark.parametrize("comp_bs", BLOCK_SIZES)
@pytest.mark.parametrize("K", [16, 512])
def test_c4a_rows_match_loop(gen, comp_bs, K):
    batch, ql, sl = _batch(gen, (64, comp_bs * 4))
    topk = _c4a_local_topk(gen, batch, ql, sl, K)
    rows, lens = _empty(batch.num_tokens, K)
    table = batch.comp_block_tables[4]
    for t, r, pos in _tokens(ql, sl):
        n = (pos + 1) // 4
        lens[t] = min(n, K)
        for j in range(lens[t]):
            rows[t][j] = _slot(table, r, int(topk[t, j]), comp_bs)
    _check(indices.topk_rows(batch, LayerKind.C4A, topk), rows, lens)
    # vLLM's top-k buffer is shared and sized for the max batch: extra rows are ignored
    padded = torch.cat([topk, _rand(gen, -1, 10**6, (5, K)).int()])
    _check(indices.topk_rows(batch, LayerKind.C4A, padded), rows, lens)


def test_c4a_rows_drop_invalid_entries_inside_the_prefix(gen):
    # a defensive rule (docstring): -1 and not-yet-visible entries inside the prefix become -1
    table = torch.tensor([[5, 9]], **I32)
    batch = StepBatch.from_lists([1], [40], torch.zeros(1, 1, **I32), 64, {4: table}, block_size=32)
    # pos 39: n = 10 visible entries, bs 8; prefix of 4 lanes of K = 4
    topk = torch.tensor([[9, -1, 10, 3]], **I32)
    # 9 -> block 9 (col 1) * 8 + 1 = 73; -1 -> -1; 10 not visible -> -1; 3 -> 5 * 8 + 3 = 43
    _check(indices.topk_rows(batch, LayerKind.C4A, topk), [[73, -1, -1, 43]], [4])


@pytest.mark.parametrize("comp_bs", BLOCK_SIZES)
def test_c128a_rows_match_loop(gen, comp_bs):
    batch, ql, sl = _batch(gen, (64, comp_bs * 128))
    width = 128  # round_up(cdiv(4096, 128), 128)
    rows, lens = _empty(batch.num_tokens, width)
    table = batch.comp_block_tables[128]
    for t, r, pos in _tokens(ql, sl):
        lens[t] = (pos + 1) // 128
        rows[t][:lens[t]] = [_slot(table, r, c, comp_bs) for c in range(lens[t])]
    _check(indices.all_rows(batch, LayerKind.C128A), rows, lens)
    # an explicit narrower width keeps the first `width` entries
    got_rows, got_lens = indices.all_rows(batch, LayerKind.C128A, width=3)
    assert got_rows.tolist() == [r[:3] for r in rows]
    assert got_lens.tolist() == [min(n, 3) for n in lens]


def test_c128a_width_is_fixed_by_max_model_len_not_the_batch(gen):
    for mml, width in [(4096, 128), (40000, 384)]:
        for _ in range(2):  # two different batches, same width
            batch, _, _ = _batch(gen, (64, 256), max_model_len=mml)
            rows, lens = indices.all_rows(batch, LayerKind.C128A)
            assert rows.shape == (batch.num_tokens, width) and lens.shape == (batch.num_tokens,)


def test_huge_slots_are_exact_int32(gen):
    batch, ql, sl = _batch(gen, (256, 256), huge=True)
    swa, _ = indices.swa_rows(batch)
    assert 2**30 < int(swa.max()) <= 2**31 - 1
    for t, r, pos in _tokens(ql, sl):
        assert int(swa[t, 0]) == _slot(batch.swa_block_table, r, max(0, pos - 127), 256)
    c128, lens = indices.all_rows(batch, LayerKind.C128A)
    for t, r, _pos in _tokens(ql, sl):
        if lens[t] > 0:
            assert int(c128[t, lens[t] - 1]) == _slot(batch.comp_block_tables[128], r, int(lens[t]) - 1, 2)


def test_out_buffers_are_written_in_place(gen):
    batch, _, _ = _batch(gen)
    T = batch.num_tokens
    want = indices.swa_rows(batch)
    buf = (torch.full((T, 128), 12345, **I32), torch.full((T,), 777, **I32))
    got = indices.swa_rows(batch, out=buf)
    assert got[0] is buf[0] and got[1] is buf[1]
    assert torch.equal(buf[0], want[0]) and torch.equal(buf[1], want[1])
    with pytest.raises(ValueError, match=r"^out: got .*allowed"):
        indices.swa_rows(batch, out=(torch.zeros(T, 64, **I32), buf[1]))
    with pytest.raises(ValueError, match=r"^out: got .*allowed"):
        indices.swa_rows(batch, out=(torch.zeros(T, 128, dtype=torch.int64), buf[1]))


def test_a_batch_of_only_padding_tokens_has_empty_rows():
    t = torch.zeros(1, 1, **I32)
    batch = StepBatch.from_lists([], [], t, 64, {4: t, 128: t}, num_tokens=3)
    _check(indices.swa_rows(batch), *_empty(3, 128))
    _check(indices.topk_rows(batch, LayerKind.C4A, torch.randint(0, 9, (3, 8)).int()), *_empty(3, 8))
    _check(indices.all_rows(batch, LayerKind.C128A, width=128), *_empty(3, 128))


def test_tokens_of_a_batch():
    batch = StepBatch.from_lists([1, 2], [5, 2], torch.zeros(2, 1, **I32), 64, num_tokens=4)
    tok = indices.Tokens.of(batch)
    assert tok.positions.tolist() == [4, 0, 1, 0]
    assert tok.token_to_req.tolist() == [0, 1, 1, -1]
    assert tok.valid.tolist() == [True, True, True, False]


# ---- merged rows (FlashInfer) and ragged CSR -----------------------------------------------

def _random_rows(gen, T, K, lens):
    """int32 [T, K] with the first lens[t] columns mostly slots (some -1), -1 after."""
    rows = _rand(gen, 0, 10**5, (T, K)).int()
    rows[_rand(gen, 0, 5, (T, K)) == 0] = -1
    for t in range(T):
        rows[t, lens[t]:] = -1
    return rows


@pytest.mark.parametrize("K, padded", [(5, 8), (512, 512), (130, 132), (1, 4)])
def test_merged_rows_match_loop(gen, K, padded):
    T, W = 7, 128
    swa_lens = _rand(gen, 0, W + 1, (T,)).int()
    comp_lens = _rand(gen, 0, K + 1, (T,)).int()
    swa = _random_rows(gen, T, W, swa_lens.tolist())
    comp = _random_rows(gen, T, K, comp_lens.tolist())
    swa[:, -1] = 7  # past swa_lens (or the last key): kept only when inside the lens

    def keys(row, n):  # the row's keys in order, -1 after, as wide as the row
        kept = [x for x in row[:n] if x >= 0]
        return kept + [-1] * (len(row) - len(kept))

    rows, lens = indices.merged_rows(swa, swa_lens, comp, comp_lens)
    expect = [keys(swa[t].tolist(), int(swa_lens[t])) + keys(comp[t].tolist(), int(comp_lens[t]))
              + [-1] * (padded - K) for t in range(T)]
    assert rows.dtype == torch.int32 and rows.is_contiguous() and rows.tolist() == expect
    counts = [sum(x >= 0 for x in comp[t, : int(comp_lens[t])].tolist()) for t in range(T)]
    assert lens.dtype == torch.int32 and lens.tolist() == [W + n for n in counts]
    # SWA-only layer: the SWA keys, lens always W
    rows, lens = indices.merged_rows(swa, swa_lens, None, None)
    assert rows.tolist() == [keys(swa[t].tolist(), int(swa_lens[t])) for t in range(T)] and lens.tolist() == [W] * T


def _csr(rows, lens):
    indptr, flat = [0], []
    for t in range(len(rows)):
        keep = [x for x in rows[t][:lens[t]] if x >= 0]
        flat += keep
        indptr.append(indptr[-1] + len(keep))
    return indptr, flat


def test_ragged_matches_loop(gen):
    T, K = 9, 37
    lens = _rand(gen, 0, K + 1, (T,)).int()
    lens[0], lens[1] = 0, K  # an empty row and a full one
    rows = _rand(gen, -1, 10**5, (T, K)).int()  # -1 inside the prefix AND garbage after lens
    rows[2, :] = -1
    indptr, flat = _csr(rows.tolist(), lens.tolist())
    got_ptr, got_idx = indices.ragged(rows, lens)
    assert got_ptr.dtype == torch.int32 and got_idx.dtype == torch.int32
    assert got_ptr.tolist() == indptr and got_idx.tolist() == flat
    got_ptr, got_idx = indices.ragged(rows, lens, capacity=T * K + 5)
    assert got_ptr.tolist() == indptr
    assert got_idx.shape == (T * K + 5,) and got_idx.tolist() == flat + [-1] * (T * K + 5 - len(flat))


def test_ragged_of_no_tokens():
    ptr, idx = indices.ragged(torch.zeros(0, 8, **I32), torch.zeros(0, **I32))
    assert ptr.tolist() == [0] and idx.numel() == 0


# ---- bad input ------------------------------------------------------------------------------

def _small_batch(**kw):
    t = torch.zeros(2, 4, **I32)
    return StepBatch.from_lists([1, 2], [9, 5], t, 64, {4: t, 128: t}, block_size=256, **kw)


_R = torch.zeros(3, 128, **I32)
_L = torch.zeros(3, **I32)
_C = torch.zeros(3, 8, **I32)


@pytest.mark.parametrize("call, name", [
    (lambda: indices.swa_rows(_small_batch(), window=0), "window"),
    (lambda: indices.topk_rows(_small_batch(), LayerKind.C4A, torch.zeros(3, 8)), "topk"),
    (lambda: indices.topk_rows(_small_batch(), LayerKind.C4A, torch.zeros(2, 8, **I32)), "topk"),
    (lambda: indices.topk_rows(_small_batch(), LayerKind.C4A, torch.zeros(8, **I32)), "topk"),
    (lambda: indices.topk_rows(_small_batch(), LayerKind.C4A, torch.zeros(3, 8, dtype=torch.int32, device="meta")),
     "topk"),
    (lambda: indices.all_rows(_small_batch(), LayerKind.C128A, width=0), "width"),
    (lambda: indices.all_rows(_small_batch(), LayerKind.C128A, width=True), "width"),
    (lambda: indices.merged_rows(_R.long(), _L, _C, _L), "swa_rows"),
    (lambda: indices.merged_rows(_R, _L[:2], _C, _L), "swa_lens"),
    (lambda: indices.merged_rows(_R, _L, _C[:2], _L), "comp_rows"),
    (lambda: indices.merged_rows(_R, _L, _C.float(), _L), "comp_rows"),
    (lambda: indices.merged_rows(_R, _L, _C, None), "comp_lens"),
    (lambda: indices.merged_rows(_R, _L, None, _L), "comp_lens"),  # lens of an SWA-only layer
    (lambda: indices.merged_rows(_R, _L, _C, _L.to("meta")), "comp_lens"),
    (lambda: indices.ragged(_R[0], _L), "rows"),
    (lambda: indices.ragged(_R.float(), _L), "rows"),
    (lambda: indices.ragged(_R, _L[:1]), "lens"),
    (lambda: indices.ragged(_R, _L.float()), "lens"),
    (lambda: indices.ragged(_R, _L, capacity=10), "capacity"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: got .*allowed"):
        call()


@pytest.mark.parametrize("starts, match", [
    (torch.zeros(1, **I32), r"swa_start: got shape \(1,\); allowed: \[>= 2\]"),
    (torch.zeros(2), "swa_start: got dtype torch.float32; allowed: torch.int32"),
    (torch.tensor([-1, 0], **I32), r"swa_start: got swa_start\[0\] = -1; allowed: 0 \.\. 8"),
    (torch.tensor([0, 4], **I32), r"swa_start: got swa_start\[1\] = 4; allowed: 0 \.\. 3, the request's first"),
])
def test_window_starts_past_a_requests_first_query_position_are_refused(starts, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(_small_batch(), swa_start=starts).validate()


def test_c4a_and_c128a_need_their_block_tables():
    batch = StepBatch.from_lists([1], [3], torch.zeros(1, 1, **I32), 64, {128: torch.zeros(1, 1, **I32)})
    with pytest.raises(ValueError, match=r"^comp_block_tables: has no ratio-4 table; allowed"):
        indices.topk_rows(batch, LayerKind.C4A, torch.zeros(1, 4, **I32))
    batch = StepBatch.from_lists([1], [3], torch.zeros(1, 1, **I32), 64, {4: torch.zeros(1, 1, **I32)}, block_size=4)
    with pytest.raises(ValueError, match=r"^comp_block_tables: has no ratio-128 table; allowed"):
        indices.all_rows(batch, LayerKind.C128A)
