"""AITER EMULATOR — a torch model of the AITER kernels the `aiter` backend calls. NOT AITER.

There is no AMD GPU here, so the `aiter` backend (``dsv4_attn/rocm/aiter.py``) is proven
against this emulator. It models what the KERNELS do, not what the docs say, as read from AITER
v0.1.20.post1 (= main ``e4048607``: same ``aiter/mla.py``, ``csrc/py_itfs_cu/asm_mla.cu`` and
``hsa/*/mla/mla_asm.csv``) and its shipped code objects, disassembled (docs/rocm.md, "Evidence"):

* ``mla_decode_fwd`` code objects read 576-element rows: the per-head q stride is the constant
  576 elements (0x240 bytes fp8, 0x480 bf16) and each KV row is 576 elements read from
  ``index * stride(0)`` of ``kv_buffer`` (the launcher only checks ``q.shape[2] == kv.shape[3]``);
  V is the row's first 512 elements. 512-wide q or rows are misread, silently.
* Every index inside a key range is read; there is no -1 sentinel. KV rows are addressed with
  64-bit products on the gfx950 objects rebuilt in AITER #4452 and with 24-bit row numbers and
  32-bit byte offsets everywhere else (row ``index & 0xFFFFFF``, offset mod 2^32).
* FP8 q (a8w8 objects): softmax probabilities are rounded to the arch's fp8 before P·V (AITER's
  own reference does the same; the denominator keeps the unrounded sum).
* The final LSE: split mode writes it in the Triton stage-2 reduce (natural log; ``-inf`` and NaN
  output for rows with no key); a one-split FP8 call skips stage 2 and leaves it unwritten.
  Persistent mode writes it only from code objects that load the LSE pointer: the gfx950 32-head
  ``*_lse_ps`` object has the non-LSE one's code (.text), so its LSE stays unwritten. Rows with
  no key get ``+inf`` LSE and NaN output there. "Unwritten" memory reads as :data:`STALE`.
* Split mode with FP8 operands: stage 1 runs ``min(S, ceil(L / block))`` splits of a row (block
  128 keys at 16 heads, 32 at 128) while stage 2 reads ``min(S, ceil(L / mgc))`` (mgc 64 / 32):
  an explicit ``num_kv_splits`` above AITER's fp8 cap makes stage 2 read unwritten partials.
* Per call, persistent ``mla_decode_fwd`` allocates fp32 partials sized by the work buffers
  (``reduce_partial_map.size(0) * heads * 513`` floats), recorded in ``call_bytes``.
* Modules load on first use (asm code objects, Triton stage 2 per constexpr set, the reduce and
  metadata kernels); loading one while a graph is being captured fails. ``simulate_capture``
  makes CPU tests see a capture.

``mla_decode_fwd_v4_nm`` (AITER >= 0.1.18, gfx950 code object only) follows AITER's own torch
golden (``op_tests/test_mla_v4_nm.py``): packed FP8 rows (448 e4m3 NoPE, 14 e8m0 bytes: half-tile
``j`` of 32 columns is scaled by byte ``448 + j``, so each tile's scale is written twice), bf16
RoPE in separate tensors, softmax scale fixed at 1/sqrt(512), sink in the kernel (joining the
first split), split-K partials merged by stage 2, no final LSE. ``sparse_mla_fwd`` (flavor
"sparse") is the keyword set vLLM 0.33 calls; no AITER release has it (a side branch does,
gfx950-only, without sink / extra scope).

Flavors: "0.1.7" (the PyPI wheel: no ``return_lse``), "0.1.20" (the default: a real release),
"sparse" ("0.1.20" plus ``sparse_mla_fwd``). Every call validates its arguments and raises
:class:`AiterContractError` naming the one AITER would reject or misread; value checks that read
device memory are skipped while a CUDA graph is being captured. Switch it on with ``enable()``
or ``DSV4_ATTN_AITER_EMULATOR`` (``1``, ``gfx942``, ``gfx950:0.1.7``, ``gfx950:sparse``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

ARCHS = ("gfx942", "gfx950")
FLAVORS = ("0.1.7", "0.1.17", "0.1.18", "0.1.19", "0.1.20", "sparse")
AITER_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"  # main of 2026-08-22 == v0.1.20.post1 for MLA
_VERSIONS = {"0.1.7": "0.1.7.post2.dev18", "0.1.17": "0.1.17", "0.1.18": "0.1.18", "0.1.19": "0.1.19.post2",
             "0.1.20": "0.1.20.post1", "sparse": "0.1.20.post1 + sparse_mla_fwd (vLLM 0.33 keywords)"}
# What changed between the releases, read from each tag's aiter/mla.py, csrc/py_itfs_cu/asm_mla.cu
# and hsa/*/mla/mla_asm.csv:
# * mla_decode_fwd_v4_nm: 0.1.17 / 0.1.18 take ``kv_last_page_lens`` as the 9th POSITIONAL
#   parameter (required); from 0.1.19 it is a trailing keyword (optional). 0.1.17 predates
#   #4117 (empty splits of short rows merged) and #4245 (out-of-range page ids fold to row 0).
# * asm_mla.cu ``lse_flag = lse != nullptr`` up to 0.1.18, ``&& persistent`` from 0.1.19: before,
#   a split-mode call with return_lse=True finds no code object and raises.
# * gfx942's native 64-head FP8 persistent objects (#3188, needing kv_granularity 32) from 0.1.18.
_POSITIONAL_NM_LAST_PAGE = ("0.1.17", "0.1.18")
_SPLIT_LSE_RAISES = ("0.1.17", "0.1.18")
_NO_GFX942_QH64 = ("0.1.17",)
_CU_NUM = {"gfx942": 304, "gfx950": 256}  # MI300X, MI355X
ROW = 576  # elements per q head / KV row the mla_decode_fwd code objects read
V_DIM = 512
NM_ROW_BYTES = 512  # v4 nm packed row: 448 e4m3 NoPE, 14 e8m0 bytes, 50 pad
NM_ROPE = 64
DSV4_ROW_BYTES = 584
STALE = 0.0  # what "unwritten" memory reads as here (AITER allocates it with torch.empty)
_CHUNK_ELEMS = 1 << 22  # bounds the [keys, heads, 512] temporaries of one chunk


@dataclass(frozen=True)
class CodeObject:
    """One shipped code object and what its disassembly shows."""

    name: str
    writes_lse: bool  # loads the final-LSE pointer (kernarg 0x130)
    wide: bool  # 64-bit row addressing; else 24-bit rows and 32-bit byte offsets
    kv_granularity: int = 16  # persistent: every work but a row's last covers whole passes of this many keys


def _co(name: str, lse: bool = False, wide: bool = False, gran: int = 16) -> CodeObject:
    return CodeObject(name + ".co", lse, wide, gran)


# What asm_mla.cu (v0.1.20) launches for one query token, by (persistent, q/kv fp8, heads, lse).
# Persistent heads not listed here are folded into 16-head pseudo-batches by aiter/mla.py.
_STAGE1 = {
    "gfx950": {
        (False, False, 16, False): _co("mla_dec_stage1_bf16_a16w16_subQ16_mqa16"),
        (False, False, 128, False): _co("mla_dec_stage1_bf16_a16w16_subQ128_mqa128"),
        (False, True, 16, False): _co("mla_a8w8_qh16_qseqlen1_gqaratio16", wide=True),
        (False, True, 128, False): _co("mla_a8w8_qh128_m32x4_n16x2_msk1"),
        (True, True, 16, True): _co("mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps", True, True),
        (True, True, 32, True): _co("mla_a8w8_qh32_qseqlen1_gqaratio32_lse_ps"),  # no LSE store
        (True, True, 64, True): _co("mla_a8w8_qh16_qseqlen4_gqaratio16_lse_v3_ps", True, True),
        (True, True, 128, True): _co("mla_a8w8_qh32_qseqlen4_gqaratio32_lse_ps", True, True),
        (True, True, 16, False): _co("mla_a8w8_qh16_qseqlen1_gqaratio16_ps", wide=True),
        (True, True, 32, False): _co("mla_a8w8_qh32_qseqlen1_gqaratio32_ps"),
        (True, True, 64, False): _co("mla_a8w8_qh16_qseqlen4_gqaratio16_v3_ps", wide=True),
        (True, True, 128, False): _co("mla_a8w8_qh32_qseqlen4_gqaratio32_ps", wide=True),
    },
    "gfx942": {
        (False, False, 16, False): _co("mla_dec_stage1_bf16_a16w16_subQ16_mqa16"),
        (False, False, 128, False): _co("mla_dec_stage1_bf16_a16w16_subQ128_mqa128"),
        (False, True, 16, False): _co("mla_a8w8_qh16_qseqlen1_gqaratio16"),
        (False, True, 128, False): _co("mla_a8w8_qh128_m32x4_n16x2_msk1"),
        # SUB_KV = 32 partial producers (#3188: "requires SUB_KV=32 partial granularity")
        (True, True, 64, True): _co("mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_ps", True, gran=32),
        (True, True, 16, False): _co("mla_a8w8_qh16_qseqlen1_gqaratio16_ps"),
        (True, True, 64, False): _co("mla_a8w8_qh64_qseqlen1_gqaratio64_v3_ps", gran=32),
        (True, True, 128, False): _co("mla_a8w8_qh128_m32x4_n16x2_msk0_ps"),
    },
}
_NATIVE_PERSISTENT = {"gfx950": (16, 32, 64, 128), "gfx942": (16, 64, 128)}
V4_NM_OBJECT = "mla_a8w8_qh64_qseqlen1_gqaratio64_nm.co"  # hsa/gfx950/mla_v4 only
_V4_NM_HEADS = (16, 32, 64, 128)
# 0.1.7 wheel listing (aiter_meta/hsa/<arch>/mla): no LSE object
_ASM_017 = ("mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_ps.co", "mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps.co",
            "mla_a8w8_qh128_m32x4_n16x2_msk1.co", "mla_a8w8_qh16_qseqlen1_gqaratio16.co",
            "mla_a8w8_qh16_qseqlen1_gqaratio16_ps.co", "mla_dec_stage1_bf16_a16w16_subQ128_mqa128.co",
            "mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co")
_FP8_BLOCK = {8: 64, 16: 128, 24: 128, 32: 128, 48: 64, 64: 64, 128: 32}  # get_meta_param's get_block_n_fp8


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


def _mgc(heads: int, fp8: bool) -> int:
    """Stage 2's keys per split (aiter/mla.py, one query token)."""
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
        block = _FP8_BLOCK[heads]
        splits = min(splits, -(-total_kv // (max(bs, 1) * block)))
        if splits > 1:
            splits = min(splits, int(abs(avg - 1) // block) + 1)
    return max(splits, 1)


def _storage_from(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage from its first element to the end, 1-D in t's dtype (what a kernel handed
    ``t.data_ptr()`` can address)."""
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((n,), (1,), t.storage_offset())


def _read_windows(flat: torch.Tensor, starts: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """Rows of ``width`` elements of ``flat`` starting at element offsets ``starts`` (int64 [N])."""
    limit = flat.numel() - width
    if not _capturing() and starts.numel():
        lo, hi = int(starts.min()), int(starts.max())
        if lo < 0 or hi > limit:
            _fail(what, f"a read of elements [{hi}, {hi + width}) ({flat.element_size() * hi} bytes in)",
                  f"reads inside the tensor's storage ({flat.numel()} elements): every index inside a "
                  "key range is read (no -1 sentinel, no bounds check)")
    return flat.unfold(0, width, 1)[starts.clamp(0, max(limit, 0))]


def _row_starts(idx: torch.Tensor, row_bytes: int, elem: int, wide: bool) -> torch.Tensor:
    """Element offsets of KV rows ``idx`` (int32 as the kernel reads them: unsigned)."""
    r = idx.long() & 0xFFFFFFFF
    if wide:
        return r * row_bytes // elem
    return ((r & 0xFFFFFF) * row_bytes & 0xFFFFFFFF) // elem


def _attend(q: torch.Tensor, rows: Callable[[torch.Tensor], torch.Tensor], key_idx: torch.Tensor,
            key_seg: torch.Tensor, key_ok: torch.Tensor, seg_row: torch.Tensor, scale: float,
            p_dtype: torch.dtype | None = None, seg_sink: torch.Tensor | None = None):
    """Softmax attention of queries ``q`` float32 [R, H, D] over flat keys, per segment.

    Key i reads ``rows(key_idx[i])`` (float32 [n, >= 512]: scores over the first D elements, V =
    the first 512) into segment ``key_seg[i]`` (int64, of S) and counts iff ``key_ok[i]``; segment
    s attends with query row ``seg_row[s]``. ``p_dtype``: probabilities rounded to it before P·V
    (denominator unrounded). ``seg_sink`` float32 [S, H] joins the running max, the denominator
    and the LSE. Returns ``out`` float32 [S, H, 512] and ``lse`` float32 [S, H] (natural log;
    both NaN where a segment has neither a key nor a finite sink) and ``has`` bool [S] (the
    segment has a key). Eager calls pad each segment's keys into a batch (fast); under a graph
    capture it runs with fixed shapes and no host sync, one chunk of keys at a time."""
    S, H = seg_row.numel(), q.shape[1]
    m = torch.full((S, H), -math.inf, device=q.device) if seg_sink is None else seg_sink.clone()  # running max
    part = _attend_flat if _capturing() else _attend_padded
    acc, denom, m, count = part(q[seg_row], rows, key_idx, key_seg, key_ok, scale, p_dtype, m)
    m_ref = torch.where(m == -math.inf, torch.zeros_like(m), m)  # a +inf sink: inf - inf = NaN, as in a kernel
    if seg_sink is not None:
        denom = denom + torch.exp(seg_sink - m_ref)
    mass = denom > 0  # keys, or a finite sink (then a keyless segment gives 0 and the sink's LSE)
    lse = torch.where(mass, torch.log(denom) + m_ref, torch.full_like(denom, math.nan))
    out = torch.where(mass[..., None], acc / denom[..., None], torch.full_like(acc, math.nan))
    return out, lse, count > 0


def _probabilities(s, m_ref, p_dtype):
    """(p for the denominator, p for P·V: rounded to ``p_dtype`` when given)."""
    p = torch.exp(s - m_ref)
    return p, (p.to(p_dtype).float() if p_dtype is not None else p)


def _attend_padded(qs, rows, key_idx, key_seg, key_ok, scale, p_dtype, m):
    """:func:`_attend`'s sums with each segment's keys padded into one batch (host syncs)."""
    S, H, D = qs.shape
    kept = key_ok.nonzero().squeeze(1)
    seg, order = torch.sort(key_seg[kept], stable=True)
    idx = key_idx[kept][order]
    count = torch.bincount(seg, minlength=S)
    width = max(int(count.max()) if seg.numel() else 0, 1)
    slot = torch.arange(seg.numel(), device=qs.device) - (torch.cumsum(count, 0) - count)[seg]
    dense = torch.zeros(S, width, dtype=torch.long, device=qs.device)
    used = torch.zeros(S, width, dtype=torch.bool, device=qs.device)
    dense[seg, slot] = idx.long()
    used[seg, slot] = True
    acc, denom = torch.zeros(S, H, V_DIM, device=qs.device), torch.zeros(S, H, device=qs.device)
    step = max(1, _CHUNK_ELEMS // (width * (ROW + H)))
    for s0 in range(0, S, step):
        d, u = dense[s0 : s0 + step], used[s0 : s0 + step]
        k = rows(torch.where(u, d, torch.zeros_like(d)).reshape(-1)).view(d.shape[0], width, -1)
        s = torch.einsum("shd,sld->shl", qs[s0 : s0 + step], k[..., :D]) * scale
        s = s.masked_fill(~u[:, None, :], -math.inf)
        m[s0 : s0 + step] = torch.maximum(m[s0 : s0 + step], s.amax(dim=2))
        m_ref = m[s0 : s0 + step]
        p, pv = _probabilities(s, torch.where(m_ref == -math.inf, torch.zeros_like(m_ref), m_ref)[..., None], p_dtype)
        denom[s0 : s0 + step] = p.sum(dim=2)
        acc[s0 : s0 + step] = torch.einsum("shl,sld->shd", pv, k[..., :V_DIM])
    return acc, denom, m, count


def _attend_flat(qs, rows, key_idx, key_seg, key_ok, scale, p_dtype, m):
    """:func:`_attend`'s sums over chunks of the flat key list: fixed shapes, no host sync."""
    S, H, D = qs.shape
    N, step = key_idx.numel(), max(64, _CHUNK_ELEMS // (H * V_DIM))
    chunks = [(c0, min(N, c0 + step)) for c0 in range(0, N, step)]

    def scores(c0, c1):
        ok = key_ok[c0:c1]
        k = rows(torch.where(ok, key_idx[c0:c1], torch.zeros_like(key_idx[c0:c1])))
        s = torch.einsum("nhd,nd->nh", qs[key_seg[c0:c1]], k[:, :D]) * scale
        return k, s.masked_fill(~ok[:, None], -math.inf)

    for c0, c1 in chunks:
        m.scatter_reduce_(0, key_seg[c0:c1, None].expand(-1, H), scores(c0, c1)[1], reduce="amax")
    m_ref = torch.where(m == -math.inf, torch.zeros_like(m), m)
    denom, acc = torch.zeros(S, H, device=qs.device), torch.zeros(S, H, V_DIM, device=qs.device)
    count = torch.zeros(S, device=qs.device)
    for c0, c1 in chunks:
        k, s = scores(c0, c1)
        seg = key_seg[c0:c1]
        p, pv = _probabilities(s, m_ref[seg], p_dtype)
        denom.index_add_(0, seg, p)
        count.index_add_(0, seg, key_ok[c0:c1].float())
        acc.index_add_(0, seg, pv[:, :, None] * k[:, None, :V_DIM])
    return acc, denom, m, count


def _ranges(indptr: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each flat position, position inside its row) for a CSR ``indptr`` over ``n`` entries."""
    pos = torch.arange(n, device=indptr.device)
    B = indptr.numel() - 1
    row = (torch.searchsorted(indptr.long(), pos, right=True) - 1).clamp(0, max(B - 1, 0))
    return row, pos - indptr.long()[row]


def stage2_merge(part_out: torch.Tensor, part_lse: torch.Tensor, count: torch.Tensor):
    """AITER's Triton stage 2 (``_fwd_kernel_stage2_asm``): merge the first ``count[b]`` of
    ``part_out`` [B, S, H, 512] / ``part_lse`` [B, S, H] (natural log). A NaN partial poisons its
    row; ``count`` 0 gives NaN output and -inf LSE. Returns (out [B, H, 512], lse [B, H])."""
    S = part_out.shape[1]
    use = (torch.arange(S, device=part_out.device)[None, :] < count[:, None])[:, :, None]
    lse = torch.where(use, part_lse, torch.full_like(part_lse, -math.inf))
    top = lse.amax(dim=1, keepdim=True)
    top = torch.where(torch.isfinite(top) | torch.isnan(top), top, torch.zeros_like(top))
    w = torch.where(use, torch.exp(lse - top), torch.zeros_like(lse))
    total = w.sum(dim=1)
    acc = torch.where(use[..., None], w[..., None] * part_out, torch.zeros_like(part_out)).sum(dim=1)
    return acc / total[..., None], top[:, 0] + torch.log(total)


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


class AiterEmulator:
    """One emulated AITER installation: ``arch`` gfx942 (FNUZ fp8) or gfx950 (OCP fp8) and
    ``flavor`` (see the module docstring).

    Attributes mirror what the adapter's ``load_aiter()`` seam exposes: ``version``, ``arch``,
    ``mla_decode_fwd``, ``get_mla_metadata_info_v1``, ``get_mla_metadata_v1``,
    ``mla_decode_fwd_v4_nm`` and ``sparse_mla_fwd`` (None where the flavor lacks them),
    ``asm_objects``. ``calls`` logs ``(function, detail)`` of every call, ``call_bytes`` the fp32
    partials each persistent call allocates, ``loaded`` the modules loaded so far.
    """

    emulated = True

    def __init__(self, arch: str = "gfx950", flavor: str = "0.1.20") -> None:
        if arch not in ARCHS:
            raise ValueError(f"arch: got {arch!r}; allowed: {ARCHS}")
        if flavor not in FLAVORS:
            raise ValueError(f"flavor: got {flavor!r}; allowed: {FLAVORS}")
        self.arch, self.flavor = arch, flavor
        self.version = _VERSIONS[flavor]
        self.cu_num = _CU_NUM[arch]
        self.fp8 = torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn
        self.calls: list[tuple[str, str]] = []
        self.call_bytes: list[int] = []
        self.loaded: set[str] = set()
        self.simulate_capture = False
        # bf16 split mode's stage-1 partition of a row (the code objects do not say): "mgc" splits
        # of whole stage-2 blocks (min(S, cdiv(L, mgc)) of them, what stage 2 merges) or "even"
        # (cdiv(L, S) keys each: partials stage 2 never merges when cdiv(L, mgc) < S)
        self.stage1_partition = "mgc"
        self._plans: dict[int, dict] = {}  # work_info_set data_ptr -> static facts of its plan
        legacy = flavor == "0.1.7"
        names = set(_ASM_017) if legacy else {o.name for o in _STAGE1[arch].values()}
        if flavor in _NO_GFX942_QH64:
            names = {n for n in names if "qh64_qseqlen1_gqaratio64" not in n}
        if not legacy and arch == "gfx950":
            names.add(V4_NM_OBJECT)
        self.asm_objects = frozenset(names)
        self.mla_decode_fwd = self._mla_decode_fwd_017 if legacy else self._mla_decode_fwd_new
        self.get_mla_metadata_info_v1 = self._info_017 if legacy else self._info_new
        self.get_mla_metadata_v1 = self._metadata_017 if legacy else self._metadata_new
        self.mla_decode_fwd_v4_nm = (None if legacy else self._mla_decode_fwd_v4_nm_0117
                                     if flavor in _POSITIONAL_NM_LAST_PAGE else self._mla_decode_fwd_v4_nm)
        self.sparse_mla_fwd = self._sparse_mla_fwd if flavor == "sparse" else None

    def __repr__(self) -> str:
        return f"AiterEmulator(arch={self.arch!r}, flavor={self.flavor!r})"

    # ---- module loading ---------------------------------------------------------------------
    def _load(self, module: str) -> None:
        if module in self.loaded:
            return
        if self.simulate_capture or _capturing():
            _fail("graph capture", f"a first use of {module} while capturing (AITER loads modules and "
                  "compiles Triton kernels on first use)", "every kernel variant run once before capture")
        self.loaded.add(module)

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
            _fail("intra_batch_mode/return_logits/g_kv_indptr/cp_world_size", "non-default values",
                  "defaults (not emulated; the adapter never uses them)")
        return self._decode(locals(), page_size=page_size, nhead_kv=nhead_kv, return_lse=return_lse)

    def _info_017(self, batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True):
        if num_head_qo % 16:
            _fail("num_head_qo", num_head_qo, "a multiple of 16 (0.1.7)")
        return self._info(batch_size, max_seqlen_qo, num_head_qo, q_dtype, is_sparse, fast_mode, -1)

    def _info_new(self, batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True,
                  num_kv_splits=32, intra_batch_mode=False, max_split_per_batch=-1):
        if num_head_qo % 8:
            _fail("num_head_qo", num_head_qo, "a multiple of 8")
        if intra_batch_mode:
            _fail("intra_batch_mode", True, "False (not emulated)")
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
        _check_tensor("kv_last_page_lens", kv_last_page_lens, torch.int32, 1, q.device if isinstance(q, torch.Tensor)
                      else None)
        return self._v4_nm(q, qrope, kv_buffer, kvrope, output, qo_indptr, kv_indptr, kv_page_indices,
                           max_seqlen_q, sink, split_indptr, num_kv_splits, logits, attn_lse)

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
        native = heads in _NATIVE_PERSISTENT[self.arch] or (dtype_q not in (None, self.fp8) and self.arch == "gfx950")
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
            _fail("kv_granularity", kv_granularity, "a power of two (metadata.cu AITER_CHECK)")
        self._load("get_mla_metadata_v1")
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
        plan = {"topk": int(topk), "heads": int(heads_per_k), "batch": B}
        if not _capturing() and topk > 0:  # the real planner's works (host values: not inside a capture)
            lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
            plan.update(lens=lens, works=plan_works(lens, int(topk), self._plan_ratio(int(heads_per_k), dtype_q),
                                                    kv_granularity, self.cu_num, max_split_per_batch))
            if len(plan["works"]) > work_info.shape[0]:
                _fail("work_info_set", _desc(work_info), f">= {len(plan['works'])} works (the planner's count)")
        self._plans[work_info.data_ptr()] = plan
        self.calls.append(("get_mla_metadata_v1", f"topk={topk}"))

    # ---- mla_decode_fwd -------------------------------------------------------------------
    def stage1_object(self, heads: int, fp8: bool, persistent: bool, lse: bool) -> CodeObject:
        """The code object asm_mla.cu launches (aiter/mla.py folds other persistent head counts of
        32..128 into 16-head pseudo-batches); AiterContractError where it finds none."""
        if persistent and heads not in _NATIVE_PERSISTENT[self.arch] and heads in range(32, 129, 16):
            heads = 16
        # lse_flag: ``lse != nullptr && persistent`` from 0.1.19, ``lse != nullptr`` before
        lse_flag = lse if self.flavor in _SPLIT_LSE_RAISES else lse and persistent
        obj = _STAGE1[self.arch].get((persistent, fp8, heads, lse_flag))
        if obj is None or obj.name not in self.asm_objects:
            _fail("q", f"{heads} heads, {'fp8' if fp8 else 'bf16'} q/kv, {'persistent' if persistent else 'split'}"
                  f"{', LSE' if lse and persistent else ''} on {self.arch}",
                  "a shipped code object (asm_mla.cu: 'cannot get heuristic kernel'); modelled: split 16/128 "
                  f"heads bf16 or fp8, persistent fp8 {sorted({k[2] for k in _STAGE1[self.arch] if k[0]})}")
        return obj

    def _decode(self, a: dict, page_size: int, nhead_kv: int, return_lse: bool):
        q, kv, o = a["q"], a["kv_buffer"], a["o"]
        _check_tensor("q", q, (torch.bfloat16, self.fp8), 3, contiguous=True)
        dev = q.device
        T, H, D = q.shape
        _check_tensor("kv_buffer", kv, (torch.bfloat16, self.fp8), 4, dev)
        if kv.shape[1] != page_size or page_size != 1 or kv.shape[2] != nhead_kv or nhead_kv != 1:
            _fail("kv_buffer", _desc(kv), "[num_page, page_size=1, nhead_kv=1, D] (page size 1, one KV head)")
        if kv.shape[3] != D:
            _fail("kv_buffer", _desc(kv), f"head_size == q.shape[2] = {D} (asm_mla.cu AITER_CHECK)")
        if kv.stride(3) != 1:
            _fail("kv_buffer", _desc(kv), "rows contiguous in the last dim")
        _check_tensor("o", o, torch.bfloat16, 3, dev, contiguous=True)
        if tuple(o.shape) != (T, H, V_DIM):
            _fail("o", _desc(o), f"[{T}, {H}, {V_DIM}] (the code objects write 512-wide V)")
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
        fp8 = q.dtype == self.fp8
        if fp8 != (kv.dtype == self.fp8):
            _fail("q/kv_buffer dtypes", f"{q.dtype} / {kv.dtype}", "both bf16 or both the arch's fp8 (a16w8 is "
                  "not modelled)")
        if fp8:
            _check_scale("q_scale", a["q_scale"], dev)
            _check_scale("kv_scale", a["kv_scale"], dev)
        meta_names = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
                      "reduce_partial_map")
        meta = [a[n] for n in meta_names]
        persistent = a["work_meta_data"] is not None
        if persistent and any(m is None for m in meta):
            _fail("work_* / reduce_*", "some of the six persistent buffers missing", "all six together")
        if persistent and not fp8:
            _fail("q", f"bf16 q/kv in persistent mode on {self.arch}", "FP8/FP8 (bf16 persistent is not modelled)")
        obj = self.stage1_object(H, fp8, persistent, return_lse)
        self._load(obj.name)
        if not _capturing():
            self._check_values(qo_indptr, kv_indptr, last)
        qf = self._q_rows(q, a["q_scale"] if fp8 else None)
        kv_flat = _storage_from(kv)
        row_bytes, elem = kv.stride(0) * kv.element_size(), kv.element_size()
        kscale = a["kv_scale"].float() if fp8 else None

        def rows(idx):
            k = _read_windows(kv_flat, _row_starts(idx, row_bytes, elem, obj.wide), ROW, "kv_indices/kv_buffer")
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

    @staticmethod
    def _check_values(qo_indptr, kv_indptr, last=None) -> None:
        B = qo_indptr.numel() - 1
        if not torch.equal(qo_indptr.cpu(), torch.arange(B + 1, dtype=torch.int32)):
            _fail("qo_indptr", qo_indptr.tolist()[:8], "arange(B + 1) (one query token per batch row)")
        if last is not None and not bool((last == 1).all()):
            _fail("kv_last_page_lens", last.tolist()[:8], "all 1 (page size 1)")
        if int(kv_indptr[0]) != 0 or bool(((kv_indptr[1:] - kv_indptr[:-1]) < 0).any()):
            _fail("kv_indptr", kv_indptr.tolist()[:8], "0 then non-decreasing")

    def _q_rows(self, q: torch.Tensor, q_scale) -> torch.Tensor:
        """float32 [T, H, 576]: head h of token t read from ``t * stride(0) + h * 576``."""
        T, H, _ = q.shape
        starts = (torch.arange(T, device=q.device)[:, None] * q.stride(0)
                  + torch.arange(H, device=q.device)[None, :] * ROW).reshape(-1)
        rows = _read_windows(_storage_from(q), starts, ROW, "q").float().view(T, H, ROW)
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
            _fail("num_kv_splits", repr(S), "an int >= 1 or None")
        if splits_indptr is not None:
            _check_tensor("num_kv_splits_indptr", splits_indptr, torch.int32, 1, dev, contiguous=True)
            if not _capturing() and not torch.equal(splits_indptr.cpu(), torch.arange(B + 1, dtype=torch.int32) * S):
                _fail("num_kv_splits_indptr", splits_indptr.tolist()[:8], f"arange(B + 1) * {S} (uniform splits)")
        mgc = _mgc(H, fp8)
        self._load(f"stage2(mgc={mgc}, lse={return_lse})")
        lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
        block = _FP8_BLOCK[H] if fp8 else mgc
        if self.stage1_partition == "even" and not fp8:
            chunk = -(-lens // S)
            written = -(-lens // chunk.clamp(min=1))
        else:
            written = torch.minimum(torch.full_like(lens, S), -(-lens // block))
            chunk = -(-lens // written.clamp(min=1))
        n = kv_indices.numel()
        row, j = _ranges(kv_indptr, n)
        valid = torch.arange(n, device=dev) < kv_indptr[-1].long()
        seg = row * S + (j // chunk[row].clamp(min=1)).clamp(max=S - 1)
        out, lse, _ = _attend(qf, rows, kv_indices, seg, valid, torch.arange(B, device=dev).repeat_interleave(S),
                              scale, p_dtype)
        if S == 1 and fp8:  # one pass: the kernel writes o directly; stage 2 (and the final LSE) skipped
            return out, torch.full((B, H), STALE, device=dev), "split1"
        part_out, part_lse = out.view(B, S, H, V_DIM), lse.view(B, S, H)
        if not _capturing():
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
            _fail("work_info_set", "buffers never filled by get_mla_metadata_v1", "a plan for this step")
        if plan["heads"] != H or plan["batch"] != B:
            _fail("work_info_set", f"a plan for {plan['batch']} rows x {plan['heads']} heads",
                  f"a plan for this call's {B} rows x {H} heads")
        kv_indptr, kv_indices = a["kv_indptr"], a["kv_indices"]
        if "works" in plan:
            return self._run_works(a, qf, rows, meta, obj, scale, p_dtype, plan)
        starts, ends = work_info[:B, 4].long(), work_info[:B, 5].long()
        if not _capturing() and not (torch.equal(starts, kv_indptr[:-1].long()) and
                                     torch.equal(ends, kv_indptr[1:].long())):
            _fail("work_info_set", "a stale work plan (filled for other kv_indptr values)",
                  "get_mla_metadata_v1 re-run after every kv_indptr update (stale plans read out of bounds)")
        self._load("mla_reduce_v1")
        topk = plan["topk"]
        if topk > 0:
            if kv_indices.numel() < B * topk:
                _fail("kv_indices", _desc(kv_indices), f">= B * topk = {B * topk} entries (fixed stride)")
            col = torch.arange(topk, device=dev)
            lens = (ends - starts).clamp(0, topk)
            keys = kv_indices[: B * topk]
            valid = (col[None, :] < lens[:, None]).reshape(-1)
            seg = torch.arange(B, device=dev).repeat_interleave(topk)
        else:  # dense persistent plan: ragged ranges from the plan
            keys = kv_indices
            seg, j = _ranges(kv_indptr, kv_indices.numel())
            valid = j < (ends - starts)[seg]
        out, lse, has = _attend(qf, rows, keys, seg, valid, torch.arange(B, device=dev), scale, p_dtype)
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
            _fail("work_info_set", "a stale work plan (filled for other kv_indptr values)",
                  "get_mla_metadata_v1 re-run after every kv_indptr update (stale plans read out of bounds)")
        if kv_indices.numel() < B * topk:
            _fail("kv_indices", _desc(kv_indices), f">= B * topk = {B * topk} entries (fixed stride)")
        self._load("mla_reduce_v1")
        g = obj.kv_granularity
        for i, (b, sub, start, end) in enumerate(plan["works"]):
            nxt = plan["works"][i + 1] if i + 1 < len(plan["works"]) else None
            last = nxt is None or nxt[:2] != (b, sub)
            if (start - b * topk) % g or (not last and (end - start) % g):
                _fail("kv_granularity",
                      f"a work of keys [{start - b * topk}, {end - b * topk}) of row {b} ({obj.name})",
                      f"works of whole {g}-key passes (its SUB_KV); the planner splits rows in kv_granularity "
                      f"blocks: pass kv_granularity={g}")
        # every pseudo-batch of a row reads the same keys for its 16 heads: one set of works for all heads
        works = [(b, start, end) for b, sub, start, end in plan["works"] if sub == 0]
        pos = [torch.arange(s, e, device=dev) for _, s, e in works]
        seg = torch.cat([torch.full((e - s,), i, device=dev) for i, (_, s, e) in enumerate(works)]).long()
        keys = kv_indices[torch.cat(pos)] if pos else kv_indices[:0]
        work_row = torch.tensor([b for b, _, _ in works], device=dev, dtype=torch.long)
        part_out, part_lse, has = _attend(qf, rows, keys, seg, torch.ones_like(seg, dtype=torch.bool), work_row, scale,
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
            _fail("sm_scale", repr(s), "a python float > 0")
        return float(s)

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
            _fail("mla_decode_fwd_v4_nm", f"arch {self.arch}", "gfx950 (the only shipped v4 nm code object: "
                  f"hsa/gfx950/mla_v4/{V4_NM_OBJECT})")
        _check_tensor("q", q, self.fp8, 3, contiguous=True)
        dev = q.device
        T, H, _ = q.shape
        _check_tensor("sink", sink, torch.float32, 1, dev, contiguous=True)
        _check_tensor("qrope", qrope, torch.bfloat16, 3, dev, contiguous=True)
        _check_tensor("kv_buffer", kv, self.fp8, 4, dev, contiguous=True)
        _check_tensor("kvrope", kvrope, torch.bfloat16, 4, dev, contiguous=True)
        _check_tensor("output", output, torch.bfloat16, 3, dev, contiguous=True)
        P = kv.shape[0]
        if q.shape[2] != NM_ROW_BYTES or kv.shape[1:] != (1, 1, NM_ROW_BYTES):
            _fail("q/kv_buffer", f"{_desc(q)}, {_desc(kv)}", f"[T, H, {NM_ROW_BYTES}] and [P, 1, 1, {NM_ROW_BYTES}] "
                  "packed rows (page size 1)")
        if qrope.shape != (T, H, NM_ROPE) or kvrope.shape != (P, 1, 1, NM_ROPE):
            _fail("qrope/kvrope", f"{_desc(qrope)}, {_desc(kvrope)}", f"[{T}, {H}, 64] and [{P}, 1, 1, 64]")
        if sink.numel() != H:
            _fail("sink", _desc(sink), f"[{H}] (num_heads)")
        if tuple(output.shape) != (T, H, V_DIM):
            _fail("output", _desc(output), f"[{T}, {H}, {V_DIM}]")
        if max_seqlen_q != 1 or H not in _V4_NM_HEADS:
            _fail("q", f"{H} heads, max_seqlen_q {max_seqlen_q}", f"heads {_V4_NM_HEADS} with one query token "
                  "(asm_mla_v4.cu's fp8 whitelist)")
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_page_indices", kv_indices)):
            _check_tensor(name, t, torch.int32, 1, dev, contiguous=True)
        if qo_indptr.numel() != T + 1 or kv_indptr.numel() != T + 1:
            _fail("qo_indptr/kv_indptr", f"{_desc(qo_indptr)}, {_desc(kv_indptr)}", f"[{T + 1}] (one token a row)")
        if not _capturing():
            self._check_values(qo_indptr, kv_indptr)
        S = num_kv_splits
        if S is None:
            S = meta_splits(T, kv_indices.numel(), H, True, self.cu_num, tg_factor=-(-H // 64), ignore_total_kv=True)
        if isinstance(S, bool) or not isinstance(S, int) or S < 1:
            _fail("num_kv_splits", repr(S), "an int >= 1 or None")
        if split_indptr is not None:
            _check_tensor("split_indptr", split_indptr, torch.int32, 1, dev, contiguous=True)
            if not _capturing() and not torch.equal(split_indptr.cpu(), torch.arange(T + 1, dtype=torch.int32) * S):
                _fail("split_indptr", split_indptr.tolist()[:8], f"arange(T + 1) * {S} (uniform splits)")
        for name, buf, shape in (("logits", logits if S > 1 else None, (T, S, H, V_DIM)),
                                 ("attn_lse", attn_lse, (T, S, H, 1))):
            if buf is not None and tuple(buf.shape) != shape:
                _fail(name, _desc(buf), f"None or {shape} float32 (kernel-native layout)")
        self._load(V4_NM_OBJECT)
        qf = self._nm_rows(q, qrope)
        n = kv_indices.numel()
        row, j = _ranges(kv_indptr, n)
        valid = torch.arange(n, device=dev) < kv_indptr[-1].long()
        lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
        chunk = (-(-lens // S) + 31) // 32 * 32  # splits of whole 32-key passes; the kernel exports the count
        written = torch.minimum(torch.full_like(lens, S), -(-lens // chunk.clamp(min=1)))
        seg = row * S + (j // chunk[row].clamp(min=1)).clamp(max=S - 1)
        kv_u8, kv_rope = kv.view(P, NM_ROW_BYTES), kvrope.view(P, NM_ROPE)

        def rows(idx):
            starts = (idx.long() & 0xFFFFFFFF)
            if not _capturing() and starts.numel() and int(starts.max()) >= P:
                _fail("kv_page_indices", f"max {int(starts.max())} (kv_buffer has {P} rows)",
                      "row ids inside kv_buffer: every index inside a range is read")
            starts = starts.clamp(max=P - 1)
            return self._nm_rows(kv_u8[starts], kv_rope[starts])

        first = (torch.arange(T * S, device=dev) % S == 0)[:, None]
        seg_sink = torch.where(first, sink.float()[None, :], torch.full((T * S, H), -math.inf, device=dev))
        out, lse, _ = _attend(qf, rows, kv_indices, seg, valid, torch.arange(T, device=dev).repeat_interleave(S),
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
        if kv.dtype not in (self.fp8, torch.uint8):
            _fail(what, f"{kv.dtype}", f"bfloat16, uint8 [.., 584] or {self.fp8} (gfx950's OCP e4m3)")
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
                extra_indices, epilogue):
        if self.arch != "gfx950":
            _fail("sparse_mla_fwd", f"arch {self.arch}", "gfx950 (sparse_mla.py asserts it: gfx950 Gluon kernels)")
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
            x_scale = kv_scale
            x_fmt = self._classify(q, extra_kv, x_scale if fmt == "fp8_scalar" else None, "extra_kv")
            if (fmt == "fp8_scalar") != (x_fmt == "fp8_scalar"):
                _fail("extra_kv", x_fmt, f"a cache of the two-loop family of kv_buffer ({fmt})")
        if (fmt == "fp8_dsv4_mla" or has_extra) and return_lse:
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
        self._load(f"sparse_mla_fwd({fmt}{'+' + x_fmt if x_fmt else ''})")
        segments = [(kv, fmt, kv_scale, kv_indptr, kv_indices)]
        if has_extra:
            segments.append((extra_kv, x_fmt, x_scale, extra_indptr, extra_indices))
        idx_all, batch_all, valid_all, readers = [], [], [], []
        for seg, (cache, f, sc, ip, ix) in enumerate(segments):
            num_slots = cache.shape[0] * cache.shape[1]
            if not _capturing():
                self._check_sparse_values(ip, ix, num_slots, has_invalid, "extra_" if seg else "")
            b, _ = _ranges(ip, ix.numel())
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
        o, lse, has = _attend(q.float(), rows, tagged, torch.cat(batch_all), valid, torch.arange(C, device=dev),
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
            _fail(f"{pre}kv_indptr", ip.tolist()[:8], f"0, non-decreasing, last <= {ix.numel()}")
        used = ix[:n]
        if n and int(used.max()) >= num_slots:
            _fail(f"{pre}kv_indices", f"max {int(used.max())}", f"GLOBAL slot ids < {num_slots}")
        if n and int(used.min()) < (-1 if has_invalid else 0):
            _fail(f"{pre}kv_indices", f"min {int(used.min())} with has_invalid={has_invalid}",
                  "slot ids >= 0 (or -1 sentinels with has_invalid=True)")


# ---- process-wide switch ---------------------------------------------------------------------
ENV_EMULATOR = "DSV4_ATTN_AITER_EMULATOR"
_active: AiterEmulator | None = None


def parse_env(value: str) -> AiterEmulator | None:
    """``DSV4_ATTN_AITER_EMULATOR``: unset/"0" = off; "1" = gfx950 AITER 0.1.20; "gfx942";
    "gfx950:0.1.7" / "gfx950:sparse" (arch[:flavor])."""
    value = (value or "").strip().lower()
    if value in ("", "0", "false", "off"):
        return None
    if value in ("1", "true", "on"):
        return AiterEmulator()
    arch, _, flavor = value.partition(":")
    return AiterEmulator(arch, flavor or "0.1.20")


def enable(arch: str = "gfx950", flavor: str = "0.1.20") -> AiterEmulator:
    """Make the `aiter` backend run against a fresh emulator (process-wide); returns it.

    The backend then accepts CPU/CUDA devices in place of a ROCm GPU and labels everything
    emulated. Undo with :func:`disable`.
    """
    global _active
    _active = AiterEmulator(arch, flavor)
    return _active


def disable() -> None:
    global _active
    _active = None


def active() -> AiterEmulator | None:
    """The emulator switched on by :func:`enable`, or None."""
    return _active
