"""Shared test helpers for the whole suite (small and generic on purpose).

- ``compare(out, ref)``: the three error numbers every numeric test reports.
- ``gen``: a seeded torch.Generator per test (seed derived from the test's name, so a test's
  inputs are reproducible and independent of which other tests ran).
- ``within_flashmla_lse_tolerance(lse, ref)``: FlashMLA's own LSE tolerance, per element.
- ``e4m3_value(byte, dialect)``: an fp8 e4m3 byte's value decoded from the bit fields by hand
  (independent of torch's float8 dtypes, for byte-level and dequantization checks).

Without a GPU, Triton kernels run under its CPU interpreter: ``TRITON_INTERPRET=1`` is set here,
before any test module defines a kernel (the interpreter is chosen per process).
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def within_flashmla_lse_tolerance(lse: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """bool per element: |lse - ref| < 1e-6 or |lse - ref| / (|ref| + 1e-6) < 8/65536 (FlashMLA's
    sparse decode test: tests/kernelkit/compare.py check_is_allclose in deepseek-ai/FlashMLA), or
    both the same infinity."""
    lse, ref = lse.double().cpu(), ref.double().cpu()
    same_inf = torch.isinf(ref) & (lse == ref)
    fin = torch.isfinite(ref) & torch.isfinite(lse)
    err = torch.where(fin, (lse - ref).abs(), torch.zeros_like(ref))
    return same_inf | (fin & ((err < 1e-6) | (err / (ref.abs() + 1e-6) < 8 / 65536)))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A torch.Generator seeded from the test's node id (stable across runs and orderings)."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


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
