"""Hopper (sm_90) fast path of the `triton` backend, written in Gluon (Triton's explicit-layout dialect).

Same math and the same argument contract as ``attention.sparse_mla_fwd_kernel`` (MODEL1_FP8
caches only), but with explicit shared memory, layouts and asynchronous copies, which the
portable kernel cannot express:

* the raw 584-byte rows of the NEXT key tile are gathered with ``cp.async`` into a two-stage
  shared-memory ring while the current tile is computed (no registers held for the prefetch);
* the current tile is dequantized from shared memory (e4m3 -> fp16 x 2^(byte-127) per 64-wide
  tile, bf16 RoPE -> fp16) straight into ONE [BLOCK_N, 512] fp16 K tile in shared memory, which
  is the B operand of both matrix products (Q·Kᵀ through a transposed view, P·V as is);
* both warpgroups split the key tile for Q·Kᵀ (no duplicated score computation) and the
  512 output dims for P·V; P goes through shared memory, never through global scratch;
* P·V of tile g runs asynchronously while tile g+1's copies are issued.

fp16 operands: e4m3 values and their power-of-two scales are exact in fp16 for every scale byte
the cache writers produce (>= 2^-22); q is RMS-normed (|q| <= sqrt(512)); bf16 RoPE values
round to fp16's 11-bit mantissa (finer than bf16's 8). Accumulation is fp32 throughout.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

BLOCK_H = gl.constexpr(64)
BLOCK_N = gl.constexpr(64)
NUM_WARPS = 8
NOPE_CHUNKS = gl.constexpr(7)  # 448 e4m3 bytes = 7 tiles of 64


@gluon.jit
def _idx_load(g, lo_b, hi, a_rows, len_a, b_rows, len_b, COMP: gl.constexpr, BN: gl.constexpr,
              layout: gl.constexpr):
    """Index pipeline, stage 1: row entries of global tile ``g`` (SWA slots for tiles < lo_b,
    compressed entries after: global slots or C4A local positions); tiles >= hi are empty."""
    live = g < hi
    j = gl.arange(0, BN, layout=layout)
    ja = g * BN + j
    ina = (ja < len_a) & (g < lo_b) & live
    val = gl.load(a_rows + ja, mask=ina, other=-1)
    inr = ina
    if COMP != 0:
        jb = (g - lo_b) * BN + j
        inb = (jb < len_b) & (g >= lo_b) & live
        vb = gl.load(b_rows + jb, mask=inb, other=-1)
        val = gl.where(g < lo_b, val, vb)
        inr = ina | inb
    return val, inr


@gluon.jit
def _idx_resolve(g, lo_b, val, inr, visible, bt_row, b_bs, COMP: gl.constexpr):
    """Index pipeline, stage 2: entries -> (slots, valid); C4A local positions -> global slots
    through the ratio-4 block table row (invalid: -1, >= visible, or past the row's length)."""
    valid = inr & (val >= 0)
    slots = val
    if COMP == 2:
        vb = valid & (val < visible)
        local = gl.where(vb, val, 0)
        col = local // b_bs
        blk = gl.load(bt_row + col, mask=vb & (g >= lo_b), other=0)
        sb = blk * b_bs + (local - col * b_bs)
        valid = gl.where(g < lo_b, valid, vb)
        slots = gl.where(g < lo_b, val, sb)
    return gl.where(valid, slots, 0), valid


@gluon.jit
def _issue_tile_copy(raw, rope, sc, stage, slots, valid, is_a, A_U8, B_U8, a_stride0, b_stride0, a_bs, b_bs,
                     BN: gl.constexpr, Lw: gl.constexpr, Lr: gl.constexpr):
    """cp.async the tile's rows into ``stage``: the 448 e4m3 bytes (one [BN, 512] copy, the last 64
    columns masked off), the 64 bf16 RoPE values and the 8 scale bytes. Three copies, each into
    its own buffer (no shared-memory hazards between them, so no barriers)."""
    base_ptr = gl.where(is_a, A_U8, B_U8)
    stride0 = gl.where(is_a, a_stride0, b_stride0)
    bs = gl.where(is_a, a_bs, b_bs)
    blk = slots // bs
    off = slots - blk * bs
    blk_base = blk.to(gl.int64) * stride0
    # 16-byte aligned rows (the launcher checks stride(0) % 16 == 0 and a 16-byte aligned base)
    row = gl.multiple_of(blk_base + off.to(gl.int64) * 576, 16)  # [BN] in SliceLayout(1, Lw)
    srow = gl.multiple_of(blk_base + bs * 576 + off.to(gl.int64) * 8, 8)
    c512 = gl.arange(0, 512, layout=gl.SliceLayout(0, Lw))
    m = gl.expand_dims(valid, 1) & gl.expand_dims(c512 < 448, 0)
    async_copy.async_copy_global_to_shared(raw.index(stage), base_ptr + gl.expand_dims(row, 1)
                                           + gl.expand_dims(c512, 0), mask=m)
    row_r = gl.convert_layout(row, gl.SliceLayout(1, Lr))
    valid_r = gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, Lr)), 1)
    c_r = gl.arange(0, 64, layout=gl.SliceLayout(0, Lr))
    rptr = (base_ptr + gl.expand_dims(row_r + 448, 1)).to(gl.pointer_type(gl.bfloat16), bitcast=True) \
        + gl.expand_dims(c_r, 0)
    async_copy.async_copy_global_to_shared(rope.index(stage), rptr, mask=valid_r)
    srow_r = gl.convert_layout(srow, gl.SliceLayout(1, Lr))
    c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, Lr))
    async_copy.async_copy_global_to_shared(sc.index(stage), base_ptr + gl.expand_dims(srow_r, 1)
                                           + gl.expand_dims(c8, 0), mask=valid_r)


@gluon.jit
def _dequant_half(raw_stage, sc_stage, exp_off, HALF: gl.constexpr, BN: gl.constexpr, Lw: gl.constexpr):
    """fp16 [BN, 256] of e4m3 columns [256*HALF, 256*HALF + 256) times their tiles' 2^(byte-127)."""
    x = raw_stage.slice(256 * HALF, 256, dim=1).load(Lw)
    x3 = gl.reshape(x.to(gl.float8e4nv, bitcast=True).to(gl.float16), [BN, 4, 64])
    e = sc_stage.slice(4 * HALF, 4, dim=1).load(gl.SliceLayout(2, x3.type.layout))
    scale = (gl.maximum(e.to(gl.int32) - exp_off, 0) << 23).to(gl.float32, bitcast=True).to(gl.float16)
    return gl.reshape(x3 * gl.expand_dims(scale, 2), [BN, 256])


@gluon.jit
def sparse_mla_fwd_hopper(
    Q, stride_qt, stride_qh,
    O, stride_ot, stride_oh,
    LSE, stride_lt,
    SINK,
    A_U8, a_stride0, a_bs, A_ROWS, stride_ar, A_LENS,
    B_U8, b_stride0, b_bs, B_ROWS, stride_br, B_LENS,
    BT, stride_bt, TOK2REQ, POS, b_width,
    PO, PML,
    num_heads, qk_scale, split, a_exp_off, b_exp_off,
    COMP: gl.constexpr, C4A_RATIO: gl.constexpr, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr,
    IS_SPLIT: gl.constexpr, BN: gl.constexpr = 64, STAGES: gl.constexpr = 2,
):
    BH: gl.constexpr = BLOCK_H
    TR: gl.constexpr = BN // 8  # rows of a tile per warp (8 warps)
    # ---- layouts ------------------------------------------------------------------------------
    Lw: gl.constexpr = gl.BlockedLayout([1, 16], [TR, 32 // TR], [8, 1], [1, 0])  # [BN, 256|512] bytes, 16 B vectors
    Lr: gl.constexpr = gl.BlockedLayout([1, 8], [TR, 32 // TR], [8, 1], [1, 0])  # [BN, 64] bf16 / [BN, 8] bytes
    Lq: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # [BH, 512] q rows
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BN // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    Lrow: gl.constexpr = gl.SliceLayout(1, Lw)
    Lsc: gl.constexpr = gl.SliceLayout(0, s_layout)
    Lsr: gl.constexpr = gl.SliceLayout(1, s_layout)
    Lor: gl.constexpr = gl.SliceLayout(1, o_layout)
    Loc: gl.constexpr = gl.SliceLayout(0, o_layout)

    # ---- shared memory ------------------------------------------------------------------------
    q_smem = gl.allocate_shared_memory(gl.float16, [BH, 512], gl.NVMMASharedLayout.get_default_for([BH, 512], gl.float16))
    k_smem = gl.allocate_shared_memory(gl.float16, [BN, 512], gl.NVMMASharedLayout.get_default_for([BN, 512], gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [BH, BN], gl.NVMMASharedLayout.get_default_for([BH, BN], gl.float16))
    raw = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 512],
                                    gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0]))
    rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 64],
                                     gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    vflag = gl.allocate_shared_memory(gl.int8, [STAGES, BN], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                                                order=[0]))
    sc = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 8], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                                                 order=[1, 0]))

    pid = gl.program_id(0)
    n_hb = gl.cdiv(num_heads, BH)
    sp = pid % split
    hb = (pid // split) % n_hb
    t = pid // (split * n_hb)
    t64 = t.to(gl.int64)

    # ---- key ranges ---------------------------------------------------------------------------
    len_a = gl.load(A_LENS + t)
    len_b = 0
    visible = 0
    req = 0
    if COMP == 1:
        len_b = gl.load(B_LENS + t)
    if COMP == 2:
        req = gl.load(TOK2REQ + t)
        pos = gl.load(POS + t)
        visible = ((pos + 1) // C4A_RATIO).to(gl.int32)
        len_b = gl.where(req >= 0, gl.minimum(visible, b_width), 0)
        req = gl.maximum(req, 0)
    tiles_a = gl.cdiv(len_a, BN)
    tiles = tiles_a + gl.cdiv(len_b, BN)
    if IS_SPLIT:
        per = gl.cdiv(tiles, split)
        lo = sp * per
        hi = gl.minimum(lo + per, tiles)
    else:
        lo = 0
        hi = tiles
    a_rows = A_ROWS + t64 * stride_ar
    b_rows = B_ROWS + t64 * stride_br
    bt_row = BT + req.to(gl.int64) * stride_bt

    # ---- prologue: q loads in flight first, then tiles lo .. lo+STAGES-2, then the index pipeline ----
    h_q = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, Lq))
    d_q = gl.arange(0, 512, layout=gl.SliceLayout(0, Lq))
    q = gl.load(Q + t64 * stride_qt + gl.expand_dims(h_q.to(gl.int64) * stride_qh, 1) + gl.expand_dims(d_q, 0),
                mask=gl.expand_dims(h_q < num_heads, 1), other=0.0)
    for i in gl.static_range(STAGES - 1):
        v0, r0 = _idx_load(lo + i, tiles_a, hi, a_rows, len_a, b_rows, len_b, COMP, BN, Lrow)
        slots0, valid0 = _idx_resolve(lo + i, tiles_a, v0, r0, visible, bt_row, b_bs, COMP)
        _issue_tile_copy(raw, rope, sc, i, slots0, valid0, lo + i < tiles_a, A_U8, B_U8, a_stride0, b_stride0,
                         a_bs, b_bs, BN, Lw, Lr)
        async_copy.commit_group()
        vflag.index(i).store(valid0.to(gl.int8))
    v_c, r_c = _idx_load(lo + STAGES - 1, tiles_a, hi, a_rows, len_a, b_rows, len_b, COMP, BN, Lrow)
    slots_c, valid_c = _idx_resolve(lo + STAGES - 1, tiles_a, v_c, r_c, visible, bt_row, b_bs, COMP)
    v_c, r_c = _idx_load(lo + STAGES, tiles_a, hi, a_rows, len_a, b_rows, len_b, COMP, BN, Lrow)

    q_smem.store(q.to(gl.float16))

    m_i = gl.full([BH], -1.0e30, gl.float32, layout=Lsr)
    l_i = gl.zeros([BH], gl.float32, layout=Lsr)
    acc = warpgroup_mma_init(gl.zeros([BH, 512], gl.float32, layout=o_layout))
    s_zero = gl.zeros([BH, BN], gl.float32, layout=s_layout)

    for g in range(lo, hi):
        stage = (g - lo) % STAGES
        # a. tile g+STAGES-1's copies go out (its stage held tile g-1, consumed before the last
        #    barrier of the previous iteration; its slots were resolved last iteration), tile
        #    g+STAGES's entries go through the block table and tile g+STAGES+1's entries start
        #    loading: every index load issued here is consumed one iteration later. The previous
        #    P·V keeps running meanwhile.
        nxt = (g - lo + STAGES - 1) % STAGES
        _issue_tile_copy(raw, rope, sc, nxt, slots_c, valid_c, g + STAGES - 1 < tiles_a, A_U8, B_U8, a_stride0,
                         b_stride0, a_bs, b_bs, BN, Lw, Lr)
        async_copy.commit_group()
        vflag.index(nxt).store(valid_c.to(gl.int8))
        slots_c, valid_c = _idx_resolve(g + STAGES, tiles_a, v_c, r_c, visible, bt_row, b_bs, COMP)
        v_c, r_c = _idx_load(g + STAGES + 1, tiles_a, hi, a_rows, len_a, b_rows, len_b, COMP, BN, Lrow)
        exp_off = gl.where(g < tiles_a, a_exp_off, b_exp_off)
        # b. this tile's rows have landed; the previous P·V has finished reading k_smem / p_smem
        async_copy.wait_group(STAGES - 1)
        acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        valid_s = vflag.index(stage).load(Lsc) != 0
        # c. dequantize into the fp16 K tile (two halves, then the RoPE columns over the masked tile 7)
        raw_st = raw.index(stage)
        sc_st = sc.index(stage)
        k_smem.slice(0, 256, dim=1).store(_dequant_half(raw_st, sc_st, exp_off, 0, BN, Lw))
        k_smem.slice(256, 256, dim=1).store(_dequant_half(raw_st, sc_st, exp_off, 1, BN, Lw))
        r = rope.index(stage).load(Lr)
        k_smem.slice(448, 64, dim=1).store(r.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        # d. scores: each warpgroup computes half of the key columns
        s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where(gl.expand_dims(valid_s, 0), s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_smem.store(p.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        # e. acc = acc * alpha + P·V, left running into the next iteration
        alpha_o = gl.convert_layout(alpha, Lor)
        acc = warpgroup_mma(p_smem, k_smem, acc_t * gl.expand_dims(alpha_o, 1), is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    # ---- epilogue ------------------------------------------------------------------------------
    h_o = hb * BH + gl.arange(0, BH, layout=Lor)
    d_o = gl.arange(0, 512, layout=Loc)
    hmask_o = h_o < num_heads
    m_o = gl.convert_layout(m_i, Lor)
    l_o = gl.convert_layout(l_i, Lor)
    if IS_SPLIT:
        part = (t64 * split + sp) * num_heads + h_o.to(gl.int64)
        gl.store(PO + gl.expand_dims(part * 512, 1) + gl.expand_dims(d_o, 0), acc, mask=gl.expand_dims(hmask_o, 1))
        gl.store(PML + part * 2, m_o, mask=hmask_o)
        gl.store(PML + part * 2 + 1, l_o, mask=hmask_o)
    else:
        denom = l_o
        if HAS_SINK:
            sink2 = gl.load(SINK + h_o, mask=hmask_o, other=float("-inf")) * 1.4426950408889634
            denom = l_o + gl.exp2(sink2 - m_o)
        has = l_o > 0.0
        inv = gl.where(has, 1.0 / gl.where(has, denom, 1.0), 0.0)
        o = acc * gl.expand_dims(inv, 1)
        # 16-byte coalesced stores (the MMA layout would give 4-byte ones)
        ob = gl.convert_layout(o.to(gl.bfloat16), Lq)
        h_s = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, Lq))
        d_s = gl.arange(0, 512, layout=gl.SliceLayout(0, Lq))
        o_ptr = O + t64 * stride_ot + gl.expand_dims(h_s.to(gl.int64) * stride_oh, 1) + gl.expand_dims(d_s, 0)
        gl.store(o_ptr, ob, mask=gl.expand_dims(h_s < num_heads, 1))
        if WRITE_LSE:
            lse = gl.where(has, (m_o + gl.log2(gl.where(has, l_o, 1.0))) * 0.6931471805599453, float("-inf"))
            gl.store(LSE + t64 * stride_lt + h_o, lse, mask=hmask_o)
