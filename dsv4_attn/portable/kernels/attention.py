"""Triton kernels of DSv4 two-scope sparse attention with the sink (decode and prefill).

One program owns one token and a block of ``BLOCK_H`` query heads (and, when the key range is
split, one slice of that token's key tiles). It walks the token's SWA rows, then its compressed
rows, in tiles of ``BLOCK_N`` keys, with ONE online softmax over both scopes:

* each key row is read ONCE from the cache, in place, and used for K and V (V = K);
* each cache is read in its own record (``FMT_A`` SWA, ``FMT_B`` compressed; docs/semantics.md
  "Cache records") and dequantized in registers, chunk by chunk, right before its dot:
  V4 rows (``FMT_MODEL1``): 448 e4m3 bytes times their 64-dim group's power-of-two scale
  ``2^(byte-127)`` (built from the exponent byte with a shift, no exp2), 64 bf16 RoPE values as
  they are; MXFP8 rows: 512 e4m3 bytes, one such scale per 32 dims; NVFP4 rows: 512 e2m1 codes
  (two per byte) rebuilt as e4m3 bytes (``_e2m1_as_e4m3``) so the same e4m3 conversion decodes
  them, times their 16-dim group's e4m3 scale; BF16 rows as they are; FP8 per-tensor rows times
  ``kv_scale``. When the two records differ (``nvfp4_ds_mla``) the SWA tiles and the compressed
  tiles run in two loops of one online softmax (``_walk``), each compiled for its record;
* the 512 dims are handled as four power-of-two chunks (``_chunk_dims``: 256 + 128 + 64 NoPE,
  64 RoPE; in layers of V4.1 records, whose values are all quantized alike, four chunks of 128
  in the pair order of their bytes: the even / odd dims of each half, so an NVFP4 byte's two
  nibbles and an MXFP8 word's two bytes feed two chunks without moving between lanes, and q, o
  and the accumulators follow that order), so ``Q·Kᵀ`` is four chained dots into one score tile
  and ``P·V`` four dots into four accumulators; no per-64 tile dots, no whole-row gathers into
  a workspace;
* local top-k entries (C4A, C1A, C2A) are translated to global slots inside the kernel through
  the block table of the layer's ratio (no extra launch per top-k layer);
* every slot -> byte offset product is int64 (caches larger than 2^31 bytes work);
* any entry that does not name a row of its cache is skipped exactly like -1, never read
  (``RANGE_CHECKS``, one compare per key; docs/bad-input.md): a slot outside ``[0, slots)``, a
  local top-k entry outside ``[0, visible)`` or past the block table's columns, a block id outside
  ``[0, blocks)``; lens are clamped to ``[0, row width]``. ``RANGE_CHECKS=False`` exists only
  to measure what the checks cost (``dsv4-attn bench --guard-cost``);
* the sink is applied once at the end: ``o = acc / (l + exp(sink - m))``; rows with no valid
  key write 0 (and lse -inf); NaN in a selected key or the sink is not hidden (NaN out).

When the tokens are too few to fill the GPU the key tiles of a token are split over ``SPLIT``
programs writing fp32 partials ``(acc, m, l)``; a small combine kernel merges them, applies the
sink and writes bf16 (the LSE merge of docs/semantics.md). ``SPLIT`` is chosen on the host from
the rows' width; a token whose keys fill fewer than ``SPLIT`` programs' ranges (a short request
in rows of the model's width, as a CUDA graph captures them) writes partials from the programs
that have keys only, and says how many (``PU``): the others store nothing and the merge reads
nothing of theirs. Scores are kept in base 2 (``qk_scale`` includes
log2(e)); the returned lse is natural-log and excludes the sink.

Dot dtype ``DT``: bfloat16 (the default on GPUs), float16 (e4m3 values and their power-of-two
scales are exact in fp16 down to 2^-24, e2m1 times an e4m3 scale down to 2^-10, and RMS-normed q
is bounded by sqrt(512)), or float32 (used under ``TRITON_INTERPRET=1``, whose bf16/fp16 dots are
wrong).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# records of a cache as the kernels name them (constexpr FMT_A / FMT_B)
FMT_MODEL1 = 0  # V4 record (584 B): 448 e4m3 + 64 bf16, UE8M0 scale per 64 dims, split pages
FMT_BF16 = 1  # 512 bf16
FMT_FP8 = 2  # 512 e4m3, one per-tensor scale (kv_scale)
FMT_MXFP8 = 3  # V4.1 (528 B): 512 e4m3, UE8M0 scale per 32 dims, each token's scales after its data
FMT_NVFP4 = 4  # V4.1 compressed (288 B): 512 e2m1 in 256 B, e4m3 scale per 16 dims, interleaved

COMP_NONE = 0  # SWA-only layer
COMP_GLOBAL = 1  # compressed rows are global slots (C128A rows from the plan)
COMP_C4A_LOCAL = 2  # compressed rows are local top-k positions (C4A, C1A, C2A): translated in the kernel


@triton.jit
def _divmod(x, d, SHIFT: tl.constexpr):
    """(x // d, x % d) for x >= 0: a shift and a mask when d is 2**SHIFT (SHIFT >= 0, the launcher's
    ``_log2_or_minus1`` of a cache's block size), else an integer division (a run-time divisor
    costs ~10 instructions per element, on every key)."""
    if SHIFT >= 0:
        q = x >> SHIFT
        r = x & ((1 << SHIFT) - 1)
    else:
        q = x // d
        r = x - q * d
    return q, r


@triton.jit
def _tile_slots(g, lo_b, hi, a_rows, len_a, a_slots, b_rows, len_b, b_slots, visible, bt_row, bt_cols, b_bs,
                b_blocks, COMP: tl.constexpr, RANGE_CHECKS: tl.constexpr, BLOCK_N: tl.constexpr,
                B_SHIFT: tl.constexpr):
    """Slots [BLOCK_N] (0 where invalid), validity, and scope flag of global tile ``g``.

    Tiles [0, lo_b) are SWA tiles of scope A, tiles [lo_b, ...) compressed tiles of scope B;
    ``g >= hi`` gives an all-invalid tile (the prefetch past the last tile). With RANGE_CHECKS an
    entry naming no row of its cache is invalid (slot outside [0, a_slots) / [0, b_slots); local top-k:
    block-table column >= bt_cols or block id outside [0, b_blocks))."""
    live = g < hi
    is_a = g < lo_b
    j = tl.arange(0, BLOCK_N)
    ja = g * BLOCK_N + j
    # scalar conditions reach the lanes through a scalar bound or a lane comparison, never joined to
    # a lane mask with `&`: Triton 3.9's interpreter refuses such a load mask ("mask has unsupported dtype")
    ina = ja < tl.where(is_a & live, len_a, 0)
    sa = tl.load(a_rows + ja, mask=ina, other=-1)
    valid = ina & (sa >= 0)
    if RANGE_CHECKS:
        valid = valid & (sa < a_slots)
    slots = sa
    if COMP != 0:
        jb = (g - lo_b) * BLOCK_N + j
        inb = (jb >= 0) & (jb < tl.where(live, len_b, 0))  # jb >= 0: a tile of scope B (not is_a)
        if COMP == 1:
            sb = tl.load(b_rows + jb, mask=inb, other=-1)
            vb = inb & (sb >= 0)
            if RANGE_CHECKS:
                vb = vb & (sb < b_slots)
        else:
            local = tl.load(b_rows + jb, mask=inb, other=-1)
            vb = inb & (local >= 0) & (local < visible)
            local = tl.where(vb, local, 0)
            col, row_in_block = _divmod(local, b_bs, B_SHIFT)
            if RANGE_CHECKS:
                vb = vb & (col < bt_cols)
            blk = tl.load(bt_row + col, mask=vb, other=0)
            if RANGE_CHECKS:
                vb = vb & (blk >= 0) & (blk < b_blocks)
            sb = blk * b_bs + row_in_block
        valid = tl.where(is_a, valid, vb)
        slots = tl.where(is_a, sa, sb)
    return tl.where(valid, slots, 0), valid, is_a


@triton.jit
def _chunk_ptrs(base, row, start: tl.constexpr, K: tl.constexpr, W: tl.constexpr):
    """Pointers [N, K, W] to the K groups of W elements at ``row + start`` of each row."""
    t = tl.arange(0, K)
    c = tl.arange(0, W)
    return base + row[:, None, None] + start + (t * W)[None, :, None] + c[None, None, :]


@triton.jit
def _chunk_dims(k: tl.constexpr, PAIRED: tl.constexpr):
    """The dims of chunk ``k`` (0..3) of q, o and the accumulators: [0,256), [256,384), [384,448),
    [448,512); ``PAIRED`` (layers reading NVFP4, two dims per byte): four chunks of 128, the even
    then the odd dims of [0,256), the even then the odd dims of [256,512), so chunks 0 / 1 are the
    low / high nibbles of the same 128 bytes (2 / 3 of the next 128): each byte is loaded once, as
    part of a vector, and its nibbles never move between lanes."""
    if PAIRED:
        d = 256 * (k // 2) + 2 * tl.arange(0, 128) + k % 2
    elif k == 0:
        d = tl.arange(0, 256)
    elif k == 1:
        d = 256 + tl.arange(0, 128)
    else:
        d = 384 + 64 * (k - 2) + tl.arange(0, 64)
    return d


@triton.jit
def _span_ptrs(base, row, start: tl.constexpr, W: tl.constexpr):
    """Pointers [N, W] to the W elements at ``row + start`` of each row."""
    return base + row[:, None] + start + tl.arange(0, W)[None, :]


@triton.jit
def _load_kv_raw(cache_u8, cache_16, stride0, bs, slots, valid, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                 SHIFT: tl.constexpr):
    """Issue every load of a tile of BLOCK_N rows (raw; dequantized later, chunk by chunk).

    Returns (a, b, c, r, ea, eb, ec, er): the dims of chunks 0..3 (``_chunk_dims``) of each row in
    the cache's storage type, and their scale bytes. V4 rows: a [N,4,64], b [N,2,64], c [N,64]
    e4m3, r [N,64] bf16, scales ea [N,4], eb [N,2], ec [N] (of the 64-dim groups). V4.1 records
    (MXFP8, NVFP4) in pair order: a = b (their low / high halves) and c = r, the same raw values;
    NVFP4 (dims 2j, 2j+1 in byte j's low / high nibble) bytes [0,128) and [128,256) [N,16,8] with
    the e4m3 scales of their 16-dim groups [N,16]; MXFP8 as 16-bit words (dims 2j, 2j+1 in word
    j's low / high byte) [0,128) and [128,256) [N,8,16] with their 32-dim groups' scales [N,8].
    BF16 / FP8: a [N,4,64], b [N,2,64], c, r [N,64], no scales. Invalid rows read as 0."""
    blk, off = _divmod(slots, bs, SHIFT)
    m3 = valid[:, None, None]
    m2 = valid[:, None]
    if FMT == 0:
        # MODEL1: data row at blk*stride0 + off*576; scale row at blk*stride0 + bs*576 + off*8
        t4 = tl.arange(0, 4)
        t2 = tl.arange(0, 2)
        c64 = tl.arange(0, 64)
        base = blk.to(tl.int64) * stride0
        row = base + off.to(tl.int64) * 576
        srow = base + bs * 576 + off.to(tl.int64) * 8
        a = tl.load(cache_u8 + row[:, None, None] + (t4 * 64)[None, :, None] + c64[None, None, :], mask=m3, other=0)
        b = tl.load(cache_u8 + row[:, None, None] + 256 + (t2 * 64)[None, :, None] + c64[None, None, :], mask=m3,
                    other=0)
        c = tl.load(cache_u8 + row[:, None] + 384 + c64[None, :], mask=m2, other=0)
        r = tl.load(cache_16 + (row[:, None] + 448) // 2 + c64[None, :], mask=m2, other=0.0)
        ea = tl.load(cache_u8 + srow[:, None] + t4[None, :], mask=m2, other=0)
        eb = tl.load(cache_u8 + srow[:, None] + 4 + t2[None, :], mask=m2, other=0)
        ec = tl.load(cache_u8 + srow + 6, mask=valid, other=0)
        er = 0
    elif FMT == 4:
        # NVFP4: token at blk*stride0 + off*288: 256 bytes of e2m1 pairs (8 bytes = 16 dims per
        # scale), then its 32 e4m3 scale bytes at +256
        row = blk.to(tl.int64) * stride0 + off.to(tl.int64) * 288
        a = tl.load(_chunk_ptrs(cache_u8, row, 0, 16, 8), mask=m3, other=0)
        c = tl.load(_chunk_ptrs(cache_u8, row, 128, 16, 8), mask=m3, other=0)
        ea = tl.load(_span_ptrs(cache_u8, row, 256, 16), mask=m2, other=0)
        ec = tl.load(_span_ptrs(cache_u8, row, 272, 16), mask=m2, other=0)
        b, eb, r, er = a, ea, c, ec
    elif FMT == 3:
        # MXFP8: token at blk*stride0 + off*528, its 16 scale bytes at +512 (one per 32 dims); the
        # values read as 16-bit words (byte offsets are even)
        row = blk.to(tl.int64) * stride0 + off.to(tl.int64) * 528
        a = tl.load(_chunk_ptrs(cache_16, row // 2, 0, 8, 16), mask=m3, other=0.0)
        c = tl.load(_chunk_ptrs(cache_16, row // 2, 128, 8, 16), mask=m3, other=0.0)
        ea = tl.load(_span_ptrs(cache_u8, row, 512, 8), mask=m2, other=0)
        ec = tl.load(_span_ptrs(cache_u8, row, 520, 8), mask=m2, other=0)
        b, eb, r, er = a, ea, c, ec
    else:
        t4 = tl.arange(0, 4)
        t2 = tl.arange(0, 2)
        c64 = tl.arange(0, 64)
        row = blk.to(tl.int64) * stride0 + off.to(tl.int64) * 512
        if FMT == 1:
            ptr = cache_16
        else:
            ptr = cache_u8
        a = tl.load(ptr + row[:, None, None] + (t4 * 64)[None, :, None] + c64[None, None, :], mask=m3, other=0)
        b = tl.load(ptr + row[:, None, None] + 256 + (t2 * 64)[None, :, None] + c64[None, None, :], mask=m3, other=0)
        c = tl.load(ptr + row[:, None] + 384 + c64[None, :], mask=m2, other=0)
        r = tl.load(ptr + row[:, None] + 448 + c64[None, :], mask=m2, other=0)
        ea = 0
        eb = 0
        ec = 0
        er = 0
    return a, b, c, r, ea, eb, ec, er


@triton.jit
def _exp_scale(e, exp_off, DT: tl.constexpr):
    """2^(byte-127) (halved for FNUZ bytes) as DT: the float32 whose exponent field is the byte."""
    return (tl.maximum(e.to(tl.int32) - exp_off, 0) << 23).to(tl.float32, bitcast=True).to(DT)


@triton.jit
def _e4m3(x, exp_off, DT: tl.constexpr, FNUZ: tl.constexpr):
    """e4m3 bytes as DT, read as OCP; FNUZ bytes (exp_off 1) are halved by the caller's scale.
    FNUZ 0x7F / 0xFF are ±240 but NaN in OCP, so they become ±480 here (±240 once halved); that
    fix-up (5 instructions per byte on AMD) is compiled only where a cache holds FNUZ bytes (FNUZ)."""
    f = x.to(tl.float8e4nv, bitcast=True).to(DT)
    if FNUZ:
        top = (exp_off > 0) & ((x & 0x7F) == 0x7F)
        f = tl.where(top, tl.where(x > 0x7F, -480.0, 480.0).to(DT), f)
    return f


@triton.jit
def _e2m1_as_e4m3(x, HIGH: tl.constexpr):
    """The e2m1 codes in the low (or ``HIGH``) nibbles of bytes x -> e4m3 bytes worth 2^-6 times
    their e2m1 value: e2m1's sign, 2 exponent bits (bias 1) and mantissa bit land on e4m3's sign,
    low exponent bits (bias 7) and top mantissa bit, so e2m1's subnormal 0.5 becomes e4m3's
    subnormal 2^-7 (exact). Nibbles are never joined back into dim order in registers (that gave
    wrong NVFP4 outputs compiled for sm_90 under Triton 3.6): each chunk holds one nibble of its
    bytes (``_chunk_dims``)."""
    if HIGH:
        code = x >> 4
    else:
        code = x & 0xF
    return ((code << 2) & 0x1C) | ((code << 4) & 0x80)


@triton.jit
def _byte_of_words(x, HIGH: tl.constexpr):
    """The low (or ``HIGH``) bytes of 16-bit words x (loaded as bf16) as uint8."""
    w = x.to(tl.int16, bitcast=True).to(tl.int32)
    if HIGH:
        w = w >> 8
    return (w & 0xFF).to(tl.uint8)


@triton.jit
def _dequant(x, e, kv_scale, exp_off, FMT: tl.constexpr, DT: tl.constexpr, GROUPED: tl.constexpr,
             FNUZ: tl.constexpr, F32_DECODE: tl.constexpr, HIGH: tl.constexpr):
    """One chunk to DT [N, dims]. ``GROUPED``: x comes in groups [N, k, w] sharing a scale e [N, k]
    (else x [N, w], e [N]). V4 / MXFP8: e4m3 * 2^(byte-127) per group of 64 / 32 dims; NVFP4: e2m1
    * e4m3 scale per 16 dims (w = 16 dims, one byte each); BF16: as is; FP8_TENSOR: e4m3 * kv_scale.
    ``F32_DECODE``: V4 / MXFP8 bytes go to fp32, are scaled there and rounded to DT once (gfx950
    converts e4m3 -> fp32 and fp32 -> bf16 in hardware, while a bf16 product is an fp32 multiply
    and a software round, 5 instructions per element); else they are converted to DT and scaled
    in DT (fewer instructions where those conversions are software, gfx942). Both are exact:
    e4m3 times a power of two is a bf16 value, e2m1 times an e4m3 scale too. ``HIGH``: which half
    of each NVFP4 byte / paired MXFP8 word the chunk holds (``_chunk_dims``)."""
    if FMT == 3:
        x = _byte_of_words(x, HIGH)
    if FMT == 0 or FMT == 3:
        if F32_DECODE:
            f = _e4m3(x, exp_off, tl.float32, FNUZ)
            if GROUPED:
                y = (f * _exp_scale(e, exp_off, tl.float32)[:, :, None]).to(DT)
            else:
                y = (f * _exp_scale(e, exp_off, tl.float32)[:, None]).to(DT)
        else:
            f = _e4m3(x, exp_off, DT, FNUZ)
            if GROUPED:
                y = f * _exp_scale(e, exp_off, DT)[:, :, None]
            else:
                y = f * _exp_scale(e, exp_off, DT)[:, None]
    elif FMT == 4:
        # 64 = 2^6 undoes _e2m1_as_e4m3's factor (448 * 64 still fits fp16)
        f = _e2m1_as_e4m3(x, HIGH).to(tl.float8e4nv, bitcast=True)
        if F32_DECODE:
            y = (f.to(tl.float32) * (e.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0)[:, :, None]).to(DT)
        else:
            y = f.to(DT) * (e.to(tl.float8e4nv, bitcast=True).to(DT) * 64.0)[:, :, None]
    elif FMT == 1:
        y = x.to(DT)
    else:
        sc = kv_scale * tl.where(exp_off > 0, 0.5, 1.0)
        y = (_e4m3(x, exp_off, tl.float32, FNUZ) * sc).to(DT)
    if GROUPED:
        y = tl.reshape(y, (y.shape[0], y.shape[1] * y.shape[2]))
    return y


@triton.jit
def _attend_tile(qa, qb, qc, qr, raw, valid, m_i, l_i, acc_a, acc_b, acc_c, acc_r, qk_scale, kv_scale, exp_off,
                 scr_p, scr_a, FMT: tl.constexpr, DT: tl.constexpr, P_SCRATCH: tl.constexpr, FNUZ: tl.constexpr,
                 F32_DECODE: tl.constexpr):
    a, b, c, r, ea, eb, ec, er = raw
    BLOCK_N: tl.constexpr = a.shape[0]
    BLOCK_H: tl.constexpr = qa.shape[0]
    GROUPED_CR: tl.constexpr = FMT >= 3  # V4.1 records: chunks c and r come in groups too
    # Each chunk is dequantized right before its score dot (only one chunk's registers live).
    # s = Q·Kᵀ [BLOCK_H, BLOCK_N]; the shared-memory K chunks are the B operands of both dots.
    # The four chunk dots are summed, not chained through the accumulator: a dot feeding a dot
    # makes Triton give it all warps along M, i.e. every warpgroup would compute the whole score
    # tile (the multiplies by the scale also stop Triton folding the sum back into a chain).
    if FMT == 0:
        kr = r.to(DT)
    else:
        kr = _dequant(r, er, kv_scale, exp_off, FMT, DT, GROUPED_CR, FNUZ, F32_DECODE, True)
    s = tl.dot(qr, tl.trans(kr)) * qk_scale
    ka = _dequant(a, ea, kv_scale, exp_off, FMT, DT, True, FNUZ, F32_DECODE, False)
    s += tl.dot(qa, tl.trans(ka)) * qk_scale
    kb = _dequant(b, eb, kv_scale, exp_off, FMT, DT, True, FNUZ, F32_DECODE, True)
    s += tl.dot(qb, tl.trans(kb)) * qk_scale
    kc = _dequant(c, ec, kv_scale, exp_off, FMT, DT, GROUPED_CR, FNUZ, F32_DECODE, False)
    s += tl.dot(qc, tl.trans(kc)) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if P_SCRATCH:
        # P and alpha take a round trip through this program's scratch (L1/L2): Triton then sees
        # no dot chained on the score dots and lays Q·Kᵀ out over both warpgroups (each computes
        # half the keys) instead of computing it twice, once per warpgroup.
        ptr_p = scr_p + tl.arange(0, BLOCK_H)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        ptr_a = scr_a + tl.arange(0, BLOCK_H)
        tl.store(ptr_p, p.to(DT))
        tl.store(ptr_a, alpha)
        tl.debug_barrier()
        pd = tl.load(ptr_p)
        alpha = tl.load(ptr_a)
    else:
        pd = p.to(DT)
    acc_a = tl.dot(pd, ka, acc_a * alpha[:, None])
    acc_b = tl.dot(pd, kb, acc_b * alpha[:, None])
    acc_c = tl.dot(pd, kc, acc_c * alpha[:, None])
    acc_r = tl.dot(pd, kr, acc_r * alpha[:, None])
    return m_new, l_i, acc_a, acc_b, acc_c, acc_r


@triton.jit
def _walk(g0, g1, tiles_a, a_rows, len_a, a_slots, b_rows, len_b, b_slots, visible, bt_row, bt_cols, b_blocks,
          A_U8, A_16, a_stride0, a_bs, a_exp_off, B_U8, B_16, b_stride0, b_bs, b_exp_off,
          qa, qb, qc, qr, m_i, l_i, acc_a, acc_b, acc_c, acc_r, qk_scale, kv_scale, scr_p, scr_a,
          FMT: tl.constexpr, COMP: tl.constexpr, SCOPE: tl.constexpr, RANGE_CHECKS: tl.constexpr,
          BLOCK_N: tl.constexpr, DT: tl.constexpr, P_SCRATCH: tl.constexpr, A_SHIFT: tl.constexpr,
          B_SHIFT: tl.constexpr, FNUZ: tl.constexpr, F32_DECODE: tl.constexpr):
    """The online softmax over global tiles [g0, g1) read in record FMT (tiles < tiles_a are SWA
    tiles, the others compressed ones); returns (m, l, acc_a, acc_b, acc_c, acc_r) updated.
    SCOPE 0: tiles of both caches (one record), base pointers chosen per tile; 1: SWA tiles only
    (give COMP 0); 2: compressed tiles only. A_SHIFT / B_SHIFT: log2 of each cache's block size
    (-1: not a power of two), so a slot splits into block and row with a shift and a mask (``_divmod``)."""
    BLOCK_H: tl.constexpr = qa.shape[0]
    # slots of the first tile; each iteration prefetches the next tile's slots (index loads and
    # the top-k block-table lookup leave the critical path)
    slots, valid, is_a = _tile_slots(g0, tiles_a, g1, a_rows, len_a, a_slots, b_rows, len_b, b_slots, visible, bt_row,
                                     bt_cols, b_bs, b_blocks, COMP, RANGE_CHECKS, BLOCK_N, B_SHIFT)
    for g in range(g0, g1):
        slots_n, valid_n, is_a_n = _tile_slots(g + 1, tiles_a, g1, a_rows, len_a, a_slots, b_rows, len_b, b_slots,
                                               visible, bt_row, bt_cols, b_bs, b_blocks, COMP, RANGE_CHECKS, BLOCK_N,
                                               B_SHIFT)
        if COMP == 0 or SCOPE == 1:
            raw = _load_kv_raw(A_U8, A_16, a_stride0, a_bs, slots, valid, FMT, BLOCK_N, A_SHIFT)
            exp_off = a_exp_off
        elif SCOPE == 2:
            raw = _load_kv_raw(B_U8, B_16, b_stride0, b_bs, slots, valid, FMT, BLOCK_N, B_SHIFT)
            exp_off = b_exp_off
        else:
            raw = _load_kv_raw(tl.where(is_a, A_U8, B_U8), tl.where(is_a, A_16, B_16),
                               tl.where(is_a, a_stride0, b_stride0), tl.where(is_a, a_bs, b_bs), slots, valid,
                               FMT, BLOCK_N, A_SHIFT if A_SHIFT == B_SHIFT else -1)
            exp_off = tl.where(is_a, a_exp_off, b_exp_off)
        par = g % 2
        m_i, l_i, acc_a, acc_b, acc_c, acc_r = _attend_tile(
            qa, qb, qc, qr, raw, valid, m_i, l_i, acc_a, acc_b, acc_c, acc_r, qk_scale, kv_scale, exp_off,
            scr_p + par * (BLOCK_H * BLOCK_N), scr_a + par * BLOCK_H, FMT, DT, P_SCRATCH, FNUZ, F32_DECODE)
        slots = slots_n
        valid = valid_n
        is_a = is_a_n
    return m_i, l_i, acc_a, acc_b, acc_c, acc_r


@triton.jit
def _store_rows(row_ptrs, k: tl.constexpr, val, hmask, PAIRED: tl.constexpr):
    d = _chunk_dims(k, PAIRED)
    tl.store(row_ptrs[:, None] + d[None, :], val, mask=hmask[:, None])


@triton.jit
def _sink_inverse(m, lsum, SINK, h, hmask, HAS_SINK: tl.constexpr):
    """Per head ``h`` of a finished (m, l) (m in log2 units, fp32 [BLOCK_H] each): 1 / (l +
    exp2(sink2 - m)), 0 where no key was valid. With :func:`_lse`, the Gluon kernels'
    ``hopper._normalizer`` in Triton's language (two helpers: each runs where the kernels need it,
    the LSE only where it is stored)."""
    denom = lsum
    if HAS_SINK:
        sink2 = tl.load(SINK + h, mask=hmask, other=float("-inf")) * 1.4426950408889634
        denom = lsum + tl.exp2(sink2 - m)
    has = lsum != 0.0  # no valid key: 0 (a NaN l, from a NaN key, stays visible)
    return tl.where(has, 1.0 / tl.where(has, denom, 1.0), 0.0)


@triton.jit
def _lse(m, lsum):
    """The LSE (natural log, sink excluded) of a finished (m, l), -inf where no key was valid."""
    has = lsum != 0.0
    return tl.where(has, (m + tl.log2(tl.where(has, lsum, 1.0))) * 0.6931471805599453, float("-inf"))


@triton.jit(do_not_specialize=("split",))  # per step: no variant per split value (== 1, % 16 == 0)
def sparse_mla_fwd_kernel(
    Q, stride_qt, stride_qh,
    O, stride_ot, stride_oh,
    LSE, stride_lt,
    SINK,
    # scope A: SWA rows (global slots) into cache A of a_slots slots; rows a_width wide
    A_U8, A_16, a_stride0, a_bs, a_slots, A_ROWS, stride_ar, A_LENS, a_width,
    # scope B: compressed rows (global slots, or C4A local positions) into cache B
    B_U8, B_16, b_stride0, b_bs, b_slots, B_ROWS, stride_br, B_LENS,
    # top-k translation: the ratio's block table (bt_cols columns of ids < b_blocks), token -> request,
    # positions; b_width = compressed row width
    BT, stride_bt, bt_cols, b_blocks, TOK2REQ, POS, b_width,
    # split partials: PO fp32 [T, SPLIT, H, 512], PML fp32 [T, SPLIT, H, 2], PU int32 [T] the
    # partials each token wrote (splits [0, PU[t]))
    PO, PML, PU,
    # per-program scratch for P (DT [grid, 2, BLOCK_H, BLOCK_N]) and alpha (fp32 [grid, 2, BLOCK_H])
    SCR_P, SCR_A,
    num_heads, qk_scale, kv_scale, split, a_exp_off, b_exp_off,
    FMT_A: tl.constexpr, FMT_B: tl.constexpr, COMP: tl.constexpr, C4A_RATIO: tl.constexpr,
    HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr,
    IS_SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
    P_SCRATCH: tl.constexpr, RANGE_CHECKS: tl.constexpr, A_SHIFT: tl.constexpr, B_SHIFT: tl.constexpr,
    FNUZ: tl.constexpr, F32_DECODE: tl.constexpr,
):
    pid = tl.program_id(0)
    n_hb = tl.cdiv(num_heads, BLOCK_H)
    # split index fastest, then head block: programs sharing a token's rows run together (L2 reuse)
    sp = pid % split
    hb = (pid // split) % n_hb
    t = pid // (split * n_hb)
    t64 = t.to(tl.int64)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < num_heads
    q_row = Q + t64 * stride_qt + h.to(tl.int64) * stride_qh
    # V4.1 records (MXFP8, NVFP4) keep q, o and the accumulators in the pair order of their bytes
    PAIRED: tl.constexpr = FMT_A >= 3
    qa = tl.load(q_row[:, None] + _chunk_dims(0, PAIRED)[None, :], mask=hmask[:, None], other=0.0).to(DT)
    qb = tl.load(q_row[:, None] + _chunk_dims(1, PAIRED)[None, :], mask=hmask[:, None], other=0.0).to(DT)
    qc = tl.load(q_row[:, None] + _chunk_dims(2, PAIRED)[None, :], mask=hmask[:, None], other=0.0).to(DT)
    qr = tl.load(q_row[:, None] + _chunk_dims(3, PAIRED)[None, :], mask=hmask[:, None], other=0.0).to(DT)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros(qa.shape, tl.float32)
    acc_b = tl.zeros(qb.shape, tl.float32)
    acc_c = tl.zeros(qc.shape, tl.float32)
    acc_r = tl.zeros(qr.shape, tl.float32)

    # ---- key ranges of this token: tiles [0, tiles_a) SWA, then [tiles_a, +tiles_b) compressed
    len_a = tl.load(A_LENS + t)
    len_b = 0
    visible = 0
    req = 0
    if COMP == 1:
        len_b = tl.load(B_LENS + t)
    if COMP == 2:
        req = tl.load(TOK2REQ + t)
        pos = tl.load(POS + t)
        # int64 positions: cap before the int32 cast (2**31 - 1 wraps negative past it; C1A's ratio is 1)
        visible = tl.minimum((pos + 1) // C4A_RATIO, 2147483647).to(tl.int32)
        len_b = tl.where(req >= 0, tl.minimum(visible, b_width), 0)
        req = tl.maximum(req, 0)
    if RANGE_CHECKS:  # a length never reaches past its row (nor below 0)
        len_a = tl.minimum(tl.maximum(len_a, 0), a_width)
        len_b = tl.minimum(tl.maximum(len_b, 0), b_width)
    tiles_a = tl.cdiv(len_a, BLOCK_N)
    tiles = tiles_a + tl.cdiv(len_b, BLOCK_N)
    used = 1  # programs of this token with keys (split partials it writes)
    if IS_SPLIT:
        per, used = split_ranges(tiles, split)
        lo = sp * per
        hi = tl.minimum(lo + per, tiles)
    else:
        lo = 0
        hi = tiles
    a_rows = A_ROWS + t64 * stride_ar
    b_rows = B_ROWS + t64 * stride_br
    bt_row = BT + req.to(tl.int64) * stride_bt  # type: ignore[attr-defined]  # req starts as the Python 0 the JIT turns into a scalar tensor
    scr_p = SCR_P + pid.to(tl.int64) * (2 * BLOCK_H * BLOCK_N)
    scr_a = SCR_A + pid.to(tl.int64) * (2 * BLOCK_H)

    # each scope's tiles read in its cache's record: one walk when both caches share a record, else
    # (nvfp4_ds_mla) the SWA tiles, then the compressed tiles, through one online softmax
    if FMT_A == FMT_B:
        m_i, l_i, acc_a, acc_b, acc_c, acc_r = _walk(
            lo, hi, tiles_a, a_rows, len_a, a_slots, b_rows, len_b, b_slots, visible, bt_row, bt_cols, b_blocks,
            A_U8, A_16, a_stride0, a_bs, a_exp_off, B_U8, B_16, b_stride0, b_bs, b_exp_off,
            qa, qb, qc, qr, m_i, l_i, acc_a, acc_b, acc_c, acc_r, qk_scale, kv_scale, scr_p, scr_a,
            FMT_A, COMP, 0, RANGE_CHECKS, BLOCK_N, DT, P_SCRATCH, A_SHIFT, B_SHIFT, FNUZ, F32_DECODE)
    else:
        m_i, l_i, acc_a, acc_b, acc_c, acc_r = _walk(
            lo, tl.minimum(hi, tiles_a), tiles_a, a_rows, len_a, a_slots, b_rows, len_b, b_slots, visible, bt_row,
            bt_cols, b_blocks, A_U8, A_16, a_stride0, a_bs, a_exp_off, B_U8, B_16, b_stride0, b_bs, b_exp_off,
            qa, qb, qc, qr, m_i, l_i, acc_a, acc_b, acc_c, acc_r, qk_scale, kv_scale, scr_p, scr_a,
            FMT_A, 0, 1, RANGE_CHECKS, BLOCK_N, DT, P_SCRATCH, A_SHIFT, B_SHIFT, FNUZ, F32_DECODE)
        m_i, l_i, acc_a, acc_b, acc_c, acc_r = _walk(
            tl.maximum(lo, tiles_a), hi, tiles_a, a_rows, len_a, a_slots, b_rows, len_b, b_slots, visible, bt_row,
            bt_cols, b_blocks, A_U8, A_16, a_stride0, a_bs, a_exp_off, B_U8, B_16, b_stride0, b_bs, b_exp_off,
            qa, qb, qc, qr, m_i, l_i, acc_a, acc_b, acc_c, acc_r, qk_scale, kv_scale, scr_p, scr_a,
            FMT_B, COMP, 2, RANGE_CHECKS, BLOCK_N, DT, P_SCRATCH, A_SHIFT, B_SHIFT, FNUZ, F32_DECODE)

    if not IS_SPLIT:
        inv = _sink_inverse(m_i, l_i, SINK, h, hmask, HAS_SINK)
        o_row = O + t64 * stride_ot + h.to(tl.int64) * stride_oh
        _store_rows(o_row, 0, (acc_a * inv[:, None]).to(O.dtype.element_ty), hmask, PAIRED)
        _store_rows(o_row, 1, (acc_b * inv[:, None]).to(O.dtype.element_ty), hmask, PAIRED)
        _store_rows(o_row, 2, (acc_c * inv[:, None]).to(O.dtype.element_ty), hmask, PAIRED)
        _store_rows(o_row, 3, (acc_r * inv[:, None]).to(O.dtype.element_ty), hmask, PAIRED)
        if WRITE_LSE:
            tl.store(LSE + t64 * stride_lt + h, _lse(m_i, l_i), mask=hmask)
    elif sp < used:  # a program past the token's keys writes nothing (the merge reads [0, used))
        part = (t64 * split + sp) * num_heads + h.to(tl.int64)
        po_row = PO + part * 512
        _store_rows(po_row, 0, acc_a, hmask, PAIRED)
        _store_rows(po_row, 1, acc_b, hmask, PAIRED)
        _store_rows(po_row, 2, acc_c, hmask, PAIRED)
        _store_rows(po_row, 3, acc_r, hmask, PAIRED)
        tl.store(PML + part * 2, m_i, mask=hmask)
        tl.store(PML + part * 2 + 1, l_i, mask=hmask)
        if sp + hb == 0:
            tl.store(PU + t, used)


@triton.jit
def split_ranges(tiles, split):
    """(tiles per split program, programs with keys) of a token of ``tiles`` key tiles over ``split``
    programs: program s takes tiles [s * per, (s + 1) * per); at least one program (it writes the
    empty partial of a token without keys)."""
    per = tl.maximum(tl.cdiv(tiles, split), 1)
    return per, tl.maximum(tl.cdiv(tiles, per), 1)


@triton.jit
def _partial(PO, t, i, split, used, h, hmask, d, num_heads):
    """Split ``i``'s partial acc [BH, BD] of heads ``h``, dims ``d`` (0 for i >= used: not written)."""
    p = (t * split + i) * num_heads + h.to(tl.int64)
    # [BH] int1, the split's comparison made per head: Triton 3.9's interpreter refuses the mask
    # ``(hmask & (i < used))[:, None]`` (a scalar comparison broadcast by ``&``: "unsupported dtype")
    written = hmask & (h * 0 + i < used)
    return tl.load(PO + p[:, None] * 512 + d[None, :], mask=written[:, None], other=0.0)


@triton.jit
def _column(w, s, i):
    """Column ``i`` of w [BH, SP] (lanes ``s``) as [BH, 1], picked in registers (no reload)."""
    return tl.sum(tl.where(s[None, :] == i, w, 0.0), 1)[:, None]


@triton.jit(do_not_specialize=("split",))  # per step: one variant per SPLIT_P2, not per split value
def combine_kernel(
    PO, PML, PU, O, stride_ot, stride_oh, LSE, stride_lt, SINK, num_heads, split,
    SPLIT_P2: tl.constexpr, HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    """Merge the PU[t] <= split partials (acc, m, l) a token wrote: o = Σ w_s acc_s / (Σ w_s l_s +
    exp2(sink2 - M)), w_s = exp2(m_s - M). Grid: (T, cdiv(H, BLOCK_H), 512 // BLOCK_D). At small
    batches its time is dependent round trips to L2, so the (m, l) of every split are loaded with
    PU (before ``used`` is known; those past it are then dropped) and the partials CHUNK splits per
    round trip (``ops.combine_chunk``: 1 or 4), weighted by their column of (m, l)'s weights. With PDL
    (a programmatic dependent launch after the attention kernel, ``ops.pdl_launches``) it may start
    before the partials are written: it waits for the previous kernel before any load or store,
    and lets the next kernel launch early (that one waits for this one the same way)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    hmask = h < num_heads
    used = tl.load(PU + t)
    s = tl.arange(0, SPLIT_P2)
    part = (t * split + s[None, :]) * num_heads + h[:, None].to(tl.int64)  # [BH, SP]
    pm = hmask[:, None] & (s[None, :] < split)  # inside the workspace; splits >= used: dropped below
    live = s[None, :] < used
    m = tl.where(live, tl.load(PML + part * 2, mask=pm, other=-1.0e30), -1.0e30)
    l = tl.where(live, tl.load(PML + part * 2 + 1, mask=pm, other=0.0), 0.0)
    m_max = tl.max(m, 1)
    w = tl.exp2(m - m_max[:, None])
    l_sum = tl.sum(w * l, 1)
    inv = _sink_inverse(m_max, l_sum, SINK, h, hmask, HAS_SINK)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(0, used, CHUNK):
        a0 = _partial(PO, t, i, split, used, h, hmask, d, num_heads)
        if CHUNK == 4:  # 4 partials loaded before any is used (one round trip), weights picked from w
            a1 = _partial(PO, t, i + 1, split, used, h, hmask, d, num_heads)
            a2 = _partial(PO, t, i + 2, split, used, h, hmask, d, num_heads)
            a3 = _partial(PO, t, i + 3, split, used, h, hmask, d, num_heads)
            acc += a0 * _column(w, s, i) + a1 * _column(w, s, i + 1) + a2 * _column(w, s, i + 2) \
                + a3 * _column(w, s, i + 3)
        else:  # its weight reloaded (L2), not picked: no pass over w per split (AMD: up to 304 splits)
            m_i = tl.load(PML + ((t * split + i) * num_heads + h.to(tl.int64)) * 2, mask=hmask, other=-1.0e30)
            acc += a0 * tl.exp2(m_i - m_max)[:, None]
    o = acc * inv[:, None]
    tl.store(O + t * stride_ot + h[:, None].to(tl.int64) * stride_oh + d[None, :],
             o.to(O.dtype.element_ty), mask=hmask[:, None])
    if WRITE_LSE:
        if tl.program_id(2) == 0:
            tl.store(LSE + t * stride_lt + h, _lse(m_max, l_sum), mask=hmask)
