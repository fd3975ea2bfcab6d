"""Hopper (sm_90) Gluon kernel for unsplit 64-head launches (prefill), with the two consumer
warpgroups on DIFFERENT key tiles ("key-tile ping-pong", FlashMLA's SM90 prefill schedule).

Same argument contract and producer as ``hopper.sparse_mla_fwd_hopper`` (one program = one token x 64
heads; V4 records in OCP e4m3), unsplit only (``ops.prefill_pingpong`` picks it). Why a second
consumer schedule (notes/perf-prefill.md): in the 64-head kernel both consumer warpgroups work on
the SAME key tile (Q·Kᵀ split over the keys, N = 32 each, so both read all of q from shared memory;
the row max reduced across them; P through shared memory; P·V split over the dims), one phase after
the other: H100 ablations put its consumer alone (producer loading nothing) at 0.73x FlashMLA's raw
prefill op, its producer alone at 0.85-0.91x. Here:

* warpgroup w (``_consumer_tile``, ME = w; 0 is the default partition, 1 a worker) takes the key
  tiles lo + 2j + w (K stage w): Q·Kᵀ over its whole tile (N = 64: q read once per tile), the online
  softmax of its tile, then P·V into ITS half of the 512 dims (``acc`` [64, 256]) for its own tile
  (P from registers) and for the other warpgroup's tile (P through shared memory);
* per pair of tiles the running max is chained (warpgroup 0 publishes max(m, its tile's max),
  warpgroup 1 adds its tile's and publishes the pair's max), so both exponentiate and accumulate
  against one max; the row sums are added at the end;
* the producer (``_producer_pairs``: ``hopper``'s gathers and dequantization) fills the pair's two
  K stages in HALVES of the dims, each released separately (``kempty`` [stage * 2 + half], counting
  both warpgroups): a pair holds both stages until its last P·V, but the half a warpgroup's own P·V
  reads of its own tile is free before that, so the next pair's first halves are written while
  the current pair runs (FlashMLA releases its stages the same way). An odd tile count ends with an
  empty tile (every key invalid).

While one warpgroup runs its softmax the other's matrix products use the tensor cores. Every wgmma
is retired before the next mbarrier wait (hopper.py: C7515). Each warpgroup writes its half of the
output rows (bf16, normalized) and warpgroup 0 the LSE.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import compat
from .hopper import (
    BLOCK_H,
    PRODUCER_REGS,
    _chunk_ptrs,
    _dequant,
    _idx_load,
    _idx_resolve,
    _normalizer,
    _opaque_zero,
    _prefetch_l2,
    _row_ptrs,
    _token_tiles,
)

NUM_WARPS = 4  # the default partition: consumer warpgroup 0; workers: consumer warpgroup 1, the producer
CONSUMER_REGS = gl.constexpr(192)
MAXNREG = 168  # 12 warps x 32 threads x 168 <= 64K registers: each consumer 192, the producer 120


@gluon.jit
def _sync_wgmma(a, b, acc, use_acc: gl.constexpr = True):
    """acc (+)= a·b, retired before returning (no wgmma stays in flight across the mbarrier waits
    that follow: ptxas serializes every wgmma otherwise, hopper.py)."""
    acc = warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _signal(bar):
    """Every thread of this warpgroup is past its shared-memory writes, then one arrive on ``bar``."""
    compat.barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _consumer_tile(ME: gl.constexpr, q_smem, k_smem, p_smem, m_smem, l_smem, vflag, kready, kempty, bq, bm, bp, bl,
                   Q, stride_qt, stride_qh, O, stride_ot, stride_oh, LSE, stride_lt, SINK, t64, hb, num_heads,
                   qk_scale, lo, hi, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr, BH: gl.constexpr,
                   BN: gl.constexpr):
    """Consumer warpgroup ``ME`` (0 or 1): its half of q into shared memory, then per pair j of key
    tiles its tile lo + 2j + ME (K stage ME) and dims [ME*256, ME*256 + 256) of the output; at the end
    its half of the normalized output rows (warpgroup 0: and the LSE)."""
    DH: gl.constexpr = 256
    Lq: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # [BH, 256] q rows
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DH, 16])
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    Lsc: gl.constexpr = gl.SliceLayout(0, s_layout)
    Lsr: gl.constexpr = gl.SliceLayout(1, s_layout)
    Lor: gl.constexpr = gl.SliceLayout(1, o_layout)
    Loc: gl.constexpr = gl.SliceLayout(0, o_layout)
    OTHER: gl.constexpr = 1 - ME
    d0: gl.constexpr = ME * DH

    # q: each warpgroup stores its half of the dims, both wait for the whole (bq counts 2)
    h_q = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, Lq))
    d_q = d0 + gl.arange(0, DH, layout=gl.SliceLayout(0, Lq))
    q = gl.load(Q + t64 * stride_qt + gl.expand_dims(h_q.to(gl.int64) * stride_qh, 1) + gl.expand_dims(d_q, 0),
                mask=gl.expand_dims(h_q < num_heads, 1), other=0.0)
    q_smem.index(0).slice(d0, DH, dim=1).store(q.to(gl.float16))  # exact (hopper.py: q as it is)
    fence_async_shared()
    _signal(bq)
    mbarrier.wait(bq, 0)

    m_i = gl.full([BH], -1.0e30, gl.float32, layout=Lsr)
    l_i = gl.zeros([BH], gl.float32, layout=Lsr)
    acc = gl.zeros([BH, DH], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BH, BN], gl.float32, layout=s_layout)
    for j in range(0, gl.cdiv(hi - lo, 2)):
        ph = j & 1
        # pair j is tiles lo + 2j (K stage 0) and lo + 2j + 1 (stage 1); the warpgroups swap stages
        # every pair: a stage index that varies in the loop keeps the wgmma descriptors in the loop
        # (hoisted, the worker warpgroup's 64 of them spilled ~600 B)
        mine = (j + ME) & 1
        k_mine = k_smem.index(mine)
        k_other = k_smem.index(1 - mine)
        mbarrier.wait(kready.index(mine), ph)
        q_cur = q_smem.index(_opaque_zero(j))  # q's descriptors in the loop too (see above)
        s = _sync_wgmma(q_cur, k_mine.permute((1, 0)), s_zero, use_acc=False)  # q·k unscaled
        _signal(kempty.index(2 * mine + OTHER))  # done with its tile's other half (the other's P·V reads it)
        valid = vflag.index(mine).load(Lsc) != 0
        s = gl.where(gl.expand_dims(valid, 0), s, float("-inf"))
        tile_max = gl.max(s, axis=1) * qk_scale
        # the pair's max, chained: warpgroup 0 publishes max(m, its tile's), warpgroup 1 adds its
        # tile's and publishes the result, which both use
        if ME == 0:
            m_smem.index(0).store(gl.maximum(m_i, tile_max))
            _signal(bm.index(0))
            mbarrier.wait(bm.index(1), ph)
            m_new = m_smem.index(1).load(Lsr)
        else:
            mbarrier.wait(bm.index(0), ph)
            m_new = gl.maximum(m_smem.index(0).load(Lsr), tile_max)
            m_smem.index(1).store(m_new)
            _signal(bm.index(1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1)).to(gl.float16)
        l_i = l_i * alpha + gl.sum(p.to(gl.float32), axis=1)
        m_i = m_new
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, Lor), 1)
        p_smem.index(ME).store(p)  # the other warpgroup's A operand for its dims
        fence_async_shared()
        _signal(bp.index(ME))
        acc = _sync_wgmma(gl.convert_layout(p, p_op), k_mine.slice(d0, DH, dim=1), acc)
        _signal(kempty.index(2 * mine + ME))  # done with its own tile
        mbarrier.wait(bp.index(OTHER), ph)
        # the other tile's half this warpgroup never reads (not before the other warpgroup is past
        # its previous pair: it signalled bp after that)
        _signal(kempty.index(2 * (1 - mine) + OTHER))
        acc = _sync_wgmma(p_smem.index(OTHER), k_other.slice(d0, DH, dim=1), acc)
        _signal(kempty.index(2 * (1 - mine) + ME))

    # both warpgroups hold the same max; the row sum is theirs added
    l_smem.index(ME).store(l_i)
    _signal(bl)
    mbarrier.wait(bl, 0)
    l_tot = l_i + l_smem.index(OTHER).load(Lsr)
    h_o = hb * BH + gl.arange(0, BH, layout=Lor)
    hmask = h_o < num_heads
    inv, lse = _normalizer(gl.convert_layout(m_i, Lor), gl.convert_layout(l_tot, Lor), SINK, h_o, hmask, HAS_SINK)
    d_o = d0 + gl.arange(0, DH, layout=Loc)
    # stored from the MMA layout (4-byte stores): a layout change would need shared memory, all of
    # it in use inside the warp-specialized region
    o_ptr = O + t64 * stride_ot + gl.expand_dims(h_o.to(gl.int64) * stride_oh, 1) + gl.expand_dims(d_o, 0)
    gl.store(o_ptr, (acc * gl.expand_dims(inv, 1)).to(gl.bfloat16), mask=gl.expand_dims(hmask, 1))
    if WRITE_LSE and ME == 0:
        gl.store(LSE + t64 * stride_lt + h_o, lse, mask=hmask)


@gluon.jit
def _tile_rows(g, tiles_a, hi, a_rows, len_a, b_rows, len_b, A_U8, B_U8, a_stride0, b_stride0, a_bs, b_bs, a_slots,
               b_slots, visible, bt_row, bt_cols, b_blocks, A_SHIFT: gl.constexpr, B_SHIFT: gl.constexpr,
               COMP: gl.constexpr, RANGE_CHECKS: gl.constexpr, BN: gl.constexpr, Lrow: gl.constexpr):
    """Tile ``g``'s row pointers (576 data bytes, scale bytes) and validity (``hopper``'s index
    stages), pulled into L2."""
    v, r = _idx_load(g, tiles_a, hi, a_rows, len_a, b_rows, len_b, COMP, BN, Lrow)
    slots, valid = _idx_resolve(g, tiles_a, v, r, a_slots, b_slots, visible, bt_row, bt_cols, b_bs, b_blocks,
                                B_SHIFT, COMP, RANGE_CHECKS)
    row, srow = _row_ptrs(g, slots, tiles_a, A_U8, B_U8, a_stride0, b_stride0, a_bs, b_bs, A_SHIFT, B_SHIFT)
    _prefetch_l2(row, srow)
    return row, srow, valid


@gluon.jit
def _load_half(row, srow, valid, HI: gl.constexpr, rope_buf, L3: gl.constexpr, Lr: gl.constexpr):
    """The e4m3 bytes of dims [256 HI, 256 HI + 256) of a tile's rows into registers (low half:
    chunks 0-3; high half: chunks 4-6, the RoPE values with cp.async into ``rope_buf``) and the scale
    word of their chunks."""
    valid3 = valid
    e = gl.load(srow.to(gl.pointer_type(gl.int32), bitcast=True) + HI, mask=valid, other=0)
    ptrs, m = _chunk_ptrs(row, valid3, 4 * HI, 2, L3)
    x0 = gl.load(ptrs, mask=m, other=0)
    if HI:
        ptrs, m = _chunk_ptrs(row, valid3, 6, 1, L3)
        x1 = gl.load(ptrs, mask=m, other=0)
        row_r = gl.convert_layout(row, gl.SliceLayout(1, Lr))
        valid_r = gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, Lr)), 1)
        rptr = gl.expand_dims(row_r + 448, 1).to(gl.pointer_type(gl.bfloat16), bitcast=True) \
            + gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, Lr)), 0)
        compat.async_load(rope_buf, rptr, mask=valid_r)
        async_copy.commit_group()
    else:
        ptrs, m = _chunk_ptrs(row, valid3, 2, 2, L3)
        x1 = gl.load(ptrs, mask=m, other=0)
    return x0, x1, e


@gluon.jit
def _store_half(k_buf, x0, x1, e, HI: gl.constexpr, rope_buf, BN: gl.constexpr, Lr: gl.constexpr):
    """Dequantize a half loaded by ``_load_half`` into its dims of the fp16 K tile ``k_buf``."""
    if HI:
        k_buf.slice(256, 128, dim=1).store(_dequant(x0, e, 0, BN))
        k_buf.slice(384, 64, dim=1).store(_dequant(x1, e, 2, BN))
        async_copy.wait_group(0)
        k_buf.slice(448, 64, dim=1).store(rope_buf.load(Lr).to(gl.float16))
    else:
        k_buf.slice(0, 128, dim=1).store(_dequant(x0, e, 0, BN))
        k_buf.slice(128, 128, dim=1).store(_dequant(x1, e, 2, BN))


@gluon.jit
def _tile_ready(vflag_buf, valid, bar):
    """Both halves of a K stage written: its validity flags, then ``kready``."""
    vflag_buf.store(valid.to(gl.int8))
    fence_async_shared()
    compat.barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _fill_pair(A_HI_FIRST: gl.constexpr, ph, k_smem, vflag, rope, kready, kempty, row_a, srow_a, valid_a, row_b,
               srow_b, valid_b, BN: gl.constexpr, L3: gl.constexpr, Lr: gl.constexpr):
    """Tiles A (K stage 0) and B (stage 1) of a pair, in halves, each half once the consumers have
    released it (``kempty`` [stage * 2 + half], phase parity ``ph``): A's early half, B's early half
    (the other one: of the previous pair, stage 0's low half is free after consumer 0's own P·V when
    it owned stage 0, its high half after consumer 1's own P·V otherwise, ``A_HI_FIRST``), then
    A's late half and B's. At most two halves' bytes in registers; each half's bytes are loaded
    before the wait of the half before it."""
    A_E: gl.constexpr = 1 if A_HI_FIRST else 0
    B_E: gl.constexpr = 1 - A_E
    a0, a1, ae = _load_half(row_a, srow_a, valid_a, A_E, rope.index(0), L3, Lr)
    b0, b1, be = _load_half(row_b, srow_b, valid_b, B_E, rope.index(1), L3, Lr)
    mbarrier.wait(kempty.index(A_E), ph)
    _store_half(k_smem.index(0), a0, a1, ae, A_E, rope.index(0), BN, Lr)
    a0, a1, ae = _load_half(row_a, srow_a, valid_a, 1 - A_E, rope.index(0), L3, Lr)
    mbarrier.wait(kempty.index(2 + B_E), ph)
    _store_half(k_smem.index(1), b0, b1, be, B_E, rope.index(1), BN, Lr)
    b0, b1, be = _load_half(row_b, srow_b, valid_b, 1 - B_E, rope.index(1), L3, Lr)
    mbarrier.wait(kempty.index(1 - A_E), ph)
    _store_half(k_smem.index(0), a0, a1, ae, 1 - A_E, rope.index(0), BN, Lr)
    _tile_ready(vflag.index(0), valid_a, kready.index(0))
    mbarrier.wait(kempty.index(2 + 1 - B_E), ph)
    _store_half(k_smem.index(1), b0, b1, be, 1 - B_E, rope.index(1), BN, Lr)
    _tile_ready(vflag.index(1), valid_b, kready.index(1))


@gluon.jit
def _producer_pairs(k_smem, vflag, rope, kready, kempty, A_U8, a_stride0, a_bs, a_slots, a_rows, len_a, B_U8,
                    b_stride0, b_bs, b_slots, b_rows, len_b, bt_row, bt_cols, b_blocks, visible, lo, hi, tiles_a,
                    A_SHIFT: gl.constexpr, B_SHIFT: gl.constexpr, COMP: gl.constexpr, BN: gl.constexpr,
                    RANGE_CHECKS: gl.constexpr):
    """Producer warpgroup: the key tiles in pairs (lo + 2p into K stage 0, lo + 2p + 1 into stage 1,
    tiles >= hi empty), each in two halves of the dims released separately (``_fill_pair``); the
    next pair's rows are resolved (and pulled into L2) while this pair's load."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 1, 4], [4, 1, 1], [2, 1, 0])  # [BN, n, 64] e4m3 bytes
    Lr: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # [BN, 64] bf16
    Lrow: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    row_a, srow_a, valid_a = _tile_rows(lo, tiles_a, hi, a_rows, len_a, b_rows, len_b, A_U8, B_U8, a_stride0,
                                        b_stride0, a_bs, b_bs, a_slots, b_slots, visible, bt_row, bt_cols, b_blocks,
                                        A_SHIFT, B_SHIFT, COMP, RANGE_CHECKS, BN, Lrow)
    row_b, srow_b, valid_b = _tile_rows(lo + 1, tiles_a, hi, a_rows, len_a, b_rows, len_b, A_U8, B_U8, a_stride0,
                                        b_stride0, a_bs, b_bs, a_slots, b_slots, visible, bt_row, bt_cols, b_blocks,
                                        A_SHIFT, B_SHIFT, COMP, RANGE_CHECKS, BN, Lrow)
    for p in range(0, gl.cdiv(hi - lo, 2)):
        ph = (p & 1) ^ 1  # the previous pair's release (passes at once for p = 0)
        # stage 0 was consumer 0's in pair p - 1 when p - 1 is even: its low half frees first
        if (p & 1) == 1:
            _fill_pair(False, ph, k_smem, vflag, rope, kready, kempty, row_a, srow_a, valid_a, row_b, srow_b,
                       valid_b, BN, L3, Lr)
        else:
            _fill_pair(True, ph, k_smem, vflag, rope, kready, kempty, row_a, srow_a, valid_a, row_b, srow_b,
                       valid_b, BN, L3, Lr)
        g = lo + 2 * p + 2
        row_a, srow_a, valid_a = _tile_rows(g, tiles_a, hi, a_rows, len_a, b_rows, len_b, A_U8, B_U8, a_stride0,
                                            b_stride0, a_bs, b_bs, a_slots, b_slots, visible, bt_row, bt_cols,
                                            b_blocks, A_SHIFT, B_SHIFT, COMP, RANGE_CHECKS, BN, Lrow)
        row_b, srow_b, valid_b = _tile_rows(g + 1, tiles_a, hi, a_rows, len_a, b_rows, len_b, A_U8, B_U8, a_stride0,
                                            b_stride0, a_bs, b_bs, a_slots, b_slots, visible, bt_row, bt_cols,
                                            b_blocks, A_SHIFT, B_SHIFT, COMP, RANGE_CHECKS, BN, Lrow)


@gluon.jit
def sparse_mla_fwd_hopper_prefill(
    Q, stride_qt, stride_qh,
    O, stride_ot, stride_oh,
    LSE, stride_lt,
    SINK,
    A_U8, a_stride0, a_bs, a_slots, A_ROWS, stride_ar, A_LENS, a_width,
    B_U8, b_stride0, b_bs, b_slots, B_ROWS, stride_br, B_LENS,
    BT, stride_bt, bt_cols, b_blocks, TOK2REQ, POS, b_width,
    PO, PML, CNT, PU,
    num_heads, qk_scale, split,
    COMP: gl.constexpr, C4A_RATIO: gl.constexpr, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr,
    IS_SPLIT: gl.constexpr, BN: gl.constexpr = 64, A_SHIFT: gl.constexpr = -1, B_SHIFT: gl.constexpr = -1,
    RANGE_CHECKS: gl.constexpr = True, MERGE_IN_KERNEL: gl.constexpr = False, PINGPONG: gl.constexpr = True,
):
    """``hopper.sparse_mla_fwd_hopper``'s arguments (the split's ``PO``/``PML``/``CNT``/``PU`` unused:
    unsplit launches only); ``PINGPONG`` names this kernel in a launch's constexprs
    (``build.hopper_kernel``)."""
    gl.static_assert(not IS_SPLIT, "hopper_prefill: unsplit launches only (ops.prefill_pingpong)")
    gl.static_assert(BN == 64, "hopper_prefill: 64-key tiles")
    BH: gl.constexpr = BLOCK_H
    q_smem = gl.allocate_shared_memory(gl.float16, [1, BH, 512],  # [1, ...]: _opaque_zero
                                       gl.NVMMASharedLayout.get_default_for([BH, 512], gl.float16))
    k_smem = gl.allocate_shared_memory(gl.float16, [2, BN, 512],
                                       gl.NVMMASharedLayout.get_default_for([BN, 512], gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [2, BH, BN],
                                       gl.NVMMASharedLayout.get_default_for([BH, BN], gl.float16))
    rope = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64],
                                     gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    vflag = gl.allocate_shared_memory(gl.int8, [2, BN], flat)
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BH], flat)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, BH], flat)
    kready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kempty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # [stage * 2 + dims half]
    bm = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bp = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bq = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bl = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kready.index(i), count=1)
        mbarrier.init(kempty.index(2 * i), count=2)  # both consumer warpgroups
        mbarrier.init(kempty.index(2 * i + 1), count=2)
        mbarrier.init(bm.index(i), count=1)
        mbarrier.init(bp.index(i), count=1)
    mbarrier.init(bq, count=2)
    mbarrier.init(bl, count=2)

    t, t64, sp, hb, a_rows, b_rows, len_a, len_b, visible, bt_row, tiles_a, lo, hi, used = _token_tiles(
        split, gl.cdiv(num_heads, BH), A_ROWS, stride_ar, A_LENS, a_width, B_ROWS, stride_br, B_LENS, BT, stride_bt,
        bt_cols, b_bs, TOK2REQ, POS, b_width, COMP, C4A_RATIO, IS_SPLIT, RANGE_CHECKS, BN)

    gl.warp_specialize([
        (_consumer_tile, (0, q_smem, k_smem, p_smem, m_smem, l_smem, vflag, kready, kempty, bq, bm, bp, bl, Q,
                          stride_qt, stride_qh, O, stride_ot, stride_oh, LSE, stride_lt, SINK, t64, hb, num_heads,
                          qk_scale, lo, hi, HAS_SINK, WRITE_LSE, BH, BN)),
        (_consumer_tile, (1, q_smem, k_smem, p_smem, m_smem, l_smem, vflag, kready, kempty, bq, bm, bp, bl, Q,
                          stride_qt, stride_qh, O, stride_ot, stride_oh, LSE, stride_lt, SINK, t64, hb, num_heads,
                          qk_scale, lo, hi, HAS_SINK, WRITE_LSE, BH, BN)),
        (_producer_pairs, (k_smem, vflag, rope, kready, kempty, A_U8, a_stride0, a_bs, a_slots, a_rows, len_a, B_U8,
                           b_stride0, b_bs, b_slots, b_rows, len_b, bt_row, bt_cols, b_blocks, visible, lo, hi,
                           tiles_a, A_SHIFT, B_SHIFT, COMP, BN, RANGE_CHECKS)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
