"""Device script: parity of the triton backend's kernels (Gluon Hopper path and portable path)
against the float64 reference on production-shaped random cases; prints one line per case.

    PYTHONPATH=. python tests/gpu_scripts/triton_check.py
"""

from __future__ import annotations

import math
import sys

import torch

from dsv4_attn import bench
from dsv4_attn.common import reference
from dsv4_attn.common.spec import LayerKind


def compare(out, ref):
    a, b = out.double().flatten(), ref.double().flatten()
    rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return float((a - b).abs().max()), rel, cos


def main() -> int:
    dev = torch.device("cuda")
    names = {"gluon": bench.register_variant("gluon=impl=gluon") if torch.cuda.get_device_capability() == (9, 0)
             else None, "portable": bench.register_variant("portable=impl=triton")}
    cases = [
        ("h64-c4a512", 3, 1), ("h64-c4a512", 2, 2), ("h128-c4a1024", 2, 1), ("h64-c128a", 4, 1),
        ("h128-c128a", 2, 2), ("h64-c4a512", 70, 1), ("h128-c4a1024", 40, 1),
    ]
    bad = 0
    for cfg, b, sq in cases:
        case = bench.make_decode_case(bench.DECODE_CONFIGS[cfg], b, sq, dev, seed=b + sq)
        case.sink[0], case.sink[1] = math.inf, -math.inf
        for impl, name in names.items():
            if name is None:
                continue
            run, out, plan = bench.api_runner(case, name)
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            rows, lens = plan.comp_scope(case.kind, case.c4a_topk)
            ref, _ = reference.sparse_mla(case.q, case.swa_cache, plan.swa_rows, plan.swa_lens, case.comp_cache, rows,
                                          lens, case.sink, case.spec.scale, case.fmt)
            nan = int(out.isnan().sum())
            mx, rel, cos = compare(out.nan_to_num(0), ref)
            ok = nan == 0 and rel < 1e-2 and cos > 0.9999 and float(out[:, 0].abs().max()) == 0
            bad += not ok
            print(f"{'OK ' if ok else 'BAD'} {impl:<8} {case.label:<30} nan {nan} max_abs {mx:.2e} rel_l2 {rel:.2e} "
                  f"cos {cos:.6f}", flush=True)
        # SWA-only layer through the same kernels
    print("parity failures:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
