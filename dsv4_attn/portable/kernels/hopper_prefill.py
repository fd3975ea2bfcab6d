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
* the producer (``hopper._producer``, unchanged) fills the two K stages in turn; a stage is free
  once both warpgroups are past it (``kempty`` counts 2). An odd tile count ends with an empty
  tile (every key invalid: the producer's tiles past the token's lengths are).

While one warpgroup runs its softmax the other's matrix products use the tensor cores. Every wgmma
is retired before the next mbarrier wait (hopper.py: C7515). Each warpgroup writes its half of the
output rows (bf16, normalized) and warpgroup 0 the LSE.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import compat
from .hopper import BLOCK_H, PRODUCER_REGS, _normalizer, _producer, _token_tiles

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
def _opaque_zero(x):
    """0, which the compiler cannot see is 0 (``x`` any int32 scalar): a shared-memory view indexed
    by it is computed where it is used instead of hoisted out of the loop."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


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
        _signal(kempty.index(mine))  # this warpgroup is done with its own tile
        mbarrier.wait(bp.index(OTHER), ph)
        acc = _sync_wgmma(p_smem.index(OTHER), k_other.slice(d0, DH, dim=1), acc)
        _signal(kempty.index(1 - mine))

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
    kempty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bm = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bp = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bq = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bl = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kready.index(i), count=1)
        mbarrier.init(kempty.index(i), count=2)  # both consumer warpgroups
        mbarrier.init(bm.index(i), count=1)
        mbarrier.init(bp.index(i), count=1)
    mbarrier.init(bq, count=2)
    mbarrier.init(bl, count=2)

    t, t64, sp, hb, a_rows, b_rows, len_a, len_b, visible, bt_row, tiles_a, lo, hi, used = _token_tiles(
        split, gl.cdiv(num_heads, BH), A_ROWS, stride_ar, A_LENS, a_width, B_ROWS, stride_br, B_LENS, BT, stride_bt,
        bt_cols, b_bs, TOK2REQ, POS, b_width, COMP, C4A_RATIO, IS_SPLIT, RANGE_CHECKS, BN)
    hi2 = lo + 2 * gl.cdiv(hi - lo, 2)  # tiles in pairs; a last odd one pairs with an all-invalid tile

    gl.warp_specialize([
        (_consumer_tile, (0, q_smem, k_smem, p_smem, m_smem, l_smem, vflag, kready, kempty, bq, bm, bp, bl, Q,
                          stride_qt, stride_qh, O, stride_ot, stride_oh, LSE, stride_lt, SINK, t64, hb, num_heads,
                          qk_scale, lo, hi, HAS_SINK, WRITE_LSE, BH, BN)),
        (_consumer_tile, (1, q_smem, k_smem, p_smem, m_smem, l_smem, vflag, kready, kempty, bq, bm, bp, bl, Q,
                          stride_qt, stride_qh, O, stride_ot, stride_oh, LSE, stride_lt, SINK, t64, hb, num_heads,
                          qk_scale, lo, hi, HAS_SINK, WRITE_LSE, BH, BN)),
        (_producer, (k_smem, vflag, rope, kready, kempty, A_U8, a_stride0, a_bs, a_slots, a_rows, len_a, B_U8,
                     b_stride0, b_bs, b_slots, b_rows, len_b, bt_row, bt_cols, b_blocks, visible, lo, hi2, tiles_a,
                     A_SHIFT, B_SHIFT, COMP, BN, RANGE_CHECKS, 2, a_rows, len_a, 0, b_rows, len_b, 0, False)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
