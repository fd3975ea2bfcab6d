"""Device script: run one decode case through the triton backend a few times (for ncu / nsys).

    ncu --kernel-name regex:sparse_mla --launch-skip 2 --launch-count 1 --set full \
        python tests/gpu_scripts/triton_profile.py --config h64-c4a512 --batch 128

``--flashmla-raw`` also runs FlashMLA's raw decode op on the same rows (the bench's runner), and
``--profile-last`` brackets only the last call of each with cudaProfilerStart/Stop, for
``ncu --profile-from-start off``: every kernel of one triton forward, then of one FlashMLA call.
"""

from __future__ import annotations

import argparse

import torch

from dsv4_attn import bench


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="h64-c4a512")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--mtp", type=int, default=1)
    p.add_argument("--variant", default=None, help="as bench --variant")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--flashmla-raw", action="store_true", help="also run FlashMLA's raw op on the same rows")
    p.add_argument("--profile-last", action="store_true", help="cudaProfilerStart/Stop around the last call")
    args = p.parse_args()
    name = bench.runners.register_variant(args.variant) if args.variant else "triton"
    case = bench.make_decode_case(bench.DECODE_CONFIGS[args.config], args.batch, args.mtp, torch.device("cuda"))
    run, out, plan = bench.runners.api_runner(case, name)
    runs = [(name, run, out)]
    if args.flashmla_raw:
        raw, raw_out, how = bench.runners.flashmla_raw_runner(case, plan)
        if raw is None:
            raise SystemExit(f"FlashMLA raw op unavailable: {how}")
        runs.append(("flashmla_raw", raw, raw_out))
    for label, fn, result in runs:
        for i in range(args.iters):
            if args.profile_last and i == args.iters - 1:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
            fn()
        torch.cuda.synchronize()
        if args.profile_last:
            torch.cuda.profiler.stop()
        print("ok", label, float(result.float().abs().mean()))


if __name__ == "__main__":
    main()
