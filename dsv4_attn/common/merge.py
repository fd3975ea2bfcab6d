"""LSE merge of per-scope attention results and sink application (docs/semantics.md "LSE").

For kernels without a sink or a second scope: attend each scope separately, returning
``(out_i, lse_i)`` with ``out_i`` normalized over scope i and ``lse_i`` its natural-log
logsumexp, then

    lse = logaddexp(lse_a, lse_b);   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
    out_with_sink = out * sigmoid(lse - sink)      (= exp(lse) / (exp(lse) + exp(sink)))

which equals one softmax over the union of both scopes plus ``exp(sink)`` in the denominator.

Empty scopes. Kernels disagree on what an empty row reports: FlashMLA gives lse = +inf,
AITER can give NaN out and lse, others -inf. A real, non-empty row always has a finite lse,
so here ANY non-finite lse marks an empty scope: its output is ignored (even if NaN) and a row
with no non-empty scope comes out 0 with lse -inf.
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


def lse_base2_to_natural(lse2: torch.Tensor) -> torch.Tensor:
    """log2-sum-exp2 (FlashInfer trtllm-gen, AITER split statistics) -> natural log."""
    return lse2 * LN2


def lse_natural_to_base2(lse: torch.Tensor) -> torch.Tensor:
    return lse / LN2


def _empty_to_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(lse), lse, torch.full_like(lse, -math.inf))


def _check_pair(name: str, out: torch.Tensor, lse: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
        raise ValueError(f"{name}: got {type(out).__name__}, {type(lse).__name__}; allowed: torch.Tensors")
    if out.device != lse.device:
        raise ValueError(f"{name}: got devices {out.device}, {lse.device}; allowed: one device")
    if out.shape[:-1] != lse.shape:
        raise ValueError(
            f"{name}: got out shape {tuple(out.shape)} and lse shape {tuple(lse.shape)}; "
            "allowed: lse shape == out.shape[:-1]"
        )
    if not lse.is_floating_point() or not out.is_floating_point():
        raise ValueError(f"{name}: got dtypes {out.dtype}, {lse.dtype}; allowed: floating point")


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two scope results. ``out_*`` ``[..., D]``, ``lse_*`` ``[...]`` natural log.

    Returns ``(out float32 [..., D], lse float32 [...])``; empty in both -> 0 and -inf.
    """
    _check_pair("out_a/lse_a", out_a, lse_a)
    _check_pair("out_b/lse_b", out_b, lse_b)
    if out_a.shape != out_b.shape or out_a.device != out_b.device:
        raise ValueError(f"out_b: got shape {tuple(out_b.shape)} on {out_b.device}; allowed: "
                         f"{tuple(out_a.shape)} on {out_a.device} (as out_a)")
    la, lb = _empty_to_neg_inf(lse_a.float()), _empty_to_neg_inf(lse_b.float())
    lse = torch.logaddexp(la, lb)
    # Both empty: lse = -inf; weights computed against a 0 reference stay finite (0).
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa, wb = torch.exp(la - ref), torch.exp(lb - ref)
    a = torch.where(wa[..., None] > 0, out_a.float() * wa[..., None], torch.zeros_like(out_a, dtype=torch.float32))
    b = torch.where(wb[..., None] > 0, out_b.float() * wb[..., None], torch.zeros_like(out_b, dtype=torch.float32))
    return a + b, lse


def _check_sink(sink, lse: torch.Tensor) -> None:
    """sink: a floating tensor [H] on lse's device, H = lse.shape[-1]."""
    ok = isinstance(sink, torch.Tensor) and sink.is_floating_point() and sink.shape == lse.shape[-1:]
    if not ok or sink.device != lse.device:
        got = f"{sink.dtype} {tuple(sink.shape)} on {sink.device}" if isinstance(sink, torch.Tensor) \
            else type(sink).__name__
        raise ValueError(f"sink: got {got}; allowed: a float tensor [{lse.shape[-1]}] (one per head) on {lse.device}")


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Scale ``out [T, H, D]`` by ``sigmoid(lse - sink)``; ``lse [T, H]`` natural log without
    the sink, ``sink [H]`` (None = no sink). Empty rows (non-finite lse) -> 0, NaN-free.

    sink = -inf leaves out unchanged; sink = +inf zeroes it; a NaN sink gives NaN on the rows with
    keys (as the reference: garbage in is never turned into zeros). Returns float32.
    """
    _check_pair("out/lse", out, lse)
    lse = _empty_to_neg_inf(lse.float())
    empty = ~torch.isfinite(lse)
    if sink is None:
        factor = torch.ones_like(lse)
    else:
        _check_sink(sink, lse)
        factor = torch.sigmoid(lse - sink.float())
    factor = torch.where(empty, torch.zeros_like(factor), factor)
    # factor 0 (empty row, +inf sink) -> 0 even where out holds NaN; a NaN factor stays NaN
    return torch.where(factor[..., None] == 0, torch.zeros_like(out, dtype=torch.float32),
                       out.float() * factor[..., None])


def remove_sink_from_lse(lse_with_sink: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """AITER ``sparse_mla_fwd`` counts the sink in its LSE: ``log(Σexp(s) + exp(sink))``.
    Return ``log(Σexp(s))`` (-inf for rows whose keys carried no mass)."""
    if sink is None:
        return lse_with_sink.float()
    _check_sink(sink, lse_with_sink)
    lse = lse_with_sink.float()
    diff = sink.float() - lse
    return torch.where(diff < 0, lse + torch.log1p(-torch.exp(diff)), torch.full_like(lse, -math.inf))
