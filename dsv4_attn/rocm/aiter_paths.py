"""The three AITER entry points the `aiter` backend runs a layer through (``PATHS``): their
scratch, their one-token warm-up runs and their calls."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import torch

from ..common.backend import (
    LayerInputs,
)
from ..common.layout import CacheGeometry, Fp8Dialect, KVFormat, Record, new_cache, packed_records, quantize_model1
from ..common.merge import apply_sink, merge_lse
from ..common.plan import StepPlan
from ..common.spec import HEAD_DIM, NOPE_DIM, NUM_QUANT_TILES
from .aiter_api import AiterAPI, call_by_keyword
from .aiter_features import (
    NM_HEADS,
    NM_ROW,
    PLAN_GRANULARITY,
    ROW,
    native_dialect,
    persistent_lse_heads,
    scope_widths,
    split_heads,
    split_mgc,
)
from .aiter_steps import AiterMeta, AiterSteps
from .scratch import AiterScratch, ScopeBuffers, ScratchKey, amax, pow2_scale_, quantize_pow2_, to_fp8
from .staging import ROWS_PER_CHUNK, chunks, decode_rows


def nm_pack(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MODEL1 records uint8 [N, 584] -> (v4 nm rows uint8 [N, 512], RoPE bf16 [N, 64]): the e4m3
    NoPE bytes, each tile's UE8M0 byte twice (the kernel reads one per 32 columns), zero pad."""
    scales = records[:, ROW : ROW + NUM_QUANT_TILES].repeat_interleave(2, dim=1)
    pad = torch.zeros(records.shape[0], NM_ROW - NOPE_DIM - scales.shape[1], dtype=torch.uint8,
                      device=records.device)
    packed = torch.cat([records[:, :NOPE_DIM], scales, pad], dim=1)
    return packed, records[:, NOPE_DIM:ROW].contiguous().view(torch.bfloat16)



class AiterPaths(AiterSteps):
    """``sparse_mla_fwd``, ``mla_decode_fwd_v4_nm`` and ``mla_decode_fwd`` (split or persistent).

    ``gather_chunk_rows``: the most rows the gathered paths stage at once (:mod:`.staging`)."""

    gather_chunk_rows = ROWS_PER_CHUNK

    # ---- path 1: sparse_mla_fwd ---------------------------------------------------------------
    def _sparse_scratch(self, api: AiterAPI, plan: StepPlan, fmt: KVFormat, heads: int) -> AiterScratch:
        # its Triton kernels compile per cache format and scope count on first use
        self._warm(("sparse_mla_fwd", fmt, heads),
                   [functools.partial(self._sparse_dummy, api, fmt, heads, plan.device, two) for two in (False, True)])
        return self._get_scratch(api, ScratchKey(
            path="sparse_mla_fwd", device=plan.device, max_tokens=self.max_decode_tokens, heads=heads,
            widths=scope_widths(plan.spec), q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, layout="slots"))

    @staticmethod
    def _sparse_dummy(api: AiterAPI, fmt: KVFormat, heads: int, device: torch.device, two_scopes: bool) -> None:
        """One token, one zero key in a one-block cache of ``fmt`` (and a second scope)."""
        cache = new_cache(fmt, 1, 64, device)
        i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        indptr, indices = torch.arange(2, **i32), torch.zeros(1, **i32)
        scale = torch.ones(1, dtype=torch.float32, device=device) if fmt is KVFormat.FP8_TENSOR else None
        extra = dict(extra_kv=cache, extra_indptr=indptr, extra_indices=indices) if two_scopes else {}
        sparse_mla_fwd = api.function("sparse_mla_fwd")
        sparse_mla_fwd(torch.zeros(1, heads, HEAD_DIM, dtype=torch.bfloat16, device=device), cache, indptr,
                           indices, 1.0, kv_scale=scale, kv_lora_rank=HEAD_DIM, qk_rope_head_dim=0,
                           has_invalid=False, out=torch.empty(1, heads, HEAD_DIM, dtype=torch.bfloat16, device=device),
                           attn_sink=torch.zeros(heads, dtype=torch.float32, device=device), **extra)

    def _forward_sparse(self, api: AiterAPI, plan: StepPlan, meta: AiterMeta, layer: LayerInputs,
                        out: torch.Tensor) -> None:
        T, H = plan.num_tokens, layer.q.shape[1]
        scr = meta.scratch
        built = []
        for name, rows, lens, cache, geo in self._scopes(plan, layer):
            sb = self._indices(plan, meta, name, [(rows, lens, geo.num_slots)], layer.kind.uses_topk and name != "swa",
                               api)
            scale = None
            if layer.fmt is KVFormat.FP8_TENSOR:
                scale = sb.kv_scale
                scale.fill_(layer.kv_scale)
            built.append((sb, cache, scale))
        (swa, swa_cache, swa_scale), extra = built[0], (built[1] if len(built) > 1 else None)
        kwargs = dict(kv_scale=swa_scale, kv_lora_rank=HEAD_DIM, qk_rope_head_dim=0, has_invalid=False, out=out,
                      attn_sink=None if layer.sink is None else self._stage_sink(scr, layer.sink, H))
        if extra is not None:
            sb, cache, _ = extra
            kwargs.update(extra_kv=cache, extra_indptr=sb.kv_indptr[: T + 1],
                          extra_indices=sb.kv_indices[: T * sb.width])  # one kv_scale serves both caches
        api.function("sparse_mla_fwd")(layer.q, swa_cache, swa.kv_indptr[: T + 1], swa.kv_indices[: T * swa.width],
                           layer.softmax_scale, **kwargs)
        empty = swa.counts[:T] == 0
        if extra is not None:
            empty &= extra[0].counts[:T] == 0
        out.masked_fill_(empty[:, None, None], 0.0)  # AITER's output for a row with no key is unspecified

    # ---- path 2: mla_decode_fwd_v4_nm, both scopes + sink in one call -------------------------
    def _nm_scratch(self, api: AiterAPI, plan: StepPlan, fmt: KVFormat, num_heads: int) -> AiterScratch:
        heads = next(h for h in NM_HEADS if h >= num_heads)
        # one index scope per layer kind, over its SWA keys then its compressed keys
        widths = tuple((name, plan.spec.window + (w if name != "swa" else 0)) for name, w in scope_widths(plan.spec))
        fp8 = native_dialect(api).torch_dtype
        key = ScratchKey(path="mla_decode_fwd_v4_nm", device=plan.device, max_tokens=self.max_decode_tokens,
                         heads=heads, widths=widths, q_dtype=fp8, kv_dtype=fp8, layout="ragged", row=NM_ROW)
        scr = self._get_scratch(api, key)
        self._warm(("mla_decode_fwd_v4_nm", heads), [lambda: self._nm_dummy(api, heads, plan.device)])
        return scr

    def _forward_nm(self, api: AiterAPI, plan: StepPlan, meta: AiterMeta, layer: LayerInputs,
                    out: torch.Tensor) -> None:
        T, H = plan.num_tokens, layer.q.shape[1]
        scr = meta.scratch
        fp8 = native_dialect(api).torch_dtype
        scopes = self._scopes(plan, layer)
        sb = self._indices(plan, meta, layer.kind.name.lower(),
                           [(rows, lens, geo.num_slots) for _, rows, lens, _, geo in scopes],
                           layer.kind.uses_topk, api)
        col = 0
        for _, rows, _, cache, geo in scopes:  # this step's records, repacked where the indices point
            K = rows.shape[1]
            slots = sb.slots[: T * sb.width].view(T, sb.width)[:, col : col + K].reshape(-1)
            pos = sb.pos[: T * sb.width].view(T, sb.width)[:, col : col + K].reshape(-1)
            for part in chunks(T * K, self.gather_chunk_rows):
                packed, rope = nm_pack(packed_records(cache, Record.V4_FP8, geo, slots[part]))
                scr.rows.index_copy_(0, pos[part], packed)
                scr.rows_rope.index_copy_(0, pos[part], rope)
            col += K
        # the kernel's softmax scale is fixed at 1/sqrt(512): fold the layer's into q
        q = layer.q.float() * (layer.softmax_scale * NM_ROW**0.5)
        packed, rope = nm_pack(quantize_model1(q.reshape(-1, HEAD_DIM).to(torch.bfloat16)))
        scr.q[:T, :H].copy_(packed.view(T, H, NM_ROW))
        scr.q_rope[:T, :H].copy_(rope.view(T, H, -1))
        scr.q[:T, H:].zero_()
        scr.q_rope[:T, H:].zero_()
        n = T * sb.width
        o = scr.out[0][:T]
        # by keyword: kv_last_page_lens is the 9th positional parameter on 0.1.17 / 0.1.18
        call_by_keyword(api.function("mla_decode_fwd_v4_nm"), q=scr.q[:T].view(fp8), qrope=scr.q_rope[:T],
                        kv_buffer=scr.rows[:n].view(fp8).view(n, 1, 1, NM_ROW),
                        kvrope=scr.rows_rope[:n].view(n, 1, 1, -1),
                        output=o, qo_indptr=scr.qo_indptr[: T + 1], kv_indptr=sb.kv_indptr[: T + 1],
                        kv_page_indices=sb.kv_indices[:n], kv_last_page_lens=scr.last_page[:T], max_seqlen_q=1,
                        sink=self._stage_sink(scr, layer.sink, H))
        keyless = (sb.counts[:T] == 0)[:, None, None]
        out.copy_(torch.where(keyless, torch.zeros_like(o[:, :H]), o[:, :H]))

    @staticmethod
    def _nm_dummy(api: AiterAPI, heads: int, device: torch.device) -> None:
        """One token, one key: a multi-split call (stage 2 compiled) of the v4 nm kernel."""
        fp8 = native_dialect(api).torch_dtype
        i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        call_by_keyword(api.function("mla_decode_fwd_v4_nm"), q=torch.zeros(1, heads, NM_ROW, dtype=fp8, device=device),
                        qrope=torch.zeros(1, heads, 64, dtype=torch.bfloat16, device=device),
                        kv_buffer=torch.zeros(1, 1, 1, NM_ROW, dtype=fp8, device=device),
                        kvrope=torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16, device=device),
                        output=torch.zeros(1, heads, HEAD_DIM, dtype=torch.bfloat16, device=device),
                        qo_indptr=torch.arange(2, **i32), kv_indptr=torch.arange(2, **i32),
                        kv_page_indices=torch.zeros(1, **i32), kv_last_page_lens=torch.ones(1, **i32), max_seqlen_q=1,
                        sink=torch.full((heads,), -math.inf, device=device), num_kv_splits=2)

    # ---- path 3: mla_decode_fwd, two scopes + LSE merge + sink ----------------------------------
    def _decode_key(self, api: AiterAPI, plan: StepPlan, heads: int, persistent_heads: int | None,
                    T: int) -> ScratchKey:
        widths = scope_widths(plan.spec)
        split = ScratchKey(path="mla_decode_fwd", device=plan.device, max_tokens=self.max_decode_tokens,
                           heads=split_heads(heads), widths=widths, q_dtype=torch.bfloat16,
                           kv_dtype=torch.bfloat16, layout="padded", row=ROW, max_splits=self.max_splits,
                           pad_slack=max(w for _, w in widths) + 2 * split_mgc(split_heads(heads)))
        if persistent_heads is None or T >= self.persistent_max_batch:
            return split
        fp8 = native_dialect(api).torch_dtype
        # persistent mode only runs below persistent_max_batch: its work buffers (and the fp32
        # partials AITER allocates per call from them) are sized for that, not max_decode_tokens
        return replace(split, max_tokens=min(self.max_decode_tokens, self.persistent_max_batch - 1),
                       heads=persistent_heads, q_dtype=fp8, kv_dtype=fp8, layout="fixed", persistent=True,
                       pad_slack=0)

    def _persistent_heads_for(self, api: AiterAPI, fmt: KVFormat, heads: int) -> int | None:
        """Heads handed to the persistent (FP8/FP8) kernels, or None where split mode serves every
        batch: persistent mode computes in fp8, so only with fp8_compute, and never for bf16
        caches (their precision is why they are bf16)."""
        if not self.fp8_compute or fmt is KVFormat.BF16 or self.persistent_max_batch <= 1:
            return None
        return persistent_lse_heads(api, heads)[0]

    def _decode_scratch(self, api: AiterAPI, plan: StepPlan, fmt: KVFormat, H: int) -> AiterScratch:
        persistent_heads = self._persistent_heads_for(api, fmt, H)
        variants = [self._decode_key(api, plan, H, persistent_heads, t) for t in (1, self.persistent_max_batch)]
        self._warm(("mla_decode_fwd",) + tuple(sorted({(k.heads, k.persistent) for k in variants})),
                   [functools.partial(self._decode_dummy, api, k) for k in dict.fromkeys(variants)])
        for key in variants:  # both modes' scratch now: a later batch size allocates nothing
            self._get_scratch(api, key)
        return self._get_scratch(api, self._decode_key(api, plan, H, persistent_heads, plan.num_tokens))

    def _forward_decode(self, api: AiterAPI, plan: StepPlan, meta: AiterMeta, layer: LayerInputs,
                        out: torch.Tensor) -> None:
        T, H = plan.num_tokens, layer.q.shape[1]
        scr = meta.scratch
        key = scr.key
        q = scr.q[:T]
        if key.persistent:
            quantize_pow2_(q[:, :H, :HEAD_DIM], layer.q, scr.q_scale)
        else:
            q[:, :H, :HEAD_DIM].copy_(layer.q)
        q[:, H:, :HEAD_DIM].zero_()
        results = []
        for i, (name, rows, lens, cache, geo) in enumerate(self._scopes(plan, layer)):
            dialect = layer.swa_dialect if name == "swa" else layer.comp_dialect
            sb = self._indices(plan, meta, name, [(rows, lens, geo.num_slots)], layer.kind.uses_topk and name != "swa",
                               api)
            n = T * (sb.width + key.pad_slack)
            self._stage_rows(scr, sb, T * rows.shape[1], cache, layer.fmt, geo, layer.kv_scale, dialect)
            o = scr.out[i][:T]
            work_plan = dict(zip(("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
                                  "reduce_final_map", "reduce_partial_map"), sb.meta)) if key.persistent else {}
            splits = self.max_splits if key.persistent else self._split_count(T, sb.width, key.heads)
            if not key.persistent:
                torch.arange(0, (T + 1) * splits, splits, out=scr.splits_indptr[: T + 1])
            _, lse = call_by_keyword(api.function("mla_decode_fwd"), q=q, kv_buffer=scr.rows.view(-1, 1, 1, ROW), o=o,
                                     qo_indptr=scr.qo_indptr[: T + 1], kv_indptr=sb.kv_indptr[: T + 1],
                                     kv_indices=sb.kv_indices[:n], kv_last_page_lens=scr.last_page[:T], max_seqlen_q=1,
                                     page_size=1, nhead_kv=1, sm_scale=layer.softmax_scale, num_kv_splits=splits,
                                     num_kv_splits_indptr=None if key.persistent else scr.splits_indptr[: T + 1],
                                     q_scale=scr.q_scale if key.persistent else None,
                                     kv_scale=sb.kv_scale if key.persistent else None, return_lse=True, **work_plan)
            # a row with no key has no LSE, whatever the kernel wrote there (+inf, NaN or nothing)
            lse_buf = scr.lse[i][:T]
            lse_buf.copy_(torch.where(sb.counts[:T, None] > 0, lse, torch.full_like(lse, -math.inf)))
            results.append((o, lse_buf))
        merged, lse = results[0] if len(results) == 1 else merge_lse(*results[0], *results[1])
        out.copy_(apply_sink(merged[:, :H], lse[:, :H], layer.sink))

    def _stage_rows(self, scr: AiterScratch, sb: ScopeBuffers, n: int, cache: torch.Tensor, fmt: KVFormat,
                    geo: CacheGeometry, kv_scale: float, dialect: Fp8Dialect) -> None:
        """A scope's ``n`` selected rows (``sb.slots`` -> ``sb.pos``) decoded into ``scr.rows`` a
        chunk at a time (:mod:`.staging`): bf16 (split mode), or fp8 with one power-of-two scale
        for the step (persistent mode, ``sb.kv_scale``: its amax is found in a first pass)."""
        key = scr.key
        parts = list(chunks(n, self.gather_chunk_rows))
        if not parts:  # a scope of no columns
            return
        first = decode_rows(cache, fmt, geo, sb.slots[parts[0]], kv_scale, dialect)

        def values(i: int) -> torch.Tensor:
            return first if i == 0 else decode_rows(cache, fmt, geo, sb.slots[parts[i]], kv_scale, dialect)

        if key.persistent:
            peak = amax(first)
            for i in range(1, len(parts)):
                peak = torch.maximum(peak, amax(values(i)))
            pow2_scale_(sb.kv_scale, peak, key.kv_dtype)
        # by bytes: index_copy_ has no fp8 kernel on every device
        rows = scr.rows.view(torch.uint8 if key.persistent else key.kv_dtype)[:, :HEAD_DIM]
        for i, part in enumerate(parts):
            staged = (to_fp8(values(i), sb.kv_scale, key.kv_dtype).view(torch.uint8) if key.persistent
                      else values(i).to(key.kv_dtype))
            rows.index_copy_(0, sb.pos[part], staged)

    def _decode_dummy(self, api: AiterAPI, key: ScratchKey) -> None:
        """One token, one zero key: every kernel of a mode (stage 1, stage 2 or reduce, metadata)."""
        dev, h = key.device, key.heads
        i32: dict[str, Any] = dict(dtype=torch.int32, device=dev)
        one, ar = torch.ones(1, dtype=torch.float32, device=dev), torch.arange(2, **i32)
        meta = {}
        if key.persistent:
            shapes = call_by_keyword(api.function("get_mla_metadata_info_v1"), batch_size=1, max_seqlen_qo=1,
                                     num_head_qo=h,
                                     q_dtype=key.q_dtype, kv_dtype=key.kv_dtype, is_sparse=True, fast_mode=True,
                                     num_kv_splits=key.max_splits, max_split_per_batch=key.max_splits)
            bufs = [torch.empty(s, dtype=d, device=dev) for s, d in shapes]
            names = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
                     "reduce_partial_map")
            meta = dict(zip(names, bufs))
            call_by_keyword(api.function("get_mla_metadata_v1"), seqlens_qo_indptr=ar, seqlens_kv_indptr=ar,
                            kv_last_page_lens=torch.ones(1, **i32), num_heads_per_head_k=h, num_heads_k=1,
                            is_causal=True, work_metadata_ptrs=bufs[0], work_info_set=bufs[2], work_indptr=bufs[1],
                            reduce_indptr=bufs[3], reduce_final_map=bufs[4], reduce_partial_map=bufs[5], page_size=1,
                            kv_granularity=PLAN_GRANULARITY.get(h, 16), max_seqlen_qo=1, uni_seqlen_qo=1,
                            fast_mode=True, topk=1, max_split_per_batch=key.max_splits, dtype_q=key.q_dtype,
                            dtype_kv=key.kv_dtype)
        call_by_keyword(api.function("mla_decode_fwd"), q=torch.zeros(1, h, ROW, dtype=key.q_dtype, device=dev),
                        kv_buffer=torch.zeros(1, 1, 1, ROW, dtype=key.kv_dtype, device=dev),
                        o=torch.zeros(1, h, HEAD_DIM, dtype=torch.bfloat16, device=dev), qo_indptr=ar, kv_indptr=ar,
                        kv_indices=torch.zeros(1, **i32), kv_last_page_lens=torch.ones(1, **i32), max_seqlen_q=1,
                        page_size=1, nhead_kv=1, sm_scale=1.0, num_kv_splits=key.max_splits if key.persistent else 2,
                        num_kv_splits_indptr=None if key.persistent else torch.tensor([0, 2], **i32),
                        q_scale=one if key.persistent else None, kv_scale=one if key.persistent else None,
                        return_lse=True, **meta)
