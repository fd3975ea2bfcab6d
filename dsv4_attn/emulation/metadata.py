"""``get_mla_metadata_info_v1`` / ``get_mla_metadata_v1`` emulated: work-buffer shapes and the
persistent work plan (the planner port in :mod:`.planner`)."""

from __future__ import annotations

import math

import torch

from .base import EmulatorBase
from .contract import capturing, check_tensor, describe, fail
from .planner import plan_works
from .releases import NATIVE_PERSISTENT


class MetadataKernels(EmulatorBase):
    """The two metadata functions, both releases' signatures."""

    def _info_017(self, batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True):
        if num_head_qo % 16:
            fail("num_head_qo", num_head_qo, "a multiple of 16 (0.1.7)")
        return self._info(batch_size, max_seqlen_qo, num_head_qo, q_dtype, is_sparse, fast_mode, -1)

    def _info_new(self, batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True,
                  num_kv_splits=32, intra_batch_mode=False, max_split_per_batch=-1):
        if num_head_qo % 8:
            fail("num_head_qo", num_head_qo, "a multiple of 8")
        if intra_batch_mode:
            fail("intra_batch_mode", True, "False (not emulated)")
        return self._info(batch_size, max_seqlen_qo, num_head_qo, q_dtype, is_sparse, fast_mode,
                          max_split_per_batch)

    def _metadata_017(self, seqlens_qo_indptr, seqlens_kv_indptr, num_heads_per_head_k, num_heads_k, is_causal,
                      work_metadata_ptrs, work_indptr, work_info, reduce_indptr, reduce_final_map,
                      reduce_partial_map, kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1, fast_mode=True,
                      topk=-1, max_split_per_batch=-1):
        self._metadata(seqlens_qo_indptr, seqlens_kv_indptr, None, num_heads_per_head_k, num_heads_k,
                       work_metadata_ptrs, work_indptr, work_info, reduce_indptr, reduce_final_map,
                       reduce_partial_map, 1, topk, kv_granularity, max_split_per_batch, None)

    def _metadata_new(self, seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k,
                      num_heads_k, is_causal, work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr,
                      reduce_final_map, reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1,
                      uni_seqlen_qo=-1, fast_mode=True, topk=-1, max_split_per_batch=-1, intra_batch_mode=False,
                      is_cp_round_robin=False, mla_version=0, dtype_q_nope=None, dtype_q_rope=None,
                      dtype_kv_nope=None, dtype_kv_rope=None, dtype_q=None, dtype_kv=None):
        self._metadata(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k, num_heads_k,
                       work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map,
                       reduce_partial_map, page_size, topk, kv_granularity, max_split_per_batch, dtype_q)

    # ---- persistent metadata --------------------------------------------------------------
    def _info(self, batch_size, max_seqlen_qo, num_head_qo, q_dtype, is_sparse, fast_mode, max_split_per_batch):
        """Buffer shapes as aiter/ops/attention.py (v0.1.20) computes them for one query token:
        FP8 16/64/128 heads take one 128-row tile per token, other counts ceil(heads / 16)."""
        max_splits = self.cu_num
        packed = num_head_qo * (1 if is_sparse else max_seqlen_qo)
        one_tile = q_dtype == self.fp8 and num_head_qo in (16, 64, 128)
        tiles = -(-packed // 128) if one_tile else -(-packed // 16)
        batch = batch_size * max_seqlen_qo if is_sparse else batch_size
        tile_cnt = batch * tiles
        if fast_mode:
            max_work = (batch + max_splits - 1) * tiles
            max_split_tiles = min(batch + max_splits - 1, (max_splits - 1) * 2) * tiles
        else:
            max_work = max_split_tiles = tile_cnt * max_splits
        if max_split_per_batch > 0:
            max_split_tiles = max(max_split_tiles, tile_cnt + min(max_splits, max_split_per_batch * batch))
        return ((2, torch.uint64), (max_splits + 1, torch.int32), ((max_work, 8), torch.int32),
                (tile_cnt + 1, torch.int32), ((tile_cnt, 2), torch.int32), (max_split_tiles, torch.int32))

    def _plan_ratio(self, heads: int, dtype_q) -> int:
        """qk_batch_ratio of v1_2_device.cuh: heads the FP8 kernels do not take natively run as
        16-head pseudo-batches (natively: 16, 64 and on gfx950 32 / 128, on gfx942 128)."""
        native = heads in NATIVE_PERSISTENT[self.arch] or (dtype_q not in (None, self.fp8) and self.arch == "gfx950")
        return 1 if native or heads % 16 else heads // 16

    def _metadata(self, qo_indptr, kv_indptr, last_page, heads_per_k, heads_k, ptrs, work_indptr, work_info,
                  reduce_indptr, reduce_final_map, reduce_partial_map, page_size, topk, kv_granularity=16,
                  max_split_per_batch=-1, dtype_q=None):
        """Fill the six work buffers for the current indptrs.

        The device buffers get one work item per batch row (fixed-shape device ops: what a graph
        capture records): work_info row b = [b, -1, q_start, q_end, kv_start, kv_end, 0, 0].
        Outside a capture the sparse (``topk``) plan is also built the way AITER's planner builds
        it (:func:`plan_works`, a port of ``kn_get_mla_metadata_v1_2``), which splits rows across
        CUs in ``kv_granularity`` blocks; the persistent call runs those works and asserts its code
        object's granularity on them.
        """
        if kv_granularity < 1 or kv_granularity & (kv_granularity - 1):
            fail("kv_granularity", kv_granularity, "a power of two (metadata.cu AITER_CHECK)")
        self._load("get_mla_metadata_v1")
        dev = qo_indptr.device
        check_tensor("seqlens_qo_indptr", qo_indptr, torch.int32, 1, contiguous=True)
        check_tensor("seqlens_kv_indptr", kv_indptr, torch.int32, 1, dev, contiguous=True)
        B = qo_indptr.numel() - 1
        if kv_indptr.numel() != B + 1:
            fail("seqlens_kv_indptr", describe(kv_indptr), f"[{B + 1}] like seqlens_qo_indptr")
        if last_page is not None:
            check_tensor("kv_last_page_lens", last_page, torch.int32, 1, dev)
            if last_page.numel() != B:
                fail("kv_last_page_lens", describe(last_page), f"[{B}]")
        if heads_k != 1:
            fail("num_heads_k", heads_k, "1 (MLA has one KV head)")
        if page_size != 1:
            fail("page_size", page_size, "1 (the only page size the emulator models)")
        want = [("work_metadata_ptrs", ptrs, torch.uint64, (2,)), ("work_indptr", work_indptr, torch.int32, None),
                ("work_info_set", work_info, torch.int32, None), ("reduce_indptr", reduce_indptr, torch.int32, None),
                ("reduce_final_map", reduce_final_map, torch.int32, None),
                ("reduce_partial_map", reduce_partial_map, torch.int32, None)]
        for name, t, dtype, shape in want:
            check_tensor(name, t, dtype, device=dev, contiguous=True)
            if shape is not None and tuple(t.shape) != shape:
                fail(name, describe(t), str(shape))
        if work_info.dim() != 2 or work_info.shape[1] != 8 or work_info.shape[0] < B:
            fail("work_info_set", describe(work_info), f"[>= {B}, 8] (sized by get_mla_metadata_info_v1)")
        if reduce_indptr.numel() < B + 1 or reduce_final_map.dim() != 2 or reduce_final_map.shape[0] < B:
            fail("reduce_indptr/reduce_final_map", f"{describe(reduce_indptr)}, {describe(reduce_final_map)}",
                 f"[>= {B + 1}] and [>= {B}, 2] (sized for the max batch by get_mla_metadata_info_v1)")
        if work_indptr.numel() < 2:
            fail("work_indptr", describe(work_indptr), "[cu_num + 1]")
        b = torch.arange(B, device=dev, dtype=torch.int32)
        work_info.fill_(0)
        rows = work_info[:B]
        rows[:, 0].copy_(b)
        rows[:, 1].fill_(-1)
        rows[:, 2].copy_(qo_indptr[:-1])
        rows[:, 3].copy_(qo_indptr[1:])
        rows[:, 4].copy_(kv_indptr[:-1])
        rows[:, 5].copy_(kv_indptr[1:])
        parts = work_indptr.numel() - 1
        per = max(1, math.ceil(B / parts))
        torch.clamp(torch.arange(parts + 1, device=dev, dtype=torch.int32) * per, max=B, out=work_indptr)
        reduce_indptr.fill_(0)
        reduce_final_map.fill_(-1)
        reduce_partial_map.fill_(-1)
        ptrs.view(torch.int64)[0].fill_(work_indptr.data_ptr())
        ptrs.view(torch.int64)[1].fill_(work_info.data_ptr())
        plan = {"topk": int(topk), "heads": int(heads_per_k), "batch": B}
        if not capturing() and topk > 0:  # the real planner's works (host values: not inside a capture)
            lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
            plan.update(lens=lens, works=plan_works(lens, int(topk), self._plan_ratio(int(heads_per_k), dtype_q),
                                                    kv_granularity, self.cu_num, max_split_per_batch))
            if len(plan["works"]) > work_info.shape[0]:
                fail("work_info_set", describe(work_info), f">= {len(plan['works'])} works (the planner's count)")
        self._plans[work_info.data_ptr()] = plan
        self.calls.append(("get_mla_metadata_v1", f"topk={topk}"))

