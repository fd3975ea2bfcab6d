"""``dsv4-attn parity``: argument parsing, and the glue from them to a run or a merge.

    dsv4-attn parity                                   # packaged default matrix, this machine
    dsv4-attn parity --backends all --cases 'core.c4a.*'
    dsv4-attn parity --full --out parity-h100          # + production-sized shapes (GPU machines)
    dsv4-attn parity --merge cpu/parity-cpu-cpu.json h100/parity-cuda-sm90.json

Exit status: 0 when every cell that ran passed, 1 when a cell failed or nothing ran, 2 for bad
arguments or a bad matrix file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .matrix import load_matrix
from .merge import load_report, merge_reports, render_merge
from .report import finite_json, render_report, write_files
from .runner import default_backends, default_device, failed, resolve_backends, run

DEFAULT_OUT = "parity-out"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-attn parity",
        description="Run the parity matrix (every backend vs the float64 reference) or merge runs from "
                    "several machines into the cross-vendor table. Exit status: 0 all cells that ran passed, "
                    "1 a cell failed or nothing ran, 2 bad arguments.")
    p.add_argument("--matrix", help="matrix YAML (default: the packaged dsv4_attn/data/parity.yaml)")
    p.add_argument("--backends", nargs="+", metavar="NAME",
                   help="backends to run (names or comma lists; 'all' = every registered backend). Default: "
                        "the matrix's list for this device (CPU: torch)")
    p.add_argument("--cases", metavar="PATTERN", help="comma-separated globs over case names "
                   "(no wildcard: substring), e.g. 'core.c4a.*.long'")
    p.add_argument("--full", action="store_true", help="add the large shapes (sweeps marked full: GPU machines)")
    p.add_argument("--device", help="device under test (default: cuda when available, else cpu)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"directory for the JSON and Markdown (default ./{DEFAULT_OUT})")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge parity JSON files into the cross-vendor table")
    p.add_argument("--emulate-aiter", nargs="?", const="1", metavar="ARCH[:FLAVOR]",
                   help="run the aiter backend through the AITER emulator (dsv4_attn.rocm.emulate; e.g. "
                        "gfx950, gfx942, gfx950:0.1.7); its cells are labelled emulated")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on a CPU device, else torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.merge:
            reports = [load_report(p) for p in args.merge]
            merged = merge_reports(reports, args.merge)
            markdown = render_merge(merged)
            print(markdown, end="")
            paths = write_files(Path(args.out), "merged", finite_json(merged), markdown)
            print(f"wrote {paths[0]} and {paths[1]}", file=sys.stderr)
            return int(any(c["status"] in ("fail", "error") for case in merged["cases"]
                           for c in case["cells"].values()))
        if args.emulate_aiter:
            _enable_aiter_emulator(args.emulate_aiter)
        matrix = load_matrix(args.matrix, full=args.full)
        cases = matrix.select(args.cases)
        if args.list:
            print("\n".join(c.name for c in cases))
            return 0
        device = _device(args.device) if args.device else default_device()
        if args.threads or device.type == "cpu":
            # One thread by default: on an idle 2-core machine the default matrix takes 37 s instead
            # of 25 s, but when other processes share the cores OpenMP workers spin-wait and two
            # threads ran 3-4x slower than one (measured), which would break the 3-minute budget.
            torch.set_num_threads(args.threads or 1)
        backends = resolve_backends(args.backends) if args.backends else default_backends(matrix, device)
        if args.emulate_aiter and not args.backends and "aiter" not in backends:
            backends.append("aiter")
    except ValueError as exc:
        print(f"dsv4-attn parity: {exc}", file=sys.stderr)
        return 2
    report = run(matrix, backends, device, cases, progress=not args.no_progress)
    markdown = render_report(report)
    print(markdown, end="")
    plat = report["platform"]
    paths = write_files(Path(args.out), f"parity-{plat['vendor']}-{plat['arch']}", finite_json(report), markdown)
    print(f"wrote {paths[0]} and {paths[1]}", file=sys.stderr)
    if not any(s["pass"] + s["fail"] + s["error"] for s in report["summary"].values()):
        print("dsv4-attn parity: no cell ran (every backend skipped every case)", file=sys.stderr)
        return 1
    return int(failed(report))


def _device(arg: str) -> torch.device:
    try:
        device = torch.device(arg)
    except RuntimeError:
        raise ValueError(f"--device: got {arg!r}; allowed: a torch device such as cpu, cuda, cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: got {arg!r}, but torch sees no GPU; allowed: cpu")
    return device


def _enable_aiter_emulator(value: str) -> None:
    """Switch the AITER emulator on for this process (``value``: 1, ARCH or ARCH:FLAVOR)."""
    try:
        from ..rocm import emulate

        emulator = emulate.parse_env(value)
        if emulator is None:
            raise ValueError("it switches the emulator off")
        emulate.enable(emulator.arch, emulator.flavor)
    except ImportError as exc:
        raise ValueError(f"--emulate-aiter: the AITER emulator is not available ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"--emulate-aiter: got {value!r} ({exc}); allowed: 1, gfx950, gfx942, "
                         "or ARCH:FLAVOR such as gfx950:0.1.7") from None
