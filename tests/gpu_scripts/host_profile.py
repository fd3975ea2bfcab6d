"""Where a repeated eager layer call's host time goes (issue 24, notes/host-time.md): cProfile of
``SparseMLA.forward`` with the same inputs called again and again (every memo of the host path
hits, the launches bound), or with ``--fresh`` q / out / top-k and the caches at addresses no
earlier call used (bench.host's ``fresh`` way: the first call's launches relocated), on a GPU
(kernels run) or the CPU (kernels stubbed, interpreter).

    PYTHONPATH=. python tests/gpu_scripts/host_profile.py [--case flash-decode-b2] [--calls 3000] [--fresh]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import os
import pstats

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv4_attn.bench import host  # noqa: E402
from dsv4_attn.bench.runners import _case_mla  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="flash-decode-b2", choices=list(host.CASES))
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--fresh", action="store_true", help="every call at new addresses")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = host._make_case(args.case, device)
    with host.kernels_stubbed() if device.type == "cpu" else contextlib.nullcontext():
        mla = _case_mla(case, args.backend)
        plan = mla.plan(case.batch)
        triples = host._inputs(case, 100 + 2 * args.calls if args.fresh else 1)
        numbers = itertools.count()

        def call() -> None:
            q, out, topk, swa, comp = triples[next(numbers) % len(triples)]
            mla.forward(plan, case.kind, q, swa, comp, topk=topk, sink=case.sink, out=out)

        # unprofiled: bench.host's measure (blocks of 10 calls, the device drained between them)
        unprofiled = host.median_us(lambda i: call(), 200, 15, device)
        print(f"{case.label} {args.backend}: {unprofiled:.1f} us per call (median of 15 x 200 calls, "
              f"{'fresh' if args.fresh else 'same'} addresses, unprofiled)")
        host._sync(device)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            call()
        profile.disable()
        host._sync(device)
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
