"""AITER EMULATOR — a torch stand-in for the AITER calls the `aiter` backend uses. NOT AITER.

There is no AMD GPU here, so the `aiter` backend (``dsv4_attn/rocm/aiter.py``) is proven
against this emulator: it implements the DOCUMENTED semantics of

    aiter.mla.mla_decode_fwd              (0.1.7 wheel and newer keyword signatures)
    aiter.get_mla_metadata_info_v1        (0.1.7 and newer)
    aiter.get_mla_metadata_v1             (0.1.7 and newer positional orders)
    aiter.ops.triton.attention.sparse_mla.sparse_mla_fwd   (newer only)

in plain torch, on CPU and CUDA, with fixed-shape ops only (no host sync: a decode step that
calls it can be captured in a CUDA graph), and it VALIDATES every argument the adapter passes
(shapes, dtypes, strides, contiguity, sentinel layout, scale types, kernel availability per
arch / head count / dtype, stale persistent work plans). A violation raises
:class:`AiterContractError` naming the argument. Value checks that read device memory are
skipped while a CUDA graph is being captured.

Sources of the semantics (see ../shared/spec/vendor-apis.md §3): amd-aiter 0.1.7.post2.dev18
``aiter/mla.py``, ``aiter/ops/attention.py``, ``aiter_meta/csrc/kernels/mla/reduce.cu``;
ROCm/aiter (2026) ``aiter/mla.py``, ``aiter/ops/attention.py``,
``aiter/ops/triton/attention/sparse_mla.py``; vLLM PR #40892 ``rocm_aiter_dsv4_decode.py``.
Modelled hazards (so that tests prove the adapter handles them):

* rows with no key: ``mla_decode_fwd`` / ``sparse_mla_fwd`` write NaN output (and NaN LSE)
  ("AITER can return NaN output/LSE for those rows", vLLM rocm_aiter_mla_sparse.py);
* 0.1.7 ``mla_decode_fwd`` has no ``return_lse``; its ``final_lse`` is returned unwritten
  (NaN here) in the split path and written only for split tiles in the persistent path;
* gfx942 fp8 one-split decode writes no LSE (NaN here); gfx942 persistent kernels have no LSE
  code object; gfx950 persistent LSE kernels exist for FP8/FP8 only;
* persistent mode reads the key ranges from the work plan, so a plan not refilled for the
  current ``kv_indptr`` is an error ("reads out-of-bounds if left with a stale work plan").

Switch it on for the whole process with ``enable()`` (or ``DSV4_ATTN_AITER_EMULATOR=1``,
``=gfx942``, ``=gfx950:0.1.7``); every result the backend then produces is labelled emulated.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

ARCHS = ("gfx942", "gfx950")
FLAVORS = ("0.1.7", "new")
# compute units: MI300X 304, MI355X 256
_CU_NUM = {"gfx942": 304, "gfx950": 256}
_VERSIONS = {"0.1.7": "0.1.7.post2.dev18", "new": "0.1.2x (ROCm/aiter main, 2026)"}
# asm code objects under hsa/<arch>/mla/ (0.1.7 wheel listing; the lse_ps object is the one
# vLLM PR #40892 used on gfx950; gfx942 ships no persistent LSE object).
_ASM_017 = ("mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_ps.co", "mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps.co",
            "mla_a8w8_qh128_m32x4_n16x2_msk1.co", "mla_a8w8_qh16_qseqlen1_gqaratio16.co",
            "mla_a8w8_qh16_qseqlen1_gqaratio16_ps.co", "mla_dec_stage1_bf16_a16w16_subQ128_mqa128.co",
            "mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co")
_ASM_LSE_PS = "mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps.co"
# one-split heads of the non-persistent stage 1 (0.1.7 get_mgc; subQ16/subQ128, qh16/qh128 objects)
SPLIT_HEADS = (16, 128)
# gfx950 persistent FP8/FP8 native heads (newer aiter/mla.py "Natively support cases")
PERSISTENT_HEADS = (16, 32, 64, 128)
DSV4_ROW_BYTES = 584
_CHUNK = 2048  # keys per chunk in the emulated attention (bounds temporaries)


class AiterContractError(ValueError):
    """The adapter passed something AITER would reject or misread."""


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fail(arg: str, got, allowed: str) -> None:
    raise AiterContractError(f"{arg}: got {got}; allowed: {allowed}")


def _desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}"


def _check_tensor(arg: str, t, dtype=None, dim=None, device=None, contiguous=False) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(arg, type(t).__name__, "a torch.Tensor")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if dtype is not None and t.dtype not in dtypes:
        _fail(arg, _desc(t), f"dtype in {dtypes}")
    if dim is not None and t.dim() != dim:
        _fail(arg, _desc(t), f"a {dim}-d tensor")
    if device is not None and t.device != device:
        _fail(arg, f"device {t.device}", f"{device} (q's device)")
    if contiguous and not t.is_contiguous():
        _fail(arg, _desc(t), "a contiguous tensor")


def _check_scale(arg: str, s, device) -> None:
    """Per-tensor scales are [1] float32 device tensors (the aiter asm convention), never floats."""
    if not isinstance(s, torch.Tensor):
        _fail(arg, repr(s), "a float32 tensor with one element on q's device (not a python number)")
    if s.dtype != torch.float32 or s.numel() != 1 or s.device != device:
        _fail(arg, f"{_desc(s)} on {s.device}", f"float32 with one element on {device}")


def _segment_attention(q: torch.Tensor, rows: Callable[[torch.Tensor], torch.Tensor], key_idx: torch.Tensor,
                       key_batch: torch.Tensor, key_valid: torch.Tensor, scale: float,
                       sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` [B, H, D] (float32) over flat keys.

    Key i (of N) belongs to batch row ``key_batch[i]``, reads row ``rows(key_idx[i])`` and counts
    iff ``key_valid[i]``. Fixed-shape chunked ops only (graph capturable). Returns
    ``out`` float32 [B, H, Dv] (NaN for rows with no key, as AITER can return) and ``lse``
    float32 [B, H] natural log WITHOUT the sink (NaN for rows with no key). With ``sink`` the
    output is normalized by ``Σexp(s) + exp(sink)``.
    """
    B, H, _ = q.shape
    N = key_idx.numel()
    dev = q.device
    m = torch.full((B, H), -math.inf, device=dev)
    chunks = [(c0, min(N, c0 + _CHUNK)) for c0 in range(0, N, _CHUNK)]

    def scores(c0, c1):
        idx = torch.where(key_valid[c0:c1], key_idx[c0:c1], torch.zeros_like(key_idx[c0:c1]))
        k = rows(idx)
        s = torch.einsum("nhd,nd->nh", q[key_batch[c0:c1]], k[:, : q.shape[2]]) * scale
        return k, s.masked_fill(~key_valid[c0:c1, None], -math.inf)

    for c0, c1 in chunks:
        _, s = scores(c0, c1)
        m.scatter_reduce_(0, key_batch[c0:c1, None].expand(-1, H), s, reduce="amax")
    m_ref = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    denom = torch.zeros(B, H, device=dev)
    acc = None
    for c0, c1 in chunks:
        k, s = scores(c0, c1)
        p = torch.exp(s - m_ref[key_batch[c0:c1]])
        denom.index_add_(0, key_batch[c0:c1], p)
        contrib = p[:, :, None] * k[:, None, :]
        if acc is None:
            acc = torch.zeros(B, H, k.shape[1], device=dev)
        acc.index_add_(0, key_batch[c0:c1], contrib)
    if acc is None:
        acc = torch.zeros(B, H, q.shape[2], device=dev)
    keys = denom > 0
    lse = torch.where(keys, torch.log(denom) + m_ref, torch.full_like(denom, math.nan))
    full = denom + (torch.exp(sink[None, :].float() - m_ref) if sink is not None else 0.0)
    out = torch.where(keys[..., None], acc / full[..., None], torch.full_like(acc, math.nan))
    return out, lse


class AiterEmulator:
    """One emulated AITER installation: ``arch`` gfx942 (FNUZ fp8) or gfx950 (OCP fp8) and
    ``flavor`` "0.1.7" (the PyPI wheel) or "new" (ROCm/aiter main, 2026).

    Attributes mirror what the adapter's ``load_aiter()`` seam exposes: ``version``, ``arch``,
    ``mla_decode_fwd``, ``get_mla_metadata_info_v1``, ``get_mla_metadata_v1``,
    ``sparse_mla_fwd`` (None in 0.1.7), ``asm_objects`` (code object names for the arch).
    ``calls`` logs ``(function, mode)`` of every call for tests.
    """

    emulated = True

    def __init__(self, arch: str = "gfx950", flavor: str = "new") -> None:
        if arch not in ARCHS:
            raise ValueError(f"arch: got {arch!r}; allowed: {ARCHS}")
        if flavor not in FLAVORS:
            raise ValueError(f"flavor: got {flavor!r}; allowed: {FLAVORS}")
        self.arch, self.flavor = arch, flavor
        self.version = _VERSIONS[flavor]
        self.cu_num = _CU_NUM[arch]
        self.fp8 = torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn
        self.calls: list[tuple[str, str]] = []
        self._plans: dict[int, dict] = {}  # work_info_set data_ptr -> static facts of its plan
        names = set(_ASM_017)
        if flavor == "new" and arch == "gfx950":
            names.add(_ASM_LSE_PS)
        self.asm_objects = frozenset(names)
        if flavor == "0.1.7":
            self.mla_decode_fwd = self._mla_decode_fwd_017
            self.get_mla_metadata_info_v1 = self._info_017
            self.get_mla_metadata_v1 = self._metadata_017
            self.sparse_mla_fwd = None
        else:
            self.mla_decode_fwd = self._mla_decode_fwd_new
            self.get_mla_metadata_info_v1 = self._info_new
            self.get_mla_metadata_v1 = self._metadata_new
            self.sparse_mla_fwd = self._sparse_mla_fwd

    def __repr__(self) -> str:
        return f"AiterEmulator(arch={self.arch!r}, flavor={self.flavor!r})"

    # ---- exact public signatures (bound methods; inspect.signature drops self) -------------
    def _mla_decode_fwd_017(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                            max_seqlen_q, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                            num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None, work_info_set=None,
                            reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None, q_scale=None,
                            kv_scale=None):
        return self._decode(locals(), page_size=1, nhead_kv=1, return_lse=False, legacy=True)

    def _mla_decode_fwd_new(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                            max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                            num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None,
                            work_info_set=None, reduce_indptr=None, reduce_final_map=None,
                            reduce_partial_map=None, q_scale=None, kv_scale=None, intra_batch_mode=False,
                            return_logits=False, return_lse=False, g_kv_indptr=None, cp_world_size=1, cp_rank=0,
                            causal=True):
        if intra_batch_mode or return_logits or g_kv_indptr is not None or cp_world_size != 1:
            _fail("intra_batch_mode/return_logits/g_kv_indptr/cp_world_size", "non-default values",
                  "defaults (not emulated; the adapter never uses them)")
        return self._decode(locals(), page_size=page_size, nhead_kv=nhead_kv, return_lse=return_lse, legacy=False)

    def _info_017(self, batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True):
        if num_head_qo % 16:
            _fail("num_head_qo", num_head_qo, "a multiple of 16 (0.1.7)")
        return self._info(batch_size, max_seqlen_qo, num_head_qo, is_sparse, fast_mode, self.cu_num, -1)

    def _info_new(self, batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True,
                  num_kv_splits=32, intra_batch_mode=False, max_split_per_batch=-1):
        if num_head_qo % 8:
            _fail("num_head_qo", num_head_qo, "a multiple of 8")
        if intra_batch_mode:
            _fail("intra_batch_mode", True, "False (not emulated)")
        return self._info(batch_size, max_seqlen_qo, num_head_qo, is_sparse, fast_mode, self.cu_num,
                          max_split_per_batch)

    def _metadata_017(self, seqlens_qo_indptr, seqlens_kv_indptr, num_heads_per_head_k, num_heads_k, is_causal,
                      work_metadata_ptrs, work_indptr, work_info, reduce_indptr, reduce_final_map,
                      reduce_partial_map, kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1, fast_mode=True,
                      topk=-1, max_split_per_batch=-1):
        self._metadata(seqlens_qo_indptr, seqlens_kv_indptr, None, num_heads_per_head_k, num_heads_k,
                       work_metadata_ptrs, work_indptr, work_info, reduce_indptr, reduce_final_map,
                       reduce_partial_map, 1, topk)

    def _metadata_new(self, seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k,
                      num_heads_k, is_causal, work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr,
                      reduce_final_map, reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1,
                      uni_seqlen_qo=-1, fast_mode=True, topk=-1, max_split_per_batch=-1, intra_batch_mode=False,
                      is_cp_round_robin=False, mla_version=0, dtype_q_nope=None, dtype_q_rope=None,
                      dtype_kv_nope=None, dtype_kv_rope=None, dtype_q=None, dtype_kv=None):
        self._metadata(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k, num_heads_k,
                       work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map,
                       reduce_partial_map, page_size, topk)

    def _sparse_mla_fwd(self, q, kv_buffer, kv_indptr, kv_indices, softmax_scale, *, kv_scale=None,
                        kv_lora_rank=512, qk_rope_head_dim=64, kv_splits=None, skip_reduce=False, has_invalid=False,
                        dot_precision="bf16", q_scale=None, out=None, return_lse=False, attn_sink=None,
                        extra_kv=None, extra_indptr=None, extra_indices=None, extra_kv_scale=None,
                        inv_rope_positions=None, inv_rope_cos_sin_cache=None, out_mxfp8=None):
        return self._sparse(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, kv_scale, kv_lora_rank,
                            qk_rope_head_dim, skip_reduce, has_invalid, dot_precision, out, return_lse, attn_sink,
                            extra_kv, extra_indptr, extra_indices, extra_kv_scale,
                            inv_rope_positions is not None or out_mxfp8 is not None)

    # ---- persistent metadata --------------------------------------------------------------
    @staticmethod
    def _info(batch_size, max_seqlen_qo, num_head_qo, is_sparse, fast_mode, cu_num, max_split_per_batch):
        """Buffer shapes as aiter/ops/attention.py computes them (one 16-head qo tile per batch row
        for max_seqlen_qo * heads <= 128, which covers single-token decode)."""
        tiles = max(1, math.ceil(max_seqlen_qo * num_head_qo / 128))
        batch = batch_size * max_seqlen_qo if is_sparse else batch_size
        tile_cnt = batch * tiles
        max_work = tile_cnt + cu_num - 1 if fast_mode else tile_cnt * cu_num
        max_split_tiles = (min(batch + cu_num - 1, (cu_num - 1) * 2) * tiles if fast_mode else tile_cnt * cu_num)
        if max_split_per_batch > 0:
            max_split_tiles = max(max_split_tiles, tile_cnt + min(cu_num, max_split_per_batch * batch))
        return ((2, torch.uint64), (cu_num + 1, torch.int32), ((max_work, 8), torch.int32),
                (tile_cnt + 1, torch.int32), ((tile_cnt, 2), torch.int32), (max_split_tiles, torch.int32))

    def _metadata(self, qo_indptr, kv_indptr, last_page, heads_per_k, heads_k, ptrs, work_indptr, work_info,
                  reduce_indptr, reduce_final_map, reduce_partial_map, page_size, topk):
        """Fill the six work buffers for the current indptrs with fixed-shape device ops.

        The emulated plan has one work item per batch row and no split: work_info row b =
        [b, -1, q_start, q_end, kv_start, kv_end, 0, 0]; every reduce range is empty. The real
        planner splits long rows across CUs, which changes speed, not results.
        """
        dev = qo_indptr.device
        _check_tensor("seqlens_qo_indptr", qo_indptr, torch.int32, 1, contiguous=True)
        _check_tensor("seqlens_kv_indptr", kv_indptr, torch.int32, 1, dev, contiguous=True)
        B = qo_indptr.numel() - 1
        if kv_indptr.numel() != B + 1:
            _fail("seqlens_kv_indptr", _desc(kv_indptr), f"[{B + 1}] like seqlens_qo_indptr")
        if last_page is not None:
            _check_tensor("kv_last_page_lens", last_page, torch.int32, 1, dev)
            if last_page.numel() != B:
                _fail("kv_last_page_lens", _desc(last_page), f"[{B}]")
        if heads_k != 1:
            _fail("num_heads_k", heads_k, "1 (MLA has one KV head)")
        if page_size != 1:
            _fail("page_size", page_size, "1 (the only page size the emulator models)")
        want = [("work_metadata_ptrs", ptrs, torch.uint64, (2,)), ("work_indptr", work_indptr, torch.int32, None),
                ("work_info_set", work_info, torch.int32, None), ("reduce_indptr", reduce_indptr, torch.int32, None),
                ("reduce_final_map", reduce_final_map, torch.int32, None),
                ("reduce_partial_map", reduce_partial_map, torch.int32, None)]
        for name, t, dtype, shape in want:
            _check_tensor(name, t, dtype, device=dev, contiguous=True)
            if shape is not None and tuple(t.shape) != shape:
                _fail(name, _desc(t), str(shape))
        if work_info.dim() != 2 or work_info.shape[1] != 8 or work_info.shape[0] < B:
            _fail("work_info_set", _desc(work_info), f"[>= {B}, 8] (sized by get_mla_metadata_info_v1)")
        if reduce_indptr.numel() < B + 1 or reduce_final_map.dim() != 2 or reduce_final_map.shape[0] < B:
            _fail("reduce_indptr/reduce_final_map", f"{_desc(reduce_indptr)}, {_desc(reduce_final_map)}",
                  f"[>= {B + 1}] and [>= {B}, 2] (sized for the max batch by get_mla_metadata_info_v1)")
        if work_indptr.numel() < 2:
            _fail("work_indptr", _desc(work_indptr), "[cu_num + 1]")
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
        self._plans[work_info.data_ptr()] = {"topk": int(topk), "heads": int(heads_per_k), "batch": B}
        self.calls.append(("get_mla_metadata_v1", f"topk={topk}"))

    # ---- mla_decode_fwd -------------------------------------------------------------------
    def _decode_heads_ok(self, nhead: int, q_dtype, kv_dtype, persistent: bool, legacy: bool) -> bool:
        if not persistent:
            return nhead in SPLIT_HEADS
        fp8 = q_dtype == self.fp8 and kv_dtype == self.fp8
        if nhead == 16 or (nhead == 128 and kv_dtype == self.fp8):
            return True
        if not legacy and self.arch == "gfx950" and fp8 and nhead in PERSISTENT_HEADS:
            return True
        return nhead in range(32, 513 if legacy else 129, 16)  # folded into 16-head pseudo-batches

    def _decode(self, a: dict, page_size: int, nhead_kv: int, return_lse: bool, legacy: bool):
        q, kv, o = a["q"], a["kv_buffer"], a["o"]
        _check_tensor("q", q, (torch.bfloat16, self.fp8), 3, contiguous=True)
        dev = q.device
        T, H, D = q.shape
        _check_tensor("kv_buffer", kv, (torch.bfloat16, self.fp8), 4, dev)
        if kv.shape[1] != page_size or page_size != 1 or kv.shape[2] != nhead_kv or nhead_kv != 1:
            _fail("kv_buffer", _desc(kv), "[num_page, page_size=1, nhead_kv=1, D] (page size 1, one KV head)")
        if kv.shape[3] != D or kv.stride(3) != 1 or kv.stride(0) != D:
            _fail("kv_buffer", _desc(kv), f"fixed-stride rows of D={D} elements (stride(0) == D, last dim contiguous)")
        _check_tensor("o", o, torch.bfloat16, 3, dev, contiguous=True)
        if o.shape[0] != T or o.shape[1] != H or o.shape[2] > D:
            _fail("o", _desc(o), f"[{T}, {H}, <= {D}]")
        qo_indptr, kv_indptr, kv_indices, last = (a["qo_indptr"], a["kv_indptr"], a["kv_indices"],
                                                  a["kv_last_page_lens"])
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_last_page_lens", last)):
            _check_tensor(name, t, torch.int32, 1, dev, contiguous=True)
        B = qo_indptr.numel() - 1
        if kv_indptr.numel() != B + 1 or last.numel() != B:
            _fail("kv_indptr/kv_last_page_lens", f"{_desc(kv_indptr)}, {_desc(last)}", f"[{B + 1}] and [{B}]")
        if a["max_seqlen_q"] != 1 or B != T:
            _fail("max_seqlen_q/qo_indptr", f"{a['max_seqlen_q']} / {B} batch rows for {T} tokens",
                  "1 query token per batch row (the adapter flattens tokens; MTP tokens are separate rows)")
        if a["logit_cap"] > 0:
            _fail("logit_cap", a["logit_cap"], "<= 0")
        if q.dtype == self.fp8:
            _check_scale("q_scale", a["q_scale"], dev)
        if kv.dtype == self.fp8:
            _check_scale("kv_scale", a["kv_scale"], dev)
        if q.dtype != kv.dtype and not (q.dtype == torch.bfloat16 and H == 16):
            _fail("q/kv_buffer dtypes", f"{q.dtype} / {kv.dtype}", "equal dtypes (a16w8 exists for 16 heads only)")
        meta_names = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
                      "reduce_partial_map")
        meta = [a[n] for n in meta_names]
        persistent = a["work_meta_data"] is not None
        if persistent and any(m is None for m in meta):
            _fail("work_* / reduce_*", "some of the six persistent buffers missing", "all six together")
        if not self._decode_heads_ok(H, q.dtype, kv.dtype, persistent, legacy):
            _fail("q", f"{H} heads with q {q.dtype}, kv {kv.dtype} on {self.arch} "
                  f"({'persistent' if persistent else 'non-persistent'})",
                  f"non-persistent heads {SPLIT_HEADS}; persistent 16, 128 (fp8 kv) or folded 32..128 step 16"
                  + ("; gfx950 FP8/FP8 native 32/64" if not legacy else ""))
        if not _capturing():
            self._check_values(qo_indptr, kv_indptr, kv_indices, last, kv.shape[0], persistent)
        if persistent:
            return self._decode_persistent(a, q, kv, o, meta, return_lse, legacy)
        return self._decode_split(a, q, kv, o, return_lse, legacy)

    @staticmethod
    def _check_values(qo_indptr, kv_indptr, kv_indices, last, num_rows, persistent) -> None:
        B = qo_indptr.numel() - 1
        if not torch.equal(qo_indptr.cpu(), torch.arange(B + 1, dtype=torch.int32)):
            _fail("qo_indptr", qo_indptr.tolist()[:8], "arange(B + 1) (one query token per batch row)")
        if not bool((last == 1).all()):
            _fail("kv_last_page_lens", last.tolist()[:8], "all 1 (page size 1)")
        lens = kv_indptr[1:] - kv_indptr[:-1]
        if int(kv_indptr[0]) != 0 or bool((lens < 0).any()):
            _fail("kv_indptr", kv_indptr.tolist()[:8], "0 then non-decreasing")
        if not persistent:
            n = int(kv_indptr[-1])
            if n > kv_indices.numel():
                _fail("kv_indptr", f"last value {n} > kv_indices size {kv_indices.numel()}", "<= kv_indices.numel()")
            used = kv_indices[:n]
            if n and (int(used.min()) < 0 or int(used.max()) >= num_rows):
                _fail("kv_indices", f"values in [{int(used.min())}, {int(used.max())}] inside kv_indptr ranges",
                      f"0..{num_rows - 1}: the non-persistent kernel has no -1 sentinel (ragged CSR)")
        elif kv_indices.numel() and (int(kv_indices.min()) < -1 or int(kv_indices.max()) >= num_rows):
            _fail("kv_indices", f"values in [{int(kv_indices.min())}, {int(kv_indices.max())}]",
                  f"-1 (sentinel) or 0..{num_rows - 1}")

    def _kv_rows(self, kv: torch.Tensor, kv_scale) -> Callable[[torch.Tensor], torch.Tensor]:
        flat = kv.reshape(kv.shape[0], kv.shape[3])
        scale = kv_scale.float() if kv.dtype == self.fp8 else None
        return lambda idx: flat[idx.long()].float() * scale if scale is not None else flat[idx.long()].float()

    def _q_float(self, q, q_scale) -> torch.Tensor:
        return q.float() * q_scale.float() if q.dtype == self.fp8 else q.float()

    def _decode_split(self, a, q, kv, o, return_lse, legacy):
        """Non-persistent: batch b reads kv_indices[kv_indptr[b]:kv_indptr[b+1]] (ragged CSR)."""
        B, dev = q.shape[0], q.device
        splits, splits_indptr = a["num_kv_splits"], a["num_kv_splits_indptr"]
        if splits is not None:
            if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
                _fail("num_kv_splits", repr(splits), "an int >= 1 or None")
            if splits_indptr is not None:
                _check_tensor("num_kv_splits_indptr", splits_indptr, torch.int32, 1, dev, contiguous=True)
                if splits_indptr.numel() != B + 1:
                    _fail("num_kv_splits_indptr", _desc(splits_indptr), f"[{B + 1}]")
        kv_indptr, kv_indices = a["kv_indptr"], a["kv_indices"]
        pos = torch.arange(kv_indices.numel(), device=dev)
        key_batch = (torch.searchsorted(kv_indptr.long(), pos, right=True) - 1).clamp(0, max(B - 1, 0))
        valid = pos < kv_indptr[-1].long()
        out, lse = _segment_attention(self._q_float(q, a["q_scale"]), self._kv_rows(kv, a["kv_scale"]),
                                      kv_indices, key_batch, valid, self._sm_scale(a, q), None)
        o.copy_(out[..., : o.shape[2]])
        self.calls.append(("mla_decode_fwd", f"split{splits}"))
        one_split_no_lse = splits == 1 and q.dtype == self.fp8 and self.arch == "gfx942"
        if legacy or not return_lse or one_split_no_lse:
            return o, torch.full_like(lse, math.nan)  # final_lse never written (0.1.7 / gfx942 one-split fp8)
        return o, lse

    def _decode_persistent(self, a, q, kv, o, meta, return_lse, legacy):
        """Persistent: key ranges come from the work plan; with ``topk`` (sparse plan) batch b reads
        the fixed-stride row kv_indices[b*topk : b*topk + len_b], skipping -1 sentinels."""
        B, H, dev = q.shape[0], q.shape[1], q.device
        work_info = meta[2]
        plan = self._plans.get(work_info.data_ptr())
        if plan is None:
            _fail("work_info_set", "buffers never filled by get_mla_metadata_v1", "a plan for this step")
        if plan["heads"] != H or plan["batch"] != B:
            _fail("work_info_set", f"a plan for {plan['batch']} rows x {plan['heads']} heads",
                  f"a plan for this call's {B} rows x {H} heads")
        if return_lse and not (self.arch == "gfx950" and q.dtype == self.fp8 and kv.dtype == self.fp8):
            _fail("return_lse", f"True with q {q.dtype}, kv {kv.dtype} on {self.arch} (persistent)",
                  "persistent LSE kernels exist for FP8/FP8 on gfx950 only")
        kv_indptr, kv_indices = a["kv_indptr"], a["kv_indices"]
        starts, ends = work_info[:B, 4].long(), work_info[:B, 5].long()
        if not _capturing() and not (torch.equal(starts, kv_indptr[:-1].long()) and
                                     torch.equal(ends, kv_indptr[1:].long())):
            _fail("work_info_set", "a stale work plan (filled for other kv_indptr values)",
                  "get_mla_metadata_v1 re-run after every kv_indptr update (stale plans read out of bounds)")
        topk = plan["topk"]
        if topk > 0:
            if kv_indices.numel() < B * topk:
                _fail("kv_indices", _desc(kv_indices), f">= B * topk = {B * topk} entries (fixed stride)")
            lens = (ends - starts).clamp(min=0)
            if not _capturing() and bool((lens > topk).any()):
                _fail("kv_indptr", "a row longer than topk", f"rows of <= topk = {topk} keys")
            col = torch.arange(topk, device=dev)
            idx = kv_indices[: B * topk].view(B, topk)
            valid = (col[None, :] < lens[:, None]) & (idx >= 0)
            key_batch = torch.arange(B, device=dev).repeat_interleave(topk)
            keys, valid = idx.reshape(-1), valid.reshape(-1)
        else:  # dense persistent plan: ragged ranges from the plan, no sentinels
            pos = torch.arange(kv_indices.numel(), device=dev)
            key_batch = (torch.searchsorted(kv_indptr.long(), pos, right=True) - 1).clamp(0, max(B - 1, 0))
            valid = (pos >= starts[key_batch]) & (pos < ends[key_batch])
            keys = kv_indices
        out, lse = _segment_attention(self._q_float(q, a["q_scale"]), self._kv_rows(kv, a["kv_scale"]), keys,
                                      key_batch, valid, self._sm_scale(a, q), None)
        o.copy_(out[..., : o.shape[2]])
        self.calls.append(("mla_decode_fwd", f"persistent topk={topk}"))
        if legacy or not return_lse:
            return o, torch.full_like(lse, math.nan)  # 0.1.7: final_lse written for split tiles only
        return o, lse

    @staticmethod
    def _sm_scale(a, q) -> float:
        s = a["sm_scale"]
        if s is None:
            return q.shape[2] ** -0.5
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
            _fail("sm_scale", repr(s), "a python float > 0")
        return float(s)

    # ---- sparse_mla_fwd -------------------------------------------------------------------
    def _classify(self, q, kv, scale, what: str) -> str:
        """Format tag of a 3-D block cache, as sparse_mla.py's _classify_cache infers it."""
        _check_tensor(what, kv, None, 3, q.device)
        nb, bs, width = kv.shape
        if kv.stride(2) != 1 or (bs > 1 and kv.stride(1) != width):
            _fail(what, _desc(kv), "rows contiguous inside a block (stride(2) == 1, stride(1) == width)")
        if width == DSV4_ROW_BYTES and kv.dtype == torch.uint8:
            if scale is not None:
                _fail(f"{what} scale", _desc(scale), "None: packed caches carry their own scales")
            return "fp8_dsv4_mla"
        if width != q.shape[2]:
            _fail(what, _desc(kv), f"[nb, block, {q.shape[2]}] (bf16 / fp8_scalar) or [nb, block, 584] uint8")
        if kv.dtype == torch.bfloat16:
            return "bf16"
        if kv.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) and kv.dtype != self.fp8:
            _fail(what, f"{kv.dtype}", f"{self.fp8}: the kernel reads {self.arch}'s native fp8 encoding")
        if kv.dtype not in (self.fp8, torch.uint8):
            _fail(what, f"{kv.dtype}", "bfloat16, uint8 [.., 584] or the arch's fp8")
        if scale is None:
            _fail(f"{what} scale", "None", "a [1] float32 kv_scale for an fp8_scalar cache")
        _check_scale(f"{what} scale", scale, q.device)
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
                extra_indices, extra_kv_scale, epilogue):
        _check_tensor("q", q, torch.bfloat16, 3, device=None)
        if q.stride(2) != 1:
            _fail("q", _desc(q), "last dim contiguous")
        C, H, d_qk = q.shape
        dev = q.device
        if skip_reduce or dot_precision != "bf16" or epilogue:
            _fail("skip_reduce/dot_precision/inv_rope/out_mxfp8", "non-default", "defaults (adapter never uses them)")
        fmt = self._classify(q, kv, kv_scale, "kv_buffer")
        extra = (extra_kv, extra_indptr, extra_indices)
        has_extra = all(x is not None for x in extra)
        if any(x is not None for x in extra) and not has_extra:
            _fail("extra_kv/extra_indptr/extra_indices", "some given", "all three together")
        x_fmt = None
        if has_extra:
            x_scale = extra_kv_scale if extra_kv_scale is not None else kv_scale
            x_fmt = self._classify(q, extra_kv, x_scale if fmt == "fp8_scalar" else None, "extra_kv")
            if (fmt == "fp8_scalar") != (x_fmt == "fp8_scalar"):
                _fail("extra_kv", x_fmt, f"a cache of the two-loop family of kv_buffer ({fmt})")
        packed = fmt == "fp8_dsv4_mla" or (has_extra and fmt != "fp8_scalar")
        if packed and self.arch != "gfx950":
            _fail("kv_buffer", f"{fmt}{' two-loop' if has_extra else ''} on {self.arch}",
                  "gfx950 (fp8_dsv4_mla caches and the bf16 two-loop are gfx950-only)")
        if packed and return_lse:
            _fail("return_lse", True, "False for dsv4 / two-loop caches")
        if fmt != "fp8_dsv4_mla":
            if d_qk != kv_lora_rank + qk_rope_head_dim or kv_lora_rank & (kv_lora_rank - 1):
                _fail("kv_lora_rank/qk_rope_head_dim", f"{kv_lora_rank}/{qk_rope_head_dim} for q width {d_qk}",
                      "powers of two summing to q's width (DSv4 rows: 512 / 0)")
        elif d_qk != 512:
            _fail("q", _desc(q), "width 512 for fp8_dsv4_mla")
        for pre, ip, ix in (("", kv_indptr, kv_indices), ("extra_", extra_indptr, extra_indices)):
            if ip is None:
                continue
            _check_tensor(f"{pre}kv_indptr", ip, torch.int32, 1, dev, contiguous=True)
            _check_tensor(f"{pre}kv_indices", ix, torch.int32, 1, dev, contiguous=True)
            if ip.numel() != C + 1:
                _fail(f"{pre}kv_indptr", _desc(ip), f"[C + 1 = {C + 1}] (check the indptr/indices order)")
        if attn_sink is not None:
            _check_tensor("attn_sink", attn_sink, torch.float32, 1, dev, contiguous=True)
            if attn_sink.numel() != H:
                _fail("attn_sink", _desc(attn_sink), f"[{H}] (one per head)")
        if out is not None:
            _check_tensor("out", out, torch.bfloat16, 3, dev)
            if out.shape[0] != C or out.shape[1] != H or out.shape[2] < kv_lora_rank or out.stride(2) != 1:
                _fail("out", _desc(out), f"[{C}, {H}, >= {kv_lora_rank}] bf16, last dim contiguous")
        else:
            out = torch.empty(C, H, 512, dtype=torch.bfloat16, device=dev)
        segments = [(kv, fmt, kv_scale, kv_indptr, kv_indices)]
        if has_extra:
            segments.append((extra_kv, x_fmt, x_scale, extra_indptr, extra_indices))
        idx_all, batch_all, valid_all, readers = [], [], [], []
        for seg, (cache, f, sc, ip, ix) in enumerate(segments):
            num_slots = cache.shape[0] * cache.shape[1]
            if not _capturing():
                self._check_sparse_values(ip, ix, num_slots, has_invalid, "extra_" if seg else "")
            pos = torch.arange(ix.numel(), device=dev)
            b = (torch.searchsorted(ip.long(), pos, right=True) - 1).clamp(0, max(C - 1, 0))
            idx_all.append(ix)
            batch_all.append(b)
            valid_all.append((pos < ip[-1].long()) & (ix >= 0))
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
        tagged = torch.where(valid, tagged, torch.zeros_like(tagged))
        o, lse = _segment_attention(q.float(), rows, tagged, torch.cat(batch_all), valid, float(softmax_scale),
                                    attn_sink)
        out[:, :, :kv_lora_rank].copy_(o[..., :kv_lora_rank])
        self.calls.append(("sparse_mla_fwd", f"{fmt}{'+' + x_fmt if x_fmt else ''}"))
        if not return_lse:
            return out, None
        # sparse_mla_fwd's LSE INCLUDES the sink (a virtual key); a fully masked row reports -inf
        with_sink = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.float()[None, :])
        return out, torch.where(torch.isnan(lse), torch.full_like(lse, -math.inf), with_sink)

    @staticmethod
    def _check_sparse_values(ip, ix, num_slots, has_invalid, pre) -> None:
        n = int(ip[-1])
        if int(ip[0]) != 0 or bool(((ip[1:] - ip[:-1]) < 0).any()) or n > ix.numel():
            _fail(f"{pre}kv_indptr", ip.tolist()[:8], f"0, non-decreasing, last <= {ix.numel()}")
        used = ix[:n]
        if n and int(used.max()) >= num_slots:
            _fail(f"{pre}kv_indices", f"max {int(used.max())}", f"GLOBAL slot ids < {num_slots}")
        if n and int(used.min()) < (-1 if has_invalid else 0):
            _fail(f"{pre}kv_indices", f"min {int(used.min())} with has_invalid={has_invalid}",
                  "slot ids >= 0 (or -1 sentinels with has_invalid=True)")


# ---- process-wide switch ---------------------------------------------------------------------
ENV_EMULATOR = "DSV4_ATTN_AITER_EMULATOR"


def parse_env(value: str) -> AiterEmulator | None:
    """``DSV4_ATTN_AITER_EMULATOR``: unset/"0" = off; "1" = gfx950 newer AITER; "gfx942";
    "gfx950:0.1.7" (arch[:flavor])."""
    value = (value or "").strip().lower()
    if value in ("", "0", "false", "off"):
        return None
    if value in ("1", "true", "on"):
        return AiterEmulator()
    arch, _, flavor = value.partition(":")
    return AiterEmulator(arch, flavor or "new")


def enable(arch: str = "gfx950", flavor: str = "new") -> AiterEmulator:
    """Make the `aiter` backend run against a fresh emulator (process-wide); returns it.

    The backend then accepts CPU/CUDA devices in place of a ROCm GPU and labels everything
    emulated. Undo with :func:`disable`.
    """
    from . import aiter

    emulator = AiterEmulator(arch, flavor)
    aiter.set_api_override(emulator)
    return emulator


def disable() -> None:
    from . import aiter

    aiter.set_api_override(None)
