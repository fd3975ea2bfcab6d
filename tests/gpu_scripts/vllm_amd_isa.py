"""Compile vLLM 0.33.0's gfx950 Triton sparse-MLA decode kernel offline for gfx942 / gfx950 with
the Triton installed (no GPU, no vLLM import) and print its ISA figures: what docs/rocm.md "Triton
kernels on AMD" compares the portable kernel with, and where tests/test_amd_compile.py's recorded
figure (``VLLM_INSTRUCTIONS_PER_KEY``) comes from. Not run in CI (it needs vLLM's wheel).

    python tests/gpu_scripts/vllm_amd_isa.py vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl

The kernel is ``_sparse_attn_decode_gfx950_partial_kernel`` of
``vllm/v1/attention/ops/rocm_aiter_mla_sparse.py`` (with the helpers it calls), read from the wheel
and compiled with the constexprs and options of vLLM's launch there (``rocm_sparse_attn_decode``:
16 heads, BLOCK_K 32, 4 warps, ``waves_per_eu=0``, strides and page size as constexprs; V4 record
584-byte rows in 64-token pages, 64 heads, 8 splits; FNUZ SWA cache on gfx942). Its SWA loop walks
32 keys per iteration, its compressed loop 2 x 32 (two tiles unrolled): instructions per key = the
loop's ISA instructions / its keys (``portable_build.amd_loops``).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
import tempfile
import zipfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import portable_build as pb  # noqa: E402

SOURCE = "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py"
KERNEL = "_sparse_attn_decode_gfx950_partial_kernel"
HELPERS = ("_decode_e8m0_scales_triton", "_load_fp8_ds_mla_gfx950_nope_exact_chunk",
           "_load_fp8_ds_mla_gfx950_tail128", "_sparse_attn_decode_gfx950_partial_loaded_tile")
POINTERS = {"q_ptr": "*bf16", "main_cache_ptr": "*u8", "main_indices_ptr": "*i32", "main_indptr_ptr": "*i32",
            "extra_cache_ptr": "*u8", "extra_indices_ptr": "*i32", "extra_indptr_ptr": "*i32",
            "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32"}
BLOCK_K = 32


def load_kernel(wheel: str):
    """vLLM's kernel and its helpers, copied from the wheel into a module of their own."""
    text = zipfile.ZipFile(wheel).read(SOURCE).decode()
    lines = text.splitlines()
    parts = ["import triton\nimport triton.language as tl\n"]
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name in (*HELPERS, KERNEL):
            parts.append("\n".join(lines[node.decorator_list[0].lineno - 1: node.end_lineno]))
    path = os.path.join(tempfile.mkdtemp(), "vllm_rocm_sparse_mla.py")
    with open(path, "w") as f:
        f.write("\n\n\n".join(parts))
    spec = importlib.util.spec_from_file_location("vllm_rocm_sparse_mla", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, KERNEL)


def compile_vllm(fn, arch: str, heads: int = 64, page: int = 64):
    const = dict(q_stride0=heads * 512, q_stride1=512, main_cache_stride0=page * 584, extra_cache_stride0=page * 584,
                 MAIN_BLOCK_SIZE=page, EXTRA_BLOCK_SIZE=page, scale=512**-0.5, num_heads=heads, HAS_EXTRA=True,
                 NOPE_DIM=448, ROPE_DIM=64, IS_FNUZ_MAIN=arch == "gfx942", IS_FNUZ_EXTRA=False,
                 TRUST_EXTRA_CACHE_NAN_FREE=False, ADAPTIVE_SPLITS=False, ONE_WAVE_SPLITS=8, BLOCK_H=16,
                 BLOCK_K=BLOCK_K, NUM_SPLITS=8, NUM_STAGES=1)
    sig = {p.name: POINTERS.get(p.name) or ("constexpr" if p.name in const else "i32") for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name in POINTERS}
    return triton.compile(ASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("hip", arch, 64),
                          options=dict(num_warps=4, waves_per_eu=0))


def measure(fn, arch: str) -> dict:
    kernel = compile_vllm(fn, arch)
    asm = kernel.asm["amdgcn"]
    res = pb.amd_resources(kernel)
    loops = sorted((c for c in pb.amd_loops(asm) if c["mfma"]), key=lambda c: c["mfma"])
    per_tile = loops[0]["mfma"]  # the SWA loop: one tile of BLOCK_K keys
    res["loops"] = [{"keys": BLOCK_K * c["mfma"] // per_tile, "instructions": c["total"], "mfma": c["mfma"],
                     "per_key": round(c["total"] / (BLOCK_K * c["mfma"] // per_tile), 1)} for c in loops]
    res["per_key_min"] = min(r["per_key"] for r in res["loops"])
    return {"triton": triton.__version__, "arch": arch, **res}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("wheel", help="vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    p.add_argument("--arch", choices=("gfx942", "gfx950"), action="append")
    args = p.parse_args()
    fn = load_kernel(args.wheel)
    for arch in args.arch or ("gfx942", "gfx950"):
        print(json.dumps(measure(fn, arch)))


if __name__ == "__main__":
    main()
