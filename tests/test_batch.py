"""common/batch.py: StepBatch's derived per-token facts against a plain per-request loop, and
its validation (every error names the argument, what it got and what is allowed)."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn.common.batch import StepBatch
from dsv4_attn.common.spec import LayerKind

I32 = dict(dtype=torch.int32)


def _table(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, **I32).view(rows, cols)


def _expected_tokens(query_lens, seq_lens, num_tokens):
    """(positions, token_to_req, valid) by walking the requests token by token."""
    pos, req, valid = [], [], []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for i in range(q):
            pos.append(s - q + i)
            req.append(r)
            valid.append(True)
    while len(pos) < num_tokens:  # padding tokens
        pos.append(0)
        req.append(-1)
        valid.append(False)
    return pos, req, valid


@pytest.mark.parametrize("query_lens, seq_lens, num_tokens", [
    ([1, 1, 3, 5], [1, 700, 3, 200], None),  # decode at pos 0, long decode, prefill from 0, chunk
    ([2, 2, 1, 7], [5, 130, 1, 7], 16),  # MTP pairs, a lone first token, padding to 16
    ([], [], 4),  # only padding
    ([0, 3], [10, 3], None),  # a request with no tokens this step
])
def test_derived_tokens_match_a_per_request_loop(query_lens, seq_lens, num_tokens):
    batch = StepBatch.from_lists(query_lens, seq_lens, _table(max(len(seq_lens), 1), 12), 64,
                                 num_tokens=num_tokens)
    batch.validate()
    T = sum(query_lens) if num_tokens is None else num_tokens
    pos, req, valid = _expected_tokens(query_lens, seq_lens, T)
    assert batch.num_tokens == T and batch.num_reqs == len(query_lens)
    assert batch.positions.dtype == torch.int64 and batch.positions.tolist() == pos
    assert batch.token_to_req.dtype == torch.int32 and batch.token_to_req.tolist() == req
    assert batch.token_valid.dtype == torch.bool and batch.token_valid.tolist() == valid


def test_random_batches_match_the_loop(gen):
    for _ in range(20):
        R = int(torch.randint(1, 7, (1,), generator=gen))
        q = torch.randint(1, 6, (R,), generator=gen).tolist()
        s = [qi + int(torch.randint(0, 300, (1,), generator=gen)) for qi in q]
        pad = int(torch.randint(0, 3, (1,), generator=gen))
        batch = StepBatch.from_lists(q, s, _table(R, 5), 64, num_tokens=sum(q) + pad).validate()
        pos, req, valid = _expected_tokens(q, s, sum(q) + pad)
        assert (batch.positions.tolist(), batch.token_to_req.tolist(), batch.token_valid.tolist()) == (pos, req, valid)


def test_from_lists_counts_leading_single_token_requests_as_decode():
    t = _table(4, 4)
    assert StepBatch.from_lists([1, 1, 4, 1], [9, 9, 9, 9], t, 64).num_decode_tokens == 2
    assert StepBatch.from_lists([3, 1], [9, 9], t, 64).num_decode_tokens == 0
    assert StepBatch.from_lists([2, 2, 5], [9, 9, 9], t, 64, num_decode_tokens=4).num_decode_tokens == 4


def test_comp_block_table_and_sizes():
    t4, t128 = _table(2, 3), _table(2, 1)
    batch = StepBatch.from_lists([1, 1], [5, 6], _table(2, 1), 64, {4: t4, 128: t128}, block_size=256)
    assert batch.comp_block_size(LayerKind.C4A) == 64 and batch.comp_block_size("c128a") == 2
    assert batch.comp_block_table(4) is batch.comp_block_tables[4]
    only4 = StepBatch.from_lists([1], [5], _table(1, 1), 64, {4: t4[:1]}, block_size=8)
    with pytest.raises(ValueError, match=r"^comp_block_tables: .*allowed: provide comp_block_tables\[128\]"):
        only4.comp_block_table(LayerKind.C128A)


# ---- bad input ------------------------------------------------------------------------------

def _kwargs(**over):
    base = dict(query_start_loc=torch.tensor([0, 1, 4], **I32), seq_lens=torch.tensor([10, 3], **I32),
                num_decode_tokens=1, swa_block_table=_table(2, 2), swa_block_size=64,
                comp_block_tables={4: _table(2, 2), 128: _table(2, 1)}, block_size=256, max_model_len=4096)
    base.update(over)
    return base


@pytest.mark.parametrize("over, name", [
    (dict(query_start_loc=torch.tensor([0, 1, 4])), "query_start_loc"),  # int64
    (dict(query_start_loc=torch.tensor([[0, 1, 4]], **I32)), "query_start_loc"),
    (dict(query_start_loc=torch.zeros(0, **I32), seq_lens=torch.zeros(0, **I32)), "query_start_loc"),
    (dict(query_start_loc=[0, 1, 4]), "query_start_loc"),
    (dict(seq_lens=torch.tensor([10], **I32)), "seq_lens"),
    (dict(seq_lens=torch.tensor([10.0, 3.0])), "seq_lens"),
    (dict(seq_lens=torch.tensor([10, 3], dtype=torch.int32, device="meta")), "seq_lens"),
    (dict(swa_block_table=_table(1, 2)), "swa_block_table"),
    (dict(swa_block_table=_table(2, 2).long()), "swa_block_table"),
    (dict(swa_block_size=0), "swa_block_size"),
    (dict(block_size=True), "block_size"),
    (dict(block_size=258), "block_size"),  # not a multiple of 4
    (dict(max_model_len=0), "max_model_len"),
    (dict(comp_block_tables={0: _table(2, 2)}), "comp_block_tables"),
    (dict(comp_block_tables={"4": _table(2, 2)}), "comp_block_tables"),
    (dict(comp_block_tables=[_table(2, 2)]), "comp_block_tables"),
    (dict(comp_block_tables={4: _table(1, 2)}), r"comp_block_tables\[4\]"),
    (dict(num_decode_tokens=-1), "num_decode_tokens"),
    (dict(num_decode_tokens=5, num_tokens=4), "num_decode_tokens"),
    (dict(num_tokens=-2), "num_tokens"),
])
def test_constructor_rejects_bad_input(over, name):
    with pytest.raises(ValueError, match=rf"^{name}: got .*allowed"):
        StepBatch(**_kwargs(**over))


def test_num_tokens_set_to_none_after_check_is_refused_until_check_rereads_it():
    batch = StepBatch(**_kwargs(num_tokens=6))
    assert batch.checked_num_tokens == 6
    batch.num_tokens = None
    for call in (batch.token_facts, batch.validate):
        with pytest.raises(ValueError, match=r"^num_tokens: got None since the last check\(\); allowed: an int"):
            call()
    assert batch.check().checked_num_tokens == 4  # query_start_loc[-1]


@pytest.mark.parametrize("over, name", [
    (dict(query_start_loc=torch.tensor([1, 1, 4], **I32)), "query_start_loc"),
    (dict(query_start_loc=torch.tensor([0, 3, 2], **I32), num_tokens=3), "query_start_loc"),
    (dict(seq_lens=torch.tensor([10, 2], **I32)), "seq_lens"),  # shorter than its 3 query tokens
    (dict(seq_lens=torch.tensor([5000, 3], **I32)), "seq_lens"),  # > max_model_len
    (dict(num_tokens=3), "num_tokens"),  # fewer than query_start_loc[-1]
    (dict(num_decode_tokens=5, num_tokens=6), "num_decode_tokens"),  # more than the real tokens
    # block table too short: 130 tokens need cdiv(130, 64) = 3 SWA blocks
    (dict(seq_lens=torch.tensor([130, 3], **I32)), "swa_block_table"),
    # 600 tokens -> 150 C4 entries at 64 per block -> 3 blocks (table has 2)
    (dict(seq_lens=torch.tensor([600, 3], **I32), swa_block_table=_table(2, 10)), r"comp_block_tables\[4\]"),
    (dict(swa_block_table=torch.tensor([[-1, 0], [1, 2]], **I32)), "swa_block_table"),  # used column
    # block id whose slots overflow int32: (2**25 + 1) * 64 > 2**31
    (dict(swa_block_table=torch.tensor([[2**25, 0], [1, 2]], **I32)), "swa_block_table"),
])
def test_validate_rejects_bad_values(over, name):
    batch = StepBatch(**_kwargs(**over))
    with pytest.raises(ValueError, match=rf"^{name}: got .*allowed"):
        batch.validate()


def test_validate_accepts_unused_negative_columns_and_returns_self():
    # request 1 has 3 tokens: one SWA block; the unused column may hold -1
    batch = StepBatch(**_kwargs(swa_block_table=torch.tensor([[0, 7], [1, -1]], **I32)))
    assert batch.validate() is batch


def test_validate_ignores_garbage_in_unused_columns():
    # request 1 (3 tokens) uses one SWA block; its unused column holds a huge garbage id that
    # would overflow int32 slots if it were read
    batch = StepBatch(**_kwargs(swa_block_table=torch.tensor([[0, 7], [1, 2**30]], **I32)))
    assert batch.validate() is batch
