"""Device script: the Gluon kernel's split merge inside the kernel (``KernelConfig.merge_in_kernel``)
against the float64 reference, beside the combine launch and the automatic choice, on the bench's
decode configs at small batches (where the key range splits) and 1 - 128 heads. Each output is
NaN-poisoned first; every case runs eagerly and then as three CUDA-graph replays (poisoned before
each), so the arrival counters must come back to zero after every launch.

    PYTHONPATH=. python tests/gpu_scripts/merge_check.py [--configs h8-c4a512 ...] [--batches 1 2 4 64]
        [--variant LABEL=KernelConfig fields ...]  (default: combine launch, in-kernel merge, auto)
"""

from __future__ import annotations

import argparse
import sys

import torch

from dsv4_attn import bench
from dsv4_attn.common import reference
from dsv4_attn.testing.errors import error_figures

CONFIGS = ["h8-c4a512", "h8-swa", "h16-c4a1024", "h16-c128a", "h32-c4a512", "h64-c4a512", "h64-c128a",
           "h128-c4a1024"]


def outputs(run, out: torch.Tensor) -> list[torch.Tensor]:
    """The output of one eager call and of three graph replays, each poisoned before."""
    got = []
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    got.append(out.clone())
    graph = bench.timing.capture_graph(run)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got.append(out.clone())
    return got


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=CONFIGS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 64])
    p.add_argument("--variant", nargs="+", default=["combine=impl=gluon,merge_in_kernel=0",
                                                    "in-kernel=impl=gluon,merge_in_kernel=1", "auto=impl=gluon"])
    args = p.parse_args()
    dev = torch.device("cuda")
    names = {spec.split("=", 1)[0]: bench.runners.register_variant(spec) for spec in args.variant}
    bad = 0
    for cfg in args.configs:
        for b in args.batches:
            case = bench.make_decode_case(bench.DECODE_CONFIGS[cfg], b, 1, dev, seed=b + 7)
            case.sink[0] = float("inf")  # the sink taking all the weight of head 0 (output 0)
            ref = None
            for label, name in names.items():
                run, out, plan = bench.runners.api_runner(case, name)
                if ref is None:
                    rows, lens = plan.comp_scope(case.kind, case.topk)
                    ref, _ = reference.sparse_mla(case.q, case.swa_cache, plan.swa_rows, plan.swa_lens,
                                                  case.comp_cache, rows, lens, case.sink, case.spec.scale, case.fmt)
                for i, got in enumerate(outputs(run, out)):
                    nan = int(got.isnan().sum())
                    err = error_figures(got.nan_to_num(0), ref)
                    mx, rel, cos = err["max_abs"], err["rel_l2"], err["cosine"]
                    ok = nan == 0 and rel < 1e-2 and cos > 0.9999 and float(got[:, 0].abs().max()) == 0
                    bad += not ok
                    how = "eager" if i == 0 else f"replay {i}"
                    print(f"{'OK ' if ok else 'BAD'} {label:<9} {case.label:<24} {how:<8} nan {nan} max_abs {mx:.2e} "
                          f"rel_l2 {rel:.2e} cos {cos:.7f}", flush=True)
    print("merge check failures:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
