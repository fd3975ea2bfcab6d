"""How the bench times: the device ceilings (copy bandwidth, bf16 matrix rate), the L2 flush, one
CUDA event pair per run (the host clock on the CPU), CUDA-graph replay with an eager fallback, and
``Timing``: median, fastest and 90th percentile of the runs."""

from __future__ import annotations

import functools
import statistics
import sys
import time
from dataclasses import dataclass

import torch

# ---- device ceilings --------------------------------------------------------------------------


def warm_up(device: torch.device, seconds: float = 2.0) -> None:
    """Keep the GPU busy with matrix products for ``seconds`` so clocks leave idle before the
    ceilings and the first case are timed (a cold first case read 10x slow)."""
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for _ in range(10):
            torch.mm(x, x)
        torch.cuda.synchronize(device)
    del x


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (bytes read + written per second) and the bf16 matrix rate, measured (on a
    CPU at small sizes: a second, not a minute)."""
    cpu = device.type == "cpu"
    n = 1 << (26 if cpu else 30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    reps = 5 if cpu else 20
    copy_s = statistics.median(_samples(functools.partial(b.copy_, a), reps=reps, flush=None, device=device))
    del a, b
    m = 512 if cpu else 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_s = statistics.median(_samples(functools.partial(torch.mm, x, y), reps=reps, flush=None, device=device))
    del x, y
    if not cpu:
        torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n / copy_s, "bf16_flops_per_s": 2 * m**3 / mm_s}


# ---- timing -----------------------------------------------------------------------------------


class L2Flush:
    def __init__(self, device: torch.device, nbytes: int = 256 << 20) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


@dataclass(frozen=True)
class Timing:
    """Seconds per run of a timed callable over ``runs`` runs: median, fastest and 90th percentile
    (the spread: how much slower one run in ten was), and how it ran ('graph' | 'eager')."""

    median: float
    min: float
    p90: float
    runs: int
    how: str

    @classmethod
    def of(cls, samples: list[float], how: str) -> Timing:
        p90 = statistics.quantiles(samples, n=10, method="inclusive")[-1] if len(samples) > 1 else samples[0]
        return cls(statistics.median(samples), min(samples), p90, len(samples), how)

    def as_us(self) -> dict:
        """The JSON record: µs (median), µs_min, µs_p90, runs, timing."""
        return {"us": self.median * 1e6, "us_min": self.min * 1e6, "us_p90": self.p90 * 1e6, "runs": self.runs,
                "timing": self.how}


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.cuda.synchronize()


def host_us(run, device: torch.device, calls: int = 50) -> float:
    """Host us per eager call of ``run``: the calling thread's time (checks, backend decision,
    launches; a GPU's queue takes the kernels), what an eager or piecewise engine step pays per
    layer beside the GPU time. On a CPU the work itself is in it."""
    run()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        run()
    elapsed = time.perf_counter() - start
    sync(device)
    return elapsed / calls * 1e6


def _samples(fn, reps: int, flush, warmup: int = 3, device: torch.device | None = None) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn`` (``flush()`` before each): one CUDA event pair
    per run on a GPU, the host clock around a finished run on the CPU."""
    device = device or torch.device("cuda")
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cpu":
        out = []
        for _ in range(reps):
            if flush is not None:
                flush()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one call on a side stream: the allocations and
    one-time setup (compiles, workspaces) of a first call happen outside the capture, as
    torch.cuda.graph asks. The caller synchronizes as it needs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_callable(fn, reps: int, flush, graph: bool, device: torch.device | None = None,
                  uncapturable: str | None = None) -> Timing:
    """``reps`` timed runs of ``fn``: CUDA-graph replays when ``graph`` (eager launches when the
    capture fails, or at once when ``uncapturable`` says why it cannot be captured), else eager
    calls; on the CPU always eager, with no flush and one warm-up run."""
    device = device or torch.device("cuda")
    if device.type == "cpu":
        return Timing.of(_samples(fn, reps, None, warmup=1, device=device), "eager")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph and uncapturable:
        print(f"  ({uncapturable}; timing eager launches)", file=sys.stderr)
    elif graph:
        try:
            g = capture_graph(fn)
            torch.cuda.synchronize()
            return Timing.of(_samples(g.replay, reps, flush, warmup=2), "graph")
        except Exception as exc:  # capture unsupported by this callable: time eager launches
            print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing eager launches)",
                  file=sys.stderr)
            torch.cuda.synchronize()
    return Timing.of(_samples(fn, reps, flush), "eager")

