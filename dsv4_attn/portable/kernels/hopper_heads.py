"""Hopper (sm_90) Gluon kernel for few query heads (up to 16: what one rank of V4-Flash / V4-Pro
runs under tensor parallelism 8): the heads on the MMA N dimension, two CTAs per SM.

Same math, argument contract and producer as ``hopper.sparse_mla_fwd_hopper``, which puts the
heads on wgmma's M dimension: M is at least 64, so with 8 heads 7/8 of its Q·Kᵀ and P·V rows are
padding, its two consumer warpgroups hold a [64, 512] fp32 accumulator and its q buffer is 64 KB.
Here the products are transposed (swap AB), NH = 8 or 16 heads per program:

* Sᵀ [64 keys, NH] = K · Qᵀ (A: the fp16 K tile in shared memory, B: q [NH, 512] transposed);
  the online softmax runs along the keys (axis 0); Pᵀ goes through shared memory as [NH, 64];
* Oᵀ [512, NH] += Vᵀ · Pᵀ (A: the same K tile, transposed view; 8 repetitions of M = 64).

One consumer warpgroup (the default partition) holds 512 x NH / 128 = 32-64 accumulator
registers. What decides the speed (notes/perf-wave5.md, ablations on the H100): at b = 64 the
producer's gathers run near the DRAM rate for such rows, and what is left is each program's fixed
chain (lengths -> index rows -> block table -> rows, then the partial stores and the merge), during
which the memory system idles when every SM runs one program. So this kernel trades the second K
stage for a second CTA per SM: ONE K stage (the producer gathers tile g+1 while the consumer works
on tile g, and dequantizes once the stage is free), 83-93 KB of shared memory and 128 registers
per thread (8 warps: consumer 136, producer 120), so two programs share each SM and one's chain
runs under the other's gathers; the launcher splits the keys for ``CTAS_PER_SM`` x SMs programs.

Chosen by ``ops.heads_on_n`` (KernelConfig.heads_on_n) for up to ``MAX_HEADS`` heads.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import compat
from .hopper import (
    _launch_dependents,
    _merge_if_last,
    _normalizer,
    _opaque_zero,
    _prefetch_index_rows,
    _producer,
    _split_range,
    _token_tiles,
    _wait_prior_grids,
)

MAX_HEADS = 16  # 32 heads' accumulator (128 registers) does not fit the consumer's 136
NUM_WARPS = 4  # the consumer (default) partition; the producer adds one warpgroup
PRODUCER_REGS = gl.constexpr(120)
MAXNREG = 128  # 2 CTAs x 8 warps x 32 threads x 128 = 64K registers: the consumer gets 136, the producer 120
CTAS_PER_SM = 2
# The token pair's overlap check (``_pair_offset``) reads 512 entries of each index row a pass: 4 a
# thread spread over the warps (a cross-warp reduction each pass), or 16 a thread in every warp
# (each warp holds a copy: the reduction stays inside it). Spread, it runs 3.5-7 % faster under
# Triton 3.6; under 3.8 its reduction, before warp_specialize, made ptxas spill 632-688 B and the
# pair launches 1.4-1.6x slower (H100, h8-c128a s_q 2 at 64-256 pairs; notes/perf-wave6.md). Under
# 3.9 both spill ~250 B and run within 5 % of each other; auto takes no pairs there.
PAIR_CHECK_PER_THREAD = gl.constexpr(4 if triton.__version__.startswith("3.6.") else 16)


def heads_per_program(num_heads: int) -> int:
    """NH, the heads one program computes (wgmma N: 8 or 16) for ``num_heads`` <= MAX_HEADS."""
    return max(8, min(MAX_HEADS, 1 << max(0, num_heads - 1).bit_length()))


@gluon.jit
def _columns(t64, hb, num_heads, num_tokens, stride_t, stride_h, NH: gl.constexpr, PAIR: gl.constexpr,
             layout: gl.constexpr):
    """Per column of a program's NH (wgmma N): its head, its row offset ``token * stride_t + head *
    stride_h`` (int64) and whether it is a real (token, head). One token: heads hb * NH + c. A token
    pair (PAIR): columns [0, NH/2) token t64's heads, [NH/2, NH) token t64 + 1's."""
    c = gl.arange(0, NH, layout=layout)
    if PAIR:
        head = c % (NH // 2)
        tok = t64 + (c // (NH // 2))
        return head, tok * stride_t + head.to(gl.int64) * stride_h, (head < num_heads) & (tok < num_tokens)
    else:
        head = hb * NH + c
        return head, t64 * stride_t + head.to(gl.int64) * stride_h, head < num_heads


@gluon.jit
def _consumer_heads_n(q_smem, k_smem, p_smem, vflag, kready, kempty, Q, stride_qt, stride_qh, t64, hb, num_heads,
                      num_tokens, qk_scale, lo, hi, NH: gl.constexpr, BN: gl.constexpr, PAIR: gl.constexpr):
    """The consumer warpgroup: q into shared memory, then per key tile Sᵀ = K·Qᵀ, the online softmax
    along the keys, Pᵀ through shared memory, Oᵀ += Vᵀ·Pᵀ, the K stage handed back. Returns (accᵀ
    [512, NH], m [NH], l [NH]). With PAIR a key counts for a column where its token's validity bit
    is set (``hopper._pair_scope``)."""
    Lq: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # [NH, 512] q rows
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
    Lkey: gl.constexpr = gl.SliceLayout(1, mma)
    Lh: gl.constexpr = gl.SliceLayout(0, mma)
    _, q_off, q_live = _columns(t64, hb, num_heads, num_tokens, stride_qt, stride_qh, NH, PAIR,
                                gl.SliceLayout(1, Lq))
    d_q = gl.arange(0, 512, layout=gl.SliceLayout(0, Lq))
    q = gl.load(Q + gl.expand_dims(q_off, 1) + gl.expand_dims(d_q, 0), mask=gl.expand_dims(q_live, 1), other=0.0)
    bit = gl.where(gl.arange(0, NH, layout=Lh) < NH // 2, 1, 2)  # PAIR: the column's token's validity bit
    q_smem.store(q.to(gl.float16))  # exact (hopper.py: the scale goes on the fp32 scores)
    fence_async_shared()
    compat.barrier()

    m_i = gl.full([NH], -1.0e30, gl.float32, layout=Lh)
    l_i = gl.zeros([NH], gl.float32, layout=Lh)
    acc = gl.zeros([512, NH], gl.float32, layout=mma)
    s_zero = gl.zeros([BN, NH], gl.float32, layout=mma)
    for g in range(lo, hi):
        i = g - lo
        mbarrier.wait(kready.index(0), i & 1)
        # the one K stage through an index the compiler cannot fold: its 64 wgmma descriptors are
        # then made in the loop; as loop invariants Triton 3.9 hoisted them and ptxas spilled 35,
        # reloaded every tile (16 heads: 1.12-1.26x slower; notes/perf-gather.md, session 39)
        k_cur = k_smem.index(_opaque_zero(i))
        s = warpgroup_mma(k_cur, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))  # kᵀq unscaled, [BN, NH]
        if PAIR:
            flags = vflag.index(0).load(Lkey).to(gl.int32)
            s = gl.where((gl.expand_dims(flags, 1) & gl.expand_dims(bit, 0)) != 0, s, float("-inf"))
        else:
            valid = vflag.index(0).load(Lkey) != 0
            s = gl.where(gl.expand_dims(valid, 1), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 0))
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))  # [NH, BN]: keys contiguous, a K-major B
        fence_async_shared()
        compat.barrier()
        acc = warpgroup_mma(k_cur.permute((1, 0)), p_smem.permute((1, 0)), acc * gl.expand_dims(alpha, 0),
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # retired per tile (hopper.py: C7515)
        compat.barrier()
        mbarrier.arrive(kempty.index(0), count=1)
    return acc, m_i, l_i


@gluon.jit
def _pair_offset(rows0, rows1, n0, n1, width, WINDOW: gl.constexpr):
    """Where token 1's list starts in a token pair's shared key list: ``off`` (a window: n0 + 1 - n1,
    the next position's window ends one later; compressed rows: 0, they share their start) where
    that shares every overlapping entry (rows0[j] == rows1[j - off] for the j both name) and
    0 <= off <= 1, else n0 (token 1's entries after token 0's: nothing shared, still exact). Both
    index rows are in L2 (prefetched with the lengths)."""
    L1d: gl.constexpr = gl.BlockedLayout([PAIR_CHECK_PER_THREAD], [32], [gl.num_warps()], [0])
    j0 = gl.arange(0, 512, layout=L1d)
    if WINDOW:
        off = n0 + 1 - n1
    else:
        off = n0 * 0
    differs = ((off < 0) | (off > 1)).to(gl.int32)
    for c0 in range(0, gl.minimum(n0, width), 512):  # past n0 nothing overlaps
        j = c0 + j0
        both = (j < n0) & (j - off >= 0) & (j - off < n1)
        e0 = gl.load(rows0 + j, mask=both, other=0)
        e1 = gl.load(rows1 + (j - off), mask=both, other=0)
        differs += gl.sum((e0 != e1).to(gl.int32), axis=0)
    return gl.where(differs == 0, off, n0)


@gluon.jit
def _pair_tiles(split, num_tokens, A_ROWS, stride_ar, A_LENS, a_width, B_ROWS, stride_br, B_LENS, b_width,
                COMP: gl.constexpr, IS_SPLIT: gl.constexpr, RANGE_CHECKS: gl.constexpr, BN: gl.constexpr,
                PDL: gl.constexpr):
    """``_token_tiles`` of a token pair's program (tokens t, t + 1; window and global compressed
    rows, COMP 0 / 1): the two tokens' index rows and lengths, where token 1's list starts in the
    shared key list of each scope (``_pair_offset``: a window of the next position starts one
    later and ends one later; compressed rows share their start), its tiles (SWA first) and this
    split's [lo, hi)."""
    pid = gl.program_id(0)
    sp = pid % split
    t = (pid // split) * 2
    t1 = gl.minimum(t + 1, num_tokens - 1)  # an odd last token pairs with itself, masked out below
    has1 = t + 1 < num_tokens
    t64 = t.to(gl.int64)
    a_rows = A_ROWS + t64 * stride_ar
    b_rows = B_ROWS + t64 * stride_br
    a_rows1 = A_ROWS + t1.to(gl.int64) * stride_ar
    b_rows1 = B_ROWS + t1.to(gl.int64) * stride_br
    _launch_dependents(PDL)
    _prefetch_index_rows(a_rows, a_width, b_rows, b_width, COMP)
    _prefetch_index_rows(a_rows1, a_width, b_rows1, b_width, COMP)
    _wait_prior_grids(PDL)  # as _token_tiles: the prefetches before it, every load after it
    len_a = gl.load(A_LENS + t)
    len_a1 = gl.where(has1, gl.load(A_LENS + t1), 0)
    len_b = 0
    len_b1 = 0
    if COMP == 1:
        len_b = gl.load(B_LENS + t)
        len_b1 = gl.where(has1, gl.load(B_LENS + t1), 0)
    if RANGE_CHECKS:  # a length never reaches past its row (nor below 0)
        len_a = gl.minimum(gl.maximum(len_a, 0), a_width)
        len_a1 = gl.minimum(gl.maximum(len_a1, 0), a_width)
        len_b = gl.minimum(gl.maximum(len_b, 0), b_width)
        len_b1 = gl.minimum(gl.maximum(len_b1, 0), b_width)
    if COMP == 1:  # the C128A rows (max_model_len / 128 wide) to their lengths, as _token_tiles
        _prefetch_index_rows(b_rows, gl.minimum(len_b, b_width), b_rows, 0, 0)
        _prefetch_index_rows(b_rows1, gl.minimum(len_b1, b_width), b_rows1, 0, 0)
    off_a = _pair_offset(a_rows, a_rows1, len_a, len_a1, a_width, True)
    off_b = 0
    if COMP == 1:
        off_b = _pair_offset(b_rows, b_rows1, len_b, len_b1, b_width, False)
    tiles_a = gl.cdiv(gl.maximum(len_a, len_a1 + off_a), BN)
    lo, hi, used = _split_range(tiles_a + gl.cdiv(gl.maximum(len_b, len_b1 + off_b), BN), sp, split, IS_SPLIT)
    return (t, t64, sp, a_rows, b_rows, len_a, len_b, tiles_a, lo, hi, used, a_rows1, len_a1, off_a, b_rows1, len_b1,
            off_b, 1 + has1.to(gl.int32))


@gluon.jit(do_not_specialize=("split", "num_tokens"))  # per step: no variant per split value or token count
def sparse_mla_fwd_hopper_heads_n(
    Q, stride_qt, stride_qh,
    O, stride_ot, stride_oh,
    LSE, stride_lt,
    SINK,
    A_U8, a_stride0, a_bs, a_slots, A_ROWS, stride_ar, A_LENS, a_width,
    B_U8, b_stride0, b_bs, b_slots, B_ROWS, stride_br, B_LENS,
    BT, stride_bt, bt_cols, b_blocks, TOK2REQ, POS, b_width,
    PO, PML, CNT, PU,
    num_heads, qk_scale, split, num_tokens,
    COMP: gl.constexpr, C4A_RATIO: gl.constexpr, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr,
    IS_SPLIT: gl.constexpr, BN: gl.constexpr = 64, A_SHIFT: gl.constexpr = -1, B_SHIFT: gl.constexpr = -1,
    RANGE_CHECKS: gl.constexpr = True, MERGE_IN_KERNEL: gl.constexpr = False, NH: gl.constexpr = 16,
    PAIR: gl.constexpr = False, PDL: gl.constexpr = False,
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
    Lh: gl.constexpr = gl.SliceLayout(0, mma)
    # [512, NH] stores: 8 consecutive dims per thread (16-byte bf16 / 32-byte fp32 stores), a warp per head
    Lo: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [1, 4], [0, 1])

    # ---- shared memory: q, ONE K tile, Pᵀ, the RoPE buffer, tile validity, one mbarrier pair -------
    q_smem = gl.allocate_shared_memory(gl.float16, [NH, 512],
                                       gl.NVMMASharedLayout.get_default_for([NH, 512], gl.float16))
    k_smem = gl.allocate_shared_memory(gl.float16, [1, BN, 512],
                                       gl.NVMMASharedLayout.get_default_for([BN, 512], gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [NH, BN], gl.NVMMASharedLayout.get_default_for([NH, BN], gl.float16))
    rope = gl.allocate_shared_memory(gl.bfloat16, [1, BN, 64],
                                     gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    vflag = gl.allocate_shared_memory(gl.int8, [1, BN], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                                           order=[0]))
    kready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    kempty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kready.index(0), count=1)
    mbarrier.init(kempty.index(0), count=1)

    if PAIR:  # two tokens per program (columns [0, NH/2) and [NH/2, NH)), one head block
        n_hb = 1
        hb = 0
        bh = NH // 2
        visible = 0
        bt_row = BT
        (t, t64, sp, a_rows, b_rows, len_a, len_b, tiles_a, lo, hi, used, a_rows1, len_a1, off_a, b_rows1, len_b1,
         off_b, n_tok) = _pair_tiles(split, num_tokens, A_ROWS, stride_ar, A_LENS, a_width, B_ROWS, stride_br, B_LENS,
                                     b_width, COMP, IS_SPLIT, RANGE_CHECKS, BN, PDL)
    else:
        n_hb = gl.cdiv(num_heads, NH)
        bh = NH
        n_tok = 1
        t, t64, sp, hb, a_rows, b_rows, len_a, len_b, visible, bt_row, tiles_a, lo, hi, used = _token_tiles(
            split, n_hb, A_ROWS, stride_ar, A_LENS, a_width, B_ROWS, stride_br, B_LENS, BT, stride_bt, bt_cols, b_bs,
            TOK2REQ, POS, b_width, COMP, C4A_RATIO, IS_SPLIT, RANGE_CHECKS, BN, PDL)
        a_rows1, len_a1, off_a, b_rows1, len_b1, off_b = a_rows, len_a, 0, b_rows, len_b, 0

    acc, m_i, l_i = gl.warp_specialize([
        (_consumer_heads_n, (q_smem, k_smem, p_smem, vflag, kready, kempty, Q, stride_qt, stride_qh, t64, hb,
                             num_heads, num_tokens, qk_scale, lo, hi, NH, BN, PAIR)),
        (_producer, (k_smem, vflag, rope, kready, kempty, A_U8, a_stride0, a_bs, a_slots, a_rows, len_a, B_U8,
                     b_stride0, b_bs, b_slots, b_rows, len_b, bt_row, bt_cols, b_blocks, visible, lo, hi, tiles_a,
                     A_SHIFT, B_SHIFT, COMP, BN, RANGE_CHECKS, 1, a_rows1, len_a1, off_a, b_rows1, len_b1, off_b,
                     PAIR, PDL)),
    ], [4], [PRODUCER_REGS])

    # ---- epilogue: accᵀ [512, NH] -> out [NH, 512] (or the split's fp32 partial) -----------------
    # per column: its head, out row offset and whether it is real, in the MMA's column layout (_o) and
    # in the store layout (_s); a split partial's row: (token * split + sp) * num_heads + head
    h_o, tok_o, hmask_o = _columns(t64, hb, num_heads, num_tokens, split, 0, NH, PAIR, Lh)  # tok_o: token * split
    h_s, o_off, live_s = _columns(t64, hb, num_heads, num_tokens, stride_ot, stride_oh, NH, PAIR,
                                  gl.SliceLayout(0, Lo))
    d_s = gl.arange(0, 512, layout=gl.SliceLayout(1, Lo))
    hmask_s = gl.expand_dims(live_s, 0)
    if IS_SPLIT:
        if sp < used:  # a program past the token's keys writes nothing and does not arrive
            _, tok_s, _ = _columns(t64, hb, num_heads, num_tokens, split, 0, NH, PAIR, gl.SliceLayout(0, Lo))
            part = (tok_o + sp) * num_heads + h_o.to(gl.int64)
            part_s = (tok_s + sp) * num_heads + h_s.to(gl.int64)
            gl.store(PO + gl.expand_dims(part_s * 512, 0) + gl.expand_dims(d_s, 1), gl.convert_layout(acc, Lo),
                     mask=hmask_s)
            gl.store(PML + part * 2, m_i, mask=hmask_o)
            gl.store(PML + part * 2 + 1, l_i, mask=hmask_o)
            if MERGE_IN_KERNEL:
                _merge_if_last(PO, PML, O, stride_ot, stride_oh, LSE, stride_lt, SINK, CNT, t, t64, hb, n_hb,
                               num_heads, split, used, HAS_SINK, WRITE_LSE, bh, n_tok)
            else:
                # the token's ``used`` for the combine launch (it reads the partials [0, used)), by
                # its first program, from the column of each token's head 0 (a pair's program: two
                # tokens). A masked store over the columns, not hopper._finish_split's scalar one:
                # with that (or any scalar store outside this block) the 16-head variant spilled
                # 168 B under Triton 3.6 and ran 10-18 % slower on the H100 (notes/perf-gather.md)
                head_u, tok_u, live_u = _columns(t64, hb, num_heads, num_tokens, 1, 0, NH, PAIR, Lh)
                gl.store(PU + tok_u, gl.zeros_like(head_u) + used, mask=live_u & (head_u == 0) & (sp == 0))
    else:
        inv, lse = _normalizer(m_i, l_i, SINK, h_o, hmask_o, HAS_SINK)
        # scaled after the layout change, as the split path stores (scaling in the MMA layout first
        # spilled 528-688 B under Triton 3.6)
        inv_s = gl.convert_layout(inv, gl.SliceLayout(0, Lo))
        ob = (gl.convert_layout(acc, Lo) * gl.expand_dims(inv_s, 0)).to(gl.bfloat16)
        gl.store(O + gl.expand_dims(o_off, 0) + gl.expand_dims(d_s, 1), ob, mask=hmask_s)
        if WRITE_LSE:
            _, lse_off, _ = _columns(t64, hb, num_heads, num_tokens, stride_lt, 1, NH, PAIR, Lh)
            gl.store(LSE + lse_off, lse, mask=hmask_o)
