"""Compile the portable Triton kernel (``attention.sparse_mla_fwd_kernel``) offline, for any
target, with exactly the constexprs and options the launcher uses (``ops.portable_constexprs``,
``ops.launch_options``), and read what decides its speed from the binary: AMD (``GPUTarget("hip",
arch, 64)``, PyPI Triton's AMD backend): LDS bytes, VGPR / AGPR / SGPR counts, spills, scratch;
NVIDIA (sm_90a): ptxas' report and the SASS (``ptxas_and_sass``). Used by triton_amd.py (which
tests/test_amd_compile.py runs) and triton_sass.py. Needs a real (not interpreted) Triton: run it in
a process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4_attn.common.layout import KVFormat
from dsv4_attn.common.platform import triton_interpreting
from dsv4_attn.portable.kernels import attention as K
from dsv4_attn.portable.kernels import ops

POINTERS = {"Q": "*bf16", "O": "*bf16", "LSE": "*fp32", "SINK": "*fp32", "A_U8": "*u8", "A_16": "*bf16",
            "B_U8": "*u8", "B_16": "*bf16", "A_ROWS": "*i32", "A_LENS": "*i32", "B_ROWS": "*i32",
            "B_LENS": "*i32", "BT": "*i32", "TOK2REQ": "*i32", "POS": "*i64", "PO": "*fp32", "PML": "*fp32",
            "SCR_P": "*bf16", "SCR_A": "*fp32"}
FLOATS = {"qk_scale", "kv_scale"}
# AMD limits per workgroup: LDS bytes; VGPRs (arch + AGPRs) per lane at one wave per SIMD
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
COMP_NAMES = {K.COMP_NONE: "SWA only", K.COMP_GLOBAL: "all entries (C128A)", K.COMP_C4A_LOCAL: "top-k"}


def variant(fmt: KVFormat, comp_mode: int, tile: ops.Tile, split: int = 1, topk_ratio: int = 4) -> dict:
    """The constexprs of one launch (``ops.portable_constexprs``), with a sink and the LSE."""
    records = (fmt.swa_record,) if comp_mode == K.COMP_NONE else (fmt.swa_record, fmt.comp_record)
    codes = (ops.RECORD_CODE[records[0]], ops.RECORD_CODE[records[-1]])
    return ops.portable_constexprs(codes, comp_mode, topk_ratio, True, True, split, tile, K.tl.bfloat16, True)


def compile_portable(target: GPUTarget, constexprs: dict, options: dict):
    """A CompiledKernel of the portable kernel (pointers specialized as 16-byte aligned, as the
    launcher's are for cache tensors)."""
    if triton_interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: offline compiles need Triton's compiler")
    fn = K.sparse_mla_fwd_kernel
    sig = {p.name: POINTERS.get(p.name) or ("constexpr" if p.name in constexprs else
                                            "fp32" if p.name in FLOATS else "i32") for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name in POINTERS}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs=attrs), target=target, options=options)


def compile_combine(target: GPUTarget, split: int = 304, block_h: int = 16):
    """A CompiledKernel of the split-KV merge (``attention.combine_kernel``) as the launcher
    compiles it; 304 splits: one token on an MI300X's 304 CUs, the most ``ops.choose_split`` gives."""
    if triton_interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: offline compiles need Triton's compiler")
    fn = K.combine_kernel
    constexprs = dict(SPLIT=split, SPLIT_P2=triton.next_power_of_2(split), HAS_SINK=True, WRITE_LSE=True,
                      BLOCK_H=block_h, BLOCK_D=128)
    sig = {p.name: {"PO": "*fp32", "PML": "*fp32", "O": "*bf16", "LSE": "*fp32", "SINK": "*fp32"}.get(p.name)
           or ("constexpr" if p.name in constexprs else "i32") for p in fn.params}
    return triton.compile(ASTSource(fn, sig, constexprs), target=target, options=dict(num_warps=4))


HOPPER_POINTERS = {"Q": "*bf16", "O": "*bf16", "LSE": "*fp32", "SINK": "*fp32", "A_U8": "*u8", "B_U8": "*u8",
                   "A_ROWS": "*i32", "A_LENS": "*i32", "B_ROWS": "*i32", "B_LENS": "*i32", "BT": "*i32",
                   "TOK2REQ": "*i32", "POS": "*i64", "PO": "*fp32", "PML": "*fp32"}
# what the launcher's arguments are specialized as (16-byte aligned pointers and strides)
HOPPER_DIV16 = set(HOPPER_POINTERS) | {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "a_stride0", "b_stride0",
                                       "stride_ar", "stride_br", "stride_bt", "b_width", "a_width", "a_slots",
                                       "b_slots"}


def hopper_constexprs(comp: int, split: bool = False, write_lse: bool = False, shifts: tuple[int, int] = (6, 6),
                      range_checks: bool = True) -> dict:
    """The Gluon Hopper kernel's constexprs of one launch (``ops.sparse_mla_fwd``), with a sink."""
    return dict(COMP=comp, C4A_RATIO=4, HAS_SINK=True, WRITE_LSE=write_lse and not split, IS_SPLIT=split, BN=64,
                A_SHIFT=shifts[0], B_SHIFT=shifts[1], RANGE_CHECKS=range_checks)


def compile_hopper(constexprs: dict):
    """A CompiledKernel of the Gluon Hopper kernel for sm_90a, with the launcher's options."""
    if triton_interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: offline compiles need Triton's compiler")
    from triton.experimental.gluon._runtime import GluonASTSource

    from dsv4_attn.portable.kernels import hopper

    fn = hopper.sparse_mla_fwd_hopper
    sig = {p.name: HOPPER_POINTERS.get(p.name) or ("constexpr" if p.name in constexprs else
                                                   "fp32" if p.name == "qk_scale" else "i32") for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name in HOPPER_DIV16}
    return triton.compile(GluonASTSource(fn, sig, constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=hopper.NUM_WARPS, maxnreg=hopper.MAXNREG))


def _amd_field(asm: str, name: str) -> int:
    m = re.search(rf"^\s*(?:-\s+)?\.{name}:\s+(\d+)", asm, re.M)
    if m is None:
        raise ValueError(f"no .{name} in the AMDGPU metadata")
    return int(m.group(1))


def amd_resources(kernel) -> dict:
    """LDS bytes, VGPRs (arch + AGPRs, ``.vgpr_count``), AGPRs, SGPRs, VGPR / SGPR spills and
    scratch bytes per lane of an AMD CompiledKernel (from its code object's metadata)."""
    asm = kernel.asm["amdgcn"]
    return {"lds": kernel.metadata.shared, "vgprs": _amd_field(asm, "vgpr_count"),
            "agprs": _amd_field(asm, "agpr_count"), "sgprs": _amd_field(asm, "sgpr_count"),
            "vgpr_spills": _amd_field(asm, "vgpr_spill_count"), "sgpr_spills": _amd_field(asm, "sgpr_spill_count"),
            "scratch": _amd_field(asm, "private_segment_fixed_size")}


def ptxas_and_sass(kernel) -> tuple[str, str]:
    """(ptxas -v's report, nvdisasm's SASS) of a CUDA CompiledKernel for sm_90a, with Triton's
    bundled ptxas / nvdisasm."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        report = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o",
                                 os.path.join(tmp, "v.cubin")], capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    return report, sass
