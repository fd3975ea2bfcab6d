"""Compile the Gluon Hopper kernel for sm_90a on any machine (no GPU needed) and print what
decides its speed: ptxas' registers, spills and C7515 warnings, and the HGMMA / DEPBAR counts
(one WARPGROUP.DEPBAR per HGMMA = every wgmma serialized).

    PYTHONPATH=. python tests/gpu_scripts/triton_sass.py [--comp 2] [--split] [--no-range-checks]
"""

from __future__ import annotations

import argparse
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from dsv4_attn.portable.kernels import hopper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from portable_build import ptxas_and_sass  # noqa: E402

POINTERS = {"Q": "*bf16", "O": "*bf16", "LSE": "*fp32", "SINK": "*fp32", "A_U8": "*u8", "B_U8": "*u8",
            "A_ROWS": "*i32", "A_LENS": "*i32", "B_ROWS": "*i32", "B_LENS": "*i32", "BT": "*i32",
            "TOK2REQ": "*i32", "POS": "*i64", "PO": "*fp32", "PML": "*fp32"}
# what the launcher's arguments are specialized as (16-byte aligned pointers and strides)
DIV16 = set(POINTERS) | {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "a_stride0", "b_stride0",
                         "stride_ar", "stride_br", "stride_bt", "b_width", "a_width", "a_slots", "b_slots"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--comp", type=int, default=2, help="0 SWA only, 1 global compressed rows, 2 C4A local top-k")
    p.add_argument("--split", action="store_true", help="the split-KV variant (small batches)")
    p.add_argument("--shifts", type=int, nargs=2, default=(6, 6), metavar=("A", "B"),
                   help="log2 of the SWA / compressed cache block sizes (-1: not a power of two)")
    p.add_argument("--no-range-checks", action="store_true",
                   help="compile without the index range checks (to see what they cost)")
    args = p.parse_args()
    fn = hopper.sparse_mla_fwd_hopper
    const = dict(COMP=args.comp, C4A_RATIO=4, HAS_SINK=True, WRITE_LSE=False, IS_SPLIT=args.split, BN=64,
                 A_SHIFT=args.shifts[0], B_SHIFT=args.shifts[1], RANGE_CHECKS=not args.no_range_checks)
    sig = {}
    for prm in fn.params:
        sig[prm.name] = (POINTERS.get(prm.name) or ("constexpr" if prm.name in const else
                         "fp32" if prm.name == "qk_scale" else "i32"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, prm in enumerate(fn.params) if prm.name in DIV16}
    kernel = triton.compile(GluonASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=hopper.NUM_WARPS, maxnreg=hopper.MAXNREG))
    report, sass = ptxas_and_sass(kernel)
    print("\n".join(line for line in report.splitlines() if "stack" in line or "egisters" in line
                    or "C75" in line))
    print(f"shared memory {kernel.metadata.shared} B; HGMMA {sass.count('HGMMA')}, "
          f"WARPGROUP.DEPBAR {sass.count('WARPGROUP.DEPBAR')}, local loads/stores "
          f"{sass.count('LDL') + sass.count('STL')}, SASS instructions {sass.count(';')}")


if __name__ == "__main__":
    main()
