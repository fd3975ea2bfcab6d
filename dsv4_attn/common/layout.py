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

A *KV format* (:class:`KVFormat`, named as vLLM's ``--kv-cache-dtype`` names it) gives the record
of the SWA cache and of the compressed cache: ``nvfp4_ds_mla`` is MXFP8 SWA + NVFP4 compressed,
every other format uses one record for both. FP8 values follow a dialect per cache
(:class:`Fp8Dialect`, docs/semantics.md "FP8 dialects").

A slot is ``block * block_size + offset``; -1 means "no row". Byte offsets derived from slots
are computed by torch indexing in int64. The block stride is ``cache.stride(0)``: at least one
page, larger when other layers' pages are interleaved per block.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .spec import (
    HEAD_DIM,
    MODEL1_DATA_BYTES,
    MODEL1_PAGE_ALIGN,
    MODEL1_SCALE_BYTES,
    MODEL1_TOKEN_BYTES,
    NOPE_DIM,
    QUANT_TILE,
    ROPE_DIM,
    round_up,
)


class Fp8Dialect(str, enum.Enum):
    OCP = "ocp"
    FNUZ = "fnuz"

    @classmethod
    def parse(cls, value: Fp8Dialect | str) -> Fp8Dialect:
        if isinstance(value, Fp8Dialect):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"dialect: got {value!r}; allowed: 'ocp' or 'fnuz'") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Fp8Dialect.OCP else torch.float8_e4m3fnuz

    @property
    def quant_max(self) -> float:
        """Clamp bound used when quantizing (OCP 448; FNUZ 224 as vLLM's gfx942 quantizer)."""
        return 448.0 if self is Fp8Dialect.OCP else 224.0


@dataclass(frozen=True)
class RecordLayout:
    """How one token's row is stored (docs/semantics.md "Cache records").

    elem           the cache tensor's element: "byte" (packed records, uint8), "bf16" or "fp8"
    data_bytes     bytes of a token's values: block-scaled dims first, then raw bf16 dims
    scale_bytes    bytes of a token's block scales, pad bytes included (0: none)
    values         encoding of the block-scaled dims: "e4m3", "e2m1" (two per byte) or None
    scaled_dims    dims stored as ``values`` with a block scale (448, 512) -- 0 for plain rows
    bf16_dims      dims stored as little-endian bf16 after them (V4's RoPE dims)
    group          dims per block scale
    scale          scale encoding: "ue8m0" (byte b means 2**(b - 127)), "e4m3" (an OCP e4m3 value)
    split_pages    True: a page holds all data rows, then all scale rows (V4); False: each
                   token's scales directly follow its data (V4.1)
    page_align     a page (block_size tokens) is padded to a multiple of this many bytes
    dialects       FP8 dialects the record is written in
    """

    elem: str
    data_bytes: int
    scale_bytes: int
    values: str | None
    scaled_dims: int
    bf16_dims: int
    group: int
    scale: str | None
    split_pages: bool
    page_align: int
    dialects: tuple[Fp8Dialect, ...]

    @property
    def token_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def packed(self) -> bool:
        return self.elem == "byte"

    @property
    def row_elems(self) -> int:
        """Elements per token in the cache tensor's last dim."""
        return self.token_bytes if self.packed else HEAD_DIM

    @property
    def num_scales(self) -> int:
        return self.scaled_dims // self.group if self.group else 0


_BOTH = (Fp8Dialect.OCP, Fp8Dialect.FNUZ)


class Record(str, enum.Enum):
    """The record one cache stores (its value names the record in messages and strings)."""

    V4_FP8 = "v4_fp8"
    BF16 = "bf16"
    FP8_TENSOR = "fp8_tensor"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"

    @property
    def layout(self) -> RecordLayout:
        return _LAYOUTS[self]

    def cache_dtype(self, dialect: Fp8Dialect = Fp8Dialect.OCP) -> torch.dtype:
        elem = self.layout.elem
        return torch.uint8 if elem == "byte" else torch.bfloat16 if elem == "bf16" else dialect.torch_dtype


_LAYOUTS = {
    # vLLM fp8_ds_mla on every arch but SM100 (V4.1 too); FlashMLA "MODEL1"
    Record.V4_FP8: RecordLayout("byte", MODEL1_DATA_BYTES, MODEL1_SCALE_BYTES, "e4m3", NOPE_DIM, ROPE_DIM,
                                QUANT_TILE, "ue8m0", True, MODEL1_PAGE_ALIGN, _BOTH),
    Record.BF16: RecordLayout("bf16", 2 * HEAD_DIM, 0, None, 0, HEAD_DIM, 0, None, False, 1, _BOTH),  # no fp8
    Record.FP8_TENSOR: RecordLayout("fp8", HEAD_DIM, 0, None, 0, 0, 0, None, False, 1, _BOTH),
    # vLLM fp8_ds_mla of V4.1 on SM100; FlashMLA ModelType::V41
    Record.MXFP8: RecordLayout("byte", HEAD_DIM, 16, "e4m3", HEAD_DIM, 0, 32, "ue8m0", False, 512, _BOTH),
    # the compressed cache of vLLM nvfp4_ds_mla (SM100); FlashMLA ModelType::V41_FP4. Its scales are
    # OCP e4m3 (vLLM has no FNUZ writer or reader for it).
    Record.NVFP4: RecordLayout("byte", HEAD_DIM // 2, 32, "e2m1", HEAD_DIM, 0, 16, "e4m3", False, 512,
                               (Fp8Dialect.OCP,)),
}


class KVFormat(str, enum.Enum):
    """A KV format as vLLM's ``--kv-cache-dtype`` names it: the records of the two caches.

    ``fp8_ds_mla`` is the V4 record (what vLLM stores under that name everywhere but on SM100);
    vLLM calls the V4.1 MXFP8 record ``fp8_ds_mla`` too when it runs V4.1 on SM100 -- here it is
    ``mxfp8_ds_mla``. ``nvfp4_ds_mla`` is vLLM's name: MXFP8 SWA cache, NVFP4 compressed cache.
    """

    MODEL1_FP8 = "fp8_ds_mla"
    BF16 = "bfloat16"
    FP8_TENSOR = "fp8_e4m3"
    MXFP8 = "mxfp8_ds_mla"
    NVFP4 = "nvfp4_ds_mla"

    @classmethod
    def parse(cls, value: KVFormat | str) -> KVFormat:
        if isinstance(value, KVFormat):
            return value
        key = str(value).lower()
        if key in _FORMAT_ALIASES:
            return _FORMAT_ALIASES[key]
        raise ValueError(
            f"fmt: got {value!r}; allowed: {sorted(_FORMAT_ALIASES)} or a KVFormat member"
        )

    @property
    def swa_record(self) -> Record:
        return _FORMAT_RECORDS[self][0]

    @property
    def comp_record(self) -> Record:
        return _FORMAT_RECORDS[self][1]

    @property
    def record(self) -> Record:
        """The record of both caches; ValueError for a format whose two caches differ."""
        return _single_record(self, "fmt")

    @property
    def row_elems(self) -> int:
        """Elements per token row in the cache tensor's last dim (formats with one record)."""
        return self.record.layout.row_elems

    def cache_dtype(self, dialect: Fp8Dialect) -> torch.dtype:
        return self.record.cache_dtype(dialect)

    @property
    def uses_fp8(self) -> bool:
        return self is not KVFormat.BF16


_FORMAT_RECORDS = {
    KVFormat.MODEL1_FP8: (Record.V4_FP8, Record.V4_FP8),
    KVFormat.BF16: (Record.BF16, Record.BF16),
    KVFormat.FP8_TENSOR: (Record.FP8_TENSOR, Record.FP8_TENSOR),
    KVFormat.MXFP8: (Record.MXFP8, Record.MXFP8),
    KVFormat.NVFP4: (Record.MXFP8, Record.NVFP4),
}

_FORMAT_ALIASES = {
    "fp8_ds_mla": KVFormat.MODEL1_FP8,
    "model1_fp8": KVFormat.MODEL1_FP8,
    "model1": KVFormat.MODEL1_FP8,
    "bfloat16": KVFormat.BF16,
    "bf16": KVFormat.BF16,
    "fp8_e4m3": KVFormat.FP8_TENSOR,
    "fp8": KVFormat.FP8_TENSOR,
    "fp8_tensor": KVFormat.FP8_TENSOR,
    "mxfp8_ds_mla": KVFormat.MXFP8,
    "mxfp8": KVFormat.MXFP8,
    "nvfp4_ds_mla": KVFormat.NVFP4,
}


def _single_record(fmt: KVFormat, name: str) -> Record:
    swa, comp = _FORMAT_RECORDS[fmt]
    if swa is not comp:
        raise ValueError(
            f"{name}: got {fmt.value!r}, whose SWA cache is {swa.value} and compressed cache {comp.value}; "
            f"allowed here: one record -- pass KVFormat.{fmt.name}.swa_record or .comp_record"
        )
    return swa


def parse_record(value: Record | KVFormat | str, name: str = "fmt") -> Record:
    """The record named by a Record, a one-record KVFormat, or a string of either."""
    if isinstance(value, Record):
        return value
    if isinstance(value, KVFormat):
        return _single_record(value, name)
    key = str(value).lower()
    if key in _FORMAT_ALIASES:
        return _single_record(_FORMAT_ALIASES[key], name)
    try:
        return Record(key)
    except ValueError:
        allowed = sorted(set(_FORMAT_ALIASES) | {r.value for r in Record})
        raise ValueError(f"{name}: got {value!r}; allowed: {allowed}, a Record or a KVFormat") from None


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


def _check_dialect(record: Record, dialect: Fp8Dialect, name: str) -> None:
    if dialect not in record.layout.dialects:
        allowed = " or ".join(d.value for d in record.layout.dialects)
        raise ValueError(f"{name}: got dialect {dialect.value!r}; allowed: {allowed} for record {record.value}")


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
    _check_dialect(record, dialect, "dialect")
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
    _check_dialect(record, dialect, name)
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


def _check_rows(name: str, t, dtypes: tuple[torch.dtype, ...], width: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() != 2 or t.shape[1] != width:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        allowed = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: got {got}; allowed: {allowed} [N, {width}]")


# ---- block-scaled values (docs/semantics.md "Quantization rules") ---------------------------

_UE8M0_AMAX_FLOOR = 1e-4  # vLLM's writers floor a tile's amax so an all-zero tile gets a finite scale
_NVFP4_SCALE_MIN = 2.0**-9  # the smallest e4m3 magnitude (a subnormal): a zero tile keeps a nonzero scale
_E2M1_MAX = 6.0
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _recip32(x: float) -> torch.Tensor:
    """``1 / x`` rounded to fp32: vLLM's writers multiply by this instead of dividing by x."""
    return torch.tensor(1.0 / x, dtype=torch.float32)


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(v))`` of positive fp32 ``v`` from its bits (frexp: v = m * 2**p, m in [0.5, 1))."""
    m, p = torch.frexp(v)
    return (p - (m == 0.5).to(p.dtype)).to(torch.float32)


def _encode_ue8m0(x: torch.Tensor, group: int, dialect: Fp8Dialect) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, D] -> (e4m3 bytes [N, D], UE8M0 bytes [N, D // group]).

    Per group: amax = max(max|x|, 1e-4); e = ceil(log2(amax * fp32(1 / qmax))); values
    fp8(clamp(x * 2**-e, +-qmax)) rounded to nearest even; scale byte clamp(e + 127, 0, 255).
    """
    n, d = x.shape
    tiles = x.reshape(n, d // group, group)
    amax = tiles.abs().amax(dim=-1).clamp_min(_UE8M0_AMAX_FLOOR)
    exponent = _ceil_log2(amax * _recip32(dialect.quant_max))
    scaled = (tiles * torch.exp2(-exponent)[..., None]).clamp(-dialect.quant_max, dialect.quant_max)
    values = scaled.to(dialect.torch_dtype).view(torch.uint8).reshape(n, d)
    return values, (exponent + 127).clamp(0, 255).to(torch.uint8)


def _decode_ue8m0(values: torch.Tensor, scales: torch.Tensor, group: int, dialect: Fp8Dialect) -> torch.Tensor:
    n, d = values.shape
    v = values.contiguous().view(dialect.torch_dtype).float().reshape(n, d // group, group)
    return (v * torch.exp2(scales.float() - 127.0)[..., None]).reshape(n, d)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, 0..15) as PTX ``cvt.rn.satfinite.e2m1x2.f32``: nearest magnitude
    of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to the even code, saturating at 6, sign bit 8 kept for values
    that round to zero. Thresholds are the midpoints; ``>=`` where the tie goes up to an even code."""
    a = y.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0))
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _encode_nvfp4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, D] -> (packed e2m1 bytes [N, D // 2], e4m3 scale bytes [N, D // group]).

    Per group: s = e4m3(clamp(amax * fp32(1 / 6), 2**-9, 448)) rounded to nearest even; codes
    e2m1(x / s) (IEEE division); byte j = code(2j) | code(2j + 1) << 4.
    """
    n, d = x.shape
    tiles = x.reshape(n, d // group, group)
    amax = tiles.abs().amax(dim=-1)
    scale = (amax * _recip32(_E2M1_MAX)).clamp(_NVFP4_SCALE_MIN, 448.0).to(torch.float8_e4m3fn)
    codes = _e2m1_codes(tiles / scale.float()[..., None]).reshape(n, d)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale.view(torch.uint8)


def _decode_nvfp4(packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    n = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, -1).long()
    mags = torch.tensor(_E2M1_MAGNITUDES, device=packed.device)[codes & 7]
    vals = torch.where(codes >= 8, -mags, mags).reshape(n, -1, group)
    return (vals * scales.contiguous().view(torch.float8_e4m3fn).float()[..., None]).reshape(n, -1)


def encode(record: Record | KVFormat | str, rows: torch.Tensor,
           dialect: Fp8Dialect | str = Fp8Dialect.OCP) -> torch.Tensor:
    """Quantize rows into a packed record's bytes: bf16 or fp32 ``[N, 512]`` -> uint8
    ``[N, token_bytes]`` in the record's order within a token (data bytes, then scale bytes).

    fp32 input is what vLLM's compressor writers quantize (RoPE applied in fp32, never rounded to
    bf16); bf16 input is widened exactly. Raw bf16 dims (V4's RoPE) are rounded to nearest even.
    """
    record = parse_record(record, "record")
    dialect = Fp8Dialect.parse(dialect)
    lay = record.layout
    if not lay.packed:
        raise ValueError(f"record: got {record.value}; allowed: a packed record (v4_fp8, mxfp8, nvfp4)")
    _check_dialect(record, dialect, "dialect")
    _check_rows("rows", rows, (torch.bfloat16, torch.float32), HEAD_DIM)
    x = rows.float()
    scaled = x[:, :lay.scaled_dims]
    if lay.values == "e2m1":
        values, scales = _encode_nvfp4(scaled, lay.group)
    else:
        values, scales = _encode_ue8m0(scaled, lay.group, dialect)
    tail = x[:, lay.scaled_dims:].to(torch.bfloat16).contiguous().view(torch.uint8)
    pad = torch.zeros(x.shape[0], lay.scale_bytes - lay.num_scales, dtype=torch.uint8, device=x.device)
    return torch.cat([values, tail, scales, pad], dim=1)


def decode(record: Record | KVFormat | str, tokens: torch.Tensor,
           dialect: Fp8Dialect | str = Fp8Dialect.OCP) -> torch.Tensor:
    """Dequantize a packed record's bytes: uint8 ``[N, token_bytes]`` -> float32 ``[N, 512]`` (exact)."""
    record = parse_record(record, "record")
    dialect = Fp8Dialect.parse(dialect)
    lay = record.layout
    if not lay.packed:
        raise ValueError(f"record: got {record.value}; allowed: a packed record (v4_fp8, mxfp8, nvfp4)")
    _check_dialect(record, dialect, "dialect")
    _check_rows("tokens", tokens, (torch.uint8,), lay.token_bytes)
    value_bytes = lay.scaled_dims // 2 if lay.values == "e2m1" else lay.scaled_dims
    values = tokens[:, :value_bytes]
    scales = tokens[:, lay.data_bytes:lay.data_bytes + lay.num_scales]
    if lay.values == "e2m1":
        scaled = _decode_nvfp4(values, scales, lay.group)
    else:
        scaled = _decode_ue8m0(values, scales, lay.group, dialect)
    tail = tokens[:, value_bytes:lay.data_bytes].contiguous().view(torch.bfloat16).float()
    return torch.cat([scaled, tail], dim=1)


def quantize_model1(kv: torch.Tensor, dialect: Fp8Dialect = Fp8Dialect.OCP) -> torch.Tensor:
    """bf16 ``[N, 512]`` -> uint8 ``[N, 584]``: a V4 record's 576 data bytes then its 8 scale bytes."""
    _check_rows("kv", kv, (torch.bfloat16,), HEAD_DIM)
    return encode(Record.V4_FP8, kv, dialect)


def dequantize_model1(rows: torch.Tensor, dialect: Fp8Dialect = Fp8Dialect.OCP) -> torch.Tensor:
    """uint8 ``[N, 584]`` (576 data bytes + 8 scale bytes) -> float32 ``[N, 512]``."""
    _check_rows("rows", rows, (torch.uint8,), MODEL1_TOKEN_BYTES)
    return decode(Record.V4_FP8, rows, dialect)


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
    _check_rows("kv", kv, (torch.bfloat16,), HEAD_DIM)
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


def packed_records(cache: torch.Tensor, record: Record, geo: CacheGeometry, slots: torch.Tensor) -> torch.Tensor:
    """Unvalidated: the raw records of a packed cache at int slots ``[N]`` as uint8 ``[N,
    data_bytes + scale_bytes]`` (the token's data bytes, then its scale bytes, as :func:`encode`
    writes them); a slot outside ``[0, num_slots)`` gives zeros. Reads only the selected tokens."""
    valid = (slots >= 0) & (slots < geo.num_slots)
    safe = torch.where(valid, slots, torch.zeros_like(slots)).long()
    data, scales = _token_views(cache, record.layout, geo)
    block, offset = safe // geo.block_size, safe % geo.block_size
    return torch.cat([data[block, offset], scales[block, offset]], dim=1).masked_fill(~valid[:, None], 0)


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
