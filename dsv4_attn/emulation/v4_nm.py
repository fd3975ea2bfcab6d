"""``mla_decode_fwd_v4_nm`` emulated (AITER >= 0.1.17, gfx950): packed fp8 rows with per-tile
scales, bf16 RoPE apart, the softmax scale fixed at 1/sqrt(512), the sink in the kernel."""

from __future__ import annotations

import math

import torch

from .attend import attend, key_ranges, stage2_merge
from .base import EmulatorBase
from .contract import capturing, check_indptr_values, check_tensor, describe, fail
from .planner import meta_splits
from .releases import NM_ROPE, NM_ROW_BYTES, V4_NM_HEADS, V4_NM_OBJECT, V_DIM


class NmKernel(EmulatorBase):
    """``mla_decode_fwd_v4_nm``, both releases' signatures."""

    def _mla_decode_fwd_v4_nm(self, q, qrope, kv_buffer, kvrope, output, qo_indptr, kv_indptr, kv_page_indices,
                              max_seqlen_q, *, sink, split_indptr=None, sm_scale=None, out_16_nosplit=0,
                              num_kv_splits=None, logits=None, attn_lse=None, kv_last_page_lens=None):
        return self._v4_nm(q, qrope, kv_buffer, kvrope, output, qo_indptr, kv_indptr, kv_page_indices,
                           max_seqlen_q, sink, split_indptr, num_kv_splits, logits, attn_lse)

    def _mla_decode_fwd_v4_nm_0117(self, q, qrope, kv_buffer, kvrope, output, qo_indptr, kv_indptr, kv_page_indices,
                                   kv_last_page_lens, max_seqlen_q, *, sink, split_indptr=None, sm_scale=None,
                                   out_16_nosplit=0, num_kv_splits=None, logits=None, attn_lse=None):
        """0.1.17 / 0.1.18: ``kv_last_page_lens`` is the 9th positional parameter (an int32
        tensor; a positional call of the 0.1.19 order hands it max_seqlen_q)."""
        check_tensor("kv_last_page_lens", kv_last_page_lens, torch.int32, 1, q.device if isinstance(q, torch.Tensor)
                     else None)
        return self._v4_nm(q, qrope, kv_buffer, kvrope, output, qo_indptr, kv_indptr, kv_page_indices,
                           max_seqlen_q, sink, split_indptr, num_kv_splits, logits, attn_lse)

    # ---- mla_decode_fwd_v4_nm -------------------------------------------------------------
    def _nm_rows(self, packed: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """float32 [..., 512] of packed v4 nm rows (uint8/fp8 [..., 512]) and their bf16 RoPE [..., 64]."""
        raw = packed.view(torch.uint8)
        nope = raw[..., :448].contiguous().view(self.fp8).float()
        exps = raw[..., 448:462].float()
        scales = torch.where(exps == 255, torch.full_like(exps, math.nan), torch.exp2(exps - 127.0))
        nope = (nope.unflatten(-1, (14, 32)) * scales[..., None]).flatten(-2)
        return torch.cat([nope, rope.float()], dim=-1)

    def _v4_nm(self, q, qrope, kv, kvrope, output, qo_indptr, kv_indptr, kv_indices, max_seqlen_q, sink,
               split_indptr, num_kv_splits, logits, attn_lse):
        if self.arch != "gfx950":
            fail("mla_decode_fwd_v4_nm", f"arch {self.arch}", "gfx950 (the only shipped v4 nm code object: "
                 f"hsa/gfx950/mla_v4/{V4_NM_OBJECT})")
        check_tensor("q", q, self.fp8, 3, contiguous=True)
        dev = q.device
        T, H, _ = q.shape
        check_tensor("sink", sink, torch.float32, 1, dev, contiguous=True)
        check_tensor("qrope", qrope, torch.bfloat16, 3, dev, contiguous=True)
        check_tensor("kv_buffer", kv, self.fp8, 4, dev, contiguous=True)
        check_tensor("kvrope", kvrope, torch.bfloat16, 4, dev, contiguous=True)
        check_tensor("output", output, torch.bfloat16, 3, dev, contiguous=True)
        P = kv.shape[0]
        if q.shape[2] != NM_ROW_BYTES or kv.shape[1:] != (1, 1, NM_ROW_BYTES):
            fail("q/kv_buffer", f"{describe(q)}, {describe(kv)}",
                 f"[T, H, {NM_ROW_BYTES}] and [P, 1, 1, {NM_ROW_BYTES}] packed rows (page size 1)")
        if qrope.shape != (T, H, NM_ROPE) or kvrope.shape != (P, 1, 1, NM_ROPE):
            fail("qrope/kvrope", f"{describe(qrope)}, {describe(kvrope)}", f"[{T}, {H}, 64] and [{P}, 1, 1, 64]")
        if sink.numel() != H:
            fail("sink", describe(sink), f"[{H}] (num_heads)")
        if tuple(output.shape) != (T, H, V_DIM):
            fail("output", describe(output), f"[{T}, {H}, {V_DIM}]")
        if max_seqlen_q != 1 or H not in V4_NM_HEADS:
            fail("q", f"{H} heads, max_seqlen_q {max_seqlen_q}", f"heads {V4_NM_HEADS} with one query token "
                 "(asm_mla_v4.cu's fp8 whitelist)")
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_page_indices", kv_indices)):
            check_tensor(name, t, torch.int32, 1, dev, contiguous=True)
        if qo_indptr.numel() != T + 1 or kv_indptr.numel() != T + 1:
            fail("qo_indptr/kv_indptr", f"{describe(qo_indptr)}, {describe(kv_indptr)}", f"[{T + 1}] (one token a row)")
        if not capturing():
            check_indptr_values(qo_indptr, kv_indptr)
        S = num_kv_splits
        if S is None:
            S = meta_splits(T, kv_indices.numel(), H, True, self.cu_num, tg_factor=-(-H // 64), ignore_total_kv=True)
        if isinstance(S, bool) or not isinstance(S, int) or S < 1:
            fail("num_kv_splits", repr(S), "an int >= 1 or None")
        if split_indptr is not None:
            check_tensor("split_indptr", split_indptr, torch.int32, 1, dev, contiguous=True)
            if not capturing() and not torch.equal(split_indptr.cpu(), torch.arange(T + 1, dtype=torch.int32) * S):
                fail("split_indptr", split_indptr.tolist()[:8], f"arange(T + 1) * {S} (uniform splits)")
        for name, buf, shape in (("logits", logits if S > 1 else None, (T, S, H, V_DIM)),
                                 ("attn_lse", attn_lse, (T, S, H, 1))):
            if buf is not None and tuple(buf.shape) != shape:
                fail(name, describe(buf), f"None or {shape} float32 (kernel-native layout)")
        self._load(V4_NM_OBJECT)
        qf = self._nm_rows(q, qrope)
        n = kv_indices.numel()
        row, j = key_ranges(kv_indptr, n)
        valid = torch.arange(n, device=dev) < kv_indptr[-1].long()
        lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
        chunk = (-(-lens // S) + 31) // 32 * 32  # splits of whole 32-key passes; the kernel exports the count
        written = torch.minimum(torch.full_like(lens, S), -(-lens // chunk.clamp(min=1)))
        seg = row * S + (j // chunk[row].clamp(min=1)).clamp(max=S - 1)
        kv_u8, kv_rope = kv.view(P, NM_ROW_BYTES), kvrope.view(P, NM_ROPE)

        def rows(idx):
            starts = (idx.long() & 0xFFFFFFFF)
            if not capturing() and starts.numel() and int(starts.max()) >= P:
                fail("kv_page_indices", f"max {int(starts.max())} (kv_buffer has {P} rows)",
                     "row ids inside kv_buffer: every index inside a range is read")
            starts = starts.clamp(max=P - 1)
            return self._nm_rows(kv_u8[starts], kv_rope[starts])

        first = (torch.arange(T * S, device=dev) % S == 0)[:, None]
        seg_sink = torch.where(first, sink.float()[None, :], torch.full((T * S, H), -math.inf, device=dev))
        out, lse, _ = attend(qf, rows, kv_indices, seg, valid, torch.arange(T, device=dev).repeat_interleave(S),
                             NM_ROW_BYTES ** -0.5, None, seg_sink)
        self.calls.append(("mla_decode_fwd_v4_nm", f"split{S}"))
        if S == 1:
            output.copy_(out)  # keyless rows: 0 with a finite sink, NaN without
            return output.view(T, 1, H, V_DIM), lse.view(T, 1, H, 1)
        self._load("stage2(v4_nm)")
        unwritten = (torch.arange(S, device=dev)[None, :] >= written[:, None])[:, :, None]
        part_lse = torch.where(unwritten, torch.full_like(lse.view(T, S, H), math.nan), lse.view(T, S, H))
        merged, _ = stage2_merge(out.view(T, S, H, V_DIM), part_lse, written)
        output.copy_(merged)
        logits = out.view(T, S, H, V_DIM) if logits is None else logits.copy_(out.view(T, S, H, V_DIM))
        attn_lse = part_lse[..., None] if attn_lse is None else attn_lse.copy_(part_lse[..., None])
        return logits, attn_lse

