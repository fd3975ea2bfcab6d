"""Time the `flashmla` backend through SparseMLA on a GPU (not part of the test suite: no timing
tests there). Prints, per config, the eager forward, the FlashMLA op calls alone (CUDA events
around them: inflated when the GPU waits for the host) and, for decode, one forward captured in a
CUDA graph and replayed (what an engine runs; no host overhead).

    DSV4_ATTN_FLASHMLA_LIB=.flashmla/_flashmla_C.abi3.so PYTHONPATH=.:tests python tests/gpu_scripts/flashmla_timing.py
"""

from __future__ import annotations

import torch

from dsv4_attn.api import SparseMLA
from dsv4_attn.common.spec import LayerKind
from dsv4_attn.cuda import flashmla

from kit.steps import nvidia_step

ITERS = 20
_kernel_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []


def _timed(method):
    def wrapper(self, *args):
        if torch.cuda.is_current_stream_capturing():  # no timing events inside a graph
            return method(self, *args)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        method(self, *args)
        end.record()
        _kernel_events.append((start, end))

    return wrapper


flashmla.FlashMLAOps.decode = _timed(flashmla.FlashMLAOps.decode)
flashmla.FlashMLAOps.prefill = _timed(flashmla.FlashMLAOps.prefill)


def measure(name, qlens, seqs, kind, **kw):
    gen = torch.Generator().manual_seed(len(name))
    case = nvidia_step(gen, qlens, seqs, device="cuda", **kw)
    mla = SparseMLA(case.spec, case.fmt, backend="flashmla", device="cuda", max_tokens=max(8192, sum(qlens)))
    plan = mla.plan(case.batch)
    out = torch.empty_like(case.q)
    args = (case.q, case.caches["swa"], case.caches.get(kind) if kind.has_comp_scope else None)
    topk = case.topk_for(kind) if kind is LayerKind.C4A else None

    def run():
        mla.forward(plan, kind, *args, topk=topk, sink=case.sink, out=out)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    _kernel_events.clear()
    total = _time(run)
    kernel = sum(s.elapsed_time(e) for s, e in _kernel_events) * 1000 / ITERS
    replay = "-"
    if case.batch.num_decode_tokens == case.batch.num_tokens:
        graph = torch.cuda.CUDAGraph()
        plan = mla.plan(case.batch)  # fresh plan: the schedule is planned inside the capture
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        replay = f"{_time(graph.replay):.1f}"
    print(f"| {name} | {kind.name} | {total:.1f} | {kernel:.1f} | {replay} |", flush=True)


def _time(fn) -> float:
    """Mean microseconds per call of ITERS back-to-back calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / ITERS


def main():
    print("| config | kind | eager forward us | FlashMLA op calls us | graph replay us |\n|---|---|---|---|---|")
    for b in (2, 128, 256):
        measure(f"decode H64 W128+C4A512 b{b} s_kv16k", [1] * b, [16384] * b, LayerKind.C4A, heads=64, topk=512,
                max_model_len=65536)
    measure("decode H128 W128+C4A1024 b128", [1] * 128, [16384] * 128, LayerKind.C4A, heads=128, topk=1024,
            max_model_len=65536)
    measure("decode H64 C128A (width 512) b128", [1] * 128, [16384] * 128, LayerKind.C128A, heads=64,
            max_model_len=65536)
    measure("decode H64 MTP s_q=2 b128", [2] * 128, [16384] * 128, LayerKind.C4A, heads=64, topk=512,
            max_model_len=65536, num_decode_tokens=256)
    for heads, topk in ((64, 512), (128, 1024)):
        measure(f"prefill H{heads} 4096 tok, s_kv 32k, W128+C4A{topk}", [4096], [32768], LayerKind.C4A,
                heads=heads, topk=topk, max_model_len=65536, num_decode_tokens=0)


if __name__ == "__main__":
    main()
