"""Reference helpers the tests check bytes and LSEs with, written independently of the package:

- ``e4m3_value(byte, dialect)`` / ``e4m3_table(dialect)``: an fp8 e4m3 byte's value decoded from
  its bit fields by hand (independent of torch's float8 dtypes, for byte-level and
  dequantization checks).
- ``within_flashmla_lse_tolerance(lse, ref)``: FlashMLA's own LSE tolerance, per element.
"""

from __future__ import annotations

import math

import torch


def within_flashmla_lse_tolerance(lse: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """bool per element: |lse - ref| < 1e-6 or |lse - ref| / (|ref| + 1e-6) < 8/65536 (FlashMLA's
    sparse decode test: tests/kernelkit/compare.py check_is_allclose in deepseek-ai/FlashMLA), or
    both the same infinity."""
    lse, ref = lse.double().cpu(), ref.double().cpu()
    same_inf = torch.isinf(ref) & (lse == ref)
    fin = torch.isfinite(ref) & torch.isfinite(lse)
    err = torch.where(fin, (lse - ref).abs(), torch.zeros_like(ref))
    return same_inf | (fin & ((err < 1e-6) | (err / (ref.abs() + 1e-6) < 8 / 65536)))


def e4m3_value(byte: int, dialect: str = "ocp") -> float:
    """Value of one e4m3 byte from its bit fields (sign 1, exponent 4, mantissa 3).

    OCP e4m3fn: bias 7, 0x7F/0xFF are NaN, no infinities. FNUZ e4m3fnuz: bias 8, 0x80 is the
    only NaN, no negative zero, no infinities.
    """
    sign, exp, man = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if dialect == "ocp":
        bias = 7
        if byte & 0x7F == 0x7F:
            return math.nan
    else:
        bias = 8
        if byte == 0x80:
            return math.nan
    mag = (man / 8) * 2.0 ** (1 - bias) if exp == 0 else (1 + man / 8) * 2.0 ** (exp - bias)
    return -mag if sign else mag


def e4m3_table(dialect: str = "ocp") -> torch.Tensor:
    """float64 [256]: ``e4m3_value`` of every byte (index a uint8 tensor with ``.long()``)."""
    return torch.tensor([e4m3_value(b, dialect) for b in range(256)], dtype=torch.float64)
