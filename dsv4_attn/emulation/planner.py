"""AITER's split and work planning, ported: ``get_meta_param``'s split count and the sparse
persistent planner ``kn_get_mla_metadata_v1_2``."""

from __future__ import annotations

from .releases import FP8_BLOCK


def stage2_keys_per_split(heads: int, fp8: bool) -> int:
    """Stage 2's keys per split, ``mgc`` (aiter/mla.py, one query token)."""
    if heads == 128 and fp8:
        return 32
    return 64 if heads in (8, 16) else 16


def meta_splits(bs: int, total_kv: int, heads: int, fp8: bool, cu_num: int, tg_factor: int = 1,
                ignore_total_kv: bool = False) -> int:
    """``aiter.mla.get_meta_param``'s split count for ``num_kv_splits=None`` (one query token)."""
    occ = bs * tg_factor
    avg = total_kv / max(bs, 1)
    scores = [occ * i / (-(-occ * i // cu_num) * cu_num) * (1.0 if ignore_total_kv else avg / (avg + 84.1 * i))
              for i in range(1, 17)]
    splits = 1 + max(range(16), key=lambda i: scores[i])
    if fp8 and not ignore_total_kv:
        block = FP8_BLOCK[heads]
        splits = min(splits, -(-total_kv // (max(bs, 1) * block)))
        if splits > 1:
            splits = min(splits, int(abs(avg - 1) // block) + 1)
    return max(splits, 1)



def plan_works(lens: list[int], topk: int, ratio: int, kv_granularity: int, cu_num: int,
               max_split_per_batch: int) -> list[tuple[int, int, int, int]]:
    """The works AITER's sparse persistent planner makes: a port of ``kn_get_mla_metadata_v1_2``
    (``csrc/kernels/mla/metadata/v1_2_device.cuh``, v0.1.20.post1) for one query token per row,
    page size 1, causal, one KV head. ``lens``: keys per row (``kv_indptr`` differences), row b's
    keys at ``[b*topk, b*topk + min(len_b, topk))``; ``ratio``: 16-head pseudo-batches per row
    (``qk_batch_ratio``). Returns (row, pseudo-batch of the row, kv_start, kv_end) per work in CU
    order: rows that do not fit a CU's payload are split into works of whole ``kv_granularity``
    blocks but their last."""
    overhead, tail_threshold = 16, 1  # fixed_over_head_num_blocks (page 1), tail_done_threshold = max_seqlen_qo
    num_batches = len(lens) * ratio
    seqlen = [min(n, topk) for n in lens for _ in range(ratio)]
    num_splits = cu_num if max_split_per_batch < 0 else min(cu_num, max_split_per_batch * num_batches)
    sum_blocks = sum(-(-n // kv_granularity) + overhead for n in seqlen)
    payload = -(-sum_blocks // max(num_splits, 1)) + overhead
    works: list[tuple[int, int, int, int]] = []
    batch, kv_block, kv_begin, tail_done = 0, 0, 0, False
    kv_end = kv_begin + (seqlen[0] if seqlen else 0)
    for _ in range(cu_num):
        remain = payload
        while batch < num_batches:
            remain_blocks = -(-seqlen[batch] // kv_granularity) - kv_block
            row, sub = divmod(batch, ratio)
            start = kv_begin + kv_block * kv_granularity
            if remain >= remain_blocks + overhead or tail_done:
                works.append((row, sub, start,
                              kv_end if tail_done else min(start + remain_blocks * kv_granularity, kv_end)))
                remain -= remain_blocks + overhead
                batch += 1
                if batch < num_batches and batch % ratio == 0:
                    kv_begin += topk
                    kv_end = kv_begin + seqlen[batch]
                kv_block, tail_done = 0, False
                continue
            if remain > overhead:
                consuming = remain - overhead
                end = min(start + consuming * kv_granularity, kv_end)
                if kv_end - end < tail_threshold:
                    tail_done = True
                else:
                    works.append((row, sub, start, end))
                    kv_block += consuming
            if not tail_done:
                break
    return works

