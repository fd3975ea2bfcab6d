"""The tests' comparison against the float64 reference, and their tolerances.

Tolerances are READ FROM THE PARITY MATRIX (``dsv4_attn/data/parity.yaml``, the file
``dsv4-attn parity`` judges with), so a test and the matrix cannot drift apart:

    BF16        the default: bf16 output rounding plus a float32 kernel
    FP8_Q       q cast to e4m3 before the kernel: NOT in the matrix, which holds every backend to
                BF16 (one contract); for the tests of paths that compute in fp8 by choice (aiter's
                opt-in a8w8 kernels; FlashInfer's fp8 path casts q as well)

A test compares with ``compare`` (the package's three figures, ``dsv4_attn.testing.errors``; or
``metrics``, which also says whether the NaN poison was overwritten everywhere) and checks with
``assert_close``, whose bounds are strict (<, >).
"""

from __future__ import annotations

import math

import torch

from dsv4_attn.parity.matrix import Tolerance, load_matrix
from dsv4_attn.testing.errors import compare

__all__ = ["BF16", "FP8_Q", "assert_close", "compare", "metrics"]

_MATRIX = load_matrix()
BF16: Tolerance = _MATRIX.tolerance_default
FP8_Q: Tolerance = Tolerance(max_abs=5.0e-1, rel_l2=6.0e-2, cosine=0.998)


def metrics(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """compare() plus ``written`` (no NaN poison left in ``out``) and ``out`` itself."""
    written = not bool(out.isnan().any())
    m = compare(out, ref) if written else {"max_abs": math.nan, "rel_l2": math.nan, "cosine": math.nan}
    return dict(m, written=written, out=out)


def assert_close(m: dict, tol: Tolerance = BF16, *, max_abs: bool = True, what=None) -> None:
    """``m`` (compare() or metrics()) strictly within ``tol``: rel_l2 and cosine, and max_abs
    unless ``max_abs=False``; metrics() results must also have been written everywhere. ``what``
    names the case in the failure message."""
    shown = {k: v for k, v in m.items() if k != "out"}
    if what is not None:
        shown = (what, shown)
    assert m.get("written", True), f"output not fully written (NaN poison survived): {shown}"
    assert m["rel_l2"] < tol.rel_l2 and m["cosine"] > tol.cosine, shown
    assert not max_abs or m["max_abs"] < tol.max_abs, shown
