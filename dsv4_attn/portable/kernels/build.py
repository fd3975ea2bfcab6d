"""Compile a kernel variant ahead of its launch, for a named target, with the Triton installed: what
the `triton` backend asks before it picks a kernel (``compile_error``), and what the offline compile
checks use (tests/gpu_scripts/compile_matrix.py, triton_amd.py, triton_sass.py; no GPU needed).

Gluon and Triton change between releases (kernels/compat.py names what moved): a kernel that does
not compile with the installed Triton is never chosen; the compile error is the reason shown by
``SparseMLA.explain()`` and ``dsv4-attn probe``. Selection compiles one variant per kernel, record
pair and layer kind (non-split, with the LSE and a sink: what every other variant shares), once per
process; Triton's on-disk cache makes later processes fast.
"""

from __future__ import annotations

import functools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ...common.platform import triton_interpreting
from . import attention as K

POINTERS = {"Q": "*bf16", "O": "*bf16", "LSE": "*fp32", "SINK": "*fp32", "A_U8": "*u8", "A_16": "*bf16",
            "B_U8": "*u8", "B_16": "*bf16", "A_ROWS": "*i32", "A_LENS": "*i32", "B_ROWS": "*i32",
            "B_LENS": "*i32", "BT": "*i32", "TOK2REQ": "*i32", "POS": "*i64", "PO": "*fp32", "PML": "*fp32",
            "PU": "*i32", "SCR_P": "*bf16", "SCR_A": "*fp32"}
FLOATS = {"qk_scale", "kv_scale"}
# integer arguments a launch passes as multiples of 16 in the common case (strides of q / out /
# rows, cache block strides and sizes of 16-multiple pages, slot counts, row widths, head counts
# of 16+): Triton's launcher specializes such values as 16-divisible at run time, and without it
# the AMD code is not what runs (every lane then holds all of a tile's slots in SGPRs: ~4x the
# instructions per key and 1,100+ SGPR spills offline under Triton 3.8 / 3.9)
PORTABLE_DIV16 = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_lt", "a_stride0", "a_bs", "a_slots",
                  "stride_ar", "a_width", "b_stride0", "b_bs", "b_slots", "stride_br", "stride_bt", "b_width",
                  "num_heads"}
HOPPER_POINTERS = {"Q": "*bf16", "O": "*bf16", "LSE": "*fp32", "SINK": "*fp32", "A_U8": "*u8", "B_U8": "*u8",
                   "A_ROWS": "*i32", "A_LENS": "*i32", "B_ROWS": "*i32", "B_LENS": "*i32", "BT": "*i32",
                   "TOK2REQ": "*i32", "POS": "*i64", "PO": "*fp32", "PML": "*fp32", "CNT": "*i32",
                   "PU": "*i32"}
# what the launcher's arguments are specialized as (16-byte aligned pointers and strides)
HOPPER_DIV16 = set(HOPPER_POINTERS) | {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "a_stride0", "b_stride0",
                                       "stride_ar", "stride_br", "stride_bt", "b_width", "a_width", "a_slots",
                                       "b_slots"}


def target(arch: str) -> GPUTarget:
    """Triton's target of ``arch`` as ``Platform.arch`` names it ('sm90', 'sm100', 'gfx942', ...)."""
    if arch.startswith("gfx"):
        return GPUTarget("hip", arch, 64 if arch.startswith("gfx9") else 32)
    if arch.startswith("sm") and arch[2:].isdigit():
        return GPUTarget("cuda", int(arch[2:]), 32)
    raise ValueError(f"arch: got {arch!r}; allowed: 'smNN' or 'gfxNNN'")


def _require_compiler() -> None:
    if triton_interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: compiles need Triton's compiler")


def compile_portable(gpu: GPUTarget, constexprs: dict, options: dict):
    """A CompiledKernel of the portable kernel, specialized as a launch with 16-byte aligned
    tensors and 16-multiple strides, page sizes and widths is (``PORTABLE_DIV16``)."""
    _require_compiler()
    fn = K.sparse_mla_fwd_kernel
    sig = {p.name: POINTERS.get(p.name) or ("constexpr" if p.name in constexprs else
                                            "fp32" if p.name in FLOATS else "i32") for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if p.name in POINTERS or p.name in PORTABLE_DIV16}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs=attrs), target=gpu, options=options)


def compile_combine(gpu: GPUTarget, split: int = 304, block_h: int = 16, pdl: bool = False, chunk: int = 1):
    """A CompiledKernel of the split-KV merge (``attention.combine_kernel``) as the launcher
    compiles it; 304 splits: one token on an MI300X's 304 CUs, the most ``ops.choose_split`` gives;
    ``pdl``: as a programmatic dependent launch after the Gluon kernel (sm_90, ``ops.pdl_launches``);
    ``chunk``: splits per load round trip (``ops.combine_chunk``)."""
    _require_compiler()
    fn = K.combine_kernel
    constexprs = dict(SPLIT_P2=triton.next_power_of_2(split), HAS_SINK=True, WRITE_LSE=True,
                      BLOCK_H=block_h, BLOCK_D=128, CHUNK=chunk, PDL=pdl)
    pointers = {"PO": "*fp32", "PML": "*fp32", "PU": "*i32", "O": "*bf16", "LSE": "*fp32", "SINK": "*fp32"}
    sig = {p.name: pointers.get(p.name) or ("constexpr" if p.name in constexprs else "i32") for p in fn.params}
    return triton.compile(ASTSource(fn, sig, constexprs), target=gpu,
                          options=dict(num_warps=4, **({"launch_pdl": True} if pdl else {})))


def hopper_constexprs(comp: int, split: bool = False, write_lse: bool = False, shifts: tuple[int, int] = (6, 6),
                      range_checks: bool = True, merge: bool = False, heads_n: int = 0, pair: bool = False,
                      records: tuple[int, int] | None = None, pingpong: bool = False, pdl: bool = False) -> dict:
    """The Gluon Hopper kernel's constexprs of one launch (``ops.sparse_mla_fwd``), with a sink;
    ``merge``: a split launch merging its partials itself (``ops.merge_in_kernel``); ``heads_n``
    8 / 16: the heads-on-N kernel (``hopper_heads``) with that many heads per program, 0 the
    64-head one; ``pair``: the heads-on-N kernel with a token pair per program (``ops.pair_tokens``,
    heads_n 16); ``records``: the (SWA, compressed) record codes of a layer of V4.1 records
    (``attention.FMT_MXFP8`` / ``FMT_NVFP4``: the ``hopper_records`` kernel), None the V4 record;
    ``pingpong``: the unsplit 64-head launch of the key-tile ping-pong kernel (``hopper_prefill``);
    ``pdl``: the V4 kernels' griddepcontrol (``ops.pdl_launches``; the records' and the ping-pong
    kernels hold none)."""
    merge = merge and split
    const = dict(COMP=comp, C4A_RATIO=4, HAS_SINK=True, WRITE_LSE=write_lse and (not split or merge), IS_SPLIT=split,
                 BN=64, A_SHIFT=shifts[0], B_SHIFT=shifts[1], RANGE_CHECKS=range_checks, MERGE_IN_KERNEL=merge)
    if heads_n:
        const["NH"] = heads_n
        const["PAIR"] = pair
    if records is not None:
        const["FMT_A"], const["FMT_B"] = records
    if pingpong:
        const["PINGPONG"] = True
    if pdl:
        const["PDL"] = True
    return const


def hopper_kernel(constexprs: dict):
    """(the Gluon kernel, its launch options) of ``constexprs``: the V4.1 records' kernel where they
    name FMT_A (``hopper_records``), the heads-on-N kernel where they name NH (``hopper_heads``), the
    key-tile ping-pong one where they name PINGPONG (``hopper_prefill``), else the 64-head one
    (``hopper``)."""
    if "FMT_A" in constexprs:
        from . import hopper_records

        return hopper_records.sparse_mla_fwd_hopper_records, dict(num_warps=hopper_records.NUM_WARPS,
                                                                  maxnreg=hopper_records.MAXNREG)
    if "NH" in constexprs:
        from . import hopper_heads

        return hopper_heads.sparse_mla_fwd_hopper_heads_n, dict(num_warps=hopper_heads.NUM_WARPS,
                                                                maxnreg=hopper_heads.MAXNREG)
    if "PINGPONG" in constexprs:
        from . import hopper_prefill

        return hopper_prefill.sparse_mla_fwd_hopper_prefill, dict(num_warps=hopper_prefill.NUM_WARPS,
                                                                  maxnreg=hopper_prefill.MAXNREG)
    from . import hopper

    return hopper.sparse_mla_fwd_hopper, dict(num_warps=hopper.NUM_WARPS, maxnreg=hopper.MAXNREG)


def ctas_per_sm(heads_n: int) -> int:
    """Programs of the Gluon kernel that one SM holds at once: 2 for the heads-on-N kernel (``heads_n``
    > 0, hopper_heads.CTAS_PER_SM), 1 for the 64-head one."""
    if not heads_n:
        return 1
    from . import hopper_heads

    return hopper_heads.CTAS_PER_SM


def compile_hopper(constexprs: dict):
    """A CompiledKernel of the Gluon Hopper kernel for sm_90a, with the launcher's options (raises
    ImportError where this Triton has no Gluon or lacks a name kernels/compat.py needs)."""
    _require_compiler()
    from triton.experimental.gluon._runtime import GluonASTSource

    fn, options = hopper_kernel(constexprs)
    sig = {p.name: HOPPER_POINTERS.get(p.name) or ("constexpr" if p.name in constexprs else
                                                   "fp32" if p.name == "qk_scale" else "i32") for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name in HOPPER_DIV16}
    return triton.compile(GluonASTSource(fn, sig, constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def _first_line(exc: BaseException) -> str:
    """The compile error in one line: its type and the first line of its message that says something."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else "")
    return f"{type(exc).__name__}: {said[:300]}"


@functools.lru_cache(maxsize=64)
def compile_error(arch: str, kernel: str, variant: tuple[tuple[str, object], ...],
                  options: tuple[tuple[str, int], ...] = ()) -> str:
    """'' when ``kernel`` ('gluon' | 'portable') compiles for ``arch`` with the installed Triton in
    ``variant`` (its constexprs, sorted items) and ``options``, else why not (the error's type and
    message, one line). Nothing to compile under Triton's CPU interpreter (''). Cached per process."""
    if triton_interpreting() or arch == "cpu":
        return ""
    try:
        if kernel == "gluon":
            compile_hopper(dict(variant))
        else:
            compile_portable(target(arch), dict(variant), dict(options))
    except Exception as exc:  # any failure is a reason, not a crash
        return f"the {'Gluon Hopper' if kernel == 'gluon' else 'portable'} kernel does not compile for {arch} " \
               f"with Triton {triton.__version__}: {_first_line(exc)}"
    return ""
