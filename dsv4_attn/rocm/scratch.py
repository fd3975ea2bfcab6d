"""Graph-stable scratch for the AITER decode paths.

Everything a decode step hands to AITER lives in buffers allocated ONCE, when a
:class:`AiterScratch` is built for the largest decode batch (``max_tokens`` tokens), and is
rewritten in place every step (``copy_``, ``fill_``, ``out=`` ops, ``scatter_``): the index
CSR of each scope, the persistent work plan, the staged query, the gathered rows of MODEL1
caches, the per-scope output and LSE. Nothing here reads a device value on the host, so a
decode step can be captured in a CUDA/HIP graph and replayed with new batch contents (same
token count). Temporaries of intermediate torch ops (and AITER's own per-call partial
buffers) come from the graph's private pool while capturing, so replays allocate nothing.

A scratch is keyed by :class:`ScratchKey` and shared by every layer of the model: the SWA
scope is built once per step, the C128A scope once per step, and the C4A scope once per C4A
layer (each layer has its own indexer top-k), while its persistent work plan (which only
depends on the per-token key COUNTS, identical for all C4A layers) is built once per step.

Index layouts (spec/vendor-apis.md §3.2-3.3, anchors C15):

* ragged CSR (non-persistent ``mla_decode_fwd``, ``sparse_mla_fwd``): ``kv_indptr [T+1]`` =
  cumsum of valid keys per token, ``kv_indices`` = the valid keys compacted in order; the tail
  past ``kv_indptr[T]`` is -1 and never read;
* fixed stride with -1 sentinels (persistent ``mla_decode_fwd`` with a ``topk=`` plan):
  ``kv_indices [T*K]`` = each token's row of K entries, -1 where invalid; ``kv_indptr`` =
  cumsum of the row lengths (the plan's bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

SCOPES = ("swa", "c4a", "c128a")


@dataclass(frozen=True)
class ScratchKey:
    """What fixes the shapes of a scratch. Layers with the same key share one scratch.

    heads      query heads handed to AITER (padded to what the kernel needs)
    widths     row width per scope name ("swa" W, "c4a" top-k, "c128a" C128A width)
    q_dtype / kv_dtype   dtypes handed to the kernel (bf16, or the arch's fp8)
    layout     "ragged" or "fixed" (see module docstring)
    gather     True when rows are gathered into scratch (MODEL1 caches on the mla_decode_fwd path)
    persistent True when the six persistent work buffers are needed
    staged     True when q, per-scope out/LSE and the sink are staged in scratch (mla_decode_fwd)
    """

    device: torch.device
    max_tokens: int
    heads: int
    widths: tuple[tuple[str, int], ...]
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    layout: str
    gather: bool
    persistent: bool
    staged: bool = True
    max_splits: int = 16

    def width(self, scope: str) -> int:
        return dict(self.widths)[scope]


@dataclass
class ScopeBuffers:
    """One scope's per-step buffers (views are taken for the current token count T).

    kv_indptr    int32 [max_tokens + 1] (entry 0 stays 0)
    kv_indices   int32 [max_tokens * width + 1] (the last entry is a dump slot for scatters)
    slots        int32 [max_tokens * width + 1]: cache slots in kv_indices' order (gather mode)
    counts       int64 [max_tokens]: valid keys per token of the last build
    meta         the six persistent work buffers (persistent mode) or None
    """

    width: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    slots: torch.Tensor
    counts: torch.Tensor
    kv_scale: torch.Tensor
    meta: list[torch.Tensor] | None = None


@dataclass
class AiterScratch:
    """All buffers of one :class:`ScratchKey` (see module docstring).

    qo_indptr  int32 [max_tokens + 1] = arange (one query token per AITER batch row)
    last_page  int32 [max_tokens] = 1 (page size 1)
    splits_indptr int32 [max_tokens + 1] (non-persistent split offsets)
    q          [max_tokens, heads, 512] q_dtype, padded heads stay 0; q_scale float32 [1]
    sink       float32 [heads], padded heads -inf
    out        two [max_tokens, heads, 512] bf16 buffers (first / second scope call)
    lse        two float32 [max_tokens, heads]
    gather     [max_tokens * max width, 512] kv_dtype (gather mode) or None; shared by all
               scopes because the two scope calls of a layer run in stream order
    """

    key: ScratchKey
    qo_indptr: torch.Tensor
    last_page: torch.Tensor
    splits_indptr: torch.Tensor
    q: torch.Tensor
    q_scale: torch.Tensor
    sink: torch.Tensor
    out: list[torch.Tensor]
    lse: list[torch.Tensor]
    gather: torch.Tensor | None
    scopes: dict[str, ScopeBuffers] = field(default_factory=dict)

    @classmethod
    def allocate(cls, key: ScratchKey, info_v1: Callable[..., tuple] | None) -> "AiterScratch":
        """Allocate every buffer once. ``info_v1(heads, q_dtype, kv_dtype, max_tokens)`` returns
        AITER's six (shape, dtype) pairs of the persistent work buffers (persistent keys only)."""
        dev, n, h = key.device, key.max_tokens, key.heads
        i32 = dict(dtype=torch.int32, device=dev)
        scopes = {}
        for name, width in key.widths:
            meta = None
            if key.persistent:
                meta = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in info_v1()]
            scopes[name] = ScopeBuffers(
                width=width,
                kv_indptr=torch.zeros(n + 1, **i32),
                kv_indices=torch.full((n * width + 1,), -1, **i32),
                slots=torch.full((n * width + 1,), -1, **i32),
                counts=torch.zeros(n, dtype=torch.int64, device=dev),
                kv_scale=torch.ones(1, dtype=torch.float32, device=dev),
                meta=meta,
            )
        max_width = max(w for _, w in key.widths)
        n = n if key.staged else 0  # sparse_mla_fwd reads q and writes out in place
        return cls(
            key=key,
            qo_indptr=torch.arange(key.max_tokens + 1, **i32),
            last_page=torch.ones(key.max_tokens, **i32),
            splits_indptr=torch.zeros(key.max_tokens + 1, **i32),
            q=torch.zeros(n, h, 512, dtype=key.q_dtype, device=dev),
            q_scale=torch.ones(1, dtype=torch.float32, device=dev),
            sink=torch.full((h,), float("-inf"), dtype=torch.float32, device=dev),
            out=[torch.zeros(n, h, 512, dtype=torch.bfloat16, device=dev) for _ in range(2)],
            lse=[torch.zeros(n, h, dtype=torch.float32, device=dev) for _ in range(2)],
            gather=(torch.zeros(n * max_width, 512, dtype=key.kv_dtype, device=dev) if key.gather else None),
            scopes=scopes,
        )

    def pointers(self) -> list[int]:
        """Data pointers of every buffer (graph tests check they never move)."""
        ts = [self.qo_indptr, self.last_page, self.splits_indptr, self.q, self.q_scale, self.sink, *self.out,
              *self.lse] + ([self.gather] if self.gather is not None else [])
        for s in self.scopes.values():
            ts += [s.kv_indptr, s.kv_indices, s.slots, s.counts, s.kv_scale] + (s.meta or [])
        return [t.data_ptr() for t in ts]


def write_indices(scope: ScopeBuffers, rows: torch.Tensor, lens: torch.Tensor, layout: str,
                  remap: Callable[[torch.Tensor], torch.Tensor] | None, gather: bool) -> None:
    """Write one scope's CSR for ``rows`` int32 [T, K] (global slots, -1 unused) whose first
    ``lens[t]`` columns are token t's keys. In place, fixed shapes, no host sync.

    ``remap`` turns slots into the row numbers the kernel reads (plain caches with a padded
    block pitch); with ``gather`` the kernel reads gathered scratch rows instead, so
    ``kv_indices`` holds scratch positions and ``slots`` the cache slots to gather.
    """
    T, K = rows.shape
    if K > scope.width:
        raise ValueError(f"rows: got width {K}; allowed: <= {scope.width} (the scratch was sized for it)")
    col = torch.arange(K, device=rows.device)[None, :]
    keep = (col < lens[:, None].long()) & (rows >= 0)
    target = remap(rows) if remap is not None else rows
    cap = T * scope.width
    if layout == "fixed":
        # row t occupies [t*width, t*width + K); -1 sentinels where invalid; indptr = cumsum(lens)
        view = scope.slots[:cap].view(T, scope.width)
        view.fill_(-1)
        view[:, :K].copy_(torch.where(keep, rows, torch.full_like(rows, -1)))
        kv = scope.kv_indices[:cap].view(T, scope.width)
        if gather:
            pos = torch.arange(cap, device=rows.device, dtype=torch.int32).view(T, scope.width)
            kv.copy_(torch.where(view >= 0, pos, torch.full_like(pos, -1)))
        else:
            kv.fill_(-1)
            kv[:, :K].copy_(torch.where(keep, target, torch.full_like(target, -1)))
        counts = lens.long().clamp(max=K)
    else:
        counts = keep.sum(dim=1)
        start = torch.cumsum(counts, 0) - counts
        dest = torch.where(keep, start[:, None] + keep.long().cumsum(dim=1) - 1, torch.full_like(col, cap))
        scope.slots[: cap + 1].fill_(-1)
        scope.slots.scatter_(0, dest.reshape(-1), rows.reshape(-1))
        if gather:
            torch.arange(cap, out=scope.kv_indices[:cap])
        else:
            scope.kv_indices[: cap + 1].fill_(-1)
            scope.kv_indices.scatter_(0, dest.reshape(-1), target.reshape(-1).to(torch.int32))
    scope.counts[:T].copy_(counts)
    torch.cumsum(counts, 0, dtype=torch.int32, out=scope.kv_indptr[1 : T + 1])


def quantize_pow2_(dst: torch.Tensor, src: torch.Tensor, scale_out: torch.Tensor) -> None:
    """``dst`` (fp8) = ``src / s`` with one power-of-two per-tensor scale ``s`` written to
    ``scale_out`` [1] (``2^ceil(log2(amax / fp8_max))``). A power of two keeps every value that
    already has <= 3 mantissa bits (MODEL1's NoPE bytes) exact. Device ops only."""
    fmax = torch.finfo(dst.dtype).max
    amax = src.abs().amax().float().clamp_min(1e-30)
    scale_out.copy_(torch.exp2(torch.ceil(torch.log2(amax / fmax))).reshape(1))
    dst.copy_((src.float() / scale_out).clamp(-fmax, fmax))
