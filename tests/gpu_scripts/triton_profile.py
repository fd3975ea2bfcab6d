"""Device script: run one decode case through the triton backend a few times (for ncu / nsys).

    ncu --kernel-name regex:sparse_mla --launch-skip 2 --launch-count 1 --set full \
        python tests/gpu_scripts/triton_profile.py --config h64-c4a512 --batch 128
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
    args = p.parse_args()
    name = bench.register_variant(args.variant) if args.variant else "triton"
    case = bench.make_decode_case(bench.DECODE_CONFIGS[args.config], args.batch, args.mtp, torch.device("cuda"))
    run, out, plan = bench.api_runner(case, name)
    for _ in range(args.iters):
        run()
    torch.cuda.synchronize()
    print("ok", float(out.float().abs().mean()))


if __name__ == "__main__":
    main()
