"""Device script: parity of the triton backend's kernels (Gluon Hopper path and portable path)
against the float64 reference on production-shaped random cases; prints one line per case.

    PYTHONPATH=. python tests/gpu_scripts/triton_check.py [FORMAT ...]

FORMAT (e.g. mxfp8_ds_mla nvfp4_ds_mla): only the cases in these KV formats (default: every case).
"""

from __future__ import annotations

import math
import sys

import torch

from dsv4_attn import bench
from dsv4_attn.common.layout import KVFormat


def compare(out, ref):
    a, b = out.double().flatten(), ref.double().flatten()
    rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return float((a - b).abs().max()), rel, cos


def main() -> int:
    dev = torch.device("cuda")
    names = {"gluon": bench.runners.register_variant("gluon=impl=gluon") if torch.cuda.get_device_capability() == (9, 0)
             else None, "portable": bench.runners.register_variant("portable=impl=triton")}
    v4 = KVFormat.MODEL1_FP8
    cases = [
        ("h64-c4a512", 3, 1, v4), ("h64-c4a512", 2, 2, v4), ("h128-c4a1024", 2, 1, v4), ("h64-c128a", 4, 1, v4),
        ("h128-c128a", 2, 2, v4), ("h64-c4a512", 70, 1, v4), ("h128-c4a1024", 40, 1, v4),
        # V4.1 layers in each record: V4 (SM90's), MXFP8, MXFP8 SWA + NVFP4 compressed (both kernels: the
        # Gluon one is hopper_records for the V4.1 records)
        *((cfg, b, 1, fmt) for fmt in (v4, KVFormat.MXFP8, KVFormat.NVFP4)
          for cfg, b in (("h64-c1a512", 3), ("h128-c2a1024", 40))),
    ]
    only = {KVFormat.parse(f) for f in sys.argv[1:]}
    bad = 0
    for cfg, b, sq, fmt in cases:
        if only and fmt not in only:
            continue
        case = bench.make_decode_case(bench.DECODE_CONFIGS[cfg], b, sq, dev, fmt, seed=b + sq)
        case.sink[0], case.sink[1] = math.inf, -math.inf
        for impl, name in names.items():
            if name is None:
                continue
            run, out, plan = bench.runners.api_runner(case, name)
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            ref = case.reference(plan)
            nan = int(out.isnan().sum())
            mx, rel, cos = compare(out.nan_to_num(0), ref)
            ok = nan == 0 and rel < 1e-2 and cos > 0.9999 and float(out[:, 0].abs().max()) == 0
            bad += not ok
            print(f"{'OK ' if ok else 'BAD'} {impl:<8} {case.label:<30} {fmt.value:<12} nan {nan} max_abs {mx:.2e} "
                  f"rel_l2 {rel:.2e} cos {cos:.6f}", flush=True)
    print("parity failures:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
