"""Compile the Gluon Hopper kernel for sm_90a on any machine (no GPU needed) and print what
decides its speed: ptxas' registers, spills and C7515 warnings, and the HGMMA / DEPBAR counts
(one WARPGROUP.DEPBAR per HGMMA = every wgmma serialized).

    PYTHONPATH=. python tests/gpu_scripts/triton_sass.py [--comp 2] [--split] [--no-range-checks] [--heads-n 16]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from portable_build import compile_hopper, hopper_constexprs, ptxas_and_sass  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--comp", type=int, default=2, help="0 SWA only, 1 global compressed rows, 2 C4A local top-k")
    p.add_argument("--split", action="store_true", help="the split-KV variant (small batches)")
    p.add_argument("--shifts", type=int, nargs=2, default=(6, 6), metavar=("A", "B"),
                   help="log2 of the SWA / compressed cache block sizes (-1: not a power of two)")
    p.add_argument("--no-range-checks", action="store_true",
                   help="compile without the index range checks (to see what they cost)")
    p.add_argument("--heads-n", type=int, default=0, choices=(0, 8, 16),
                   help="the heads-on-N kernel (hopper_heads) with this many heads per program; 0: the 64-head one")
    args = p.parse_args()
    kernel = compile_hopper(hopper_constexprs(args.comp, args.split, shifts=tuple(args.shifts),
                                              range_checks=not args.no_range_checks, heads_n=args.heads_n))
    report, sass = ptxas_and_sass(kernel)
    print("\n".join(line for line in report.splitlines() if "stack" in line or "egisters" in line
                    or "C75" in line))
    print(f"shared memory {kernel.metadata.shared} B; HGMMA {sass.count('HGMMA')}, "
          f"WARPGROUP.DEPBAR {sass.count('WARPGROUP.DEPBAR')}, local loads/stores "
          f"{sass.count('LDL') + sass.count('STL')}, SASS instructions {sass.count(';')}")


if __name__ == "__main__":
    main()
