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

from dsv4_attn.common.layout import KVFormat
from dsv4_attn.portable.kernels import attention as K
from dsv4_attn.portable.kernels import ops
from dsv4_attn.portable.kernels.build import (  # noqa: F401 (the compile helpers the scripts use)
    compile_combine,
    compile_hopper,
    compile_portable,
    hopper_constexprs,
)

# AMD limits per workgroup: LDS bytes; VGPRs (arch + AGPRs) per lane at one wave per SIMD
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
COMP_NAMES = {K.COMP_NONE: "SWA only", K.COMP_GLOBAL: "all entries (C128A)", K.COMP_C4A_LOCAL: "top-k"}


def variant(fmt: KVFormat, comp_mode: int, tile: ops.Tile, split: int = 1, topk_ratio: int = 4) -> dict:
    """The constexprs of one launch (``ops.portable_constexprs``), with a sink and the LSE."""
    records = (fmt.swa_record,) if comp_mode == K.COMP_NONE else (fmt.swa_record, fmt.comp_record)
    codes = (ops.RECORD_CODE[records[0]], ops.RECORD_CODE[records[-1]])
    return ops.portable_constexprs(codes, comp_mode, topk_ratio, True, True, split, tile, K.tl.bfloat16, True)


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
