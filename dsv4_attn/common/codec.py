"""Encoding rows into packed records and back (docs/semantics.md "Quantization rules"): UE8M0
block-scaled e4m3 (V4_FP8, MXFP8) and NVFP4 (e2m1 values, e4m3 block scales), bit-exact with
vLLM's writers."""

from __future__ import annotations

import torch

from .records import Fp8Dialect, KVFormat, Record, RecordLayout, check_dialect, parse_record
from .spec import (
    HEAD_DIM,
    MODEL1_TOKEN_BYTES,
)


def check_rows(name: str, t, dtypes: tuple[torch.dtype, ...], width: int) -> None:
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


def _packed_layout(record: Record | KVFormat | str, dialect: Fp8Dialect | str) -> tuple[RecordLayout, Fp8Dialect]:
    """(the layout, the parsed dialect) of a packed record, after the checks encode and decode share."""
    record = parse_record(record, "record")
    dialect = Fp8Dialect.parse(dialect)
    if not record.layout.packed:
        raise ValueError(f"record: got {record.value}; allowed: a packed record (v4_fp8, mxfp8, nvfp4)")
    check_dialect(record, dialect, "dialect")
    return record.layout, dialect


def encode(record: Record | KVFormat | str, rows: torch.Tensor,
           dialect: Fp8Dialect | str = Fp8Dialect.OCP) -> torch.Tensor:
    """Quantize rows into a packed record's bytes: bf16 or fp32 ``[N, 512]`` -> uint8
    ``[N, token_bytes]`` in the record's order within a token (data bytes, then scale bytes).

    fp32 input is what vLLM's compressor writers quantize (RoPE applied in fp32, never rounded to
    bf16); bf16 input is widened exactly. Raw bf16 dims (V4's RoPE) are rounded to nearest even.
    """
    lay, dialect = _packed_layout(record, dialect)
    check_rows("rows", rows, (torch.bfloat16, torch.float32), HEAD_DIM)
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
    lay, dialect = _packed_layout(record, dialect)
    check_rows("tokens", tokens, (torch.uint8,), lay.token_bytes)
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
    check_rows("kv", kv, (torch.bfloat16,), HEAD_DIM)
    return encode(Record.V4_FP8, kv, dialect)


def dequantize_model1(rows: torch.Tensor, dialect: Fp8Dialect = Fp8Dialect.OCP) -> torch.Tensor:
    """uint8 ``[N, 584]`` (576 data bytes + 8 scale bytes) -> float32 ``[N, 512]``."""
    check_rows("rows", rows, (torch.uint8,), MODEL1_TOKEN_BYTES)
    return decode(Record.V4_FP8, rows, dialect)


