"""Per-step sparse index builders (docs/semantics.md "Slots and block tables"), vectorized torch.

Every builder returns ``(rows, lens)``: ``rows`` int32 ``[T, width]`` of GLOBAL cache slots
(``block_table[req, p // bs] * bs + p % bs``) whose first ``lens[t]`` columns are the keys of
token t and whose every other column is -1; ``lens`` int32 ``[T]``. Padding tokens (see
StepBatch) get ``lens == 0`` and all -1 rows. Slots are computed in int64 and stored as int32
(the vendor kernels' index type). Entries that cannot be read are -1, never an out-of-bounds
lookup or an int32 wrap: a missing block-table column, a negative block id, a slot >= 2**31
(``StepBatch.validate`` raises for them instead). Block ids past the end of a cache give slots
past its end; every consumer (kernel, backend, reference) skips slots outside
``[0, num_blocks * block_size)`` exactly like -1 (docs/bad-input.md).

``out=(rows, lens)`` writes into caller buffers (plan buffers sized for the max batch) so a
step can be captured in a CUDA graph and replayed with new contents.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .batch import StepBatch
from .spec import LayerKind, cdiv, round_up

IndexPair = tuple[torch.Tensor, torch.Tensor]
_LEN_DTYPES = (torch.int32, torch.int64)


def _lookup_slots(table: torch.Tensor, req: torch.Tensor, logical: torch.Tensor, block_size: int,
                  valid: torch.Tensor) -> torch.Tensor:
    """Global slots (int64, -1 where invalid) of logical positions ``logical`` [T, W] of requests
    ``req`` [T]. A position whose block-table column does not exist, whose block id is negative
    or whose slot does not fit int32 is invalid too (never an out-of-bounds read, never a wrap);
    block ids past the cache are left for the consumer, which knows the cache."""
    rows, cols = table.shape
    if rows == 0 or cols == 0:  # nothing to look up (e.g. a step of padding tokens only)
        return torch.full_like(logical, -1, dtype=torch.int64)
    col = torch.div(logical, block_size, rounding_mode="floor")
    ok = valid & (col < cols)
    safe_req = req.long().clamp(0, rows - 1)[:, None].expand_as(col)
    block = table[safe_req, torch.where(ok, col, torch.zeros_like(col))].long()
    slots = block * block_size + logical.remainder(block_size)
    ok &= (block >= 0) & (slots < 2**31)
    return torch.where(ok, slots, torch.full_like(slots, -1))


def _check_ints(name: str, t, shape: tuple, device: torch.device | None = None,
                dtypes: tuple = (torch.int32,)) -> torch.Tensor:
    """``t`` must be a tensor of one of ``dtypes`` with ``shape`` (None: any extent) on ``device``;
    returns it (typed: callers narrow an optional argument through the check)."""
    ok = isinstance(t, torch.Tensor) and t.dtype in dtypes and t.dim() == len(shape) and all(
        want is None or got == want for got, want in zip(t.shape, shape))
    if not ok:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        dims = ", ".join("*" if d is None else str(d) for d in shape)
        raise ValueError(f"{name}: got {got}; allowed: {' or '.join(map(str, dtypes))} [{dims}]")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: got device {t.device}; allowed: {device}")
    return t


INT32_SLOTS = 2**31  # slots must fit int32 (the vendor kernels' index type)


def attended(rows: torch.Tensor, num_slots: int, lens: torch.Tensor | None = None) -> torch.Tensor:
    """bool, the shape of ``rows`` [T, K]: the entries a launch reads. Outside the cache means -1:
    an entry that is not a slot of the cache (``[0, num_slots)``), -1 included, is "no row", never
    read (docs/semantics.md "Out-of-range entries"); with ``lens`` int [T], so is every column at or
    past the token's length."""
    inside = (rows >= 0) & (rows < num_slots)
    if lens is None:
        return inside
    return inside & (torch.arange(rows.shape[1], device=rows.device)[None, :] < lens[:, None])


def bounded_rows(rows: torch.Tensor, num_slots: int | None, lens: torch.Tensor | None = None,
                 multiple: int = 1) -> torch.Tensor:
    """``rows`` [T, K] with every entry ``attended`` does not take set to -1 (``num_slots`` None:
    no bound, ``lens`` None: every column), padded with -1 columns to a multiple of ``multiple``:
    rows for a kernel that reads every entry but -1. [T, round_up(K, multiple)] of ``rows``' dtype
    (``rows`` itself when there is nothing to change)."""
    kept = rows
    if num_slots is not None or lens is not None:
        bound = INT32_SLOTS if num_slots is None else num_slots
        kept = torch.where(attended(rows, bound, lens), rows, torch.full_like(rows, -1))
    pad = round_up(rows.shape[1], multiple) - rows.shape[1]
    return kept if pad == 0 else torch.nn.functional.pad(kept, (0, pad), value=-1)


def _emit(rows64: torch.Tensor, lens: torch.Tensor, out: IndexPair | None) -> IndexPair:
    rows, lens = rows64.to(torch.int32), lens.to(torch.int32)
    if out is None:
        return rows, lens
    out_rows, out_lens = out
    if out_rows.shape != rows.shape or out_lens.shape != lens.shape or out_rows.dtype != torch.int32 \
            or out_lens.dtype != torch.int32 or out_rows.device != rows.device or out_lens.device != rows.device:
        raise ValueError(
            f"out: got {out_rows.dtype} {tuple(out_rows.shape)}, {out_lens.dtype} {tuple(out_lens.shape)}; "
            f"allowed: int32 {tuple(rows.shape)}, int32 {tuple(lens.shape)} on {rows.device}"
        )
    out_rows.copy_(rows)
    out_lens.copy_(lens)
    return out_rows, out_lens


class Tokens(NamedTuple):
    """Per-token facts the row builders need (a StepBatch's, or a slice of them).

    positions int64 [T], token_to_req int32 [T] (-1 padding), valid bool [T] (False padding)
    """

    positions: torch.Tensor
    token_to_req: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, batch: StepBatch) -> Tokens:
        return cls(*batch.token_facts())


def swa_rows(batch: StepBatch, window: int = 128, out: IndexPair | None = None) -> IndexPair:
    """Sliding-window rows: slots of positions ``max(0, pos-W+1, swa_start[r]) .. pos`` ascending
    (``batch.swa_start`` None: no per-request bound).

    Returns rows int32 ``[T, window]``, lens int32 ``[T]`` = the number of those positions
    (``min(pos+1, window)`` without ``swa_start``).
    """
    tokens = Tokens.of(batch)
    return swa_rows_for(tokens, batch.swa_block_table, batch.swa_block_size, window, out,
                        batch.window_starts(tokens.token_to_req))


def swa_rows_for(tokens: Tokens, table: torch.Tensor, block_size: int, window: int = 128,
                 out: IndexPair | None = None, starts: torch.Tensor | None = None) -> IndexPair:
    """:func:`swa_rows` from per-token facts and the SWA block table; ``starts`` int64 [T]: each
    token's lowest window position (``StepBatch.window_starts``), None for 0."""
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window: got {window!r}; allowed: a positive int")
    pos, valid_tok = tokens.positions, tokens.valid
    start = (pos - (window - 1)).clamp(min=0)
    if starts is not None:
        start = torch.maximum(start, starts)
    logical = start[:, None] + torch.arange(window, device=pos.device)[None, :]
    valid = (logical <= pos[:, None]) & valid_tok[:, None]
    rows = _lookup_slots(table, tokens.token_to_req, logical, block_size, valid)
    lens = torch.where(valid_tok, (pos + 1 - start).clamp(min=0), torch.zeros_like(pos))
    return _emit(rows, lens, out)


def check_local_topk(local_topk, num_tokens: int, device: torch.device, name: str = "topk",
                     width: int | None = None) -> torch.Tensor:
    """``local_topk`` (the argument ``name``) is int32/int64 ``[T' >= num_tokens, width]`` on
    ``device`` (``width`` None: any; the model's top-k width otherwise, so a narrower row never
    silently drops keys); returns it."""
    want = "K" if width is None else str(width)
    if not isinstance(local_topk, torch.Tensor) or local_topk.dtype not in (torch.int32, torch.int64) \
            or local_topk.dim() != 2 or local_topk.shape[0] < num_tokens \
            or (width is not None and local_topk.shape[1] != width):
        got = (f"{local_topk.dtype} {tuple(local_topk.shape)}" if isinstance(local_topk, torch.Tensor)
               else type(local_topk).__name__)
        raise ValueError(f"{name}: got {got}; allowed: int32 [T >= {num_tokens}, {want}] local compressed "
                         "positions" + ("" if width is None else f" ({width} = the model's top-k width)"))
    if local_topk.device != device:
        raise ValueError(f"{name}: got device {local_topk.device}; allowed: {device}")
    return local_topk


def topk_rows(batch: StepBatch, kind: LayerKind, local_topk: torch.Tensor,
              out: IndexPair | None = None, name: str = "topk") -> IndexPair:
    """Rows of a top-k layer (C4A, C1A, C2A) from the indexer's LOCAL top-k ``[T, K]``
    (compressed positions, -1 unused), through the block table of the layer's ratio r.

    The valid prefix is bounded by ``min((pos+1)//r, K)``; entries past it, negative entries and
    entries ``>= (pos+1)//r`` (not yet visible: stale lanes) become -1. Returns rows int32
    ``[T, K]``, lens int32 ``[T]`` = ``min((pos+1)//r, K)`` (0 for padding tokens).
    """
    kind = LayerKind.parse(kind)
    if not kind.uses_topk:
        raise ValueError(f"kind: got {kind.name}; allowed: a top-k layer kind (C4A, C1A, C2A)")
    T = batch.checked_num_tokens
    check_local_topk(local_topk, T, batch.device, name)
    return comp_rows_for(Tokens.of(batch), kind, batch.comp_block_table(kind), batch.comp_block_size(kind),
                         local_topk[:T], out)


def validate_local_topk(tokens: Tokens, local_topk: torch.Tensor, ratio: int, name: str = "topk") -> None:
    """Raise a ValueError for the first entry of a token's valid prefix (its first
    ``min((pos+1)//ratio, K)`` lanes) that is neither -1 nor a visible entry ``0 <= e <
    (pos+1)//ratio``. Without this check such entries are skipped like -1. Reads device tensors."""
    pos, valid_tok = tokens.positions.cpu(), tokens.valid.cpu()
    local = local_topk[: pos.shape[0]].long().cpu()
    visible = torch.div(pos + 1, ratio, rounding_mode="floor")
    lens = torch.where(valid_tok, visible.clamp(max=local.shape[1]), torch.zeros_like(pos))
    col = torch.arange(local.shape[1])[None, :]
    bad = (col < lens[:, None]) & ((local < -1) | (local >= visible[:, None]))
    if bool(bad.any()):
        t, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}: got {int(local[t, c])} at token {t}, lane {c} (inside its first {int(lens[t])} lanes); "
            f"allowed: -1 or a visible compressed position 0..{int(visible[t]) - 1} (position {int(pos[t])})"
        )


def all_rows(batch: StepBatch, kind: LayerKind, width: int | None = None,
             out: IndexPair | None = None) -> IndexPair:
    """Rows of an "all" layer (C128A): every compressed entry ``c < (pos+1)//r``, ascending.

    ``width`` is fixed per model (default ``round_up(cdiv(max_model_len, r), 128)``), never
    derived from the batch, so graph-captured strides stay valid. Returns rows int32
    ``[T, width]``, lens int32 ``[T]`` = ``min((pos+1)//r, width)``.
    """
    kind = LayerKind.parse(kind)
    if not kind.attends_all:
        raise ValueError(f"kind: got {kind.name}; allowed: a kind that attends every entry (C128A)")
    if width is None:
        width = round_up(cdiv(batch.max_model_len, kind.ratio), 128)
    return comp_rows_for(Tokens.of(batch), kind, batch.comp_block_table(kind), batch.comp_block_size(kind),
                         width, out)


def comp_rows_for(tokens: Tokens, kind: LayerKind, table: torch.Tensor, comp_block_size: int,
                  local: torch.Tensor | int, out: IndexPair | None = None) -> IndexPair:
    """Compressed-scope rows from per-token facts. ``local`` is a top-k layer's local top-k
    [T, K] or, for an "all" layer, the row width (entries 0..width-1)."""
    pos, valid_tok = tokens.positions, tokens.valid
    if isinstance(local, int):
        if isinstance(local, bool) or local <= 0:
            raise ValueError(f"width: got {local!r}; allowed: a positive int")
        local = torch.arange(local, device=pos.device, dtype=torch.int64)[None, :].expand(pos.shape[0], local)
    local = local.long()
    visible = torch.div(pos + 1, kind.ratio, rounding_mode="floor")
    lens = torch.where(valid_tok, visible.clamp(max=local.shape[1]), torch.zeros_like(pos))
    col = torch.arange(local.shape[1], device=pos.device)[None, :]
    valid = (col < lens[:, None]) & (local >= 0) & (local < visible[:, None])
    rows = _lookup_slots(table, tokens.token_to_req, local, comp_block_size, valid)
    return _emit(rows, lens, out)


def compact_rows(rows: torch.Tensor, lens: torch.Tensor) -> IndexPair:
    """Each row's keys (the entries inside its first ``lens[t]`` columns that are not negative)
    moved to the front in their order, -1 after. Returns rows int32 ``[T, K]`` and the key
    counts int32 ``[T]``."""
    T, K = rows.shape
    keep = (torch.arange(K, device=rows.device)[None, :] < lens[:, None].long()) & (rows >= 0)
    dest = torch.where(keep, keep.long().cumsum(dim=1) - 1, torch.full_like(rows, K, dtype=torch.long))
    out = torch.full((T, K + 1), -1, dtype=torch.int32, device=rows.device)  # column K takes the dropped
    out.scatter_(1, dest, torch.where(keep, rows, torch.full_like(rows, -1)).to(torch.int32))
    return out[:, :K], keep.sum(dim=1).to(torch.int32)


def merged_rows(swa_rows: torch.Tensor, swa_lens: torch.Tensor, comp_rows: torch.Tensor | None,
                comp_lens: torch.Tensor | None) -> IndexPair:
    """FlashInfer TRTLLM-gen DSv4 layout (docs/nvidia.md): ONE row per token.

    Columns ``[0, W)`` hold the token's SWA keys, columns ``[W, W + round_up(K, 4))`` its
    compressed keys (padded with -1 to a multiple of 4 for 16-byte aligned int32 rows); each
    region's keys (entries inside its lens that are not negative) come first, in order, so no
    -1 sits inside what the kernel attends, whether it skips a -1 or loads it as a zero key:
    lens = ``W + the compressed key count``; the kernel attends the first ``seq_len`` SWA
    columns (pass the SWA key count). SWA-only layers (``comp_rows is None``) give rows
    ``[T, W]`` and lens ``W``. Returns rows int32 ``[T, W + round_up(K, 4)]`` contiguous, lens
    int32 ``[T]``.
    """
    _check_ints("swa_rows", swa_rows, (None, None))
    T, W = swa_rows.shape
    dev = swa_rows.device
    _check_ints("swa_lens", swa_lens, (T,), dev, _LEN_DTYPES)
    if comp_rows is None:
        if comp_lens is not None:
            raise ValueError("comp_lens: got a tensor without comp_rows; allowed: None for SWA-only layers")
        swa, _ = compact_rows(swa_rows, swa_lens)
        return swa.contiguous(), torch.full_like(swa_lens, W, dtype=torch.int32)
    _check_ints("comp_rows", comp_rows, (T, None), dev)
    comp_lens = _check_ints("comp_lens", comp_lens, (T,), dev, _LEN_DTYPES)
    swa, _ = compact_rows(swa_rows, swa_lens)
    K = comp_rows.shape[1]
    comp, count = compact_rows(comp_rows, comp_lens)
    rows = torch.full((T, W + round_up(K, 4)), -1, dtype=torch.int32, device=dev)
    rows[:, :W] = swa
    rows[:, W : W + K] = comp
    return rows, count + W


def ragged(rows: torch.Tensor, lens: torch.Tensor, capacity: int | None = None) -> IndexPair:
    """CSR form for kernels that take ``kv_indptr / kv_indices``.

    Keeps the first ``lens[t]`` columns of each row minus -1 entries, in order. Returns
    ``indptr`` int32 ``[T+1]`` and ``indices`` int32 ``[nnz]``; with ``capacity`` the indices
    tensor is ``[capacity]`` with -1 after the last entry (fixed shape: no host sync).
    """
    _check_ints("rows", rows, (None, None))
    T, K = rows.shape
    _check_ints("lens", lens, (T,), rows.device, _LEN_DTYPES)
    col = torch.arange(K, device=rows.device)[None, :]
    keep = (col < lens[:, None].long()) & (rows >= 0)
    counts = keep.sum(dim=1)
    indptr = torch.zeros(T + 1, dtype=torch.int64, device=rows.device)
    indptr[1:] = counts.cumsum(0)
    rank = keep.long().cumsum(dim=1) - 1
    dest = torch.where(keep, indptr[:-1, None] + rank, torch.full_like(rank, -1))
    if capacity is None:
        size = int(indptr[-1])
    else:
        size = capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < T * K:
            raise ValueError(f"capacity: got {capacity!r}; allowed: an int >= T * K = {T * K}")
    indices = torch.full((size + 1,), -1, dtype=torch.int32, device=rows.device)
    indices.scatter_(0, torch.where(keep, dest, torch.full_like(dest, size)).reshape(-1),
                     rows.reshape(-1).to(torch.int32))
    return indptr.to(torch.int32), indices[:size]
