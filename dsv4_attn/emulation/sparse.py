"""``sparse_mla_fwd`` emulated (the keyword set vLLM 0.33 calls; flavor "sparse"): both scopes,
the sink and caches read in place in the formats its Triton kernels classify."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .attend import attend, key_ranges
from .base import EmulatorBase
from .contract import capturing, check_scale, check_tensor, describe, fail
from .releases import DSV4_ROW_BYTES


class SparseKernel(EmulatorBase):
    """``sparse_mla_fwd``."""

    def _sparse_mla_fwd(self, q, kv_buffer, kv_indptr, kv_indices, softmax_scale, *, kv_scale=None,
                        kv_lora_rank=512, qk_rope_head_dim=64, kv_splits=None, skip_reduce=False, has_invalid=False,
                        dot_precision="bf16", q_scale=None, out=None, return_lse=False, attn_sink=None,
                        extra_kv=None, extra_indptr=None, extra_indices=None,
                        inv_rope_positions=None, inv_rope_cos_sin_cache=None, out_mxfp8=None):
        """The keyword set vLLM 0.33 calls (``_aiter_ops.triton_sparse_mla_fwd``): one
        ``kv_scale`` for both caches, no ``extra_kv_scale``."""
        return self._sparse(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, kv_scale, kv_lora_rank,
                            qk_rope_head_dim, skip_reduce, has_invalid, dot_precision, out, return_lse, attn_sink,
                            extra_kv, extra_indptr, extra_indices,
                            inv_rope_positions is not None or out_mxfp8 is not None)

    # ---- sparse_mla_fwd -------------------------------------------------------------------
    def _classify(self, q, kv, scale, what: str) -> str:
        """Format tag of a 3-D block cache, as sparse_mla.py's _classify_cache infers it."""
        check_tensor(what, kv, None, 3, q.device)
        nb, bs, width = kv.shape
        if kv.stride(2) != 1 or (bs > 1 and kv.stride(1) != width):
            fail(what, describe(kv), "rows contiguous inside a block (stride(2) == 1, stride(1) == width)")
        if width == DSV4_ROW_BYTES and kv.dtype == torch.uint8:
            if scale is not None:
                fail(f"{what} scale", describe(scale), "None: packed caches carry their own scales")
            return "fp8_dsv4_mla"
        if width != q.shape[2]:
            fail(what, describe(kv), f"[nb, block, {q.shape[2]}] (bf16 / fp8_scalar) or [nb, block, 584] uint8")
        if kv.dtype == torch.bfloat16:
            return "bf16"
        if kv.dtype not in (self.fp8, torch.uint8):
            fail(what, f"{kv.dtype}", f"bfloat16, uint8 [.., 584] or {self.fp8} (gfx950's OCP e4m3)")
        if scale is None:
            fail(f"{what} scale", "None", "a [1] float32 kv_scale for an fp8_scalar cache")
        check_scale(f"{what} scale", scale, q.device)
        return "fp8_scalar"

    def _cache_rows(self, kv, fmt: str, scale) -> Callable[[torch.Tensor], torch.Tensor]:
        """slot -> float32 row [n, 512] of a block cache (block stride from stride(0))."""
        nb, bs, _ = kv.shape
        if fmt != "fp8_dsv4_mla":
            mult = scale.float() if fmt == "fp8_scalar" else None

            def plain(idx):
                idx = idx.long()
                r = kv[idx // bs, idx % bs]
                r = r.view(self.fp8) if r.dtype == torch.uint8 else r
                return r.float() * mult if mult is not None else r.float()
            return plain
        s0 = kv.stride(0)
        data = kv.as_strided((nb, bs, 576), (s0, 576, 1))
        scl = kv.as_strided((nb, bs, 8), (s0, 8, 1), kv.storage_offset() + bs * 576)

        def packed(idx):  # 448 fp8 NoPE (7 tiles of 64, UE8M0 scale each) | 64 bf16 RoPE
            idx = idx.long()
            d, e = data[idx // bs, idx % bs], scl[idx // bs, idx % bs]
            nope = d[:, :448].contiguous().view(self.fp8).float().view(-1, 7, 64)
            nope = nope * torch.exp2(e[:, :7].float() - 127.0)[:, :, None]
            rope = d[:, 448:].contiguous().view(torch.bfloat16).float()
            return torch.cat([nope.reshape(-1, 448), rope], dim=1)
        return packed

    def _sparse(self, q, kv, kv_indptr, kv_indices, softmax_scale, kv_scale, kv_lora_rank, qk_rope_head_dim,
                skip_reduce, has_invalid, dot_precision, out, return_lse, attn_sink, extra_kv, extra_indptr,
                extra_indices, epilogue):
        if self.arch != "gfx950":
            fail("sparse_mla_fwd", f"arch {self.arch}", "gfx950 (sparse_mla.py asserts it: gfx950 Gluon kernels)")
        check_tensor("q", q, torch.bfloat16, 3, device=None)
        if q.stride(2) != 1:
            fail("q", describe(q), "last dim contiguous")
        C, H, d_qk = q.shape
        dev = q.device
        if skip_reduce or dot_precision != "bf16" or epilogue:
            fail("skip_reduce/dot_precision/inv_rope/out_mxfp8", "non-default", "defaults (adapter never uses them)")
        fmt = self._classify(q, kv, kv_scale, "kv_buffer")
        extra = (extra_kv, extra_indptr, extra_indices)
        has_extra = all(x is not None for x in extra)
        if any(x is not None for x in extra) and not has_extra:
            fail("extra_kv/extra_indptr/extra_indices", "some given", "all three together")
        x_fmt = ""  # no extra scope
        if has_extra:
            x_scale = kv_scale
            x_fmt = self._classify(q, extra_kv, x_scale if fmt == "fp8_scalar" else None, "extra_kv")
            if (fmt == "fp8_scalar") != (x_fmt == "fp8_scalar"):
                fail("extra_kv", x_fmt, f"a cache of the two-loop family of kv_buffer ({fmt})")
        if (fmt == "fp8_dsv4_mla" or has_extra) and return_lse:
            fail("return_lse", True, "False for dsv4 / two-loop caches")
        if fmt != "fp8_dsv4_mla":
            if d_qk != kv_lora_rank + qk_rope_head_dim or kv_lora_rank & (kv_lora_rank - 1):
                fail("kv_lora_rank/qk_rope_head_dim", f"{kv_lora_rank}/{qk_rope_head_dim} for q width {d_qk}",
                     "powers of two summing to q's width (DSv4 rows: 512 / 0)")
        elif d_qk != 512:
            fail("q", describe(q), "width 512 for fp8_dsv4_mla")
        for pre, ip, ix in (("", kv_indptr, kv_indices), ("extra_", extra_indptr, extra_indices)):
            if ip is None:
                continue
            check_tensor(f"{pre}kv_indptr", ip, torch.int32, 1, dev, contiguous=True)
            check_tensor(f"{pre}kv_indices", ix, torch.int32, 1, dev, contiguous=True)
            if ip.numel() != C + 1:
                fail(f"{pre}kv_indptr", describe(ip), f"[C + 1 = {C + 1}] (check the indptr/indices order)")
        if attn_sink is not None:
            check_tensor("attn_sink", attn_sink, torch.float32, 1, dev, contiguous=True)
            if attn_sink.numel() != H:
                fail("attn_sink", describe(attn_sink), f"[{H}] (one per head)")
        if out is not None:
            check_tensor("out", out, torch.bfloat16, 3, dev)
            if out.shape[0] != C or out.shape[1] != H or out.shape[2] < kv_lora_rank or out.stride(2) != 1:
                fail("out", describe(out), f"[{C}, {H}, >= {kv_lora_rank}] bf16, last dim contiguous")
        else:
            out = torch.empty(C, H, 512, dtype=torch.bfloat16, device=dev)
        self._load(f"sparse_mla_fwd({fmt}{'+' + x_fmt if x_fmt else ''})")
        segments = [(kv, fmt, kv_scale, kv_indptr, kv_indices)]
        if has_extra:
            segments.append((extra_kv, x_fmt, x_scale, extra_indptr, extra_indices))
        idx_all, batch_all, valid_all, readers = [], [], [], []
        for seg, (cache, f, sc, ip, ix) in enumerate(segments):
            num_slots = cache.shape[0] * cache.shape[1]
            if not capturing():
                self._check_sparse_values(ip, ix, num_slots, has_invalid, "extra_" if seg else "")
            b, _ = key_ranges(ip, ix.numel())
            idx_all.append(ix)
            batch_all.append(b)
            valid_all.append((torch.arange(ix.numel(), device=dev) < ip[-1].long()) & (ix >= 0))
            readers.append(self._cache_rows(cache, f, sc))

        def rows(idx):  # dispatch flat key positions to their segment's cache (tag in the index)
            seg = idx // (1 << 40)
            local = idx % (1 << 40)
            r0 = readers[0](torch.where(seg == 0, local, torch.zeros_like(local)))
            if len(readers) == 1:
                return r0
            r1 = readers[1](torch.where(seg == 1, local, torch.zeros_like(local)))
            return torch.where((seg == 1)[:, None], r1, r0)

        tagged = torch.cat([ix.long() + (s << 40) for s, ix in enumerate(idx_all)])
        valid = torch.cat(valid_all)
        sink = None if attn_sink is None else attn_sink.float()[None, :].expand(C, H)
        o, lse, has = attend(q.float(), rows, tagged, torch.cat(batch_all), valid, torch.arange(C, device=dev),
                             float(softmax_scale), None, sink)
        o = torch.where(has[:, None, None], o, torch.full_like(o, math.nan))  # keyless rows: unspecified
        out[:, :, :kv_lora_rank].copy_(o[..., :kv_lora_rank])
        self.calls.append(("sparse_mla_fwd", f"{fmt}{'+' + x_fmt if x_fmt else ''}"))
        if not return_lse:
            return out, None
        # sparse_mla_fwd's LSE INCLUDES the sink (a virtual key); a fully masked row reports -inf
        return out, torch.where(torch.isnan(lse), torch.full_like(lse, -math.inf), lse)

    @staticmethod
    def _check_sparse_values(ip, ix, num_slots, has_invalid, pre) -> None:
        n = int(ip[-1])
        if int(ip[0]) != 0 or bool(((ip[1:] - ip[:-1]) < 0).any()) or n > ix.numel():
            fail(f"{pre}kv_indptr", ip.tolist()[:8], f"0, non-decreasing, last <= {ix.numel()}")
        used = ix[:n]
        if n and int(used.max()) >= num_slots:
            fail(f"{pre}kv_indices", f"max {int(used.max())}", f"GLOBAL slot ids < {num_slots}")
        if n and int(used.min()) < (-1 if has_invalid else 0):
            fail(f"{pre}kv_indices", f"min {int(used.min())} with has_invalid={has_invalid}",
                 "slot ids >= 0 (or -1 sentinels with has_invalid=True)")
