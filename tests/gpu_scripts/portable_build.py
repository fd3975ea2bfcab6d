"""Compile the portable Triton kernel (``attention.sparse_mla_fwd_kernel``) offline, for any
target, with exactly the constexprs and options the launcher uses (``ops.portable_constexprs``,
``ops.launch_options``), and read what decides its speed from the binary: AMD (``GPUTarget("hip",
arch, 64)``, PyPI Triton's AMD backend): LDS bytes, VGPR / AGPR / SGPR counts, spills, scratch;
NVIDIA (sm_90a): ptxas' report and the SASS (``ptxas_and_sass``, ``sass``). Used by triton_amd.py (which
tests/test_amd_compile.py runs) and triton_sass.py. Needs a real (not interpreted) Triton: run it in
a process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import collections
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


def layer_records(fmt: KVFormat, comp_mode: int) -> tuple:
    """The records a layer of ``comp_mode`` reads in format ``fmt`` (an SWA layer: the SWA cache's)."""
    return (fmt.swa_record,) if comp_mode == K.COMP_NONE else (fmt.swa_record, fmt.comp_record)


def variant(fmt: KVFormat, comp_mode: int, tile: ops.Tile, split: int = 1, topk_ratio: int = 4,
            fnuz: bool = False) -> dict:
    """The constexprs of one launch (``ops.portable_constexprs``), with a sink and the LSE; ``fnuz``:
    a cache in FNUZ e4m3 bytes (gfx942's)."""
    records = layer_records(fmt, comp_mode)
    codes = (ops.RECORD_CODE[records[0]], ops.RECORD_CODE[records[-1]])
    return ops.portable_constexprs(codes, comp_mode, topk_ratio, True, True, split, tile, K.tl.bfloat16, True,
                                   fnuz=fnuz)


def _amd_field(asm: str, name: str) -> int:
    m = re.search(rf"^\s*(?:-\s+)?\.{name}:\s+(\d+)", asm, re.M)
    if m is None:
        raise ValueError(f"no .{name} in the AMDGPU metadata")
    return int(m.group(1))


def amd_loops(asm: str) -> list[collections.Counter]:
    """Per loop of an AMDGCN listing (LLVM's loop annotations on its basic blocks: "Loop Header",
    "in Loop: Header=BB0_n"; a nested loop counts in its innermost loop only), the count of its
    ISA instructions ("total") and of some kinds: "mfma", "lane" (v_readlane / v_writelane:
    SGPR spills to VGPR lanes and back), "vmem" (global / buffer loads), "lds" (ds_*)."""
    loops: dict[str, collections.Counter] = {}
    current = None
    for line in asm.splitlines():
        text = line.strip()
        block = re.match(r"^(?:(\.LBB\w+):|; %bb\.\d+:)(.*)$", text)
        if block:
            header = re.search(r"Header=(\w+)", block.group(2))
            current = (".L" + header.group(1)) if header else (
                block.group(1) if "Loop Header" in block.group(2) else None)
            continue
        op = text.split(";")[0].split()
        if current is None or not op or op[0].startswith(".") or op[0].endswith(":"):
            continue
        count = loops.setdefault(current, collections.Counter())
        count["total"] += 1
        count["mfma"] += op[0].startswith("v_mfma")
        count["lane"] += op[0].startswith(("v_readlane", "v_writelane"))
        count["vmem"] += op[0].startswith(("global_load", "buffer_load"))
        count["lds"] += op[0].startswith("ds_")
    return list(loops.values())


def amd_loop_instructions(asm: str) -> tuple[int, int]:
    """(ISA instructions, MFMAs) of the largest loop with matrix instructions in it: the key-tile
    loop of an attention kernel (the one a key tile's every instruction is in)."""
    body = max((c for c in amd_loops(asm) if c["mfma"]), key=lambda c: c["total"], default=collections.Counter())
    return body["total"], body["mfma"]


def amd_resources(kernel) -> dict:
    """LDS bytes, VGPRs (arch + AGPRs, ``.vgpr_count``), AGPRs, SGPRs, VGPR / SGPR spills, scratch
    bytes per lane of an AMD CompiledKernel (from its code object's metadata), and the ISA
    instructions and MFMAs of its key-tile loop (``amd_loop_instructions``). SGPR spills go to
    VGPR lanes; one to memory needs scratch (``scratch`` > 0)."""
    asm = kernel.asm["amdgcn"]
    loop, mfma = amd_loop_instructions(asm)
    return {"lds": kernel.metadata.shared, "vgprs": _amd_field(asm, "vgpr_count"),
            "agprs": _amd_field(asm, "agpr_count"), "sgprs": _amd_field(asm, "sgpr_count"),
            "vgpr_spills": _amd_field(asm, "vgpr_spill_count"), "sgpr_spills": _amd_field(asm, "sgpr_spill_count"),
            "scratch": _amd_field(asm, "private_segment_fixed_size"), "loop_instructions": loop, "loop_mfma": mfma}


def _nvidia_tool(name: str) -> str:
    """The path of Triton's bundled ``name`` (ptxas, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass(kernel) -> str:
    """nvdisasm's SASS of a CUDA CompiledKernel, with Triton's bundled nvdisasm."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([_nvidia_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout


def ptxas_and_sass(kernel) -> tuple[str, str]:
    """(ptxas -v's report, nvdisasm's SASS) of a CUDA CompiledKernel for sm_90a, with Triton's
    bundled ptxas / nvdisasm."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([_nvidia_tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "v.cubin")],
                                capture_output=True, text=True).stderr
    return report, sass(kernel)
