"""``mla_decode_fwd`` emulated: split mode (stage 1 + the Triton stage-2 reduce) and persistent
mode (the planner's works), with the row addressing, LSE and fp8 behaviour of the code objects."""

from __future__ import annotations

import math

import torch

from .attend import attend, key_ranges, read_windows, row_starts, stage2_merge, storage_from
from .base import EmulatorBase
from .contract import capturing, check_indptr_values, check_scale, check_tensor, describe, fail
from .planner import meta_splits, stage2_keys_per_split
from .releases import FP8_BLOCK, ROW, STALE, V_DIM


class DecodeKernel(EmulatorBase):
    """``mla_decode_fwd`` of every modelled release."""

    # ---- exact public signatures (bound methods; inspect.signature drops self) -------------
    def _mla_decode_fwd_017(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                            max_seqlen_q, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                            num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None, work_info_set=None,
                            reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None, q_scale=None,
                            kv_scale=None):
        return self._decode(locals(), page_size=1, nhead_kv=1, return_lse=False)

    def _mla_decode_fwd_new(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                            max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                            num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None,
                            work_info_set=None, reduce_indptr=None, reduce_final_map=None,
                            reduce_partial_map=None, q_scale=None, kv_scale=None, intra_batch_mode=False,
                            return_logits=False, return_lse=False, g_kv_indptr=None, cp_world_size=1, cp_rank=0,
                            causal=True):
        if intra_batch_mode or return_logits or g_kv_indptr is not None or cp_world_size != 1:
            fail("intra_batch_mode/return_logits/g_kv_indptr/cp_world_size", "non-default values",
                 "defaults (not emulated; the adapter never uses them)")
        return self._decode(locals(), page_size=page_size, nhead_kv=nhead_kv, return_lse=return_lse)

    def _decode(self, a: dict, page_size: int, nhead_kv: int, return_lse: bool):
        q, kv, o = a["q"], a["kv_buffer"], a["o"]
        check_tensor("q", q, (torch.bfloat16, self.fp8), 3, contiguous=True)
        dev = q.device
        T, H, D = q.shape
        check_tensor("kv_buffer", kv, (torch.bfloat16, self.fp8), 4, dev)
        if kv.shape[1] != page_size or page_size != 1 or kv.shape[2] != nhead_kv or nhead_kv != 1:
            fail("kv_buffer", describe(kv), "[num_page, page_size=1, nhead_kv=1, D] (page size 1, one KV head)")
        if kv.shape[3] != D:
            fail("kv_buffer", describe(kv), f"head_size == q.shape[2] = {D} (asm_mla.cu AITER_CHECK)")
        if kv.stride(3) != 1:
            fail("kv_buffer", describe(kv), "rows contiguous in the last dim")
        check_tensor("o", o, torch.bfloat16, 3, dev, contiguous=True)
        if tuple(o.shape) != (T, H, V_DIM):
            fail("o", describe(o), f"[{T}, {H}, {V_DIM}] (the code objects write 512-wide V)")
        qo_indptr, kv_indptr, kv_indices, last = (a["qo_indptr"], a["kv_indptr"], a["kv_indices"],
                                                  a["kv_last_page_lens"])
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_last_page_lens", last)):
            check_tensor(name, t, torch.int32, 1, dev, contiguous=True)
        B = qo_indptr.numel() - 1
        if kv_indptr.numel() != B + 1 or last.numel() != B:
            fail("kv_indptr/kv_last_page_lens", f"{describe(kv_indptr)}, {describe(last)}", f"[{B + 1}] and [{B}]")
        if a["max_seqlen_q"] != 1 or B != T:
            fail("max_seqlen_q/qo_indptr", f"{a['max_seqlen_q']} / {B} batch rows for {T} tokens",
                 "1 query token per batch row (the adapter flattens tokens; MTP tokens are separate rows)")
        if a["logit_cap"] > 0:
            fail("logit_cap", a["logit_cap"], "<= 0")
        fp8 = q.dtype == self.fp8
        if fp8 != (kv.dtype == self.fp8):
            fail("q/kv_buffer dtypes", f"{q.dtype} / {kv.dtype}", "both bf16 or both the arch's fp8 (a16w8 is "
                 "not modelled)")
        if fp8:
            check_scale("q_scale", a["q_scale"], dev)
            check_scale("kv_scale", a["kv_scale"], dev)
        meta_names = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
                      "reduce_partial_map")
        meta = [a[n] for n in meta_names]
        persistent = a["work_meta_data"] is not None
        if persistent and any(m is None for m in meta):
            fail("work_* / reduce_*", "some of the six persistent buffers missing", "all six together")
        if persistent and not fp8:
            fail("q", f"bf16 q/kv in persistent mode on {self.arch}", "FP8/FP8 (bf16 persistent is not modelled)")
        obj = self.stage1_object(H, fp8, persistent, return_lse)
        self._load(obj.name)
        if not capturing():
            check_indptr_values(qo_indptr, kv_indptr, last)
        qf = self._q_rows(q, a["q_scale"] if fp8 else None)
        kv_flat = storage_from(kv)
        row_bytes, elem = kv.stride(0) * kv.element_size(), kv.element_size()
        kscale = a["kv_scale"].float() if fp8 else None

        def rows(idx):
            k = read_windows(kv_flat, row_starts(idx, row_bytes, elem, obj.wide), ROW, "kv_indices/kv_buffer")
            return k.float() * kscale if kscale is not None else k.float()

        scale = self._sm_scale(a, D)
        p_dtype = self.fp8 if fp8 else None
        if persistent:
            out, lse, mode = self._decode_persistent(a, qf, rows, meta, obj, scale, p_dtype)
        else:
            out, lse, mode = self._decode_split(a, qf, rows, fp8, scale, p_dtype, return_lse,
                                                kv_flat.numel() * elem // row_bytes)
        self.calls.append(("mla_decode_fwd", f"{mode} {obj.name}"))
        o.copy_(out)
        if self.flavor == "0.1.7" or not return_lse:
            lse = torch.full_like(lse, STALE)  # final_lse: torch.empty, never written
        return o, lse

    def _q_rows(self, q: torch.Tensor, q_scale) -> torch.Tensor:
        """float32 [T, H, 576]: head h of token t read from ``t * stride(0) + h * 576``."""
        T, H, _ = q.shape
        starts = (torch.arange(T, device=q.device)[:, None] * q.stride(0)
                  + torch.arange(H, device=q.device)[None, :] * ROW).reshape(-1)
        rows = read_windows(storage_from(q), starts, ROW, "q").float().view(T, H, ROW)
        return rows * q_scale.float() if q_scale is not None else rows

    def _decode_split(self, a, qf, rows, fp8, scale, p_dtype, return_lse, num_rows):
        """Stage 1 over S splits of each row's ragged CSR range, then stage 2 (see module docstring).
        Each split reads its indices in 16-key tiles: the entries past its end up to the tile
        boundary are loaded too (masked from the softmax, their V times p = 0); one that is
        negative or past ``num_rows`` folds to row 0, and a non-finite V there poisons the split
        (0 * NaN), as in AITER's v4 nm before #4245."""
        B, H, dev = qf.shape[0], qf.shape[1], qf.device
        S, splits_indptr = a["num_kv_splits"], a["num_kv_splits_indptr"]
        kv_indptr, kv_indices = a["kv_indptr"], a["kv_indices"]
        if S is None:
            S = meta_splits(B, kv_indices.numel(), H, fp8, self.cu_num)
        elif isinstance(S, bool) or not isinstance(S, int) or S < 1:
            fail("num_kv_splits", repr(S), "an int >= 1 or None")
        if splits_indptr is not None:
            check_tensor("num_kv_splits_indptr", splits_indptr, torch.int32, 1, dev, contiguous=True)
            if not capturing() and not torch.equal(splits_indptr.cpu(), torch.arange(B + 1, dtype=torch.int32) * S):
                fail("num_kv_splits_indptr", splits_indptr.tolist()[:8], f"arange(B + 1) * {S} (uniform splits)")
        mgc = stage2_keys_per_split(H, fp8)
        self._load(f"stage2(mgc={mgc}, lse={return_lse})")
        lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
        block = FP8_BLOCK[H] if fp8 else mgc
        if self.stage1_partition == "even" and not fp8:
            chunk = -(-lens // S)
            written = -(-lens // chunk.clamp(min=1))
        else:
            written = torch.minimum(torch.full_like(lens, S), -(-lens // block))
            chunk = -(-lens // written.clamp(min=1))
        n = kv_indices.numel()
        row, j = key_ranges(kv_indptr, n)
        valid = torch.arange(n, device=dev) < kv_indptr[-1].long()
        seg = row * S + (j // chunk[row].clamp(min=1)).clamp(max=S - 1)
        out, lse, _ = attend(qf, rows, kv_indices, seg, valid, torch.arange(B, device=dev).repeat_interleave(S),
                             scale, p_dtype)
        if S == 1 and fp8:  # one pass: the kernel writes o directly; stage 2 (and the final LSE) skipped
            return out, torch.full((B, H), STALE, device=dev), "split1"
        part_out, part_lse = out.view(B, S, H, V_DIM), lse.view(B, S, H)
        if not capturing():
            poisoned = self._tile_overread(rows, kv_indptr, kv_indices, chunk, written, S, num_rows)
            part_out = torch.where(poisoned[:, :, None, None], torch.full_like(part_out, math.nan), part_out)
        unwritten = (torch.arange(S, device=dev)[None, :] >= written[:, None])[:, :, None]
        part_lse = torch.where(unwritten, torch.full_like(part_lse, math.nan), part_lse)
        merged, final = stage2_merge(part_out, part_lse, torch.minimum(torch.full_like(lens, S), -(-lens // mgc)))
        return merged, final, f"split{S}"

    @staticmethod
    def _tile_overread(rows, kv_indptr, kv_indices, chunk, written, S: int, num_rows: int, tile: int = 16):
        """bool [B, S]: split s of row b over-reads (see :meth:`_decode_split`) a non-finite row."""
        dev = chunk.device
        start = kv_indptr[:-1].long()[:, None] + torch.arange(S, device=dev)[None, :] * chunk[:, None]
        end = torch.minimum(start + chunk[:, None], kv_indptr[1:].long()[:, None])
        tile_end = start + (end - start + tile - 1) // tile * tile
        pos = end[:, :, None] + torch.arange(tile - 1, device=dev)
        live = (pos < tile_end[:, :, None]) & (torch.arange(S, device=dev)[None, :, None] < written[:, None, None])
        n = kv_indices.numel()
        idx = torch.where(pos < n, kv_indices[pos.clamp(max=max(n - 1, 0))].long(), torch.zeros_like(pos))
        idx = torch.where((idx < 0) | (idx >= num_rows), torch.zeros_like(idx), idx)
        bad = torch.zeros_like(live)
        if bool(live.any()):
            bad[live] = ~torch.isfinite(rows(idx[live])[:, :V_DIM]).all(dim=1)
        return bad.any(dim=2)

    def _decode_persistent(self, a, qf, rows, meta, obj, scale, p_dtype):
        """Key ranges come from the work plan; with ``topk`` (sparse plan) batch row b reads the
        fixed-stride row ``kv_indices[b*topk : b*topk + min(len_b, topk)]``, every entry."""
        B, H, dev = qf.shape[0], qf.shape[1], qf.device
        work_info = meta[2]
        plan = self._plans.get(work_info.data_ptr())
        if plan is None:
            fail("work_info_set", "buffers never filled by get_mla_metadata_v1", "a plan for this step")
        if plan["heads"] != H or plan["batch"] != B:
            fail("work_info_set", f"a plan for {plan['batch']} rows x {plan['heads']} heads",
                 f"a plan for this call's {B} rows x {H} heads")
        kv_indptr, kv_indices = a["kv_indptr"], a["kv_indices"]
        if "works" in plan:
            return self._run_works(a, qf, rows, meta, obj, scale, p_dtype, plan)
        starts, ends = work_info[:B, 4].long(), work_info[:B, 5].long()
        if not capturing() and not (torch.equal(starts, kv_indptr[:-1].long()) and
                                     torch.equal(ends, kv_indptr[1:].long())):
            fail("work_info_set", "a stale work plan (filled for other kv_indptr values)",
                 "get_mla_metadata_v1 re-run after every kv_indptr update (stale plans read out of bounds)")
        self._load("mla_reduce_v1")
        topk = plan["topk"]
        if topk > 0:
            if kv_indices.numel() < B * topk:
                fail("kv_indices", describe(kv_indices), f">= B * topk = {B * topk} entries (fixed stride)")
            col = torch.arange(topk, device=dev)
            lens = (ends - starts).clamp(0, topk)
            keys = kv_indices[: B * topk]
            valid = (col[None, :] < lens[:, None]).reshape(-1)
            seg = torch.arange(B, device=dev).repeat_interleave(topk)
        else:  # dense persistent plan: ragged ranges from the plan
            keys = kv_indices
            seg, j = key_ranges(kv_indptr, kv_indices.numel())
            valid = j < (ends - starts)[seg]
        out, lse, has = attend(qf, rows, keys, seg, valid, torch.arange(B, device=dev), scale, p_dtype)
        self.call_bytes.append(meta[5].numel() * H * (V_DIM + 1) * 4)
        mode = f"persistent topk={topk}"
        if not obj.writes_lse:
            return out, torch.full_like(lse, STALE), mode
        return out, torch.where(has[:, None], lse, torch.full_like(lse, math.inf)), mode

    def _run_works(self, a, qf, rows, meta, obj, scale, p_dtype, plan):
        """Persistent call over the planner's works: each work attends its key range (P rounded
        per work), split rows are merged by the reduce; the code object's granularity holds."""
        B, H, dev = qf.shape[0], qf.shape[1], qf.device
        kv_indptr, kv_indices, topk = a["kv_indptr"], a["kv_indices"], plan["topk"]
        if (kv_indptr[1:] - kv_indptr[:-1]).tolist() != plan["lens"]:
            fail("work_info_set", "a stale work plan (filled for other kv_indptr values)",
                 "get_mla_metadata_v1 re-run after every kv_indptr update (stale plans read out of bounds)")
        if kv_indices.numel() < B * topk:
            fail("kv_indices", describe(kv_indices), f">= B * topk = {B * topk} entries (fixed stride)")
        self._load("mla_reduce_v1")
        g = obj.kv_granularity
        for i, (b, sub, start, end) in enumerate(plan["works"]):
            nxt = plan["works"][i + 1] if i + 1 < len(plan["works"]) else None
            last = nxt is None or nxt[:2] != (b, sub)
            if (start - b * topk) % g or (not last and (end - start) % g):
                fail("kv_granularity",
                     f"a work of keys [{start - b * topk}, {end - b * topk}) of row {b} ({obj.name})",
                      f"works of whole {g}-key passes (its SUB_KV); the planner splits rows in kv_granularity "
                      f"blocks: pass kv_granularity={g}")
        # every pseudo-batch of a row reads the same keys for its 16 heads: one set of works for all heads
        works = [(b, start, end) for b, sub, start, end in plan["works"] if sub == 0]
        pos = [torch.arange(s, e, device=dev) for _, s, e in works]
        seg = torch.cat([torch.full((e - s,), i, device=dev) for i, (_, s, e) in enumerate(works)]).long()
        keys = kv_indices[torch.cat(pos)] if pos else kv_indices[:0]
        work_row = torch.tensor([b for b, _, _ in works], device=dev, dtype=torch.long)
        part_out, part_lse, has = attend(qf, rows, keys, seg, torch.ones_like(seg, dtype=torch.bool), work_row, scale,
                                         p_dtype)
        # the reduce: an LSE merge of each row's works (works without a key contribute nothing)
        part_lse = torch.where(has[:, None], part_lse, torch.full_like(part_lse, -math.inf))
        top = torch.full((B, H), -math.inf, device=dev).scatter_reduce_(0, work_row[:, None].expand(-1, H), part_lse,
                                                                       "amax")
        top_ref = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = torch.exp(part_lse - top_ref[work_row])
        total = torch.zeros(B, H, device=dev).index_add_(0, work_row, w)
        acc = torch.zeros(B, H, V_DIM, device=dev).index_add_(
            0, work_row, torch.where(has[:, None, None], w[..., None] * part_out, torch.zeros_like(part_out)))
        row_has = torch.zeros(B, dtype=torch.bool, device=dev).index_fill_(0, work_row[has], True)
        out = torch.where(row_has[:, None, None], acc / total[..., None], torch.full_like(acc, math.nan))
        lse = torch.where(row_has[:, None], top_ref + torch.log(total), torch.full_like(total, math.inf))
        self.call_bytes.append(meta[5].numel() * H * (V_DIM + 1) * 4)
        mode = f"persistent topk={topk} works={len(works)}"
        if not obj.writes_lse:
            return out, torch.full_like(lse, STALE), mode
        return out, lse, mode

    @staticmethod
    def _sm_scale(a, D: int) -> float:
        s = a["sm_scale"]
        if s is None:
            return D ** -0.5
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
            fail("sm_scale", repr(s), "a python float > 0")
        return float(s)

