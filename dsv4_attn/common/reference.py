"""The golden model of DSv4 sparse attention: plain torch, written for clarity.

For token t and head h, with key set S = {first swa_lens[t] entries of swa_rows[t]} ∪
{first comp_lens[t] entries of comp_rows[t]}, -1 entries skipped (docs/semantics.md, "Attention
with sink"):

    s_j = scale * (q[t, h] · k_j)            over all 512 dims, v_j = k_j
    out[t, h] = Σ_j exp(s_j) v_j / (Σ_j exp(s_j) + exp(sink[h]))
    lse[t, h] = log Σ_j exp(s_j)              natural log, WITHOUT the sink

A token with no valid key outputs 0 and lse -inf. No deduplication between the scopes.

Bad input (docs/bad-input.md) -- this function DEFINES the answer every backend must give:
* an entry outside ``[0, num_blocks * block_size)`` of its cache (-1, any other negative, the
  slot count, anything past it) is skipped exactly like -1; ``validate=True`` (the default
  here) raises a ValueError for entries other than -1 instead;
* NaN is never hidden: a NaN (or a NaN score from infinities) in a selected key row makes the
  token's output and lse NaN (every head: the key enters every head's softmax), a NaN sink makes
  its head's output NaN; rows with no valid key still output 0 whatever the sink.
"""

from __future__ import annotations

import math

import torch

from .indices import _check_ints, attended
from .layout import Fp8Dialect, KVFormat, Record, _check_slots, check_cache, gather_rows
from .spec import HEAD_DIM

_TOKEN_CHUNK = 64  # bounds the float64 [chunk, keys, 512] gather
_INTS = (torch.int32, torch.int64)
# one attended scope: (argument prefix "swa" / "comp", cache, rows int [T, K], lens int [T], record, dialect)
_Scope = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, Record, Fp8Dialect]


def _check_inputs(q, scopes, sink, scale, validate: bool) -> list[_Scope]:
    """Shapes, dtypes and devices of every argument; with ``validate`` also the slot ranges
    (entries inside lens). Returns the scopes, checked."""
    if not isinstance(q, torch.Tensor) or not q.is_floating_point() or q.dim() != 3 or q.shape[2] != HEAD_DIM:
        got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q: got {got}; allowed: a float tensor [T, H, {HEAD_DIM}]")
    T, H, dev = q.shape[0], q.shape[1], q.device
    checked: list[_Scope] = []
    for prefix, cache, rows, lens, record, dialect in scopes:
        geo = check_cache(cache, record, f"{prefix}_cache", dialect)
        if cache.device != dev:
            raise ValueError(f"{prefix}_cache: got device {cache.device}; allowed: {dev} (q's device)")
        rows = _check_ints(f"{prefix}_rows", rows, (T, None), dev, _INTS)
        lens = _check_ints(f"{prefix}_lens", lens, (T,), dev, _INTS)
        if validate:
            col = torch.arange(rows.shape[1], device=dev)[None, :]
            _check_slots(torch.where(col < lens[:, None], rows, -1), f"{prefix}_rows", dev, geo.num_slots)
        checked.append((prefix, cache, rows, lens, record, dialect))
    if sink is not None and not (isinstance(sink, torch.Tensor) and sink.is_floating_point()
                                 and sink.shape == (H,) and sink.device == dev):
        got = f"{sink.dtype} {tuple(sink.shape)} on {sink.device}" if isinstance(sink, torch.Tensor) \
            else type(sink).__name__
        raise ValueError(f"sink: got {got}; allowed: None or a float tensor [{H}] on {dev}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale: got {scale!r}; allowed: a finite float > 0")
    return checked


def _scope_keys(cache, record: Record, rows, lens, kv_scale, dialect, name):
    """Dequantized keys [T, K, 512] float32 and a validity mask [T, K] of one scope: the first
    ``lens`` entries that are slots of the cache (anything else is skipped, never read)."""
    geo = check_cache(cache, record, name, dialect)
    valid = attended(rows, geo.num_slots, lens)
    slots = torch.where(valid, rows.long(), torch.full_like(rows, -1, dtype=torch.long))
    return gather_rows(cache, record, geo, slots, kv_scale, dialect), valid


def sparse_mla(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_rows: torch.Tensor,
    swa_lens: torch.Tensor,
    comp_cache: torch.Tensor | None,
    comp_rows: torch.Tensor | None,
    comp_lens: torch.Tensor | None,
    sink: torch.Tensor | None,
    scale: float,
    fmt: KVFormat | str,
    dtype: torch.dtype = torch.float64,
    kv_scale: float | None = None,
    swa_dialect: Fp8Dialect | str = Fp8Dialect.OCP,
    comp_dialect: Fp8Dialect | str = Fp8Dialect.OCP,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-scope sparse attention with sink.

    q           [T, H, 512] (any float dtype; computed in ``dtype``)
    swa_cache   cache tensor of ``fmt.swa_record`` (see layout.py); swa_rows int [T, W] global slots,
                swa_lens int [T]
    comp_cache  cache of the compressed scope (``fmt.comp_record``) or None (SWA-only layer);
                comp_rows int [T, K], comp_lens int [T]
    sink        [H] float (None = no sink, i.e. -inf)
    kv_scale    per-tensor scale of FP8_TENSOR caches (None -> 1.0)
    validate    raise for row entries (inside lens) outside -1 .. num_slots-1; False: skip them
                like -1 (the masked answer, what every backend gives without validation)
    Returns (out [T, H, 512] ``dtype``, lse [T, H] ``dtype``).
    """
    fmt = KVFormat.parse(fmt)
    swa_dialect, comp_dialect = Fp8Dialect.parse(swa_dialect), Fp8Dialect.parse(comp_dialect)
    given: list[tuple] = [("swa", swa_cache, swa_rows, swa_lens, fmt.swa_record, swa_dialect)]  # unchecked
    if comp_cache is not None:
        given.append(("comp", comp_cache, comp_rows, comp_lens, fmt.comp_record, comp_dialect))
    scopes = _check_inputs(q, given, sink, scale, validate)
    scale_kv = 1.0 if kv_scale is None else float(kv_scale)
    T, H, _ = q.shape
    out = torch.zeros(T, H, q.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((T, H), -math.inf, dtype=dtype, device=q.device)
    sink_d = None if sink is None else sink.to(dtype)
    for t0 in range(0, T, _TOKEN_CHUNK):
        t1 = min(T, t0 + _TOKEN_CHUNK)
        parts = [_scope_keys(cache, record, rows[t0:t1], lens[t0:t1], scale_kv, dialect, f"{prefix}_cache")
                 for prefix, cache, rows, lens, record, dialect in scopes]
        keys = torch.cat([k for k, _ in parts], dim=1).to(dtype)
        valid = torch.cat([v for _, v in parts], dim=1)
        scores = scale * torch.einsum("thd,tkd->thk", q[t0:t1].to(dtype), keys)
        scores = scores.masked_fill(~valid[:, None, :], -math.inf)
        chunk_lse = torch.logsumexp(scores, dim=-1)  # -inf for empty rows, NaN for NaN keys
        has_keys = valid.any(dim=1)[:, None].expand_as(chunk_lse)
        safe_lse = torch.where(has_keys, chunk_lse, torch.zeros_like(chunk_lse))
        probs = torch.exp(scores - safe_lse[..., None])  # normalized over the keys
        o = torch.einsum("thk,tkd->thd", probs, keys)
        if sink_d is not None:
            o = o * torch.sigmoid(chunk_lse - sink_d)[..., None]
        out[t0:t1] = torch.where(has_keys[..., None], o, torch.zeros_like(o))
        lse[t0:t1] = torch.where(has_keys, chunk_lse, torch.full_like(chunk_lse, -math.inf))
    return out, lse
