"""Graph-stable scratch for the AITER decode paths.

Everything a decode step hands to AITER lives in buffers allocated ONCE, when an
:class:`AiterScratch` is built for the largest decode batch it serves (``max_tokens`` tokens),
and is rewritten in place every step (``copy_``, ``fill_``, ``out=`` ops, ``scatter_``): the
index lists of each scope, the persistent work plan, the staged query, the gathered rows, the
per-scope output and LSE. Nothing here reads a device value on the host, so a decode step can be
captured in a CUDA/HIP graph and replayed with new batch contents (same token count).
Temporaries of intermediate torch ops (and AITER's own per-call partial buffers) come from the
graph's private pool while capturing, so replays allocate nothing.

A scratch is keyed by :class:`ScratchKey` and shared by every layer with that key: the SWA
scope is built once per step, the C128A scope once per step, and the C4A scope once per C4A
layer (each layer has its own indexer top-k), while its persistent work plan (which only
depends on the per-token key COUNTS, identical for all C4A layers) is built once per step.

Index lists are COMPACTED: a token's keys are the entries of its row that are inside the
scope's first ``lens`` columns and inside ``[0, capacity)`` of their cache, in row order, with no
-1 or out-of-range entry inside any token's range (AITER's kernels read every index in a range):

* ``"slots"``  ragged CSR of cache slots (``sparse_mla_fwd`` reads the caches in place);
* ``"ragged"`` ragged CSR of gathered-row positions (``mla_decode_fwd`` split mode, v4 nm);
* ``"fixed"``  token t's positions at ``kv_indices[t*width : t*width + count_t]`` and
  ``kv_indptr = cumsum(counts)`` (``mla_decode_fwd`` persistent mode with a ``topk=`` plan);
* ``"padded"`` ragged CSR of gathered-row positions with each token's range padded to a whole
  number of ``pad_unit`` entries (at least one) that point to the SENTINEL row, as is every
  entry past the last range (``mla_decode_fwd`` split mode). The sentinel row is zero but for
  its last element, ``-SENTINEL``; split mode's q carries 1.0 there (real rows carry 0), so a
  sentinel key scores about -1e30 and weighs nothing. A range of ``S * mgc`` keys gives every one
  of S splits keys under any stage-1 partition (AITER's stage 2 merges ``min(S, cdiv(L, mgc))``
  partials), a tile's over-read past a split's end stays inside the split, and an over-read past
  the last range reads the sentinel, never a live row.

Gathered rows of token t sit at positions ``t*width + j`` (j < its key count), so the three
layouts share one gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

SCOPES = ("swa", "c4a", "c128a")
LAYOUTS = ("slots", "ragged", "fixed", "padded")
SENTINEL = 1e30  # -SENTINEL: the sentinel row's last element (bf16 holds it)


def _unused() -> torch.Tensor:
    """A staging buffer the scratch's path never uses (0 elements)."""
    return torch.empty(0)


@dataclass(frozen=True)
class ScratchKey:
    """What fixes the shapes of a scratch. Layers with the same key share one scratch.

    path       the AITER entry point ("sparse_mla_fwd", "mla_decode_fwd_v4_nm", "mla_decode_fwd")
    heads      query heads handed to AITER (padded to what the kernel needs)
    widths     row width per scope name (v4 nm: per layer kind, its SWA + compressed width)
    q_dtype / kv_dtype   dtypes handed to the kernel
    layout     one of :data:`LAYOUTS`
    row        elements per gathered row (576 for mla_decode_fwd, 512 packed bytes for v4 nm;
               0 = nothing gathered)
    pad_slack  index entries per token beyond its width that the "padded" layout may use
    persistent True when the six persistent work buffers are needed
    """

    path: str
    device: torch.device
    max_tokens: int
    heads: int
    widths: tuple[tuple[str, int], ...]
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    layout: str
    row: int = 0
    persistent: bool = False
    max_splits: int = 16
    pad_slack: int = 0

    def width(self, scope: str) -> int:
        return dict(self.widths)[scope]


@dataclass
class ScopeBuffers:
    """One scope's per-step buffers (views are taken for the current token count T).

    kv_indptr    int32 [max_tokens + 1] (entry 0 stays 0)
    kv_indices   int32 [max_tokens * width + 1] (the last entry is a dump slot for scatters)
    slots        int32 [max_tokens * width]: the rows' slots, -1 where not a key (gather paths)
    pos          int64 [max_tokens * width]: the rows' gather positions (:func:`compact`)
    counts       int64 [max_tokens]: keys per token of the last build
    kv_scale     float32 [1] (fp8 operands)
    meta         the six persistent work buffers (persistent mode; empty otherwise)
    """

    width: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    slots: torch.Tensor
    pos: torch.Tensor
    counts: torch.Tensor
    kv_scale: torch.Tensor
    meta: list[torch.Tensor] = field(default_factory=list)


@dataclass
class AiterScratch:
    """All buffers of one :class:`ScratchKey` (see module docstring); staging buffers are empty
    (0 elements) on the paths that do not use them.

    qo_indptr  int32 [max_tokens + 1] = arange (one query token per AITER batch row)
    last_page  int32 [max_tokens] = 1 (page size 1)
    splits_indptr int32 [max_tokens + 1] (split-mode offsets)
    q          mla_decode_fwd: [max_tokens, heads, 576] q_dtype (RoPE tail and padded heads 0);
               v4 nm: packed uint8 [max_tokens, heads, 512]
    q_rope     v4 nm: bf16 [max_tokens, heads, 64]
    q_scale    float32 [1]
    sink       float32 [heads] as the kernels take it (padded heads -inf)
    out        mla_decode_fwd: two [max_tokens, heads, 512] bf16 (first / second scope call);
               v4 nm: one
    lse        two float32 [max_tokens, heads] (mla_decode_fwd)
    rows       gathered rows [max_tokens * max width + 2, row] (row max_tokens * width is a scatter
               dump; the last row is the "padded" layout's sentinel): mla_decode_fwd kv_dtype with a
               zero tail past 512; v4 nm packed uint8
    rows_rope  v4 nm: bf16 [max_tokens * width + 1, 64]
    """

    key: ScratchKey
    qo_indptr: torch.Tensor
    last_page: torch.Tensor
    splits_indptr: torch.Tensor
    q_scale: torch.Tensor
    sink: torch.Tensor
    scopes: dict[str, ScopeBuffers] = field(default_factory=dict)
    q: torch.Tensor = field(default_factory=_unused)
    q_rope: torch.Tensor = field(default_factory=_unused)
    out: list[torch.Tensor] = field(default_factory=list)
    lse: list[torch.Tensor] = field(default_factory=list)
    rows: torch.Tensor = field(default_factory=_unused)
    rows_rope: torch.Tensor = field(default_factory=_unused)

    @classmethod
    def allocate(cls, key: ScratchKey, info_v1: Callable[[], tuple] | None) -> AiterScratch:
        """Allocate every buffer once. ``info_v1()`` returns AITER's six (shape, dtype) pairs of
        the persistent work buffers (persistent keys only)."""
        dev, n, h = key.device, key.max_tokens, key.heads
        i32: dict[str, Any] = dict(dtype=torch.int32, device=dev)
        if key.persistent and info_v1 is None:
            raise ValueError("info_v1: got None for a persistent scratch; allowed: AITER's work-buffer shapes")
        work = info_v1() if key.persistent and info_v1 is not None else ()
        scopes = {}
        for name, width in key.widths:
            scopes[name] = ScopeBuffers(
                width=width,
                kv_indptr=torch.zeros(n + 1, **i32),
                kv_indices=torch.full((n * (width + key.pad_slack) + 1,), -1, **i32),
                slots=torch.full((n * width,), -1, **i32),
                pos=torch.zeros(n * width, dtype=torch.int64, device=dev),
                counts=torch.zeros(n, dtype=torch.int64, device=dev),
                kv_scale=torch.ones(1, dtype=torch.float32, device=dev),
                meta=[torch.empty(s, dtype=d, device=dev) for s, d in work],
            )
        scr = cls(key=key, qo_indptr=torch.arange(n + 1, **i32), last_page=torch.ones(n, **i32),
                  splits_indptr=torch.zeros(n + 1, **i32), q_scale=torch.ones(1, dtype=torch.float32, device=dev),
                  sink=torch.full((h,), float("-inf"), dtype=torch.float32, device=dev), scopes=scopes)
        if key.path == "sparse_mla_fwd":
            return scr  # reads q and writes out in place, reads the caches in place
        nm = key.path == "mla_decode_fwd_v4_nm"
        max_rows = n * max(w for _, w in key.widths) + 2
        scr.q = torch.zeros(n, h, key.row, dtype=torch.uint8 if nm else key.q_dtype, device=dev)
        scr.out = [torch.zeros(n, h, 512, dtype=torch.bfloat16, device=dev) for _ in range(1 if nm else 2)]
        scr.lse = [] if nm else [torch.zeros(n, h, dtype=torch.float32, device=dev) for _ in range(2)]
        scr.rows = torch.zeros(max_rows, key.row, dtype=torch.uint8 if nm else key.kv_dtype, device=dev)
        if key.layout == "padded":
            scr.rows[-1, -1] = -SENTINEL
            scr.q[:, :, -1] = 1.0
        if nm:
            scr.q_rope = torch.zeros(n, h, 64, dtype=torch.bfloat16, device=dev)
            scr.rows_rope = torch.zeros(max_rows, 64, dtype=torch.bfloat16, device=dev)
        return scr

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer this scratch holds (the staging buffers its path does not use left out)."""
        ts = [self.qo_indptr, self.last_page, self.splits_indptr, self.q_scale, *self.out, *self.lse]
        ts += [t for t in (self.q, self.q_rope, self.sink, self.rows, self.rows_rope) if t.numel()]
        for s in self.scopes.values():
            ts += [s.kv_indptr, s.kv_indices, s.slots, s.pos, s.counts, s.kv_scale, *s.meta]
        return ts

    def pointers(self) -> list[int]:
        """Data pointers of every buffer (graph tests check they never move)."""
        return [t.data_ptr() for t in self.buffers()]

    def nbytes(self) -> int:
        """Bytes of every buffer (what the scratch holds for its whole life)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())


def compact(parts: list[tuple[torch.Tensor, torch.Tensor, int]], width: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """Which entries of a token's rows are keys, and where they go.

    ``parts``: (rows int32 [T, K_i] of slots, lens [T], cache capacity) per scope, in order; entry
    (t, c) of part i is a key iff ``c < lens[t]`` and ``0 <= rows[t, c] < capacity``. Returns
    ``keep`` bool [T, sum K_i], ``pos`` int64 [T, sum K_i] (``t*width + j`` for the token's j-th
    key over all parts, ``T*width`` = the dump position otherwise) and ``counts`` int64 [T].
    """
    keeps = []
    for rows, lens, capacity in parts:
        col = torch.arange(rows.shape[1], device=rows.device)[None, :]
        keeps.append((col < lens[:, None].long()) & (rows >= 0) & (rows.long() < capacity))
    keep = torch.cat(keeps, dim=1)
    T, K = keep.shape
    if K > width:
        raise ValueError(f"rows: got {K} columns; allowed: <= {width} (the scratch was sized for it)")
    base = torch.arange(T, device=keep.device)[:, None] * width
    pos = torch.where(keep, base + keep.long().cumsum(dim=1) - 1, torch.full_like(base, T * width))
    return keep, pos, keep.sum(dim=1)


def write_indices(scope: ScopeBuffers, keep: torch.Tensor, pos: torch.Tensor, counts: torch.Tensor,
                  slots: torch.Tensor, layout: str, pad_unit: int = 0, sentinel: int = -1) -> None:
    """Write a scope's ``kv_indptr`` / ``kv_indices`` in ``layout`` (see module docstring) and its
    ``slots`` / ``pos`` from :func:`compact`'s result; ``slots`` int32 [T, K] are the rows' cache
    slots; "padded": ranges padded to whole ``pad_unit`` entries of row ``sentinel``. In place,
    fixed shapes, no host sync."""
    T, K = keep.shape
    cap = T * scope.width
    scope.slots[: T * K].copy_(torch.where(keep, slots, torch.full_like(slots, -1)).reshape(-1))
    scope.pos[: T * K].copy_(pos.reshape(-1))
    ind = scope.kv_indices
    lengths = counts
    if layout == "fixed":
        grid = torch.arange(cap, device=keep.device).view(T, scope.width)
        inside = grid % scope.width < counts[:, None]
        ind[:cap].copy_(torch.where(inside, grid, torch.full_like(grid, -1)).view(-1))
    else:
        if layout == "padded":  # at least one unit: a keyless token's splits read sentinels only
            lengths = torch.clamp((counts + pad_unit - 1) // pad_unit, min=1) * pad_unit
            cap = ind.numel() - 1
        start = torch.cumsum(lengths, 0) - lengths
        dest = torch.where(keep, pos - (torch.arange(T, device=keep.device)[:, None] * scope.width) + start[:, None],
                           torch.full_like(pos, cap))
        value = slots.long() if layout == "slots" else pos
        ind[: cap + 1].fill_(sentinel if layout == "padded" else -1)
        ind.scatter_(0, dest.reshape(-1), value.reshape(-1).to(torch.int32))
    scope.counts[:T].copy_(counts)
    torch.cumsum(lengths, 0, dtype=torch.int32, out=scope.kv_indptr[1 : T + 1])


def pow2_scale_(scale_out: torch.Tensor, amax: torch.Tensor, fp8: torch.dtype) -> None:
    """``scale_out`` [1] = ``2^ceil(log2(amax / fp8_max))``: the power-of-two per-tensor scale of
    values whose largest magnitude is ``amax`` (a 0-d tensor). A power of two keeps every value
    that already has <= 3 mantissa bits (MODEL1's NoPE bytes) exact. Device ops only."""
    fmax = torch.finfo(fp8).max
    scale_out.copy_(torch.exp2(torch.ceil(torch.log2(amax.float().clamp_min(1e-30) / fmax))).reshape(1))


def amax(src: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``src`` (0-d, its dtype), without an ``abs`` copy of it."""
    low, high = torch.aminmax(src)
    return torch.maximum(high, -low)


def to_fp8(src: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``src / scale`` (a power of two: exact in ``src``'s dtype, bf16 or fp32) saturated to
    ``fp8``'s range, in ``fp8``."""
    fmax = torch.finfo(fp8).max
    return src.div(scale.to(src.dtype)).clamp_(-fmax, fmax).to(fp8)


def quantize_pow2_(dst: torch.Tensor, src: torch.Tensor, scale_out: torch.Tensor) -> None:
    """``dst`` (fp8) = ``src / s`` with one power-of-two per-tensor scale ``s`` (:func:`pow2_scale_`)
    written to ``scale_out`` [1]. Device ops only."""
    pow2_scale_(scale_out, amax(src), dst.dtype)
    dst.copy_(to_fp8(src, scale_out, dst.dtype))
