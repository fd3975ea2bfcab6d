"""KV-cache formats of DeepSeek-V4: allocation, insertion (quantization) and gathering.

Formats (spec/dsv4-semantics.md §3):

MODEL1_FP8 (vLLM "fp8_ds_mla", FlashMLA "V4"/MODEL1), uint8 ``[num_blocks, bs, 584]``.
    The 584 is the per-token byte budget; the physical layout of one block is split:
    ``bs`` data rows of 576 B at ``t * 576`` (448 e4m3 NoPE bytes, then 64 bf16 RoPE values),
    then ``bs`` scale rows of 8 B at ``bs * 576 + t * 8`` (7 UE8M0 exponents, one per 64-wide
    NoPE tile, value ``2 ** (byte - 127)``, then one zero pad byte). The block stride is
    ``cache.stride(0)`` bytes: at least ``bs * 584``, normally ``round_up(bs * 584, 576)``,
    and larger when other layers' pages are interleaved. Always read it from ``stride(0)``.
BF16, bfloat16 ``[num_blocks, bs, 512]``: plain rows.
FP8_TENSOR, float8 e4m3 ``[num_blocks, bs, 512]``: plain rows with one per-tensor float scale
    (value = float(fp8) * scale; vLLM fixes the scale at 1.0).

FP8 dialects: OCP e4m3fn (max 448, NVIDIA and gfx950) and FNUZ e4m3fnuz (gfx942; the same bits
mean half the OCP value; vLLM's quantizers clamp at 224 there). On gfx942 vLLM writes the SWA
cache in FNUZ and the compressed cache in OCP (anchors C10), so the dialect is per cache.

A slot is ``block * bs + offset``; -1 means "no row". Byte offsets derived from slots are
computed by torch indexing in int64.
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
    NUM_QUANT_TILES,
    QUANT_TILE,
    round_up,
)


class KVFormat(str, enum.Enum):
    MODEL1_FP8 = "fp8_ds_mla"
    BF16 = "bfloat16"
    FP8_TENSOR = "fp8_e4m3"

    @classmethod
    def parse(cls, value: "KVFormat | str") -> "KVFormat":
        if isinstance(value, KVFormat):
            return value
        key = str(value).lower()
        if key in _FORMAT_ALIASES:
            return _FORMAT_ALIASES[key]
        raise ValueError(
            f"fmt: got {value!r}; allowed: {sorted(_FORMAT_ALIASES)} or a KVFormat member"
        )

    @property
    def row_elems(self) -> int:
        """Elements per token row in the cache tensor's last dim."""
        return MODEL1_TOKEN_BYTES if self is KVFormat.MODEL1_FP8 else HEAD_DIM

    def cache_dtype(self, dialect: "Fp8Dialect") -> torch.dtype:
        if self is KVFormat.MODEL1_FP8:
            return torch.uint8
        if self is KVFormat.BF16:
            return torch.bfloat16
        return dialect.torch_dtype

    @property
    def uses_fp8(self) -> bool:
        return self is not KVFormat.BF16


_FORMAT_ALIASES = {
    "fp8_ds_mla": KVFormat.MODEL1_FP8,
    "model1_fp8": KVFormat.MODEL1_FP8,
    "model1": KVFormat.MODEL1_FP8,
    "bfloat16": KVFormat.BF16,
    "bf16": KVFormat.BF16,
    "fp8_e4m3": KVFormat.FP8_TENSOR,
    "fp8": KVFormat.FP8_TENSOR,
    "fp8_tensor": KVFormat.FP8_TENSOR,
}


class Fp8Dialect(str, enum.Enum):
    OCP = "ocp"
    FNUZ = "fnuz"

    @classmethod
    def parse(cls, value: "Fp8Dialect | str") -> "Fp8Dialect":
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
class CacheGeometry:
    num_blocks: int
    block_size: int
    block_stride: int  # in units of the cache's element (bytes for MODEL1)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def model1_page_bytes(block_size: int) -> int:
    """Bytes of one MODEL1 block: round_up(block_size * 584, 576)."""
    return round_up(block_size * MODEL1_TOKEN_BYTES, MODEL1_PAGE_ALIGN)


def new_cache(
    fmt: KVFormat | str,
    num_blocks: int,
    block_size: int,
    device: torch.device | str = "cpu",
    block_stride: int | None = None,
    dialect: Fp8Dialect | str = Fp8Dialect.OCP,
) -> torch.Tensor:
    """Allocate a zeroed cache of ``num_blocks`` blocks of ``block_size`` tokens.

    Returns MODEL1: uint8 ``[num_blocks, block_size, 584]`` with ``stride(0) == block_stride``
    (default ``round_up(block_size * 584, 576)``); BF16 / FP8_TENSOR: ``[num_blocks, block_size,
    512]`` with ``stride(0) == block_stride`` elements (default ``block_size * 512``). A larger
    ``block_stride`` emulates pages of other layers interleaved per block. The whole backing
    allocation (``num_blocks * block_stride`` elements) is valid memory.
    """
    fmt = KVFormat.parse(fmt)
    dialect = Fp8Dialect.parse(dialect)
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: got {value!r}; allowed: a positive int")
    row = fmt.row_elems
    min_stride = block_size * row
    default_stride = model1_page_bytes(block_size) if fmt is KVFormat.MODEL1_FP8 else min_stride
    stride = default_stride if block_stride is None else block_stride
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < min_stride:
        raise ValueError(
            f"block_stride: got {block_stride!r}; allowed: an int >= block_size * {row} = {min_stride}"
        )
    flat = torch.zeros(num_blocks * stride, dtype=fmt.cache_dtype(dialect), device=device)
    return flat.as_strided((num_blocks, block_size, row), (stride, row, 1))


def check_cache(cache, fmt: KVFormat, name: str, dialect: Fp8Dialect = Fp8Dialect.OCP) -> CacheGeometry:
    """Validate a cache tensor against its format; return its geometry. Raises ValueError."""
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name}: got {type(cache).__name__}; allowed: a torch.Tensor")
    want_dtype = fmt.cache_dtype(dialect)
    if fmt is KVFormat.MODEL1_FP8 and cache.dtype in (torch.int8, torch.float8_e4m3fn):
        want_dtype = cache.dtype  # FlashMLA accepts these views of the same bytes
    if cache.dtype != want_dtype:
        raise ValueError(f"{name}: got dtype {cache.dtype}; allowed: {want_dtype} for format {fmt.value}")
    row = fmt.row_elems
    if cache.dim() != 3 or cache.shape[-1] != row:
        raise ValueError(
            f"{name}: got shape {tuple(cache.shape)}; allowed: [num_blocks, block_size, {row}] "
            f"for format {fmt.value}"
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


def _model1_views(cache: torch.Tensor, geo: CacheGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte views of a MODEL1 cache: data rows [nb, bs, 576] and scale rows [nb, bs, 8]."""
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    bs, s0, base = geo.block_size, geo.block_stride, raw.storage_offset()
    data = raw.as_strided((geo.num_blocks, bs, MODEL1_DATA_BYTES), (s0, MODEL1_DATA_BYTES, 1), base)
    scales = raw.as_strided(
        (geo.num_blocks, bs, MODEL1_SCALE_BYTES), (s0, MODEL1_SCALE_BYTES, 1), base + bs * MODEL1_DATA_BYTES
    )
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


def _check_scale(fmt: KVFormat, scale) -> float:
    if fmt is not KVFormat.FP8_TENSOR:
        if scale is not None:
            raise ValueError(f"scale: got {scale!r}; allowed: None for format {fmt.value}")
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


def _check_rows(name: str, t, dtype: torch.dtype, width: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 2 or t.shape[1] != width:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: got {got}; allowed: {dtype} [N, {width}]")


def quantize_model1(kv: torch.Tensor, dialect: Fp8Dialect = Fp8Dialect.OCP) -> torch.Tensor:
    """bf16 ``[N, 512]`` -> uint8 ``[N, 584]``: the 576 data bytes then the 8 scale bytes.

    Per 64-wide NoPE tile (spec §3.1): amax = max(max|x|, 1e-4); e = ceil(log2(amax / max));
    q = fp8(clamp(x / 2^e, ±max)); stored exponent byte = clamp(e + 127, 0, 255). RoPE dims are
    the bf16 bytes unchanged.
    """
    _check_rows("kv", kv, torch.bfloat16, HEAD_DIM)
    n = kv.shape[0]
    x = kv[:, :NOPE_DIM].float().reshape(n, NUM_QUANT_TILES, QUANT_TILE)
    amax = x.abs().amax(dim=-1).clamp_min(1e-4)
    exponent = torch.ceil(torch.log2(amax / dialect.quant_max))
    q = (x / torch.exp2(exponent)[..., None]).clamp(-dialect.quant_max, dialect.quant_max)
    nope = q.to(dialect.torch_dtype).reshape(n, NOPE_DIM).view(torch.uint8)
    rope = kv[:, NOPE_DIM:].contiguous().view(torch.uint8)
    exp_bytes = (exponent + 127).clamp(0, 255).to(torch.uint8)
    pad = torch.zeros(n, 1, dtype=torch.uint8, device=kv.device)
    return torch.cat([nope, rope, exp_bytes, pad], dim=1)


def dequantize_model1(rows: torch.Tensor, dialect: Fp8Dialect = Fp8Dialect.OCP) -> torch.Tensor:
    """uint8 ``[N, 584]`` (576 data bytes + 8 scale bytes) -> float32 ``[N, 512]``."""
    _check_rows("rows", rows, torch.uint8, MODEL1_TOKEN_BYTES)
    n = rows.shape[0]
    nope = rows[:, :NOPE_DIM].contiguous().view(dialect.torch_dtype).float()
    rope = rows[:, NOPE_DIM:MODEL1_DATA_BYTES].contiguous().view(torch.bfloat16).float()
    exps = rows[:, MODEL1_DATA_BYTES : MODEL1_DATA_BYTES + NUM_QUANT_TILES].to(torch.float32) - 127.0
    nope = (nope.reshape(n, NUM_QUANT_TILES, QUANT_TILE) * torch.exp2(exps)[..., None]).reshape(n, NOPE_DIM)
    return torch.cat([nope, rope], dim=1)


def insert(
    cache: torch.Tensor,
    fmt: KVFormat | str,
    slots: torch.Tensor,
    kv: torch.Tensor,
    scale: float | torch.Tensor | None = None,
    dialect: Fp8Dialect | str = Fp8Dialect.OCP,
) -> None:
    """Write rows ``kv`` (bf16 ``[N, 512]``) at ``slots`` (int ``[N]``; -1 entries skipped).

    MODEL1 rows are tile-quantized (:func:`quantize_model1`); FP8_TENSOR rows are
    ``fp8(clamp(x / scale, ±max))``; BF16 rows are stored as given.
    """
    fmt = KVFormat.parse(fmt)
    dialect = Fp8Dialect.parse(dialect)
    geo = check_cache(cache, fmt, "cache", dialect)
    kv_scale = _check_scale(fmt, scale)
    _check_rows("kv", kv, torch.bfloat16, HEAD_DIM)
    if kv.device != cache.device:
        raise ValueError(f"kv: got device {kv.device}; allowed: the cache's device {cache.device}")
    _check_slots(slots, "slots", cache.device, geo.num_slots)
    if slots.shape != kv.shape[:1]:
        raise ValueError(f"slots: got shape {tuple(slots.shape)}; allowed: [{kv.shape[0]}] (one per kv row)")
    keep = slots >= 0
    slots, kv = slots[keep].long(), kv[keep]
    block, offset = slots // geo.block_size, slots % geo.block_size
    if fmt is KVFormat.MODEL1_FP8:
        data, scales = _model1_views(cache, geo)
        packed = quantize_model1(kv, dialect)
        data[block, offset] = packed[:, :MODEL1_DATA_BYTES]
        scales[block, offset] = packed[:, MODEL1_DATA_BYTES:]
    elif fmt is KVFormat.FP8_TENSOR:
        q = (kv.float() / kv_scale).clamp(-dialect.quant_max, dialect.quant_max)
        cache[block, offset] = q.to(cache.dtype)
    else:
        cache[block, offset] = kv


def gather_rows(
    cache: torch.Tensor,
    fmt: KVFormat,
    geo: CacheGeometry,
    slots: torch.Tensor,
    kv_scale: float = 1.0,
    dialect: Fp8Dialect = Fp8Dialect.OCP,
) -> torch.Tensor:
    """Unchecked gather for hot paths: int slots ``[...]`` -> float32 ``[..., 512]`` (-1 -> 0).

    Reads only the selected rows (never the whole cache). Callers validate first.
    """
    flat = slots.reshape(-1)
    valid = flat >= 0
    safe = torch.where(valid, flat, torch.zeros_like(flat)).long()
    block, offset = safe // geo.block_size, safe % geo.block_size
    if fmt is KVFormat.MODEL1_FP8:
        data, scales = _model1_views(cache, geo)
        rows = dequantize_model1(torch.cat([data[block, offset], scales[block, offset]], dim=1), dialect)
    elif fmt is KVFormat.FP8_TENSOR:
        rows = cache[block, offset].float() * kv_scale
    else:
        rows = cache[block, offset].float()
    rows = rows.masked_fill(~valid[:, None], 0.0)
    return rows.reshape(*slots.shape, HEAD_DIM)


def gather(
    cache: torch.Tensor,
    fmt: KVFormat | str,
    slots: torch.Tensor,
    scale: float | torch.Tensor | None = None,
    dialect: Fp8Dialect | str = Fp8Dialect.OCP,
) -> torch.Tensor:
    """Dequantized rows at ``slots`` (int, any shape ``[...]``) as float32 ``[..., 512]``; -1 -> 0."""
    fmt = KVFormat.parse(fmt)
    dialect = Fp8Dialect.parse(dialect)
    geo = check_cache(cache, fmt, "cache", dialect)
    kv_scale = _check_scale(fmt, scale)
    _check_slots(slots, "slots", cache.device, geo.num_slots)
    return gather_rows(cache, fmt, geo, slots, kv_scale, dialect)
