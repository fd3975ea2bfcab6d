"""Hopper (sm_90) fast path of the `triton` backend, written in Gluon (Triton's explicit-layout dialect).

Same math and the same argument contract as ``attention.sparse_mla_fwd_kernel`` (V4 records in
OCP e4m3 only: ``ops.kernel_choice`` sends the V4.1 records to ``hopper_records`` and FNUZ caches
to the portable kernel), but with explicit shared memory, layouts, mbarriers and warp specialization,
which the portable kernel cannot express. One program = one token x 64 heads (x key split):

* a PRODUCER warpgroup (``_producer``, 120 registers) walks the key tiles: resolves their rows
  (C4A local -> global slots through the block table) and pulls them into L2 one tile ahead,
  gathers the raw 584-byte rows (e4m3 bytes and scale words into registers, bf16 RoPE with
  ``cp.async``), dequantizes them (e4m3 -> fp16 x 2^(byte-127) per 64-wide tile, RoPE -> fp16)
  into one of TWO fp16 [64, 512] K tiles in shared memory and signals ``kready``;
* two CONSUMER warpgroups (``_consumer``, the default partition, 192 registers) wait for a K
  tile, compute Q·Kᵀ (each warpgroup half of the keys; K is the B operand of both products),
  the online softmax, P through shared memory and P·V (each warpgroup half of the 512 dims),
  then hand the K tile back (``kempty``). The producer's gathers and dequantization of tile
  g+1 run under the consumers' matrix products of tile g.

Before its lengths are known, the prologue pulls the token's index rows (and, once its request is
known, its block-table columns) into L2, so the first tile's index loads do not wait on DRAM.
Small batches split a token's keys over ``split`` programs writing fp32 partials; with
``MERGE_IN_KERNEL`` (``ops.merge_in_kernel``: up to 8 heads) the last of them to finish, found by
an arrival counter, merges them (``_merge_splits``) instead of a combine launch.

Pitfall (ptxas C7515, every wgmma serialized): an asynchronous P·V left running across the
next mbarrier wait; it is retired at the end of each tile instead.

fp16 operands: e4m3 values and their power-of-two scales are exact in fp16 for every scale byte
the cache writers produce (>= 2^-22); q (RMS-normed, |q| <= sqrt(512) times its gain) and the
bf16 RoPE values convert to fp16 exactly (fp16 has the finer mantissa) within fp16's range. The
softmax scale multiplies the fp32 scores; accumulation is fp32 throughout.

Index entries that name no row of their cache are skipped without being read, as in the
portable kernel (``RANGE_CHECKS``; docs/bad-input.md).
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

BLOCK_H = gl.constexpr(64)
NUM_WARPS = 8  # the consumer (default) partition; the producer adds one warpgroup
PRODUCER_REGS = gl.constexpr(120)
MAXNREG = 168  # 12 warps x 32 threads x 168 <= 64K registers: the consumers get 192, the producer 120


@gluon.jit
def _launch_dependents(PDL: gl.constexpr):
    """With PDL (the launch of the next kernel in the stream may be programmatic, ``ops.pdl_launches``):
    let it launch now; it waits for this grid's completion itself (griddepcontrol.wait) before it
    reads what this grid writes. A no-op where the next launch is an ordinary one."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _wait_prior_grids(PDL: gl.constexpr):
    """With PDL (this kernel may be launched before the previous kernel in the stream completes):
    wait until it has completed and its writes are visible. Every global load or store of a
    program comes after this; before it only address arithmetic, shared-memory setup and L2
    prefetch hints (no value reaches a register, and L2 is where every SM's stores land, so a
    line prefetched before the previous kernel writes it is updated in place). Returns at once
    for an ordinary launch."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _opaque_zero(x):
    """0, which the compiler cannot see is 0 (``x`` any int32 scalar): a shared-memory view indexed
    by it is computed where it is used instead of hoisted out of the loop."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


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
def _split_slot(slots, bs, shift, POW2: gl.constexpr):
    """(block, offset in block) of non-negative ``slots``: a shift and a mask when the block size
    ``bs`` is a power of two (= 2^shift), else the integer division (~20 instructions each)."""
    if POW2:
        return slots >> shift, slots & (bs - 1)
    else:
        blk = slots // bs
        return blk, slots - blk * bs


@gluon.jit
def _idx_resolve(g, lo_b, val, inr, a_slots, b_slots, visible, bt_row, bt_cols, b_bs, b_blocks,
                 B_SHIFT: gl.constexpr, COMP: gl.constexpr, RANGE_CHECKS: gl.constexpr):
    """Index pipeline, stage 2: entries -> (slots, valid); C4A local positions -> global slots
    through the ratio-4 block table row (invalid: -1, >= visible, or past the row's length).
    With RANGE_CHECKS an entry naming no row of its cache is invalid too: a slot outside
    [0, a_slots) / [0, b_slots), a top-k entry's block-table column >= bt_cols or a block id outside
    [0, b_blocks)."""
    if RANGE_CHECKS:
        # 0 <= val < this tile's bound in ONE unsigned compare (compressed entries of top-k layers
        # are local positions: visible ones only)
        if COMP == 0:
            cap = a_slots
        else:
            cap = gl.where(g < lo_b, a_slots, visible if COMP == 2 else b_slots)
        valid = inr & (val.to(gl.uint32, bitcast=True) < cap.to(gl.uint32))
    else:
        valid = inr & (val >= 0)
    slots = val
    if COMP == 2:
        vb = valid
        if not RANGE_CHECKS:
            vb = vb & (val < visible)
        local = gl.where(vb, val, 0)
        col, off = _split_slot(local, b_bs, B_SHIFT, B_SHIFT >= 0)
        if RANGE_CHECKS:
            vb = vb & (col < bt_cols)
        blk = gl.load(bt_row + col, mask=vb & (g >= lo_b), other=0)
        if RANGE_CHECKS:
            vb = vb & (blk.to(gl.uint32, bitcast=True) < b_blocks.to(gl.uint32))  # 0 <= blk < b_blocks
        sb = blk * b_bs + off
        valid = gl.where(g < lo_b, valid, vb)
        slots = gl.where(g < lo_b, val, sb)
    return gl.where(valid, slots, 0), valid


@gluon.jit
def _pair_scope(rows0, rows1, n0, n1, off1, jj, live, cap, RANGE_CHECKS: gl.constexpr):
    """One scope of a token pair's key list (``hopper_heads`` PAIR): at list position ``jj`` token 0
    names ``rows0[jj]`` (jj < n0), token 1 ``rows1[jj - off1]``; the row read is token 0's entry
    where it has one, else token 1's; validity bits: 1 token 0, 2 token 1 (where its entry is the
    row read: the prologue's check makes every overlap equal)."""
    in0 = (jj < n0) & live
    j1 = jj - off1
    in1 = (j1 >= 0) & (j1 < n1) & live
    e0 = gl.load(rows0 + jj, mask=in0, other=-1)
    e1 = gl.load(rows1 + j1, mask=in1, other=-1)
    val = gl.where(in0, e0, e1)
    if RANGE_CHECKS:
        ok = val.to(gl.uint32, bitcast=True) < cap.to(gl.uint32)
    else:
        ok = val >= 0
    code = (in0 & ok).to(gl.int32) | ((in1 & ok & (e1 == val)).to(gl.int32) << 1)
    return val, code


@gluon.jit
def _pair_idx(g, tiles_a, hi, a_rows, a_rows1, len_a, len_a1, off_a, a_slots, b_rows, b_rows1, len_b, len_b1, off_b,
              b_slots, COMP: gl.constexpr, RANGE_CHECKS: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    """Index stage of a token pair (SWA and global compressed rows only: no block table): global
    tile ``g``'s slots and validity bits (``_pair_scope``); tiles >= hi are empty."""
    live = g < hi
    j = gl.arange(0, BN, layout=layout)
    val, code = _pair_scope(a_rows, a_rows1, len_a, len_a1, off_a, g * BN + j, live & (g < tiles_a), a_slots,
                            RANGE_CHECKS)
    if COMP != 0:
        vb, cb = _pair_scope(b_rows, b_rows1, len_b, len_b1, off_b, (g - tiles_a) * BN + j, live & (g >= tiles_a),
                             b_slots, RANGE_CHECKS)
        val = gl.where(g < tiles_a, val, vb)
        code = gl.where(g < tiles_a, code, cb)
    return gl.where(code != 0, val, 0), code


@gluon.jit
def _row_ptrs(g, slots, tiles_a, A_U8, B_U8, a_stride0, b_stride0, a_bs, b_bs, A_SHIFT: gl.constexpr,
              B_SHIFT: gl.constexpr):
    """Pointers (u8) to tile ``g``'s rows' 576-byte data and to their 8 scale bytes; slot ->
    byte offsets in int64. Computed once per tile, for its L2 prefetch and its loads."""
    is_a = g < tiles_a
    stride0 = gl.where(is_a, a_stride0, b_stride0)
    bs = gl.where(is_a, a_bs, b_bs)
    blk, off = _split_slot(slots, bs, gl.where(is_a, A_SHIFT, B_SHIFT), A_SHIFT >= 0 and B_SHIFT >= 0)
    blk_base = blk.to(gl.int64) * stride0
    base_ptr = gl.where(is_a, A_U8, B_U8)
    # 16-byte aligned rows (the launcher checks stride(0) % 16 == 0 and a 16-byte aligned base)
    row = gl.multiple_of(blk_base + off.to(gl.int64) * 576, 16)
    srow = gl.multiple_of(blk_base + bs * 576 + off.to(gl.int64) * 8, 8)
    return base_ptr + row, base_ptr + srow


@gluon.jit
def _prefetch_l2(row_ptr, srow_ptr):
    """Pull rows (576 data bytes with one bulk prefetch each, and the line of their scale bytes)
    into L2: no registers or shared memory held, so the producer's loads of that tile one
    iteration later wait for L2 instead of DRAM."""
    gl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 576;\n\t"
                              "prefetch.global.L2 [$2];\n\tmov.b32 $0, 0;",
                              "=r,l,l", [row_ptr, srow_ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_lines_l2(ptrs, mask):
    """Pull the 128-byte lines holding ``ptrs`` into L2 (masked lanes: nothing); a hint, no
    registers held: the index rows and block-table row a key tile reads next wait for L2 instead of
    DRAM (a b <= 4 step is a chain of such dependent round trips)."""
    gl.inline_asm_elementwise("@$2 prefetch.global.L2 [$1];\n\tmov.b32 $0, 0;", "=r,l,b",
                              [ptrs, mask], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_index_rows(a_rows, a_width, b_rows, b_width, COMP: gl.constexpr):
    """L2 prefetch of a token's whole index rows (SWA slots, top-k entries), one line per thread,
    issued before the lengths that pick this program's tiles are known."""
    L1d: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    j = gl.arange(0, 256, layout=L1d)  # 256 lines: one per lane (8 warps) or two (4 warps)
    ja = gl.minimum(j * 32, a_width - 1)  # 32 int32 entries per line; the last line's tail too
    _prefetch_lines_l2(a_rows + gl.maximum(ja, 0), (j < 128) & (j * 32 < a_width + 31) & (a_width > 0))
    if COMP == 2:  # (an "all" kind's rows, max_model_len / 128 wide: after their length, _token_tiles)
        jb = gl.minimum((j - 128) * 32, b_width - 1)
        _prefetch_lines_l2(b_rows + gl.maximum(jb, 0), (j >= 128) & ((j - 128) * 32 < b_width + 31) & (b_width > 0))


@gluon.jit
def _prefetch_table_row(bt_row, visible, b_bs, bt_cols):
    """L2 prefetch of the block-table columns a top-k token can name (its visible compressed
    entries), up to 256 lines."""
    L1d: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    j = gl.arange(0, 256, layout=L1d)
    cols = gl.minimum(gl.cdiv(visible, b_bs), bt_cols)
    _prefetch_lines_l2(bt_row + gl.minimum(j * 32, gl.maximum(cols - 1, 0)), (j * 32 < cols + 31) & (cols > 0))


@gluon.jit
def _normalizer(m, lsum, SINK, h, hm, HAS_SINK: gl.constexpr):
    """Per head ``h``: 1 / (l + exp2(sink2 - m)) (0 where no key was valid) and the LSE (natural
    log, sink excluded, -inf where no key was valid) of a finished (m, l)."""
    denom = lsum
    if HAS_SINK:
        sink2 = gl.load(SINK + h, mask=hm, other=float("-inf")) * 1.4426950408889634
        denom = lsum + gl.exp2(sink2 - m)
    has = lsum != 0.0  # no valid key: 0 (a NaN l, from a NaN key, stays visible)
    inv = gl.where(has, 1.0 / gl.where(has, denom, 1.0), 0.0)
    lse = gl.where(has, (m + gl.log2(gl.where(has, lsum, 1.0))) * 0.6931471805599453, float("-inf"))
    return inv, lse


@gluon.jit
def _merge_if_last(PO, PML, O, stride_ot, stride_oh, LSE, stride_lt, SINK, CNT, t, t64, hb, n_hb, num_heads, split,
                   used, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr, BH: gl.constexpr, n_tok=1):
    """After this program's partial stores: the last of the token's ``used`` split programs with
    keys to get here merges them (no combine launch; programs past the keys never arrive). One
    acq_rel counter increment per program after a CTA-wide barrier: the release covers every
    thread's stores; the acquire, broadcast through the atomic's own barrier, orders the merge's
    L1-bypassing loads after the other programs' stores (the split-K semaphore pattern). CNT is
    zero before the launch and left zero after it: the last program resets its entry once it has
    merged. A program of ``n_tok`` tokens (a token pair: 2) counts on its first token's entry and
    merges each token."""
    compat.barrier()
    cnt = CNT + t * n_hb + hb
    arrived = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == used - 1:
        for k in range(n_tok):
            _merge_splits(PO, PML, O, stride_ot, stride_oh, LSE, stride_lt, SINK, t64 + k, hb, num_heads, split,
                          used, HAS_SINK, WRITE_LSE, BH)
        gl.store(cnt, 0)


@gluon.jit
def _finish_split(PO, PML, O, stride_ot, stride_oh, LSE, stride_lt, SINK, CNT, PU, t, t64, sp, hb, n_hb, num_heads,
                  split, used, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr, MERGE_IN_KERNEL: gl.constexpr,
                  BH: gl.constexpr):
    """After a 64-head program with keys stored its partial: the merge in the kernel (by the last of
    the token's ``used`` programs), or the token's ``used`` for the combine launch, which reads the
    partials [0, used) (written once, by the token's first program). The heads-on-N kernel does
    both its own way (a token pair's two tokens; a store masked over its columns)."""
    if MERGE_IN_KERNEL:
        _merge_if_last(PO, PML, O, stride_ot, stride_oh, LSE, stride_lt, SINK, CNT, t, t64, hb, n_hb, num_heads, split,
                       used, HAS_SINK, WRITE_LSE, BH)
    elif sp + hb == 0:
        gl.store(PU + t, used)


@gluon.jit
def _load_partial(PO, PML, t64, s, split, used, h, hm, d, num_heads):
    """Split ``s``'s partial (m, l [8], acc [8, 512]) of heads ``h``; splits >= ``used`` (programs
    without keys: nothing written) are empty (m -1e30, l 0, acc 0). L1 bypassed (.cg): other CTAs
    wrote them."""
    live = hm & (s < used)
    part = (t64 * split + s) * num_heads + h.to(gl.int64)
    m = gl.load(PML + part * 2, mask=live, other=-1.0e30, cache_modifier=".cg")
    lsum = gl.load(PML + part * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
    x = gl.load(PO + gl.expand_dims(part * 512, 1) + gl.expand_dims(d, 0), mask=gl.expand_dims(live, 1), other=0.0,
                cache_modifier=".cg")
    return m, lsum, x


@gluon.jit
def _rescale_add(m_run, l_run, acc, m, lsum, x):
    """Online merge of one partial into the running (m, l, acc)."""
    m_new = gl.maximum(m_run, m)
    a_old = gl.exp2(m_run - m_new)
    w = gl.exp2(m - m_new)
    return m_new, l_run * a_old + w * lsum, acc * gl.expand_dims(a_old, 1) + x * gl.expand_dims(w, 1)


@gluon.jit
def _merge_splits(PO, PML, O, stride_ot, stride_oh, LSE, stride_lt, SINK, t64, hb, num_heads, split, used,
                  HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr, BH: gl.constexpr):
    """The split merge of ``attention.combine_kernel`` for one (token, head block) over the
    partials of its ``used`` programs with keys, run by the last of them to finish:
    o = sum_s w_s acc_s / (sum_s w_s l_s + exp2(sink2 - M)),
    w_s = exp2(m_s - M), one pass with an online rescale. 8 heads at a time (a warp per head,
    16-byte loads), 4 splits' partials in flight per step (loaded before any is used)."""
    L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])  # [8 heads, 512]
    Lh: gl.constexpr = gl.SliceLayout(1, L)
    d = gl.arange(0, 512, layout=gl.SliceLayout(0, L))
    h_hi = gl.minimum(num_heads - hb * BH, BH)
    for h0 in range(0, h_hi, 8):
        h = hb * BH + h0 + gl.arange(0, 8, layout=Lh)
        hm = h < num_heads
        m_run = gl.full([8], -1.0e30, gl.float32, layout=Lh)
        l_run = gl.zeros([8], gl.float32, layout=Lh)
        acc = gl.zeros([8, 512], gl.float32, layout=L)
        for s0 in range(0, used, 4):
            m0, l0, x0 = _load_partial(PO, PML, t64, s0, split, used, h, hm, d, num_heads)
            m1, l1, x1 = _load_partial(PO, PML, t64, s0 + 1, split, used, h, hm, d, num_heads)
            m2, l2, x2 = _load_partial(PO, PML, t64, s0 + 2, split, used, h, hm, d, num_heads)
            m3, l3, x3 = _load_partial(PO, PML, t64, s0 + 3, split, used, h, hm, d, num_heads)
            m_run, l_run, acc = _rescale_add(m_run, l_run, acc, m0, l0, x0)
            m_run, l_run, acc = _rescale_add(m_run, l_run, acc, m1, l1, x1)
            m_run, l_run, acc = _rescale_add(m_run, l_run, acc, m2, l2, x2)
            m_run, l_run, acc = _rescale_add(m_run, l_run, acc, m3, l3, x3)
        inv, lse = _normalizer(m_run, l_run, SINK, h, hm, HAS_SINK)
        o = (acc * gl.expand_dims(inv, 1)).to(gl.bfloat16)
        gl.store(O + t64 * stride_ot + gl.expand_dims(h.to(gl.int64) * stride_oh, 1) + gl.expand_dims(d, 0), o,
                 mask=gl.expand_dims(hm, 1))
        if WRITE_LSE:
            gl.store(LSE + t64 * stride_lt + h, lse, mask=hm)


@gluon.jit
def _chunk_ptrs(row_ptr, valid, C0: gl.constexpr, NC: gl.constexpr, L3: gl.constexpr):
    """Pointers [BN, NC, 64] to the e4m3 tiles C0 .. C0+NC-1 (64 bytes each) of the rows, and the
    row-validity mask (``row_ptr``/``valid`` [BN] in the row layout of ``L3``)."""
    c = gl.arange(0, NC, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    col = gl.expand_dims(gl.expand_dims((c + C0) * 64, 0), 2) + gl.expand_dims(gl.expand_dims(c64, 0), 1)
    ptrs = gl.expand_dims(gl.expand_dims(row_ptr, 1), 2) + col
    return ptrs, gl.expand_dims(gl.expand_dims(valid, 1), 2) & (col >= 0)


@gluon.jit
def _dequant(x, e, B0: gl.constexpr, BN: gl.constexpr):
    """fp16 [BN, NC*64] = e4m3 bytes [BN, NC, 64] (OCP) times their tiles' 2^(byte-127); tile c's
    scale is byte B0 + c of the little-endian int32 ``e`` [BN]."""
    NC: gl.constexpr = x.shape[1]
    c = gl.arange(0, NC, layout=gl.SliceLayout(0, gl.SliceLayout(2, x.type.layout)))
    e2 = gl.expand_dims(gl.convert_layout(e, gl.SliceLayout(1, gl.SliceLayout(2, x.type.layout))), 1)
    byte = (e2 >> gl.expand_dims((c + B0) * 8, 0)) & 255
    scale = (byte << 23).to(gl.float32, bitcast=True).to(gl.float16)
    x3 = x.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    return gl.reshape(x3 * gl.expand_dims(scale, 2), [BN, NC * 64])


@gluon.jit
def _producer(k_smem, vflag, rope, kready, kempty, A_U8, a_stride0, a_bs, a_slots, a_rows, len_a, B_U8, b_stride0,
              b_bs, b_slots, b_rows, len_b, bt_row, bt_cols, b_blocks, visible, lo, hi, tiles_a,
              A_SHIFT: gl.constexpr, B_SHIFT: gl.constexpr, COMP: gl.constexpr, BN: gl.constexpr,
              RANGE_CHECKS: gl.constexpr, NS: gl.constexpr, a_rows1, len_a1, off_a, b_rows1, len_b1, off_b,
              PAIR: gl.constexpr, PDL: gl.constexpr = False):
    """Producer warpgroup: for each key tile (tile lo + i into K stage i % NS, of NS = 1 or 2),
    load its rows (e4m3 bytes and scale words into registers, RoPE values with cp.async into the
    stage's RoPE buffer), wait until the consumers have released K[stage], dequantize into it and
    signal ``kready``. The index pipeline and an L2 prefetch of the rows run one tile ahead (tile
    g+1 goes through the block table and into L2 while tile g's rows load; two tiles ahead
    measured slower); its row pointers are resolved once, for the prefetch and the next
    iteration's loads. With PAIR the tiles are a token pair's shared key list (``_pair_idx``: no
    block table) and the validity flags hold each token's bit. With PDL its warps wait for the
    previous kernel themselves (the prologue's wait ran in the default partition's warps)."""
    _wait_prior_grids(PDL)
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 1, 4], [4, 1, 1], [2, 1, 0])  # [BN, n, 64] e4m3 bytes
    Lr: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # [BN, 64] bf16
    Lrow: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    if PAIR:
        slots_c, valid_c = _pair_idx(lo, tiles_a, hi, a_rows, a_rows1, len_a, len_a1, off_a, a_slots, b_rows,
                                     b_rows1, len_b, len_b1, off_b, b_slots, COMP, RANGE_CHECKS, BN, Lrow)
        v_c, r_c = _pair_idx(lo + 1, tiles_a, hi, a_rows, a_rows1, len_a, len_a1, off_a, a_slots, b_rows, b_rows1,
                             len_b, len_b1, off_b, b_slots, COMP, RANGE_CHECKS, BN, Lrow)
    else:
        v, r = _idx_load(lo, tiles_a, hi, a_rows, len_a, b_rows, len_b, COMP, BN, Lrow)
        slots_c, valid_c = _idx_resolve(lo, tiles_a, v, r, a_slots, b_slots, visible, bt_row, bt_cols, b_bs, b_blocks,
                                        B_SHIFT, COMP, RANGE_CHECKS)
        v_c, r_c = _idx_load(lo + 1, tiles_a, hi, a_rows, len_a, b_rows, len_b, COMP, BN, Lrow)
    row_c, srow_c = _row_ptrs(lo, slots_c, tiles_a, A_U8, B_U8, a_stride0, b_stride0, a_bs, b_bs, A_SHIFT, B_SHIFT)
    for g in range(lo, hi):
        i = g - lo
        stage = i % NS
        row = row_c
        flags = valid_c
        if PAIR:
            valid = flags != 0
        else:
            valid = flags
        ptrs, m = _chunk_ptrs(row, valid, 0, 2, L3)
        x01 = gl.load(ptrs, mask=m, other=0)
        ptrs, m = _chunk_ptrs(row, valid, 2, 2, L3)
        x23 = gl.load(ptrs, mask=m, other=0)
        ptrs, m = _chunk_ptrs(row, valid, 4, 2, L3)
        x45 = gl.load(ptrs, mask=m, other=0)
        ptrs, m = _chunk_ptrs(row, valid, 6, 1, L3)
        x6 = gl.load(ptrs, mask=m, other=0)
        e_ptr = srow_c.to(gl.pointer_type(gl.int32), bitcast=True)
        e0 = gl.load(e_ptr, mask=valid, other=0)
        e1 = gl.load(e_ptr + 1, mask=valid, other=0)
        row_r = gl.convert_layout(row, gl.SliceLayout(1, Lr))
        valid_r = gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, Lr)), 1)
        c_r = gl.arange(0, 64, layout=gl.SliceLayout(0, Lr))
        rptr = gl.expand_dims(row_r + 448, 1).to(gl.pointer_type(gl.bfloat16), bitcast=True) \
            + gl.expand_dims(c_r, 0)
        compat.async_load(rope.index(stage), rptr, mask=valid_r)
        async_copy.commit_group()
        # next tile's rows through the block table (and into L2) while this tile's bytes are in flight
        if PAIR:
            slots_c, valid_c = v_c, r_c
            v_c, r_c = _pair_idx(g + 2, tiles_a, hi, a_rows, a_rows1, len_a, len_a1, off_a, a_slots, b_rows, b_rows1,
                                 len_b, len_b1, off_b, b_slots, COMP, RANGE_CHECKS, BN, Lrow)
        else:
            slots_c, valid_c = _idx_resolve(g + 1, tiles_a, v_c, r_c, a_slots, b_slots, visible, bt_row, bt_cols,
                                            b_bs, b_blocks, B_SHIFT, COMP, RANGE_CHECKS)
            v_c, r_c = _idx_load(g + 2, tiles_a, hi, a_rows, len_a, b_rows, len_b, COMP, BN, Lrow)
        row_c, srow_c = _row_ptrs(g + 1, slots_c, tiles_a, A_U8, B_U8, a_stride0, b_stride0, a_bs, b_bs,
                                  A_SHIFT, B_SHIFT)
        _prefetch_l2(row_c, srow_c)
        mbarrier.wait(kempty.index(stage), ((i // NS) & 1) ^ 1)
        k_buf = k_smem.index(stage)
        k_buf.slice(0, 128, dim=1).store(_dequant(x01, e0, 0, BN))
        k_buf.slice(128, 128, dim=1).store(_dequant(x23, e0, 2, BN))
        k_buf.slice(256, 128, dim=1).store(_dequant(x45, e1, 0, BN))
        k_buf.slice(384, 64, dim=1).store(_dequant(x6, e1, 2, BN))
        async_copy.wait_group(0)
        k_buf.slice(448, 64, dim=1).store(rope.index(stage).load(Lr).to(gl.float16))
        vflag.index(stage).store(flags.to(gl.int8))
        fence_async_shared()
        compat.barrier()
        mbarrier.arrive(kready.index(stage), count=1)


@gluon.jit
def _consumer(q_smem, k_smem, p_smem, vflag, kready, kempty, Q, stride_qt, stride_qh, t64, hb, num_heads, qk_scale,
              lo, hi, BH: gl.constexpr, BN: gl.constexpr):
    """Consumer warpgroups (the default partition, 8 warps): q into shared memory, then per key tile
    Q·Kᵀ (each warpgroup half of the keys), online softmax, P through shared memory, P·V (each
    warpgroup half of the 512 dims) left running into the next tile. Returns (acc, m, l)."""
    Lq: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # [BH, 512] q rows
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BN // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    Lsc: gl.constexpr = gl.SliceLayout(0, s_layout)
    Lsr: gl.constexpr = gl.SliceLayout(1, s_layout)
    Lor: gl.constexpr = gl.SliceLayout(1, o_layout)
    h_q = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, Lq))
    d_q = gl.arange(0, 512, layout=gl.SliceLayout(0, Lq))
    q = gl.load(Q + t64 * stride_qt + gl.expand_dims(h_q.to(gl.int64) * stride_qh, 1) + gl.expand_dims(d_q, 0),
                mask=gl.expand_dims(h_q < num_heads, 1), other=0.0)
    # q as it is (bf16 -> fp16 is exact for |q| in [2^-14, 65504]); the softmax scale (with
    # log2 e) is applied to the fp32 scores: folding it into fp16 q rounded every element and
    # cost the LSE up to ~3e-5 (docs/bad-input.md)
    q_smem.store(q.to(gl.float16))
    fence_async_shared()
    compat.barrier()

    m_i = gl.full([BH], -1.0e30, gl.float32, layout=Lsr)
    l_i = gl.zeros([BH], gl.float32, layout=Lsr)
    acc = gl.zeros([BH, 512], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BH, BN], gl.float32, layout=s_layout)
    for g in range(lo, hi):
        i = g - lo
        stage = i % 2
        mbarrier.wait(kready.index(stage), (i // 2) & 1)
        k_cur = k_smem.index(stage)
        s = warpgroup_mma(q_smem, k_cur.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))  # q·k unscaled
        valid_s = vflag.index(stage).load(Lsc) != 0
        s = gl.where(gl.expand_dims(valid_s, 0), s, float("-inf"))
        # m in scaled (base-2) units; the scale enters p through one fused multiply-add per score
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_smem.store(p.to(gl.float16))
        fence_async_shared()
        compat.barrier()
        alpha_o = gl.convert_layout(alpha, Lor)
        acc = warpgroup_mma(p_smem, k_cur, acc * gl.expand_dims(alpha_o, 1), is_async=True)
        # retired here, not across the next mbarrier wait (ptxas serializes every wgmma otherwise,
        # C7515); the producer runs meanwhile. Both warpgroups past it: K[stage] and P are free.
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        compat.barrier()
        mbarrier.arrive(kempty.index(stage), count=1)
    return acc, m_i, l_i


@gluon.jit
def _split_range(tiles, sp, split, IS_SPLIT: gl.constexpr):
    """Split ``sp``'s key tiles [lo, hi) of ``tiles``, and ``used``: how many of the ``split``
    programs have keys (only they write partials; attention.split_ranges)."""
    used = 1
    if IS_SPLIT:
        per = gl.maximum(gl.cdiv(tiles, split), 1)
        used = gl.maximum(gl.cdiv(tiles, per), 1)
        lo = sp * per
        hi = gl.minimum(lo + per, tiles)
    else:
        lo = 0
        hi = tiles
    return lo, hi, used


@gluon.jit
def _token_tiles(split, n_hb, A_ROWS, stride_ar, A_LENS, a_width, B_ROWS, stride_br, B_LENS, BT, stride_bt, bt_cols,
                 b_bs, TOK2REQ, POS, b_width, COMP: gl.constexpr, C4A_RATIO: gl.constexpr, IS_SPLIT: gl.constexpr,
                 RANGE_CHECKS: gl.constexpr, BN: gl.constexpr, PDL: gl.constexpr = False):
    """This program's (token t, key split sp, head block hb) and its key tiles [lo, hi) (SWA tiles
    first, then compressed ones from ``tiles_a``), with the token's index rows, lengths, visible
    compressed entries and block-table row, and ``used``: how many of the token's split programs
    have keys (the rest write no partial); the index rows (and block-table columns) are pulled
    into L2 before the lengths are known. With PDL the next kernel may launch at once, and the
    index rows' prefetch is issued before the wait for the previous kernel (``_wait_prior_grids``)."""
    pid = gl.program_id(0)
    sp = pid % split
    hb = (pid // split) % n_hb
    t = pid // (split * n_hb)
    t64 = t.to(gl.int64)
    a_rows = A_ROWS + t64 * stride_ar
    b_rows = B_ROWS + t64 * stride_br
    _launch_dependents(PDL)
    _prefetch_index_rows(a_rows, a_width, b_rows, b_width, COMP)
    _wait_prior_grids(PDL)
    len_a = gl.load(A_LENS + t)
    len_b = 0
    visible = 0
    req = 0
    if COMP == 1:
        len_b = gl.load(B_LENS + t)
        _prefetch_index_rows(b_rows, gl.minimum(len_b, b_width), b_rows, 0, 0)  # its entries, not the row's width
    if COMP == 2:
        req = gl.load(TOK2REQ + t)
        pos = gl.load(POS + t)
        visible = gl.maximum(gl.minimum((pos + 1) // C4A_RATIO, 2147483647), 0).to(gl.int32)  # int64 pos: no wrap
        len_b = gl.where(req >= 0, gl.minimum(visible, b_width), 0)
        req = gl.maximum(req, 0)
    if RANGE_CHECKS:  # a length never reaches past its row (nor below 0)
        len_a = gl.minimum(gl.maximum(len_a, 0), a_width)
        len_b = gl.minimum(gl.maximum(len_b, 0), b_width)
    tiles_a = gl.cdiv(len_a, BN)
    lo, hi, used = _split_range(tiles_a + gl.cdiv(len_b, BN), sp, split, IS_SPLIT)
    bt_row = BT + req.to(gl.int64) * stride_bt  # type: ignore[attr-defined]  # req starts as the Python 0 the JIT turns into a scalar tensor
    if COMP == 2:
        _prefetch_table_row(bt_row, visible, b_bs, bt_cols)
    return t, t64, sp, hb, a_rows, b_rows, len_a, len_b, visible, bt_row, tiles_a, lo, hi, used


@gluon.jit
def _epilogue(acc, m_i, l_i, O, stride_ot, stride_oh, LSE, stride_lt, SINK, PO, PML, CNT, PU, t, t64, sp, hb, n_hb,
              num_heads, split, used, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr, IS_SPLIT: gl.constexpr,
              MERGE_IN_KERNEL: gl.constexpr, BH: gl.constexpr):
    """A 64-head program's end (this kernel's and ``hopper_records``'): the consumers' ``acc`` [BH, 512]
    fp32 and row max / sum ``m_i`` / ``l_i`` [BH] become this split's partial (then ``_finish_split``),
    or, unsplit, the normalized bf16 output rows and their LSE."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    Lq: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # [BH, 512] output rows
    Lor: gl.constexpr = gl.SliceLayout(1, o_layout)
    Loc: gl.constexpr = gl.SliceLayout(0, o_layout)
    h_o = hb * BH + gl.arange(0, BH, layout=Lor)
    d_o = gl.arange(0, 512, layout=Loc)
    hmask_o = h_o < num_heads
    m_o = gl.convert_layout(m_i, Lor)
    l_o = gl.convert_layout(l_i, Lor)
    if IS_SPLIT:
        if sp < used:  # a program past the token's keys writes nothing and does not arrive
            part = (t64 * split + sp) * num_heads + h_o.to(gl.int64)
            gl.store(PO + gl.expand_dims(part * 512, 1) + gl.expand_dims(d_o, 0), acc,
                     mask=gl.expand_dims(hmask_o, 1))
            gl.store(PML + part * 2, m_o, mask=hmask_o)
            gl.store(PML + part * 2 + 1, l_o, mask=hmask_o)
            _finish_split(PO, PML, O, stride_ot, stride_oh, LSE, stride_lt, SINK, CNT, PU, t, t64, sp, hb, n_hb,
                          num_heads, split, used, HAS_SINK, WRITE_LSE, MERGE_IN_KERNEL, BH)
    else:
        inv, lse = _normalizer(m_o, l_o, SINK, h_o, hmask_o, HAS_SINK)
        o = acc * gl.expand_dims(inv, 1)
        # 16-byte coalesced stores (the MMA layout would give 4-byte ones)
        ob = gl.convert_layout(o.to(gl.bfloat16), Lq)
        h_s = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, Lq))
        d_s = gl.arange(0, 512, layout=gl.SliceLayout(0, Lq))
        o_ptr = O + t64 * stride_ot + gl.expand_dims(h_s.to(gl.int64) * stride_oh, 1) + gl.expand_dims(d_s, 0)
        gl.store(o_ptr, ob, mask=gl.expand_dims(h_s < num_heads, 1))
        if WRITE_LSE:
            gl.store(LSE + t64 * stride_lt + h_o, lse, mask=hmask_o)


@gluon.jit(do_not_specialize=("split",))  # per step: no variant per split value
def sparse_mla_fwd_hopper(
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
    RANGE_CHECKS: gl.constexpr = True, MERGE_IN_KERNEL: gl.constexpr = False, PDL: gl.constexpr = False,
):
    BH: gl.constexpr = BLOCK_H

    # ---- shared memory: q, two K tiles (the producer fills one while the consumers read the
    #      other), P, the producer's RoPE ring, tile validity, and the two mbarrier pairs --------
    q_smem = gl.allocate_shared_memory(gl.float16, [BH, 512],
                                       gl.NVMMASharedLayout.get_default_for([BH, 512], gl.float16))
    k_smem = gl.allocate_shared_memory(gl.float16, [2, BN, 512],
                                       gl.NVMMASharedLayout.get_default_for([BN, 512], gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [BH, BN], gl.NVMMASharedLayout.get_default_for([BH, BN], gl.float16))
    rope = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64],
                                     gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    vflag = gl.allocate_shared_memory(gl.int8, [2, BN], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                                           order=[0]))
    kready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kempty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kready.index(i), count=1)
        mbarrier.init(kempty.index(i), count=1)

    n_hb = gl.cdiv(num_heads, BH)
    t, t64, sp, hb, a_rows, b_rows, len_a, len_b, visible, bt_row, tiles_a, lo, hi, used = _token_tiles(
        split, n_hb, A_ROWS, stride_ar, A_LENS, a_width, B_ROWS, stride_br, B_LENS, BT, stride_bt, bt_cols, b_bs,
        TOK2REQ, POS, b_width, COMP, C4A_RATIO, IS_SPLIT, RANGE_CHECKS, BN, PDL)

    acc, m_i, l_i = gl.warp_specialize([
        (_consumer, (q_smem, k_smem, p_smem, vflag, kready, kempty, Q, stride_qt, stride_qh, t64, hb, num_heads,
                     qk_scale, lo, hi, BH, BN)),
        (_producer, (k_smem, vflag, rope, kready, kempty, A_U8, a_stride0, a_bs, a_slots, a_rows, len_a, B_U8,
                     b_stride0, b_bs, b_slots, b_rows, len_b, bt_row, bt_cols, b_blocks, visible, lo, hi, tiles_a,
                     A_SHIFT, B_SHIFT, COMP, BN, RANGE_CHECKS, 2, a_rows, len_a, 0, b_rows, len_b, 0, False, PDL)),
    ], [4], [PRODUCER_REGS])

    _epilogue(acc, m_i, l_i, O, stride_ot, stride_oh, LSE, stride_lt, SINK, PO, PML, CNT, PU, t, t64, sp, hb, n_hb,
              num_heads, split, used, HAS_SINK, WRITE_LSE, IS_SPLIT, MERGE_IN_KERNEL, BH)
