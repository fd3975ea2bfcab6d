"""`dsv4-attn bench`: decode and prefill benchmarks with the roofline and FlashMLA side by side.

For every case it times our backend (default ``triton``) and, in the same run, FlashMLA when it
can be loaded, and prints µs, TFLOP/s, GB/s, the roofline floor (from the copy bandwidth and
the bf16 matrix rate measured at the start of the run), time / floor, FlashMLA's µs and our
speed-up over it. Timing: CUDA-graph replay (or eager launches with ``--no-graph``), one event
pair per run, the L2 flushed before every run, median of ``--reps`` runs.

Bytes of a case = every valid KV row once, in its cache's record (V4 fp8 584 B, V4.1 MXFP8 528 B,
NVFP4 288 B, BF16 1024 B, FP8 per-tensor 512 B) + q + out; FLOPs = 4 · H · valid keys · 512 per
token (Q·Kᵀ and P·V). The floor is what those bytes and FLOPs cost at the measured ceilings.

Configs: V4 (C4A / C128A layers, ``h64-c4a512`` ...) and V4.1 (C1A / C2A top-k layers,
``h64-c1a512`` ...; ``v41-`` prefill). ``--format`` takes several KV formats; a config runs in
every format its model stores (V4.1 records: V4.1 configs only), e.g. the V4.1 configs in
``fp8_ds_mla`` (vLLM's record for V4.1 on SM90, FlashMLA side by side) and in ``mxfp8_ds_mla`` /
``nvfp4_ds_mla`` (SM100 records, dequantized in software: on SM90 by the Gluon records kernel).

``--guard-cost`` also times each Triton kernel this GPU runs (Gluon on sm_90 for fp8_ds_mla and the
V4.1 records, the portable one everywhere) compiled with and without its index range checks (out-of-range entries
skipped, never read: docs/bad-input.md) on the same case, interleaved A-B-B-A, and prints the
checks' cost in percent (target < 1 %) and whether both builds gave the same bits.

``--mode step`` times one whole decode step of DeepSeek-V4-Flash (``v4-flash``: 64 heads, top-k
512, 43 layers: 0-1 window only, then C4A on even and C128A on odd layers, per the public model
card) and DeepSeek-V4-Pro (``v4-pro``: 128 heads, top-k 1024, 61 layers: 0-1 C128A, then C4A /
C128A alternating; from third-party summaries of its config, not its config.json), the layer
list built by ``ModelSpec.from_hf_config`` (the MTP draft layer left out: it runs in the
drafter's own forward). One step = ``plan()`` once + every attention layer, captured as ONE
graph, for ``auto`` (``SparseMLA(backend="auto")``), each ``--backends`` name and FlashMLA driven
the way vLLM 0.33 drives it (``flashmla_vllm_step_runner``: its per-step metadata, a C4A layer's
top-k translation and the raw ``sparse_decode_fwd`` per layer); it prints µs per step and per
layer and each one's speed-up over FlashMLA-as-vLLM (target: auto >= 1.2x). Every layer owns
its SWA cache and C128A cache; the C4A layers share one compressed cache (memory), each with
its own top-k and q. On ``--device cpu`` it runs the torch backend at context lengths <= 2048.

FlashMLA is timed through ``SparseMLA(..., backend="flashmla")`` when that backend is usable
(so its adapter is timed too); otherwise through the raw op ``torch.ops._flashmla_C`` of the
library the flashmla backend loaded (``Backend.raw_ops``: a package, or
``$DSV4_ATTN_FLASHMLA_LIB``) when it has vLLM 0.33's op schemas (noted in the output: raw prefill
then times the kernel on a ready bf16 workspace, without the gather).

    dsv4-attn bench --mode decode --batches 2 64 128 256 --json out.json --png out.png
    dsv4-attn bench --mode step --backends triton flashmla --batches 64 128 256 --json step.json
    dsv4-attn bench --configs v41 --format fp8_ds_mla mxfp8_ds_mla nvfp4_ds_mla --json v41.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import torch

from ..common import choices
from ..common.layout import KVFormat
from ..common.spec import LayerKind
from . import report
from .cases import make_decode_case, make_model_step, make_prefill_case
from .configs import (
    CONFIG_GROUPS,
    DECODE_CONFIGS,
    PREFILL_CONFIGS,
    STEP_CPU_MAX_MODEL_LEN,
    STEP_MAX_MODEL_LEN,
    STEP_MODELS,
    runs_in,
    select_configs,
)
from .layer import guard_cost, guard_variants, run_case
from .runners import VARIANT_PREFIX, flashmla_lib, register_variant
from .step import run_step_case
from .timing import L2Flush, measure_ceilings, warm_up


def batch_invariant_rows(backends: list[str]) -> list[str]:
    """The ``NAME+batch-invariant`` rows of ``--batch-invariant``: one per named backend that
    declares the mode (Backend.batch_invariant; today triton)."""
    from ..common.registry import get_backend
    from .runners import BATCH_INVARIANT

    return [name + BATCH_INVARIANT for name in backends
            if name != "auto" and (impl := get_backend(name)) is not None and impl.batch_invariant]


def default_backends() -> list[str]:
    """What `dsv4-attn bench` times without --backend: the portable kernels, and on ROCm the AITER
    path first."""
    from ..common.platform import probe

    return ["aiter", "triton"] if probe().vendor == "rocm" else ["triton"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-attn bench", description=__doc__.split("\n\n")[0] + " Exit status: 0 every case ran, 1 a case "
        "failed, 2 bad arguments. On a machine without a GPU, --device cpu times the torch backend at small decode "
        "shapes: it exists to try the tool and its outputs, the numbers say nothing about GPU kernels.")
    p.add_argument("--mode", choices=["decode", "prefill", "step", "all"], default="decode",
                   help="decode / prefill: one layer per case; step: one whole decode step of a model (plan once + "
                        "every attention layer) for 'auto', each --backends name and FlashMLA driven as vLLM 0.33 "
                        "drives it, side by side; all: the three")
    p.add_argument("--configs", nargs="+", metavar="NAME", default=None,
                   help=f"decode: {', '.join(DECODE_CONFIGS)}; prefill: {', '.join(PREFILL_CONFIGS)}; step: "
                        + "; ".join(f"{m.name} ({m.source})" for m in STEP_MODELS.values())
                        + "; or the groups 'v4' / 'v41' / 'tp' (tensor-parallel shards, fewer than 64 heads: timed "
                          "only when named or with 'tp') (default: all of --mode but the shards; with "
                          "--write-choices the decode shards too); an unknown name is an error")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="requests per decode case (default 2 64 128 256; on the CPU 2)")
    p.add_argument("--mtp", type=int, nargs="+", default=None,
                   help="query tokens per request, decode (default 1 2; on the CPU 1)")
    p.add_argument("--backends", nargs="+", metavar="NAME", default=None,
                   help="backends to time (names or comma lists; 'all' = every registered backend; 'auto' = what "
                        "the dispatcher picks per case, compared with the named ones). Default: triton; aiter and "
                        "triton on ROCm; torch on the CPU")
    p.add_argument("--backend", nargs="+", dest="backends", help=argparse.SUPPRESS)  # the old name
    p.add_argument("--variant", action="append", default=[],
                   help="development: also time a triton kernel config, e.g. "
                        "'bn64=block_n=64,num_warps=8,num_stages=2,dot_dtype=bf16' (repeatable)")
    p.add_argument("--format", nargs="+", default=["fp8_ds_mla"],
                   help="KV format(s): fp8_ds_mla, bfloat16, fp8_e4m3, mxfp8_ds_mla, nvfp4_ds_mla (V4.1 records: "
                        "V4.1 configs only)")
    p.add_argument("--device", help="cuda (default when torch sees a GPU) or cpu (the torch backend only)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per case (default 50; on the CPU 5)")
    p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replays")
    p.add_argument("--no-flashmla", action="store_true", help="do not time FlashMLA beside our backends")
    p.add_argument("--batch-invariant", action="store_true",
                   help="also time each named backend that offers it under SparseMLA(batch_invariant=True), as "
                        "'NAME+batch-invariant' (docs/batch-invariance.md): the mode's cost, side by side")
    p.add_argument("--guard-cost", action="store_true",
                   help="also time each Triton kernel with and without its index range checks (same case, "
                        "A-B-B-A) and print the checks' cost")
    p.add_argument("--json", metavar="PATH", help="write every result (with min / median / p90) and the run's facts")
    p.add_argument("--csv", metavar="PATH", help="write one row per case and backend (min / median / p90 µs, rates)")
    p.add_argument("--write-choices", metavar="PATH",
                   help="write a measured-choices table (per shape: each backend's us per layer and, for decode, "
                        "its own per-step work; common/choices.py) from this run's backends here; use it with "
                        "DSV4_ATTN_CHOICES=PATH or ship it in dsv4_attn/data/choices/<arch>-<device>.json (the "
                        "name it prints)")
    p.add_argument("--update-choices", metavar="PATH",
                   help="merge this run into the measured-choices table at PATH (one measured on this GPU): "
                        "the shapes the run times (phase, kind, heads, format) take its measurements, the "
                        "table's other entries stay")
    p.add_argument("--png", metavar="PATH", help="plot time vs batch (ours, FlashMLA, floor); needs matplotlib")
    return p


def unknown_configs(names: list[str], mode: str) -> list[str]:
    """The ``--configs`` names that name no config (nor group) of ``mode``."""
    tables = [t for m, t in (("decode", DECODE_CONFIGS), ("prefill", PREFILL_CONFIGS), ("step", STEP_MODELS))
              if mode in (m, "all")]
    return [n for n in names if not any(select_configs(t, [n]) for t in tables)]


def settle(args) -> torch.device:
    """Check the arguments and fill the device-dependent defaults in ``args``, before any work;
    the device to run on. Raises ValueError with what is wrong and what is allowed."""
    from ..cli import check_environment, check_output
    from ..common.checks import resolve_device
    from ..parity.runner import resolve_backends

    check_environment()
    device = resolve_device(args.device, "--device")
    for flag in ("json", "csv", "write_choices", "png"):  # before minutes of timing, not after
        if getattr(args, flag):
            check_output(getattr(args, flag), f"--{flag.replace('_', '-')}")
    for fmt in args.format:
        KVFormat.parse(fmt)
    if args.configs and unknown_configs(args.configs, args.mode):
        names = (*DECODE_CONFIGS, *PREFILL_CONFIGS, *STEP_MODELS, *CONFIG_GROUPS)
        allowed = [n for n in names if not unknown_configs([n], args.mode)]
        raise ValueError(f"--configs: got {unknown_configs(args.configs, args.mode)} (--mode {args.mode}); "
                         f"allowed: {allowed}")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"--png: got {args.png!r}, but matplotlib is not installed; allowed: after "
                         "pip install matplotlib (or the package's [bench] extra), or no --png")
    for name in ("batches", "mtp", "reps"):
        values = getattr(args, name)
        if values is not None and min(values if isinstance(values, list) else [values]) < 1:
            raise ValueError(f"--{name}: got {values}; allowed: positive ints")
    cpu = device.type == "cpu"
    args.backends = (resolve_backends(args.backends, also=("auto",)) if args.backends
                     else ["torch"] if cpu else default_backends())
    if cpu:
        _refuse_gpu_only(args)
        args.no_flashmla, args.no_graph = True, True
    args.batches = args.batches or ([2] if cpu else [2, 64, 128, 256])
    args.mtp = args.mtp or ([1] if cpu else [1, 2])
    args.reps = args.reps or (5 if cpu else 50)
    if args.update_choices:
        _check_table_to_update(args.update_choices, device)
    return device


def _check_table_to_update(path: str, device: torch.device) -> None:
    """ValueError unless ``path`` holds a choices table of this GPU's arch and name (what
    ``--update-choices`` merges into), before any timing."""
    from ..common.platform import probe

    choices.check_measured_on(choices.read_table(path, "--update-choices"), probe().arch,
                              _device_facts(device)["device"])


def _refuse_gpu_only(args) -> None:
    """ValueError for what ``--device cpu`` cannot run: production-sized prefill, GPU backends,
    the Triton kernels' variants and a choices table."""
    refused = {"--mode": args.mode not in ("decode", "step") and
               "prefill configs are production-sized (4k-8k query tokens)",
               "--backends": bool(set(args.backends) - {"torch", "auto"}) and
               f"{args.backends}: only the torch backend runs on CPU ('auto' picks it)",
               "--guard-cost": args.guard_cost and "it times Triton kernels", "--variant": args.variant and
               "it times Triton kernels",
               "--write-choices": args.write_choices and "CPU timings choose no GPU backend",
               "--update-choices": args.update_choices and "CPU timings choose no GPU backend"}
    for flag, why in refused.items():
        if why:
            raise ValueError(f"{flag}: {why}; allowed on --device cpu: the torch backend at decode shapes "
                             "(--mode decode or step)")


def _device_facts(device: torch.device) -> dict:
    if device.type == "cpu":
        import platform

        return {"device": platform.processor() or platform.machine() or "cpu", "sms": None}
    props = torch.cuda.get_device_properties(device)
    return {"device": props.name, "sms": props.multi_processor_count}


def decode_configs(args) -> list[str]:
    """The run's decode configs: ``--configs``, else all but the tensor-parallel shards; with
    ``--write-choices`` and no ``--configs`` the shards too, since a table ``auto`` reads must cover
    the head counts a rank looks up (a bucket the table lacks falls to the priority list, whose cuda
    decode order puts flashmla first, padding 8 or 16 heads to 64: notes/perf-h200.md)."""
    if args.write_choices and not args.configs:
        return list(DECODE_CONFIGS)
    return select_configs(DECODE_CONFIGS, args.configs)


def list_cases(args, formats: list[KVFormat]) -> list[tuple[str, str, int, int, KVFormat]]:
    """(phase, config name, requests, query tokens per request, format) of every case of the run,
    in the order they run: per format, decode, then prefill, then whole steps."""
    cases: list[tuple[str, str, int, int, KVFormat]] = []
    for fmt in formats:
        if args.mode in ("decode", "all"):
            for name in decode_configs(args):
                if runs_in(DECODE_CONFIGS[name].kind, fmt):
                    cases.extend(("decode", name, b, sq, fmt) for sq in args.mtp for b in args.batches)
        if args.mode in ("prefill", "all"):
            cases.extend(("prefill", name, 0, 0, fmt) for name in select_configs(PREFILL_CONFIGS, args.configs)
                         if runs_in(PREFILL_CONFIGS[name].kind, fmt))
        if args.mode in ("step", "all") and runs_in(LayerKind.C4A, fmt):
            cases.extend(("step", name, b, sq, fmt) for name in select_configs(STEP_MODELS, args.configs)
                         for sq in args.mtp for b in args.batches)
    return cases


def run_one(phase: str, name: str, b: int, sq: int, fmt: KVFormat, args, device: torch.device, ceilings: dict,
            flush, guards: dict) -> dict:
    """One case built and timed: its result row (its inputs freed when this returns)."""
    if phase == "step":
        step_len = STEP_CPU_MAX_MODEL_LEN if device.type == "cpu" else STEP_MAX_MODEL_LEN
        step_case = make_model_step(STEP_MODELS[name], b, sq, device, fmt, max_model_len=step_len)
        return run_step_case(step_case, args.backends, args, flush)
    case = (make_decode_case(DECODE_CONFIGS[name], b, sq, device, fmt) if phase == "decode"
            else make_prefill_case(PREFILL_CONFIGS[name], device, fmt))
    res = run_case(case, args.backends, args, ceilings, flush)
    if guards:
        res["guard_cost"] = guard_cost(case, guards[fmt], args, flush)
    return res


def run_cases(cases: list[tuple[str, str, int, int, KVFormat]], args, device: torch.device, ceilings: dict,
              flush) -> list[dict]:
    """Every case run and printed as it finishes; a case that raises is a row with its error."""
    guards = {fmt: guard_variants(fmt) for fmt in dict.fromkeys(c[-1] for c in cases)} if args.guard_cost else {}
    if any(phase != "step" for phase, *_ in cases):
        print(report.HEADER)
    results: list[dict] = []
    for phase, name, b, sq, fmt in cases:
        if phase == "step" and not any(r.get("phase") == "step" for r in results):
            print(report.STEP_HEADER)
        try:
            res = run_one(phase, name, b, sq, fmt, args, device, ceilings, flush, guards)
        except Exception as exc:
            print(f"{phase} {name} b={b} s_q={sq} {fmt.value}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)
            results.append({"case": f"{name} b={b} s_q={sq}", "phase": phase, "format": fmt.value,
                            "error": f"{type(exc).__name__}: {exc}"})
            continue
        results.append(res)
        report.print_case(res, args.backends)
        if device.type != "cpu":
            torch.cuda.empty_cache()
    return results


def _without_variants(rows: list[dict]) -> list[dict]:
    """The one-layer rows without the ``--variant`` timings: a variant ('t:...') is registered in
    the bench's process alone, so a table ordering it first would name a backend that no later
    process runs."""
    return [dict(r, backends={n: b for n, b in r["backends"].items() if not n.startswith(VARIANT_PREFIX)})
            if r.get("backends") else r for r in rows]


def write_outputs(args, meta: dict, results: list[dict], per_layer: list[dict]) -> None:
    """--json, --csv, --write-choices (from the one-layer cases) and --png, as asked."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    if args.csv:
        report.write_csv(results, args.csv)
    if args.write_choices or args.update_choices:
        from ..common.platform import probe

        table = choices.from_bench({"meta": meta, "results": _without_variants(per_layer)}, probe().arch)
        if args.write_choices:
            with open(args.write_choices, "w") as f:
                json.dump(table, f, indent=1)
            print(f"wrote {len(table['entries'])} measured choices for {table['arch']} ({table['device']}) to "
                  f"{args.write_choices}; to ship it: dsv4_attn/data/choices/"
                  f"{choices.packaged_name(table['arch'], str(table['device'] or ''))}")
        if args.update_choices:
            old = choices.read_table(args.update_choices, "--update-choices")
            with open(args.update_choices, "w") as f:
                f.write(json.dumps(choices.merged(old, table), indent=1) + "\n")
            print(f"merged {len(table['entries'])} measured choices into {args.update_choices}")
    if args.png:
        try:
            report.plot([r for r in per_layer if "error" not in r], args.png, args.backends[0])
        except Exception as exc:
            print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        device = settle(args)
    except ValueError as exc:
        print(f"dsv4-attn bench: {exc}", file=sys.stderr)
        return 2
    formats = [KVFormat.parse(f) for f in args.format]
    args.backends.extend(register_variant(spec_str) for spec_str in args.variant)
    if args.batch_invariant:
        args.backends.extend(batch_invariant_rows(args.backends))
    t0 = time.time()
    if device.type != "cpu":
        warm_up(device)
    ceilings = measure_ceilings(device)
    flush = L2Flush(device) if device.type != "cpu" else None
    meta = {**_device_facts(device), "torch": torch.__version__, "triton": _version("triton"), "ceilings": ceilings,
            "formats": [f.value for f in formats], "flashmla_lib": flashmla_lib(), "reps": args.reps,
            "graph": not args.no_graph}
    report.print_banner(meta, cpu=device.type == "cpu", flushed=flush is not None)
    results = run_cases(list_cases(args, formats), args, device, ceilings, flush)
    meta["seconds"] = time.time() - t0
    per_layer = [r for r in results if r.get("phase") != "step"]  # one-layer cases: auto's check, choices, plot
    if "auto" in args.backends:
        report.print_auto_gaps(per_layer)
    report.print_step_auto_gaps([r for r in results if r.get("phase") == "step"])
    write_outputs(args, meta, results, per_layer)
    return 1 if any("error" in r for r in results) else 0


def _version(name: str) -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version(name)
    except Exception:
        return None
