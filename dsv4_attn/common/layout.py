"""KV-cache records of DeepSeek-V4 and V4.1: allocation, insertion (quantization), gathering.

A *record* is how one cache stores one token's 512-dim K=V row; docs/semantics.md ("Cache
records") gives every record's bytes with diagrams and the sources they were read from. Each
record is described once, as data (:class:`RecordLayout`, ``Record.X.layout``), and
:func:`new_cache`, :func:`insert`, :func:`gather`, :func:`encode` and :func:`decode` read that
description:

=========== ========== ====================================================================
record      bytes/tok  layout
=========== ========== ====================================================================
V4_FP8      584        448 e4m3 + 64 bf16, then 7 UE8M0 scales (64 dims each) + 1 pad byte;
                       split page: all data rows, then all scale rows; pages of 576 B
BF16        1024       512 bf16 (plain rows)
FP8_TENSOR  512        512 e4m3, one per-tensor float scale outside the cache
MXFP8       528        512 e4m3 (RoPE dims too), then 16 UE8M0 scales (32 dims each);
                       interleaved: each token's scales follow its data; pages of 512 B
NVFP4       288        512 e2m1 packed two per byte (even dim in the low nibble), then 32 e4m3
                       scales (16 dims each), no per-tensor scale; interleaved; pages of 512 B
=========== ========== ====================================================================

The records and formats themselves are data in :mod:`.records`, the encoding of packed records
is :mod:`.codec`; this module holds what works on caches (allocation, checks, insertion,
gathering) and is the import home of all three (``__all__``).

A *KV format* (:class:`KVFormat`, named as vLLM's ``--kv-cache-dtype`` names it) gives the record
of the SWA cache and of the compressed cache: ``nvfp4_ds_mla`` is MXFP8 SWA + NVFP4 compressed,
every other format uses one record for both. FP8 values follow a dialect per cache
(:class:`Fp8Dialect`, docs/semantics.md "FP8 dialects").

A slot is ``block * block_size + offset``; -1 means "no row". Byte offsets derived from slots
are computed by torch indexing in int64. The block stride is ``cache.stride(0)``: at least one
page, larger when other layers' pages are interleaved per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import check_rows, decode, dequantize_model1, encode, quantize_model1
from .records import Fp8Dialect, KVFormat, Record, RecordLayout, check_dialect, parse_record
from .spec import HEAD_DIM, round_up

# the records and the codec are imported from here too (``from .layout import KVFormat``)
__all__ = ["CacheGeometry", "Fp8Dialect", "KVFormat", "Record", "RecordLayout", "check_cache", "decode",
           "default_block_stride", "dequantize_model1", "encode", "gather", "gather_rows", "insert",
           "model1_page_bytes", "new_cache", "packed_records", "parse_record", "quantize_model1", "record_parts",
           "token_byte_offsets"]


@dataclass(frozen=True)
class CacheGeometry:
    num_blocks: int
    block_size: int
    block_stride: int  # in units of the cache's element (bytes for packed records)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def default_block_stride(record: Record | KVFormat | str, block_size: int) -> int:
    """A cache's block stride when no other layer's page shares its blocks: one page padded to the
    record's alignment, in elements of the cache (bytes for packed records)."""
    lay = parse_record(record).layout
    return round_up(block_size * lay.row_elems, lay.page_align)


def model1_page_bytes(block_size: int) -> int:
    """Bytes of one V4 (MODEL1) block: round_up(block_size * 584, 576)."""
    return default_block_stride(Record.V4_FP8, block_size)



def new_cache(
    fmt: Record | KVFormat | str,
    num_blocks: int,
    block_size: int,
    device: torch.device | str = "cpu",
    block_stride: int | None = None,
    dialect: Fp8Dialect | str = Fp8Dialect.OCP,
) -> torch.Tensor:
    """Allocate a zeroed cache of ``num_blocks`` blocks of ``block_size`` tokens of one record.

    Returns ``[num_blocks, block_size, row]`` with ``stride(0) == block_stride``: packed records
    uint8 with ``row`` = bytes per token (584 / 528 / 288), default stride one page
    (:func:`default_block_stride`); BF16 / FP8_TENSOR ``row`` = 512 elements, default stride
    ``block_size * 512``. A larger ``block_stride`` emulates pages of other layers interleaved
    per block. The whole backing allocation (``num_blocks * block_stride`` elements) is valid
    memory. ``fmt`` is a record or a KV format with one record (``nvfp4_ds_mla`` has two: pass
    ``KVFormat.NVFP4.comp_record``).
    """
    record = parse_record(fmt)
    dialect = Fp8Dialect.parse(dialect)
    check_dialect(record, dialect, "dialect")
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: got {value!r}; allowed: a positive int")
    row = record.layout.row_elems
    min_stride = block_size * row
    stride = default_block_stride(record, block_size) if block_stride is None else block_stride
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < min_stride:
        raise ValueError(
            f"block_stride: got {block_stride!r}; allowed: an int >= block_size * {row} = {min_stride}"
        )
    flat = torch.zeros(num_blocks * stride, dtype=record.cache_dtype(dialect), device=device)
    return flat.as_strided((num_blocks, block_size, row), (stride, row, 1))


# FlashMLA also takes int8 and float8_e4m3fn views of a packed cache's bytes
_BYTE_VIEWS = (torch.uint8, torch.int8, torch.float8_e4m3fn)


def check_cache(cache, fmt: Record | KVFormat | str, name: str,
                dialect: Fp8Dialect = Fp8Dialect.OCP) -> CacheGeometry:
    """Validate a cache tensor against its declared record; return its geometry. Raises ValueError."""
    record = parse_record(fmt)
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name}: got {type(cache).__name__}; allowed: a torch.Tensor")
    lay = record.layout
    want_dtype = record.cache_dtype(dialect)
    if lay.packed and cache.dtype in _BYTE_VIEWS:
        want_dtype = cache.dtype
    if cache.dtype != want_dtype:
        raise ValueError(f"{name}: got dtype {cache.dtype}; allowed: {want_dtype} for record {record.value}")
    check_dialect(record, dialect, name)
    row = lay.row_elems
    if cache.dim() != 3 or cache.shape[-1] != row:
        raise ValueError(
            f"{name}: got shape {tuple(cache.shape)}; allowed: [num_blocks, block_size, {row}] "
            f"for record {record.value}"
        )
    nb, bs, _ = cache.shape
    if cache.stride(2) != 1 or (bs > 1 and cache.stride(1) != row):
        raise ValueError(
            f"{name}: got strides {tuple(cache.stride())}; allowed: stride(2) == 1, stride(1) == {row} "
            "(each block contiguous)"
        )
    if nb > 1 and cache.stride(0) < bs * row:
        raise ValueError(
            f"{name}: got stride(0) {cache.stride(0)}; allowed: >= block_size * {row} = {bs * row}"
        )
    stride = cache.stride(0) if nb > 1 else max(cache.stride(0), bs * row)
    return CacheGeometry(nb, bs, stride)


def _token_views(cache: torch.Tensor, lay: RecordLayout, geo: CacheGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte views of a packed cache: each token's data [nb, bs, data_bytes] and scales
    [nb, bs, scale_bytes], placed as the record says (split pages or interleaved tokens)."""
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    bs, s0, base = geo.block_size, geo.block_stride, raw.storage_offset()
    if lay.split_pages:
        data_step, scale_step, scale_base = lay.data_bytes, lay.scale_bytes, bs * lay.data_bytes
    else:
        data_step = scale_step = lay.token_bytes
        scale_base = lay.data_bytes
    data = raw.as_strided((geo.num_blocks, bs, lay.data_bytes), (s0, data_step, 1), base)
    scales = raw.as_strided((geo.num_blocks, bs, lay.scale_bytes), (s0, scale_step, 1), base + scale_base)
    return data, scales


def token_byte_offsets(cache: torch.Tensor, fmt: Record | KVFormat | str,
                       slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the records of int ``slots`` [N] (each in ``[0, num_slots)``) lie in a packed cache:
    (data byte offsets, scale byte offsets), int64 [N], from the cache's first byte (its
    ``data_ptr()``), as a kernel addresses them (split pages or interleaved tokens)."""
    record = parse_record(fmt)
    if not record.layout.packed:
        raise ValueError(f"fmt: got {record.value}; allowed: a packed record (bytes per token)")
    geo = check_cache(cache, record, "cache")
    _check_slots(slots, "slots", cache.device, geo.num_slots)
    if slots.numel() and int(slots.min()) < 0:
        raise ValueError("slots: got -1 entries; allowed: rows of the cache only (0 .. num_slots - 1)")
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    block, offset = slots.long() // geo.block_size, slots.long() % geo.block_size
    data, scales = _token_views(cache, record.layout, geo)

    def offsets(view: torch.Tensor) -> torch.Tensor:
        return block * view.stride(0) + offset * view.stride(1) + int(view.storage_offset() - raw.storage_offset())

    return offsets(data), offsets(scales)


def _check_slots(slots, name: str, device: torch.device, num_slots: int | None) -> None:
    if not isinstance(slots, torch.Tensor):
        raise ValueError(f"{name}: got {type(slots).__name__}; allowed: an integer torch.Tensor")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: got dtype {slots.dtype}; allowed: torch.int32 or torch.int64")
    if slots.device != device:
        raise ValueError(f"{name}: got device {slots.device}; allowed: the cache's device {device}")
    if num_slots is not None and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(
                f"{name}: got values in [{lo}, {hi}]; allowed: -1 (no row) or 0..{num_slots - 1} "
                f"(num_blocks * block_size of the cache)"
            )


def _check_scale(record: Record, scale) -> float:
    if record is not Record.FP8_TENSOR:
        if scale is not None:
            raise ValueError(f"scale: got {scale!r}; allowed: None for record {record.value}")
        return 1.0
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale: got a tensor of shape {tuple(scale.shape)}; allowed: one element")
        scale = float(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (scale > 0 and scale < float("inf")):
        raise ValueError(f"scale: got {scale!r}; allowed: a finite float > 0")
    return float(scale)




def insert(
    cache: torch.Tensor,
    fmt: Record | KVFormat | str,
    slots: torch.Tensor,
    kv: torch.Tensor,
    scale: float | torch.Tensor | None = None,
    dialect: Fp8Dialect | str = Fp8Dialect.OCP,
) -> None:
    """Write rows ``kv`` (bf16 ``[N, 512]``) at ``slots`` (int ``[N]``; -1 entries skipped).

    Packed records are quantized by :func:`encode` and placed as the record says; FP8_TENSOR
    rows are ``fp8(clamp(x / scale, +-max))``; BF16 rows are stored as given. Only the selected
    tokens' bytes are written (pad bytes included), nothing else in the cache.
    """
    record = parse_record(fmt)
    dialect = Fp8Dialect.parse(dialect)
    geo = check_cache(cache, record, "cache", dialect)
    kv_scale = _check_scale(record, scale)
    check_rows("kv", kv, (torch.bfloat16,), HEAD_DIM)
    if kv.device != cache.device:
        raise ValueError(f"kv: got device {kv.device}; allowed: the cache's device {cache.device}")
    _check_slots(slots, "slots", cache.device, geo.num_slots)
    if slots.shape != kv.shape[:1]:
        raise ValueError(f"slots: got shape {tuple(slots.shape)}; allowed: [{kv.shape[0]}] (one per kv row)")
    keep = slots >= 0
    slots, kv = slots[keep].long(), kv[keep]
    block, offset = slots // geo.block_size, slots % geo.block_size
    lay = record.layout
    if lay.packed:
        data, scales = _token_views(cache, lay, geo)
        packed = encode(record, kv, dialect)
        data[block, offset] = packed[:, :lay.data_bytes]
        scales[block, offset] = packed[:, lay.data_bytes:]
    elif record is Record.FP8_TENSOR:
        q = (kv.float() / kv_scale).clamp(-dialect.quant_max, dialect.quant_max)
        cache[block, offset] = q.to(cache.dtype)
    else:
        cache[block, offset] = kv


def gather_rows(
    cache: torch.Tensor,
    fmt: Record | KVFormat | str,
    geo: CacheGeometry,
    slots: torch.Tensor,
    kv_scale: float = 1.0,
    dialect: Fp8Dialect = Fp8Dialect.OCP,
) -> torch.Tensor:
    """Unvalidated gather for hot paths: int slots ``[...]`` -> float32 ``[..., 512]``.

    Reads only the selected rows (never the whole cache). A slot outside ``[0, num_slots)`` is "no
    row", like -1: zeros, nothing read (docs/semantics.md "Out-of-range entries").
    """
    record = parse_record(fmt)
    flat = slots.reshape(-1)
    valid = (flat >= 0) & (flat < geo.num_slots)
    safe = torch.where(valid, flat, torch.zeros_like(flat)).long()
    block, offset = safe // geo.block_size, safe % geo.block_size
    if record.layout.packed:
        rows = decode(record, packed_records(cache, record, geo, flat), dialect)
    elif record is Record.FP8_TENSOR:
        rows = cache[block, offset].float() * kv_scale
    else:
        rows = cache[block, offset].float()
    rows = rows.masked_fill(~valid[:, None], 0.0)
    return rows.reshape(*slots.shape, HEAD_DIM)


def record_parts(cache: torch.Tensor, record: Record, geo: CacheGeometry,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unvalidated: the raw records of a packed cache at int slots ``[N]`` as (data uint8 ``[N,
    data_bytes]``, scales uint8 ``[N, scale_bytes]``); a slot outside ``[0, num_slots)`` gives
    zeros. Reads only the selected tokens."""
    valid = (slots >= 0) & (slots < geo.num_slots)
    safe = torch.where(valid, slots, torch.zeros_like(slots)).long()
    data, scales = _token_views(cache, record.layout, geo)
    block, offset = safe // geo.block_size, safe % geo.block_size
    return data[block, offset].masked_fill_(~valid[:, None], 0), scales[block, offset].masked_fill_(~valid[:, None], 0)


def packed_records(cache: torch.Tensor, record: Record, geo: CacheGeometry, slots: torch.Tensor) -> torch.Tensor:
    """Unvalidated: :func:`record_parts` joined, uint8 ``[N, data_bytes + scale_bytes]`` (the
    token's data bytes, then its scale bytes, as :func:`encode` writes them)."""
    return torch.cat(record_parts(cache, record, geo, slots), dim=1)


def gather(
    cache: torch.Tensor,
    fmt: Record | KVFormat | str,
    slots: torch.Tensor,
    scale: float | torch.Tensor | None = None,
    dialect: Fp8Dialect | str = Fp8Dialect.OCP,
) -> torch.Tensor:
    """Dequantized rows at ``slots`` (int, any shape ``[...]``) as float32 ``[..., 512]``; -1 -> 0."""
    record = parse_record(fmt)
    dialect = Fp8Dialect.parse(dialect)
    geo = check_cache(cache, record, "cache", dialect)
    kv_scale = _check_scale(record, scale)
    _check_slots(slots, "slots", cache.device, geo.num_slots)
    return gather_rows(cache, record, geo, slots, kv_scale, dialect)
