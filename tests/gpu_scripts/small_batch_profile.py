"""Device script: where a small-batch decode layer's time goes under CUDA-graph replay (L2 flushed
before each replay, as `dsv4-attn bench` times it). Per case and backend: the event-timed replay
(what the bench reports), each kernel's duration from the profiler (CUPTI), the gap between the
graph's kernels, and, for scale, an event-timed replay of a graph holding one empty kernel.

    PYTHONPATH=. python tests/gpu_scripts/small_batch_profile.py [--backends triton t:m1=merge_in_kernel=1]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from dsv4_attn import bench
from dsv4_attn.bench.timing import L2Flush, capture_graph

CASES = [("h8-c4a512", 1), ("h8-c4a512", 4), ("h8-swa", 1), ("h16-c128a", 2), ("h64-c4a512", 2),
         ("h128-c4a1024", 2)]


def capture(run) -> torch.cuda.CUDAGraph:
    for _ in range(3):
        run()
    graph = capture_graph(run)
    torch.cuda.synchronize()
    return graph


def event_us(graph: torch.cuda.CUDAGraph, flush, reps: int = 30) -> float:
    times = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def kernel_breakdown(graph: torch.cuda.CUDAGraph, flush, reps: int = 20) -> str:
    """Median duration of each of the graph's kernels and of the gaps between them (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "zero" not in e.name
                      and "fill" not in e.name.lower()), key=lambda e: e.time_range.start)
    per_replay = len(kernels) // reps if reps else 0
    if per_replay == 0:
        return "no kernels recorded"
    parts = []
    for k in range(per_replay):
        ks = kernels[k::per_replay]
        dur = statistics.median(e.time_range.elapsed_us() for e in ks)
        parts.append(f"{ks[0].name[:28]} {dur:.1f}")
        if k + 1 < per_replay:
            nxt = kernels[k + 1::per_replay]
            gap = statistics.median(n.time_range.start - e.time_range.end for e, n in zip(ks, nxt))
            parts.append(f"gap {gap:.1f}")
    return " | ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backends", nargs="+", default=["triton"])
    p.add_argument("--variant", action="append", default=[])
    args = p.parse_args()
    dev = torch.device("cuda")
    bench.timing.warm_up(dev)
    flush = L2Flush(dev)
    backends = args.backends + [bench.runners.register_variant(v) for v in args.variant]
    empty = torch.zeros(1, device=dev)
    print(f"graph of one empty kernel: {event_us(capture(lambda: empty.add_(1)), flush):.1f} us (event-timed, "
          "L2 flushed)")
    for cfg, b in CASES:
        case = bench.make_decode_case(bench.DECODE_CONFIGS[cfg], b, 1, dev, seed=b)
        for name in backends:
            run, _, _ = bench.runners.api_runner(case, name)
            graph = capture(run)
            print(f"{case.label:<24} {name:<12} {event_us(graph, flush):6.1f} us | {kernel_breakdown(graph, flush)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
