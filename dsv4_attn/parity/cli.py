"""``dsv4-attn parity``: argument parsing, and the glue from them to a run or a merge.

    dsv4-attn parity                                   # packaged default matrix, this machine
    dsv4-attn parity --backends all --cases 'core.c4a.*'
    dsv4-attn parity --full --out parity-h100          # + production-sized shapes (GPU machines)
    dsv4-attn parity --merge cpu/*.json h100/*.json    # one file per run; merged tables are skipped

Exit status: 0 when every cell that ran passed, 1 when a cell failed or nothing ran, 2 for bad
arguments or a bad matrix file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..cli import check_count, check_environment, check_output
from ..common.checks import resolve_device
from ..common.platform import triton_interpreting
from .matrix import load_matrix
from .merge import load_runs, merge_reports, render_merge
from .report import finite_json, render_report, render_summary, write_files
from .runner import default_backends, emulated_backends, failed, resolve_backends, run, run_name

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
    p.add_argument("--out", default=DEFAULT_OUT, help=f"directory for the JSON and Markdown (default ./{DEFAULT_OUT}); "
                   "a run writes parity-<vendor>-<arch>-<backends>[-emulated-...][-full].json/.md, a merge "
                   "merged.json/.md")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge parity JSON files into the cross-vendor table "
                   "(merged tables among them, e.g. an earlier merged.json, are skipped)")
    p.add_argument("--emulate-aiter", nargs="?", const="1", metavar="ARCH[:FLAVOR]",
                   help="run the aiter backend through the AITER emulator (dsv4_attn.emulation; e.g. "
                        "gfx950, gfx942, gfx950:0.1.7); its cells are labelled emulated")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on a CPU device, else torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_environment()
        check_count(args.threads, "--threads")
        if args.merge:
            return _merge(args.merge, check_output(args.out, "--out", directory=True))
        if args.emulate_aiter:
            _enable_aiter_emulator(args.emulate_aiter)
        matrix = load_matrix(args.matrix, full=args.full)
        cases = matrix.select(args.cases)
        if args.list:
            print("\n".join(c.name for c in cases))
            return 0
        device = resolve_device(args.device, "--device")
        if args.threads or device.type == "cpu":
            # One thread by default: on an idle 2-core machine the default matrix takes 37 s instead
            # of 25 s, but when other processes share the cores OpenMP workers spin-wait and two
            # threads ran 3-4x slower than one (measured), which would break the 3-minute budget.
            torch.set_num_threads(args.threads or 1)
        backends = resolve_backends(args.backends) if args.backends else default_backends(matrix, device)
        if args.emulate_aiter and not args.backends and "aiter" not in backends:
            backends.append("aiter")
        out = check_output(args.out, "--out", directory=True)
    except ValueError as exc:
        print(f"dsv4-attn parity: {exc}", file=sys.stderr)
        return 2
    note = long_run_note(emulated_backends(backends), backends, device, cases)
    if note:
        print(f"dsv4-attn parity: {note}", file=sys.stderr)
    report = run(matrix, backends, device, cases, progress=not args.no_progress)
    markdown = render_report(report)
    paths = write_files(out, run_name(report, args.full), finite_json(report), markdown)
    print(render_summary(report, paths[1]), end="")
    if not any(s["pass"] + s["fail"] + s["error"] for s in report["summary"].values()):
        print("dsv4-attn parity: no cell ran (every backend skipped every case)", file=sys.stderr)
        return 1
    return int(failed(report))


def _merge(paths: list[str], out_dir: Path) -> int:
    """``--merge``: the cross-vendor table in ``out_dir``, its pairwise summary on stdout."""
    reports, names, skipped = load_runs(paths)
    for note in skipped:
        print(f"dsv4-attn parity: {note}", file=sys.stderr)
    merged = merge_reports(reports, names)
    markdown = render_merge(merged)
    written = write_files(out_dir, "merged", finite_json(merged), markdown)
    bad = sum(c["status"] in ("fail", "error") for case in merged["cases"] for c in case["cells"].values())
    pairwise = markdown[markdown.index("| column A |"):].split("\n\n", 1)[0]
    print(f"dsv4-attn parity: merged {len(reports)} run(s), {len(merged['cases'])} cases, "
          f"{len(merged['columns'])} columns, {bad} failed or raising cell(s)\n\n{pairwise}\n\n"
          f"full table: {written[1]}")
    return int(bad > 0)


# A case's cost with the AITER emulator on a 2-core CPU, one torch thread (torch backend included),
# measured on the packaged matrix: its 968 cases (V4 and V4.1) in 7 min 15 s with the machine shared,
# 1.5 GB peak; its 504 V4 cases alone in 4 min 51 s, 1.7 GB peak.
_EMULATED_AITER_SECONDS_PER_CASE = 0.45


def long_run_note(emulated: set[str], backends: list[str], device: torch.device, cases: list) -> str | None:
    """What to say before a run that will take minutes: an emulated AITER over a minute's worth of
    cases (time and memory as measured on a 2-core CPU), or the Triton kernels under the CPU
    interpreter."""
    if device.type == "cpu" and "triton" in backends and triton_interpreting():
        return (f"{len(cases)} cases on the Triton kernels under the CPU interpreter: expect minutes per case at "
                "production shapes; --cases selects fewer")
    seconds = len(cases) * _EMULATED_AITER_SECONDS_PER_CASE
    if "aiter" in emulated and seconds >= 60:
        return (f"the AITER emulator models AITER's kernels in torch, cell by cell: about {seconds / 60:.0f} min "
                f"for {len(cases)} cases on a 2-core CPU and up to 1.7 GB of memory (the progress bar shows the "
                "ETA)")
    return None


def _enable_aiter_emulator(value: str) -> None:
    """Switch the AITER emulator on for this process (``value``: 1, ARCH or ARCH:FLAVOR)."""
    try:
        from .. import emulation

        emulator = emulation.parse_env(value)
        if emulator is None:
            raise ValueError("it switches the emulator off")
        emulation.enable(emulator.arch, emulator.flavor)
    except ImportError as exc:
        raise ValueError(f"--emulate-aiter: the AITER emulator is not available ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"--emulate-aiter: got {value!r} ({exc}); allowed: 1, gfx950, gfx942, "
                         "or ARCH:FLAVOR such as gfx950:0.1.7") from None
