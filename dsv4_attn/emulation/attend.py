"""The attention arithmetic the emulated kernels share: reading rows from raw storage as a kernel
addresses them, attention over key ranges in chunks, and the stage-2 merge of split partials."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .contract import capturing, fail
from .releases import CHUNK_ELEMS, ROW, V_DIM


def storage_from(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage from its first element to the end, 1-D in t's dtype (what a kernel handed
    ``t.data_ptr()`` can address)."""
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((n,), (1,), t.storage_offset())


def read_windows(flat: torch.Tensor, starts: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """Rows of ``width`` elements of ``flat`` starting at element offsets ``starts`` (int64 [N])."""
    limit = flat.numel() - width
    if not capturing() and starts.numel():
        lo, hi = int(starts.min()), int(starts.max())
        if lo < 0 or hi > limit:
            fail(what, f"a read of elements [{hi}, {hi + width}) ({flat.element_size() * hi} bytes in)",
                  f"reads inside the tensor's storage ({flat.numel()} elements): every index inside a "
                  "key range is read (no -1 sentinel, no bounds check)")
    return flat.unfold(0, width, 1)[starts.clamp(0, max(limit, 0))]


def row_starts(idx: torch.Tensor, row_bytes: int, elem: int, wide: bool) -> torch.Tensor:
    """Element offsets of KV rows ``idx`` (int32 as the kernel reads them: unsigned)."""
    r = idx.long() & 0xFFFFFFFF
    if wide:
        return r * row_bytes // elem
    return ((r & 0xFFFFFF) * row_bytes & 0xFFFFFFFF) // elem


def attend(q: torch.Tensor, rows: Callable[[torch.Tensor], torch.Tensor], key_idx: torch.Tensor,
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
    part = attend_flat if capturing() else attend_padded
    acc, denom, m, count = part(q[seg_row], rows, key_idx, key_seg, key_ok, scale, p_dtype, m)
    m_ref = torch.where(m == -math.inf, torch.zeros_like(m), m)  # a +inf sink: inf - inf = NaN, as in a kernel
    if seg_sink is not None:
        denom = denom + torch.exp(seg_sink - m_ref)
    mass = denom > 0  # keys, or a finite sink (then a keyless segment gives 0 and the sink's LSE)
    lse = torch.where(mass, torch.log(denom) + m_ref, torch.full_like(denom, math.nan))
    out = torch.where(mass[..., None], acc / denom[..., None], torch.full_like(acc, math.nan))
    return out, lse, count > 0


def probabilities(s, m_ref, p_dtype):
    """(p for the denominator, p for P·V: rounded to ``p_dtype`` when given)."""
    p = torch.exp(s - m_ref)
    return p, (p.to(p_dtype).float() if p_dtype is not None else p)


def attend_padded(qs, rows, key_idx, key_seg, key_ok, scale, p_dtype, m):
    """:func:`attend`'s sums with each segment's keys padded into one batch (host syncs)."""
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
    step = max(1, CHUNK_ELEMS // (width * (ROW + H)))
    for s0 in range(0, S, step):
        d, u = dense[s0 : s0 + step], used[s0 : s0 + step]
        k = rows(torch.where(u, d, torch.zeros_like(d)).reshape(-1)).view(d.shape[0], width, -1)
        s = torch.einsum("shd,sld->shl", qs[s0 : s0 + step], k[..., :D]) * scale
        s = s.masked_fill(~u[:, None, :], -math.inf)
        m[s0 : s0 + step] = torch.maximum(m[s0 : s0 + step], s.amax(dim=2))
        m_ref = m[s0 : s0 + step]
        p, pv = probabilities(s, torch.where(m_ref == -math.inf, torch.zeros_like(m_ref), m_ref)[..., None], p_dtype)
        denom[s0 : s0 + step] = p.sum(dim=2)
        acc[s0 : s0 + step] = torch.einsum("shl,sld->shd", pv, k[..., :V_DIM])
    return acc, denom, m, count


def attend_flat(qs, rows, key_idx, key_seg, key_ok, scale, p_dtype, m):
    """:func:`attend`'s sums over chunks of the flat key list: fixed shapes, no host sync."""
    S, H, D = qs.shape
    N, step = key_idx.numel(), max(64, CHUNK_ELEMS // (H * V_DIM))
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
        p, pv = probabilities(s, m_ref[seg], p_dtype)
        denom.index_add_(0, seg, p)
        count.index_add_(0, seg, key_ok[c0:c1].float())
        acc.index_add_(0, seg, pv[:, :, None] * k[:, None, :V_DIM])
    return acc, denom, m, count


def key_ranges(indptr: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
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

