"""Host time per eager layer call, split into its parts (``python -m dsv4_attn.bench.host``).

What an eager or piecewise engine step pays per attention layer on the CPU thread, beside the
GPU's work: ``SparseMLA.forward``'s input checks, then the dispatch (backend decision, phase
split, the launcher's argument preparation), then the kernel launches themselves. Measured as
differences of medians, each over many calls of one layer:

* ``checks_us``: ``SparseMLA.layer_inputs`` alone (every check ``forward`` runs, ``out`` included;
  a repeated call whose backend bound its launches skips them: ``SparseMLA._repeated``);
* ``dispatch_us``: ``forward`` with the Triton kernels replaced by a no-op stub, minus checks
  (negative where a repeat skips the checks: then read the total);
* ``launch_us``: ``forward`` as it runs, minus the stubbed forward (GPU only: on the CPU the
  kernels run in Triton's interpreter, so only the stubbed parts are timed there);
* ``total_us``: ``forward`` as it runs (GPU), or the stubbed forward (CPU).

Two ways to call: ``same`` repeats one layer call with the same tensors (a layer whose inputs
the engine hands at the same addresses every step: every memo of the host path hits); ``fresh``
gives every call q / out / top-k and the caches at addresses no earlier call used, shapes and
16-byte alignment kept (the step's next layer of the kind, with its own caches and activations,
or an allocator that never hands the same address twice): such a call runs the launches bound
for the first one, relocated (``SparseMLA._relocated``). The first call of a layer shape, which
binds them, is not in these figures (notes/host-time.md has its cost).
``plan_us`` is ``SparseMLA.plan`` once per step (shared by the layers).

On the CPU the triton backend runs only under ``TRITON_INTERPRET=1`` (set here before Triton is
imported); the kernels are stubbed there, so nothing but the host path runs. No timing test in the
suite reads these numbers (tests check the stub and the table, never a time).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import statistics
import sys
import time

import torch

CASES = {  # name: (kind of case, config, batch): V4-Flash's C4A layer (64 heads, top-k 512) and friends
    "flash-decode-b2": ("decode", "h64-c4a512", 2),
    "flash-decode-b64": ("decode", "h64-c4a512", 64),
    "flash-c128a-b64": ("decode", "h64-c128a", 64),
    "flash-swa-b64": ("decode", "h64-swa", 64),
    "flash-prefill-4k": ("prefill", "h64-q4k-kv8k-top640", 0),
    "flash-tp8-decode-b2": ("decode", "h8-c4a512", 2),  # a V4-Flash -tp 8 rank: the split merged in the kernel
}
DEFAULT_CASES = ("flash-decode-b2", "flash-decode-b64", "flash-prefill-4k")


class _StubKernel:
    """Stands in for a Triton kernel (its parameters' names): ``kernel[grid](...)`` launches nothing
    and returns a :class:`_StubCompiled`, as Triton's JIT path returns the CompiledKernel it launched."""

    def __init__(self, kernel) -> None:
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        return _stub_launch


class _StubCompiled:
    """Stands in for a CompiledKernel: its launcher does nothing."""

    function = packed_metadata = None

    @staticmethod
    def run(*args) -> None:
        return None


def _stub_launch(*args, **kwargs) -> _StubCompiled:
    return _StubCompiled()


def _stream_zero(device_index) -> int:
    """The current stream while kernels are stubbed (``launch._stream_of``'s getter)."""
    return 0


@contextlib.contextmanager
def kernels_stubbed():
    """Every Triton kernel a layer call launches (the attention kernels and the split combine)
    replaced by a no-op while inside, below every part of our host path: the plain launch is
    stubbed at ``kernel[grid]``, the bound one (``kernels/launch.py``) at the compiled kernel's
    launcher, and on the CPU the bound path runs too (as on a GPU; stream 0)."""
    from ..portable.kernels import attention, ops

    targets: list[tuple[object, str, object]] = [
        (attention, "sparse_mla_fwd_kernel", _StubKernel(attention.sparse_mla_fwd_kernel)),
        (attention, "combine_kernel", _StubKernel(attention.combine_kernel))]
    if importlib.util.find_spec(f"{ops.__package__}.launch") is not None:  # (a baseline tree has no bound path)
        from ..portable.kernels import launch

        targets += [(launch, "bindable", lambda device: True), (launch, "_stream_of", lambda: _stream_zero)]
    if ops._gluon_importable():
        from ..portable.kernels import hopper

        targets.append((hopper, "sparse_mla_fwd_hopper", _StubKernel(hopper.sparse_mla_fwd_hopper)))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    try:
        for mod, name, stub in targets:
            setattr(mod, name, stub)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_for(device: torch.device):
    """The wall clock with a GPU (what an engine step waits for); on the CPU, where every kernel is
    stubbed and nothing waits, the calling thread's CPU time (other processes' load does not count)."""
    return time.perf_counter if device.type == "cuda" else time.thread_time


# Calls timed back to back; the device is drained between blocks, outside the timing, so the GPU's
# queue never holds more than one block's launches and a launch never waits for the GPU (a layer's
# kernels may run longer than its host path: hundreds of calls back to back timed the GPU there).
BLOCK = 10


def median_us(fn, calls: int, rounds: int, device: torch.device) -> float:
    """Median over ``rounds`` of the mean host time of ``calls`` calls of ``fn(i)``, in us, timed in
    blocks of BLOCK back-to-back calls with the device drained between blocks (not timed); i numbers
    the calls of the measurement (a warm-up round included), never the same twice."""
    clock = clock_for(device)
    numbers = iter(range(calls * (rounds + 1)))
    for _ in range(calls):
        fn(next(numbers))
    _sync(device)
    per_call = []
    for _ in range(rounds):
        spent, done = 0.0, 0
        while done < calls:
            block = min(BLOCK, calls - done)
            start = clock()
            for _ in range(block):
                fn(next(numbers))
            spent += clock() - start
            done += block
            _sync(device)
        per_call.append(spent / calls * 1e6)
    return statistics.median(per_call)


def _make_case(name: str, device: torch.device):
    from .cases import make_decode_case, make_prefill_case
    from .configs import DECODE_CONFIGS, PREFILL_CONFIGS

    phase, config, b = CASES[name]
    if phase == "decode":
        return make_decode_case(DECODE_CONFIGS[config], b, 1, device)
    return make_prefill_case(PREFILL_CONFIGS[config], device)


def _inputs(case, count: int) -> list[tuple]:
    """``count`` (q, out, topk, swa_cache, comp_cache) tuples of the case, each at addresses no
    other has (count 1: the case's own tensors): views of one buffer per tensor, 16 bytes apart,
    so every one keeps the alignment the kernels are specialized for."""
    if count == 1:
        return [(case.q, torch.empty_like(case.q), case.topk, case.swa_cache, case.comp_cache)]

    def shifted(t: torch.Tensor) -> list[torch.Tensor]:
        step = 16 // t.element_size()
        base = torch.empty(t.numel() + count * step, dtype=t.dtype, device=t.device)
        base[:t.numel()] = t.flatten()
        return [base[i * step:i * step + t.numel()].view(t.shape) for i in range(count)]

    qs, outs, swas = shifted(case.q), shifted(case.q), shifted(case.swa_cache)
    topks = shifted(case.topk) if case.topk is not None else [None] * count
    comps = shifted(case.comp_cache) if case.comp_cache is not None else [None] * count
    return list(zip(qs, outs, topks, swas, comps))


def measure_case(case, backend: str, calls: int, rounds: int) -> dict:
    """Host us per eager layer call of ``case`` on ``backend``, split (module docstring), for the
    ``same`` and ``fresh`` ways of calling. Every measurement builds its own SparseMLA (and plan):
    no memo of one (the stubbed launches' bound kernels above all) reaches another."""
    from .runners import _case_mla

    device = case.q.device
    mla = _case_mla(case, backend)
    result = {"case": case.label, "backend": backend, "tokens": case.q.shape[0], "heads": case.q.shape[1],
              "picked": mla.backend_for(case.kind, case.phase, case.q.shape[0]) if backend == "auto" else backend,
              "plan_us": median_us(lambda i: mla.plan(case.batch), max(1, calls // 10), rounds, device)}
    per_measure = calls * (rounds + 1)
    result["same"] = _measure_way(case, backend, _inputs(case, 1), 0, calls, rounds)
    # fresh: each measurement its own third of the tuples, so no address repeats at all
    result["fresh"] = _measure_way(case, backend, _inputs(case, 3 * per_measure), per_measure, calls, rounds)
    return result


def _measure_way(case, backend: str, triples: list[tuple], spacing: int, calls: int, rounds: int) -> dict:
    """checks / dispatch / launch / total us of one way of calling: call i of measurement k takes
    ``triples[k * spacing + i]`` (cyclically: ``_inputs``' tuples)."""
    from .runners import _case_mla

    device = case.q.device

    def layer(k: int):
        """Measurement k's own SparseMLA and plan, and its call i."""
        mla = _case_mla(case, backend)
        plan = mla.plan(case.batch)
        checks_only = _checks_of(mla)

        def call(i: int) -> None:
            q, out, topk, swa, comp = triples[(k * spacing + i) % len(triples)]
            if k == 0:
                checks_only(plan, case.kind, q, swa, comp, topk, case.sink, out)
            else:
                mla.forward(plan, case.kind, q, swa, comp, topk=topk, sink=case.sink, out=out)
        return call

    checks_us = median_us(layer(0), calls, rounds, device)
    with kernels_stubbed():
        stubbed_us = median_us(layer(1), calls, rounds, device)
    row = {"checks_us": checks_us, "dispatch_us": stubbed_us - checks_us, "launch_us": None, "total_us": stubbed_us}
    if device.type == "cuda":
        total_us = median_us(layer(2), calls, rounds, device)
        row.update(launch_us=total_us - stubbed_us, total_us=total_us)
    return row


def _checks_of(mla):
    """``mla``'s layer checks alone, ``out`` included: ``layer_inputs(..., out=)``; where that
    takes no ``out`` (before this tool: a baseline tree), the private method it calls."""
    if "out" in inspect.signature(mla.layer_inputs).parameters:
        return lambda plan, kind, q, swa, comp, topk, sink, out: mla.layer_inputs(
            plan, kind, q, swa, comp, topk=topk, sink=sink, out=out)
    return lambda plan, kind, q, swa, comp, topk, sink, out: mla._layer_inputs(
        plan, kind, q, swa, comp, topk, sink, 1.0, False, out)


def _fmt(v) -> str:
    return "   n/a" if v is None else f"{v:6.1f}"


def print_table(results: list[dict], device: torch.device) -> None:
    how = ("wall clock" if device.type == "cuda" else
           "the thread's CPU time; kernels stubbed: the CPU runs no kernel, launch n/a")
    print(f"host us per eager layer call, median ({how})")
    print(f"{'case':<34} {'backend':<8} {'way':<7} {'checks':>6} {'dispatch':>8} {'launch':>6} {'total':>6} "
          f"{'plan/step':>9}")
    for r in results:
        for way in ("same", "fresh"):
            w = r[way]
            print(f"{r['case']:<34} {r['picked']:<8} {way:<7} {_fmt(w['checks_us'])} {_fmt(w['dispatch_us']):>8} "
                  f"{_fmt(w['launch_us'])} {_fmt(w['total_us'])} {_fmt(r['plan_us']):>9}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsv4_attn.bench.host", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(CASES))
    p.add_argument("--backend", default="triton", help="the backend whose layer calls are timed (default triton)")
    p.add_argument("--device", default=None, help="cuda (default when torch sees a GPU) or cpu")
    p.add_argument("--calls", type=int, default=200, help="calls per round (default 200)")
    p.add_argument("--rounds", type=int, default=15, help="rounds; the median is over them (default 15)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..common.checks import resolve_device

    try:
        device = resolve_device(args.device, "--device")
    except ValueError as exc:
        print(f"host bench: {exc}", file=sys.stderr)
        return 2
    if device.type == "cpu" and args.backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU's triton platform; kernels are stubbed anyway
    results = [measure_case(_make_case(name, device), args.backend, args.calls, args.rounds)
               for name in args.cases]
    print_table(results, device)
    if args.json:
        import triton

        meta = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                else "cpu", "torch": torch.__version__, "triton": triton.__version__,
                "python": sys.version.split()[0], "calls": args.calls, "rounds": args.rounds}
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
