"""Triton kernels of DSv4 two-scope sparse attention with the sink (decode and prefill).

One program owns one token and a block of ``BLOCK_H`` query heads (and, when the key range is
split, one slice of that token's key tiles). It walks the token's SWA rows, then its compressed
rows, in tiles of ``BLOCK_N`` keys, with ONE online softmax over both scopes:

* each key row is read ONCE from the cache, in place, and used for K and V (V = K);
* MODEL1_FP8 rows are dequantized in registers: the 448 e4m3 NoPE bytes become the dot dtype
  and are multiplied by their tile's power-of-two scale ``2^(byte-127)`` (built from the
  exponent byte with a shift, no exp2), the 64 bf16 RoPE values are loaded as they are;
* the 512 dims are handled as four power-of-two chunks (256 + 128 + 64 NoPE, 64 RoPE), so
  ``Q·Kᵀ`` is four chained dots into one score tile and ``P·V`` four dots into four
  accumulators; no per-64 tile dots, no whole-row gathers into a workspace;
* C4A local top-k entries are translated to global slots inside the kernel through the
  ratio-4 block table (no extra launch per C4A layer);
* every slot -> byte offset product is int64 (caches larger than 2^31 bytes work);
* the sink is applied once at the end: ``o = acc / (l + exp(sink - m))``; rows with no valid
  key write 0 (and lse -inf).

When the tokens are too few to fill the GPU the key tiles of a token are split over ``SPLIT``
programs writing fp32 partials ``(acc, m, l)``; a small combine kernel merges them, applies the
sink and writes bf16 (spec §8 merge rule). Scores are kept in base 2 (``qk_scale`` includes
log2(e)); the returned lse is natural-log and excludes the sink.

Dot dtype ``DT``: float16 (fast default on GPUs: e4m3 values and their power-of-two scales are
exact in fp16 down to 2^-24, and RMS-normed q is bounded by sqrt(512)), bfloat16, or float32
(used under ``TRITON_INTERPRET=1``, whose bf16/fp16 dots are wrong).
"""

from __future__ import annotations

import triton
import triton.language as tl

FMT_MODEL1 = 0
FMT_BF16 = 1
FMT_FP8 = 2

COMP_NONE = 0  # SWA-only layer
COMP_GLOBAL = 1  # compressed rows are global slots (C128A rows from the plan)
COMP_C4A_LOCAL = 2  # compressed rows are C4A local positions: translate in the kernel


@triton.jit
def _tile_slots_global(rows_ptr, row_len, j0, BLOCK_N: tl.constexpr):
    """Slots [BLOCK_N] and validity of columns j0.. of a global-slot row."""
    j = j0 + tl.arange(0, BLOCK_N)
    inb = j < row_len
    slots = tl.load(rows_ptr + j, mask=inb, other=-1)
    valid = inb & (slots >= 0)
    return tl.where(valid, slots, 0), valid


@triton.jit
def _tile_slots_c4a(topk_ptr, row_len, visible, bt_ptr, bs, j0, BLOCK_N: tl.constexpr):
    """C4A: local compressed positions -> global slots through the block table row."""
    j = j0 + tl.arange(0, BLOCK_N)
    inb = j < row_len
    local = tl.load(topk_ptr + j, mask=inb, other=-1)
    valid = inb & (local >= 0) & (local < visible)
    local = tl.where(valid, local, 0)
    blk_col = local // bs
    blk = tl.load(bt_ptr + blk_col, mask=valid, other=0)
    slots = blk * bs + (local - blk_col * bs)
    return tl.where(valid, slots, 0), valid


@triton.jit
def _load_kv_tile(cache_u8, cache_16, stride0, bs, slots, valid, kv_scale,
                  FMT: tl.constexpr, FNUZ: tl.constexpr, DT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Load and dequantize BLOCK_N rows. Returns (k256, k128, k64, krope) in DT:
    dims [0,256), [256,384), [384,448), [448,512). Invalid rows are 0."""
    d256 = tl.arange(0, 256)
    d128 = tl.arange(0, 128)
    d64 = tl.arange(0, 64)
    blk = slots // bs
    off = slots - blk * bs
    m = valid[:, None]
    if FMT == 0:
        # MODEL1: data row at blk*stride0 + off*576; scale row at blk*stride0 + bs*576 + off*8
        base = blk.to(tl.int64) * stride0
        row = base + off.to(tl.int64) * 576
        srow = base + bs.to(tl.int64) * 576 + off.to(tl.int64) * 8
        a8 = tl.load(cache_u8 + row[:, None] + d256[None, :], mask=m, other=0)
        b8 = tl.load(cache_u8 + row[:, None] + 256 + d128[None, :], mask=m, other=0)
        c8 = tl.load(cache_u8 + row[:, None] + 384 + d64[None, :], mask=m, other=0)
        kr = tl.load(cache_16 + (row[:, None] + 448) // 2 + d64[None, :], mask=m, other=0.0)
        e4 = tl.load(cache_u8 + srow[:, None] + tl.arange(0, 4)[None, :], mask=m, other=127)
        e2 = tl.load(cache_u8 + srow[:, None] + 4 + tl.arange(0, 2)[None, :], mask=m, other=127)
        e1 = tl.load(cache_u8 + srow + 6, mask=valid, other=127)
        # 2^(byte-127) as the float32 whose exponent field is the byte (FNUZ: values are half)
        s4 = (e4.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        s2 = (e2.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        s1 = (e1.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        if FNUZ:
            s4 = s4 * 0.5
            s2 = s2 * 0.5
            s1 = s1 * 0.5
        fa = a8.to(tl.float8e4nv, bitcast=True).to(DT)
        fb = b8.to(tl.float8e4nv, bitcast=True).to(DT)
        fc = c8.to(tl.float8e4nv, bitcast=True).to(DT)
        ka = tl.reshape(tl.reshape(fa, (BLOCK_N, 4, 64)) * s4.to(DT)[:, :, None], (BLOCK_N, 256))
        kb = tl.reshape(tl.reshape(fb, (BLOCK_N, 2, 64)) * s2.to(DT)[:, :, None], (BLOCK_N, 128))
        kc = fc * s1.to(DT)[:, None]
        kr = kr.to(DT)
    else:
        row = blk.to(tl.int64) * stride0 + off.to(tl.int64) * 512
        if FMT == 1:
            ka = tl.load(cache_16 + row[:, None] + d256[None, :], mask=m, other=0.0).to(DT)
            kb = tl.load(cache_16 + row[:, None] + 256 + d128[None, :], mask=m, other=0.0).to(DT)
            kc = tl.load(cache_16 + row[:, None] + 384 + d64[None, :], mask=m, other=0.0).to(DT)
            kr = tl.load(cache_16 + row[:, None] + 448 + d64[None, :], mask=m, other=0.0).to(DT)
        else:
            a8 = tl.load(cache_u8 + row[:, None] + d256[None, :], mask=m, other=0)
            b8 = tl.load(cache_u8 + row[:, None] + 256 + d128[None, :], mask=m, other=0)
            c8 = tl.load(cache_u8 + row[:, None] + 384 + d64[None, :], mask=m, other=0)
            r8 = tl.load(cache_u8 + row[:, None] + 448 + d64[None, :], mask=m, other=0)
            sc = kv_scale
            if FNUZ:
                sc = sc * 0.5
            ka = (a8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(DT)
            kb = (b8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(DT)
            kc = (c8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(DT)
            kr = (r8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(DT)
    return ka, kb, kc, kr


@triton.jit
def _attend_tile(qa, qb, qc, qr, ka, kb, kc, kr, valid, m_i, l_i, acc_a, acc_b, acc_c, acc_r, qk_scale,
                 DT: tl.constexpr, TRANSPOSED: tl.constexpr):
    if TRANSPOSED:
        # sT = K·Qᵀ [BLOCK_N, BLOCK_H]: keys on the M side
        st = tl.dot(ka, tl.trans(qa))
        st = tl.dot(kb, tl.trans(qb), st)
        st = tl.dot(kc, tl.trans(qc), st)
        st = tl.dot(kr, tl.trans(qr), st)
        s = tl.trans(st)
    else:
        # s = Q·Kᵀ [BLOCK_H, BLOCK_N]: the shared-memory K tile is the B operand of both dots
        s = tl.dot(qa, tl.trans(ka))
        s = tl.dot(qb, tl.trans(kb), s)
        s = tl.dot(qc, tl.trans(kc), s)
        s = tl.dot(qr, tl.trans(kr), s)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pd = p.to(DT)
    acc_a = tl.dot(pd, ka, acc_a * alpha[:, None])
    acc_b = tl.dot(pd, kb, acc_b * alpha[:, None])
    acc_c = tl.dot(pd, kc, acc_c * alpha[:, None])
    acc_r = tl.dot(pd, kr, acc_r * alpha[:, None])
    return m_new, l_i, acc_a, acc_b, acc_c, acc_r


@triton.jit
def _store_rows(row_ptrs, col0: tl.constexpr, val, hmask, WIDTH: tl.constexpr):
    d = col0 + tl.arange(0, WIDTH)
    tl.store(row_ptrs[:, None] + d[None, :], val, mask=hmask[:, None])


@triton.jit
def sparse_mla_fwd_kernel(
    Q, stride_qt, stride_qh,
    O, stride_ot, stride_oh,
    LSE, stride_lt,
    SINK,
    # scope A: SWA rows (global slots) into cache A
    A_U8, A_16, a_stride0, a_bs, A_ROWS, stride_ar, A_LENS,
    # scope B: compressed rows (global slots, or C4A local positions) into cache B
    B_U8, B_16, b_stride0, b_bs, B_ROWS, stride_br, B_LENS,
    # C4A translation: ratio-4 block table, token -> request, positions
    BT, stride_bt, TOK2REQ, POS, b_width,
    # split partials: PO fp32 [T, SPLIT, H, 512], PML fp32 [T, SPLIT, H, 2]
    PO, PML,
    num_heads, qk_scale, kv_scale,
    FMT: tl.constexpr, A_FNUZ: tl.constexpr, B_FNUZ: tl.constexpr,
    COMP: tl.constexpr, C4A_RATIO: tl.constexpr,
    HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
    TRANSPOSED: tl.constexpr = False,
):
    pid = tl.program_id(0)
    n_hb = tl.cdiv(num_heads, BLOCK_H)
    # split index fastest, then head block: programs sharing a token's rows run together (L2 reuse)
    sp = pid % SPLIT
    hb = (pid // SPLIT) % n_hb
    t = pid // (SPLIT * n_hb)
    t64 = t.to(tl.int64)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < num_heads
    q_row = Q + t64 * stride_qt + h.to(tl.int64) * stride_qh
    d256 = tl.arange(0, 256)
    d128 = tl.arange(0, 128)
    d64 = tl.arange(0, 64)
    qa = tl.load(q_row[:, None] + d256[None, :], mask=hmask[:, None], other=0.0).to(DT)
    qb = tl.load(q_row[:, None] + 256 + d128[None, :], mask=hmask[:, None], other=0.0).to(DT)
    qc = tl.load(q_row[:, None] + 384 + d64[None, :], mask=hmask[:, None], other=0.0).to(DT)
    qr = tl.load(q_row[:, None] + 448 + d64[None, :], mask=hmask[:, None], other=0.0).to(DT)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, 256], tl.float32)
    acc_b = tl.zeros([BLOCK_H, 128], tl.float32)
    acc_c = tl.zeros([BLOCK_H, 64], tl.float32)
    acc_r = tl.zeros([BLOCK_H, 64], tl.float32)

    # ---- key ranges of this token ------------------------------------------------------
    len_a = tl.load(A_LENS + t)
    len_b = 0
    visible = 0
    req = 0
    if COMP == 1:
        len_b = tl.load(B_LENS + t)
    if COMP == 2:
        req = tl.load(TOK2REQ + t)
        pos = tl.load(POS + t)
        visible = ((pos + 1) // C4A_RATIO).to(tl.int32)
        len_b = tl.where(req >= 0, tl.minimum(visible, b_width), 0)
        req = tl.maximum(req, 0)
    tiles_a = tl.cdiv(len_a, BLOCK_N)
    tiles_b = tl.cdiv(len_b, BLOCK_N)
    if SPLIT == 1:
        a_lo = 0
        a_hi = tiles_a
        b_lo = 0
        b_hi = tiles_b
    else:
        per = tl.cdiv(tiles_a + tiles_b, SPLIT)
        lo = sp * per
        hi = tl.minimum(lo + per, tiles_a + tiles_b)
        a_lo = tl.minimum(lo, tiles_a)
        a_hi = tl.minimum(hi, tiles_a)
        b_lo = tl.maximum(lo, tiles_a) - tiles_a
        b_hi = tl.maximum(hi, tiles_a) - tiles_a

    a_rows = A_ROWS + t64 * stride_ar
    for i in range(a_lo, a_hi):
        slots, valid = _tile_slots_global(a_rows, len_a, i * BLOCK_N, BLOCK_N)
        ka, kb, kc, kr = _load_kv_tile(A_U8, A_16, a_stride0, a_bs, slots, valid, kv_scale,
                                       FMT, A_FNUZ, DT, BLOCK_N)
        m_i, l_i, acc_a, acc_b, acc_c, acc_r = _attend_tile(qa, qb, qc, qr, ka, kb, kc, kr, valid, m_i, l_i,
                                                            acc_a, acc_b, acc_c, acc_r, qk_scale, DT, TRANSPOSED)
    if COMP != 0:
        b_rows = B_ROWS + t64 * stride_br
        bt_row = BT + req.to(tl.int64) * stride_bt
        for i in range(b_lo, b_hi):
            if COMP == 1:
                slots, valid = _tile_slots_global(b_rows, len_b, i * BLOCK_N, BLOCK_N)
            else:
                slots, valid = _tile_slots_c4a(b_rows, len_b, visible, bt_row, b_bs, i * BLOCK_N, BLOCK_N)
            ka, kb, kc, kr = _load_kv_tile(B_U8, B_16, b_stride0, b_bs, slots, valid, kv_scale,
                                           FMT, B_FNUZ, DT, BLOCK_N)
            m_i, l_i, acc_a, acc_b, acc_c, acc_r = _attend_tile(qa, qb, qc, qr, ka, kb, kc, kr, valid, m_i,
                                                                l_i, acc_a, acc_b, acc_c, acc_r, qk_scale, DT, TRANSPOSED)

    if SPLIT == 1:
        denom = l_i
        if HAS_SINK:
            sink2 = tl.load(SINK + h, mask=hmask, other=float("-inf")) * 1.4426950408889634
            denom = l_i + tl.exp2(sink2 - m_i)
        has = l_i > 0.0
        inv = tl.where(has, 1.0 / tl.where(has, denom, 1.0), 0.0)
        o_row = O + t64 * stride_ot + h.to(tl.int64) * stride_oh
        _store_rows(o_row, 0, (acc_a * inv[:, None]).to(O.dtype.element_ty), hmask, 256)
        _store_rows(o_row, 256, (acc_b * inv[:, None]).to(O.dtype.element_ty), hmask, 128)
        _store_rows(o_row, 384, (acc_c * inv[:, None]).to(O.dtype.element_ty), hmask, 64)
        _store_rows(o_row, 448, (acc_r * inv[:, None]).to(O.dtype.element_ty), hmask, 64)
        if WRITE_LSE:
            lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            tl.store(LSE + t64 * stride_lt + h, lse, mask=hmask)
    else:
        part = (t64 * SPLIT + sp) * num_heads + h.to(tl.int64)
        po_row = PO + part * 512
        _store_rows(po_row, 0, acc_a, hmask, 256)
        _store_rows(po_row, 256, acc_b, hmask, 128)
        _store_rows(po_row, 384, acc_c, hmask, 64)
        _store_rows(po_row, 448, acc_r, hmask, 64)
        tl.store(PML + part * 2, m_i, mask=hmask)
        tl.store(PML + part * 2 + 1, l_i, mask=hmask)


@triton.jit
def combine_kernel(
    PO, PML, O, stride_ot, stride_oh, LSE, stride_lt, SINK, num_heads,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge SPLIT partials (acc, m, l) of one token: o = Σ w_s acc_s / (Σ w_s l_s + exp2(sink2 - M)),
    w_s = exp2(m_s - M). Grid: (T, cdiv(H, BLOCK_H), 512 // BLOCK_D)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    hmask = h < num_heads
    s = tl.arange(0, SPLIT_P2)
    smask = s < SPLIT
    part = (t * SPLIT + s[None, :]) * num_heads + h[:, None].to(tl.int64)  # [BH, SP]
    pm = hmask[:, None] & smask[None, :]
    m = tl.load(PML + part * 2, mask=pm, other=-1.0e30)
    l = tl.load(PML + part * 2 + 1, mask=pm, other=0.0)
    m_max = tl.max(m, 1)
    w = tl.exp2(m - m_max[:, None])
    l_sum = tl.sum(w * l, 1)
    denom = l_sum
    if HAS_SINK:
        sink2 = tl.load(SINK + h, mask=hmask, other=float("-inf")) * 1.4426950408889634
        denom = l_sum + tl.exp2(sink2 - m_max)
    has = l_sum > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, denom, 1.0), 0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(SPLIT):
        p_i = (t * SPLIT + i) * num_heads + h.to(tl.int64)
        m_s = tl.load(PML + p_i * 2, mask=hmask, other=-1.0e30)
        w_s = tl.exp2(m_s - m_max)
        a = tl.load(PO + p_i[:, None] * 512 + d[None, :], mask=hmask[:, None], other=0.0)
        acc += a * w_s[:, None]
    o = acc * inv[:, None]
    tl.store(O + t * stride_ot + h[:, None].to(tl.int64) * stride_oh + d[None, :],
             o.to(O.dtype.element_ty), mask=hmask[:, None])
    if WRITE_LSE:
        if tl.program_id(2) == 0:
            lse = tl.where(has, (m_max + tl.log2(tl.where(has, l_sum, 1.0))) * 0.6931471805599453,
                           float("-inf"))
            tl.store(LSE + t * stride_lt + h, lse, mask=hmask)
