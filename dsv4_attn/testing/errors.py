"""The three error figures of an output against its reference, as the tests, the parity matrix
and the bench report them: max abs error, relative L2 error ``|out-ref| / |ref|`` and cosine
similarity, in float64.

``error_figures`` is the formula (any device; NaN in gives NaN out, for the bench's side-by-side
runs); ``compare`` is the tests' strict form (equal sizes, finite values, computed on the CPU);
the parity judge applies the formula to the finite elements it counts.
"""

from __future__ import annotations

import torch


def error_figures(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max_abs, rel_l2 and cosine of ``out`` against ``ref`` (same number of elements, any
    shapes and dtypes), in float64 on ``out``'s device. An all-zero ``ref`` gives rel_l2 = |out|
    and cosine 1 iff out is 0 too; no elements give 0, 0 and 1."""
    a = out.detach().double().flatten()
    b = ref.detach().double().flatten().to(a.device)
    diff = a - b
    ref_norm, out_norm = b.norm().item(), a.norm().item()
    rel = diff.norm().item() / ref_norm if ref_norm > 0 else diff.norm().item()
    if ref_norm > 0 and out_norm > 0:
        cosine = (a @ b).item() / (ref_norm * out_norm)
    else:
        cosine = 1.0 if ref_norm == out_norm == 0 else 0.0
    return {"max_abs": diff.abs().max().item() if diff.numel() else 0.0, "rel_l2": rel, "cosine": cosine}


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """``error_figures`` on the CPU of two finite tensors of the same number of elements
    (``ValueError`` else: check the NaN poison or mask first)."""
    if out.numel() != ref.numel():
        raise ValueError(f"out: got shape {tuple(out.shape)}; allowed: as many elements as ref {tuple(ref.shape)}")
    a, b = out.detach().cpu(), ref.detach().cpu()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError("out / ref: got non-finite values; allowed: finite values (check the NaN poison first)")
    return error_figures(a, b)
