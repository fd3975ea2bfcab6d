"""The gather ceiling of a decode case: how fast this GPU reads exactly the key rows the layer
reads, in a kernel that does nothing else (``gather_us``; a backend's ``x_gather`` = its time /
that).

The roofline floor (``layer.case_work``) prices the rows' bytes at the copy bandwidth, which a
streaming copy reaches. A layer instead gathers its rows one record at a time from random places
in the cache (584 bytes each for the V4 record: 576 data bytes, then 8 scale bytes elsewhere in
the page), so the floor may be out of reach of any kernel. This kernel reads each distinct row of
the case once (the floor's bytes: data and scale bytes, at the byte offsets a kernel computes),
many rows in flight per program and nothing dependent on them, and sums every word it read into
one int32 per row so that no load is dead. Both scopes' rows go in one launch where their caches
share a record. Its time, under the same CUDA-graph replay and L2 flush as every backend's,
includes one kernel launch, as theirs does. The fastest of a few launch shapes is reported.

A bench instrument, not a backend: no engine runs it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.layout import Record, token_byte_offsets
from .cases import LayerCase

# (rows per program, warps): a few shapes, the fastest is the ceiling
SHAPES = ((4, 2), (8, 4), (16, 4), (32, 8))


@triton.jit
def _gather_rows_kernel(BASE, DATA_OFF, SCALE_OFF, OUT, n_rows, DATA_WORDS: tl.constexpr, HEAD_WORDS: tl.constexpr,
                        TAIL_P2: tl.constexpr, SCALE_BYTES: tl.constexpr, SB_P2: tl.constexpr, ROWS: tl.constexpr):
    """OUT[r] = the int32 sum (wrapping) of row r's data words and scale bytes. BASE: a uint8
    pointer (16-byte aligned); DATA_OFF / SCALE_OFF int64 [n_rows]: each row's data / scale byte
    offset from BASE (data offsets 16-byte aligned: the callers check). A row's words are read as
    a power-of-two head (HEAD_WORDS) and a tail, so no lane idles on padding."""
    words_base = BASE.to(tl.pointer_type(tl.int32))
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < n_rows
    row = words_base + tl.multiple_of(tl.load(DATA_OFF + r, mask=live, other=0) // 4, 4)
    h = tl.arange(0, HEAD_WORDS)
    total = tl.sum(tl.load(row[:, None] + h[None, :], mask=live[:, None], other=0), axis=1)
    if DATA_WORDS > HEAD_WORDS:
        t = HEAD_WORDS + tl.arange(0, TAIL_P2)
        total += tl.sum(tl.load(row[:, None] + t[None, :], mask=live[:, None] & (t[None, :] < DATA_WORDS), other=0),
                        axis=1)
    if SCALE_BYTES > 0:
        b = tl.arange(0, SB_P2)
        s_off = tl.load(SCALE_OFF + r, mask=live, other=0)
        scales = tl.load(BASE + s_off[:, None] + b[None, :], mask=live[:, None] & (b[None, :] < SCALE_BYTES), other=0)
        total += tl.sum(scales.to(tl.int32), axis=1)
    tl.store(OUT + r, total, mask=live)


def _power_of_2_below(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class RowGather:
    """Rows of one or more caches of one packed record, as byte offsets from the first cache, and
    the launch that gathers them."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]], record: Record) -> None:
        """``parts``: (cache, int slots [N]) pairs, every cache of ``record``."""
        lay = record.layout
        if not lay.packed or lay.data_bytes % 16:
            raise ValueError(f"record: got {record.value}; allowed: a packed record of 16-byte data rows")
        self.base = parts[0][0].view(torch.uint8) if parts[0][0].dtype != torch.uint8 else parts[0][0]
        if self.base.data_ptr() % 16:
            raise ValueError("cache: got an address that is not 16-byte aligned; allowed: a 16-byte aligned cache")
        offsets = []
        for cache, slots in parts:
            shift = cache.data_ptr() - self.base.data_ptr()
            if shift % 16:
                raise ValueError("caches: got two whose addresses differ by bytes not a multiple of 16; allowed: "
                                 "16-byte aligned caches")
            data, scale = token_byte_offsets(cache, record, slots)
            offsets.append((data + shift, scale + shift))
        self.data_off = torch.cat([d for d, _ in offsets])
        self.scale_off = torch.cat([s for _, s in offsets])
        if bool((self.data_off % 16 != 0).any()):
            raise ValueError("cache: its rows are not 16-byte aligned; allowed: a 16-byte aligned cache")
        self.data_words = lay.data_bytes // 4
        self.scale_bytes = lay.scale_bytes
        self.out = torch.empty(self.data_off.numel(), dtype=torch.int32, device=self.base.device)

    def __call__(self, rows: int, warps: int) -> torch.Tensor:
        n = self.out.numel()
        if n:
            head = _power_of_2_below(self.data_words)
            _gather_rows_kernel[(triton.cdiv(n, rows),)](
                self.base, self.data_off, self.scale_off, self.out, n, DATA_WORDS=self.data_words,
                HEAD_WORDS=head, TAIL_P2=triton.next_power_of_2(max(self.data_words - head, 1)),
                SCALE_BYTES=self.scale_bytes, SB_P2=triton.next_power_of_2(max(self.scale_bytes, 1)),
                ROWS=rows, num_warps=warps)
        return self.out


def case_gathers(case: LayerCase, scopes: list[tuple[torch.Tensor, Record]]) -> list[RowGather]:
    """The launches that gather ``case``'s rows (``scopes``: (distinct global slots int64 [N],
    record) per scope, the SWA cache's first, then the compressed cache's): one per record."""
    caches = [case.swa_cache] + ([case.comp_cache] if case.comp_cache is not None else [])
    by_record: dict[Record, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for cache, (slots, record) in zip(caches, scopes):
        if slots.numel():
            by_record.setdefault(record, []).append((cache, slots))
    return [RowGather(parts, record) for record, parts in by_record.items()]


def gather_runner(gathers: list[RowGather], rows: int, warps: int):
    """A callable that gathers every scope's rows with one launch shape."""
    def run() -> None:
        for g in gathers:
            g(rows, warps)
    return run
