"""GPU front end: a step's per-token facts, SWA rows and C128A rows in ONE small launch, and
a top-k layer's local -> global translation in one more (``TritonFrontEnd``, what ``SparseMLA``
uses on GPUs).

Same results as ``dsv4_attn.common.indices`` (``swa_rows_for`` / ``comp_rows_for`` on
``StepBatch.positions`` etc.), computed per token from ``query_start_loc`` and ``seq_lens``
without any host synchronisation (no ``searchsorted`` / ``.item()``), into caller buffers, so
``plan()`` is graph-capturable and costs one launch:

  token t, request r = #{i >= 1 : query_start_loc[i] <= t}   (valid iff t < query_start_loc[R])
  pos = seq_lens[r] - (qsl[r+1] - qsl[r]) + (t - qsl[r])
  SWA row:   slots of positions s .. pos, then -1;  s = max(0, pos-W+1, swa_start[r]),
             len = pos + 1 - s (min(pos+1, W) without swa_start)
  C128A row: slots of compressed entries 0 .. n-1, then -1;    n = min((pos+1)//128, width)
             (written up to max(n, the row's previous length) only: see ``_step_rows_kernel``)
  C4A row:   slot(local[t, c]) for c < n with 0 <= local[t, c] < (pos+1)//4, else -1;
             n = min((pos+1)//4, K)
  slot(p) = table[r, p // bs] * bs + p % bs  (int64 arithmetic, stored int32)
Padding tokens (t >= qsl[R]): position 0, request -1, invalid, rows all -1, lens 0.
An entry whose block-table column does not exist, whose block id is negative or whose slot
does not fit int32 is -1 (never an out-of-bounds read of the table, never an int32 wrap), as in
``common.indices``; block ids past a cache are skipped by the attention kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...common.indices import INT32_SLOTS, IndexPair, Tokens
from ...common.plan import torch_all_rows
from ...common.spec import LayerKind

# The arguments that change from step to step (the batch's requests and tables, the rows' active
# width) are not specialized on their values or alignment: one compiled variant per model and
# row-buffer shape serves every step, compiled at engine start (``TritonFrontEnd.warm``) instead
# of at the first step of each request count or width (Triton compiles a variant per value == 1,
# value % 16 == 0 and 16-byte alignment of each specialized argument).
_STEP_VALUES = ("num_reqs", "stride_swa_t", "swa_bs", "swa_cols", "stride_c_t", "c_bs", "c_cols", "c_width")
_STEP_POINTERS = ("QSL", "SEQ", "SWA_START", "SWA_TABLE", "C_TABLE")


@triton.jit(do_not_specialize=_STEP_VALUES, do_not_specialize_on_alignment=_STEP_POINTERS)
def _step_rows_kernel(
    QSL, SEQ, num_reqs, SWA_START,
    POS, TOK2REQ, VALID,
    SWA_TABLE, stride_swa_t, swa_bs, swa_cols,
    SWA_ROWS, stride_swa_r, SWA_LENS,
    C_TABLE, stride_c_t, c_bs, c_cols,
    C_ROWS, stride_c_r, C_LENS, c_width, c_cap,
    WINDOW: tl.constexpr, W_P2: tl.constexpr, HAS_START: tl.constexpr, HAS_C128: tl.constexpr,
    C_RATIO: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0)
    # request of token t: count query_start_loc[1..R] <= t (vectorized, no searchsorted)
    count = 0
    for r0 in range(0, num_reqs, BLOCK_R):
        r = r0 + 1 + tl.arange(0, BLOCK_R)
        starts = tl.load(QSL + r, mask=r <= num_reqs, other=2147483647)
        count += tl.sum((starts <= t).to(tl.int32), 0)
    total = tl.load(QSL + num_reqs)
    valid = t < total
    req = tl.minimum(count, tl.maximum(num_reqs - 1, 0))
    has_req = num_reqs > 0
    q0 = tl.load(QSL + req)
    q1 = tl.load(QSL + req + 1, mask=has_req, other=0)
    seq = tl.load(SEQ + req, mask=has_req, other=0)
    pos = (seq - (q1 - q0) + (t - q0)).to(tl.int64)
    pos = tl.where(valid, pos, 0)
    tl.store(POS + t, pos)
    tl.store(TOK2REQ + t, tl.where(valid, req, -1).to(tl.int32))
    tl.store(VALID + t, valid.to(tl.int1))
    req64 = req.to(tl.int64)

    # SWA row
    j = tl.arange(0, W_P2)
    start = tl.maximum(pos - (WINDOW - 1), 0)
    if HAS_START:  # SWA bounded replay: no window keys below the request's start
        start = tl.maximum(start, tl.load(SWA_START + req, mask=has_req, other=0).to(tl.int64))
    logical = start + j
    ok = (j < tl.where(valid, WINDOW, 0)) & (logical <= pos)  # a lane bound, not `& valid`: see attention._tile_slots
    col = logical // swa_bs
    ok = ok & (col < swa_cols)
    blk = tl.load(SWA_TABLE + req64 * stride_swa_t + col, mask=ok, other=0).to(tl.int64)
    slot = blk * swa_bs + (logical - col * swa_bs)
    ok = ok & (blk >= 0) & (slot < 2147483648)
    tl.store(SWA_ROWS + t.to(tl.int64) * stride_swa_r + j, tl.where(ok, slot, -1).to(tl.int32), mask=j < WINDOW)
    tl.store(SWA_LENS + t, tl.where(valid, tl.maximum(pos + 1 - start, 0), 0).to(tl.int32))

    if HAS_C128:
        n = tl.where(valid, tl.minimum((pos + 1) // C_RATIO, c_width), 0).to(tl.int32)
        # Columns at and past a row's length hold -1 (PlanBuffers' invariant: readers of the whole
        # row rely on it), so the row's previous length bounds what is stale: writing columns
        # [0, max(n, previous)) keeps the invariant, and a short request costs its own entries, not
        # the row's width. The bound is read here, on the device, so a CUDA graph captured at the
        # model's width (c_width = c_cap) writes only that much at every replay. Columns up to the
        # buffer's c_cap are cleared, past a narrower view's c_width too.
        previous = tl.minimum(tl.maximum(tl.load(C_LENS + t), 0), c_cap)
        written = tl.maximum(n, previous)
        for c0 in range(0, written, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            ccol = c // c_bs
            okc = (c < n) & (ccol < c_cols)
            cblk = tl.load(C_TABLE + req64 * stride_c_t + ccol, mask=okc, other=0).to(tl.int64)
            cslot = cblk * c_bs + (c - ccol * c_bs)
            okc = okc & (cblk >= 0) & (cslot < 2147483648)
            tl.store(C_ROWS + t.to(tl.int64) * stride_c_r + c, tl.where(okc, cslot, -1).to(tl.int32),
                     mask=c < written)
        tl.store(C_LENS + t, n)


def _block(n: int) -> int:
    """Tile width for a loop over ``n`` elements: a power of two, at most 1024."""
    return min(1024, triton.next_power_of_2(max(n, 1)))


# Requests per step of the request count loop: a fixed tile (not one per request count, each a
# compiled variant); 1024 requests take 4 iterations.
REQS_BLOCK = 256


def build_step_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                    swa_table: torch.Tensor, swa_block_size: int, window: int,
                    positions: torch.Tensor, token_to_req: torch.Tensor, token_valid: torch.Tensor,
                    swa_rows: torch.Tensor, swa_lens: torch.Tensor,
                    c128_table: torch.Tensor | None = None, c128_block_size: int = 2,
                    c128_rows: torch.Tensor | None = None, c128_lens: torch.Tensor | None = None,
                    all_ratio: int = 128, swa_start: torch.Tensor | None = None,
                    c128_capacity: int | None = None) -> None:
    """Fill the step buffers (first ``num_tokens`` rows of each) in one launch.

    positions int64 [>=T], token_to_req int32 [>=T], token_valid bool [>=T], swa_rows int32
    [>=T, window] (last dim contiguous), swa_lens int32 [>=T]; optionally the rows int32
    [>=T, width] and lens of an "all" kind (C128A) from its ratio-``all_ratio`` block table;
    ``swa_start`` int32 [>=R] bounds each request's window from below. The rows may be a view of
    the first ``width`` columns of a buffer of ``c128_capacity`` columns (default ``width``)
    whose columns at and past each row's length (``c128_lens``, as the last call left it) are -1:
    kept so, writing only up to the larger of the new and the previous length. Inputs are not
    validated here.
    """
    T = num_tokens
    if T == 0:
        return
    R = query_start_loc.shape[0] - 1
    has_c = c128_table is not None
    ct, cr, cl, width = swa_table, swa_rows, swa_lens, 0
    if c128_table is not None:
        if c128_rows is None or c128_lens is None:
            raise ValueError("c128_rows / c128_lens: got None with a c128_table; allowed: int32 rows and lens")
        ct, cr, cl, width = c128_table, c128_rows, c128_lens, c128_rows.shape[1]
    capacity = max(c128_capacity or width, width)
    _step_rows_kernel[(T,)](
        query_start_loc, seq_lens, R, swa_start if swa_start is not None else seq_lens,
        positions, token_to_req, token_valid,
        swa_table, swa_table.stride(0), swa_block_size, swa_table.shape[1],
        swa_rows, swa_rows.stride(0), swa_lens,
        ct, ct.stride(0), c128_block_size if has_c else 1, ct.shape[1],
        cr, cr.stride(0), cl, width, capacity,
        WINDOW=window, W_P2=triton.next_power_of_2(window), HAS_START=swa_start is not None,
        HAS_C128=has_c, C_RATIO=all_ratio if has_c else 1,
        BLOCK_R=REQS_BLOCK, BLOCK_C=_block(capacity), num_warps=4,
    )


# Likewise for the top-k rows: everything but the model's ratio and top-k tile (the engine's tables
# and top-k tensors, the cache's size, a phase sub-plan's token offset) is left unspecialized, so the
# variants ``TritonFrontEnd.warm`` compiles at engine start serve every step.
_TOPK_VALUES = ("stride_l", "stride_t", "bs", "table_cols", "K", "width", "last_slot")
_TOPK_POINTERS = ("LOCAL", "POS", "TOK2REQ", "VALID", "TABLE")


@triton.jit(do_not_specialize=_TOPK_VALUES, do_not_specialize_on_alignment=_TOPK_POINTERS)
def _topk_rows_kernel(
    LOCAL, stride_l, POS, TOK2REQ, VALID,
    TABLE, stride_t, bs, table_cols,
    ROWS, LENS, K, width, last_slot,
    RATIO: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(POS + t)
    valid = tl.load(VALID + t)
    req = tl.maximum(tl.load(TOK2REQ + t), 0).to(tl.int64)
    visible = (pos + 1) // RATIO
    n = tl.where(valid, tl.minimum(visible, K), 0)
    for k0 in range(0, width, BLOCK_K):  # columns K .. width - 1 are padding: c >= n, so -1
        c = k0 + tl.arange(0, BLOCK_K)
        local = tl.load(LOCAL + t.to(tl.int64) * stride_l + c, mask=c < K, other=-1).to(tl.int64)
        ok = (c < n) & (local >= 0) & (local < visible)
        col = tl.where(ok, local, 0) // bs
        ok = ok & (col < table_cols)
        blk = tl.load(TABLE + req * stride_t + col, mask=ok, other=0).to(tl.int64)
        slot = blk * bs + (local - col * bs)
        ok = ok & (blk >= 0) & (slot <= last_slot)
        tl.store(ROWS + t.to(tl.int64) * width + c, tl.where(ok, slot, -1).to(tl.int32), mask=c < width)
    tl.store(LENS + t, n.to(tl.int32))


def topk_rows(tokens: Tokens, ratio: int, table: torch.Tensor, comp_block_size: int,
              local_topk: torch.Tensor, num_slots: int | None = None, multiple: int = 1) -> IndexPair:
    """Rows int32 [T, round_up(K, multiple)] (contiguous) and lens int32 [T] of a top-k layer of
    compression ``ratio`` from its local top-k int32/int64 [T, K] (last dim contiguous), in one
    launch. ``num_slots`` (the slots of the cache the rows index; None: no bound) also turns
    slots at or past the cache's end into -1, and the columns past K are -1 padding: together
    the rows a kernel that reads every entry but -1 takes (FlashMLA's decode), without further
    ops. Inputs are not validated here."""
    T, K = local_topk.shape
    width = -(-K // multiple) * multiple
    rows = torch.empty((T, width), dtype=torch.int32, device=local_topk.device)
    lens = torch.empty(T, dtype=torch.int32, device=local_topk.device)
    # the last slot allowed (< 2**31: an int32 argument whether or not the cache bounds it, so one variant)
    last_slot = (INT32_SLOTS if num_slots is None else min(num_slots, INT32_SLOTS)) - 1
    if T:
        _topk_rows_kernel[(T,)](
            local_topk, local_topk.stride(0), tokens.positions, tokens.token_to_req, tokens.valid,
            table, table.stride(0), comp_block_size, table.shape[1], rows, lens, K, width, last_slot,
            RATIO=ratio, BLOCK_K=_block(width), num_warps=4,
        )
    return rows, lens


class TritonFrontEnd:
    """The front end on GPUs: one launch per step (:func:`build_step_rows`: positions, SWA rows
    and the rows of the model's "all" kind, C128A), one per top-k layer (:func:`topk_rows`); no
    host sync, graph-capturable. Same values as ``TorchFrontEnd``."""

    name = "triton"

    def step_rows(self, batch, buffers, num_tokens: int) -> None:
        kinds = buffers.all_kinds(batch)
        fused = kinds[0] if kinds else None
        rows, lens = buffers.rows_of(fused, batch) if fused else (None, None)
        swa_rows, swa_lens = buffers.window_rows()
        build_step_rows(batch.query_start_loc, batch.seq_lens, num_tokens, batch.swa_block_table,
                        batch.swa_block_size, buffers.spec.window, buffers.positions, buffers.token_to_req,
                        buffers.token_valid, swa_rows, swa_lens,
                        batch.comp_block_tables[fused.ratio] if fused else None,
                        batch.comp_block_size(fused) if fused else 1, rows, lens,
                        fused.ratio if fused else 1, batch.swa_start,
                        buffers.spec.all_width(fused.ratio) if fused else None)
        # No released model has a second "all" kind; any further one takes the torch ops.
        T = num_tokens
        tokens = Tokens(buffers.positions[:T], buffers.token_to_req[:T], buffers.token_valid[:T])
        for kind in kinds[1:]:
            torch_all_rows(tokens, kind, batch, buffers)

    def warm(self, buffers, step_rows: bool = True) -> None:
        """Compile every variant of the top-k row kernel (per top-k kind, int32 and int64 top-k)
        and, with ``step_rows``, of the step-row kernel (with and without a window start, with and
        without its "all" kind's rows) this model's steps launch, by launching each on a
        one-token step into scratch tensors shaped as ``buffers``' rows: engine start, outside
        any graph capture, so no step compiles (the values that vary per step are not
        specialized: ``_STEP_VALUES``, ``_TOPK_VALUES``)."""
        spec, dev = buffers.spec, buffers.positions.device
        i32 = dict(dtype=torch.int32, device=dev)
        table = torch.zeros(1, 1, **i32)
        facts = (torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, **i32),
                 torch.zeros(1, dtype=torch.bool, device=dev))
        for kind in spec.kinds:
            if kind.uses_topk:
                for dtype in (torch.int32, torch.int64):
                    local = torch.full((1, spec.comp_width(kind)), -1, dtype=dtype, device=dev)
                    topk_rows(Tokens(*facts), kind.ratio, table, 64, local)
        if not step_rows:
            return
        one, qsl = torch.ones(1, **i32), torch.tensor([0, 1], **i32)
        swa = (torch.full((1, spec.window), -1, **i32), torch.zeros(1, **i32))
        all_kinds = [k for k in spec.kinds if k.attends_all][:1]
        for all_kind in [None, *all_kinds]:
            rows = {}
            if all_kind is not None:
                width = spec.all_width(all_kind.ratio)
                rows = dict(c128_table=table, c128_rows=torch.full((1, width), -1, **i32),
                            c128_lens=torch.zeros(1, **i32), all_ratio=all_kind.ratio, c128_capacity=width)
            for start in (None, torch.zeros(1, **i32)):
                build_step_rows(qsl, one, 1, table, 64, spec.window, *facts, *swa, swa_start=start, **rows)

    def topk_rows(self, tokens: Tokens, kind: LayerKind, table: torch.Tensor, comp_block_size: int,
                  local_topk: torch.Tensor, num_slots: int | None = None, multiple: int = 1) -> IndexPair:
        if local_topk.stride(-1) != 1:
            local_topk = local_topk.contiguous()
        return topk_rows(tokens, kind.ratio, table, comp_block_size, local_topk, num_slots, multiple)
