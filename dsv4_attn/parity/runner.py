"""Running the matrix: every selected case on every backend, with a progress bar, into one report.

Also which backends run by default, which are emulated (labelled so in the table and the JSON),
and the versions and host facts every report records.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform as _pyplatform
import sys
import time

import torch
from tqdm import tqdm

from ..common import registry
from ..common.checks import resolve_device
from ..common.platform import platform_for_device, probe
from .inputs import make_inputs
from .judge import CaseReference, run_cell
from .matrix import Case, Matrix
from .report import SCHEMA


def progress_bar(total: int, enabled: bool) -> tqdm:
    """tqdm on stderr: cases done, elapsed time and ETA. In a log (stderr not a terminal) it
    redraws about every tenth of the run instead of several times a second."""
    tty = sys.stderr.isatty()
    return tqdm(total=total, unit="case", file=sys.stderr, disable=not enabled or total == 0, dynamic_ncols=tty,
                mininterval=0.1 if tty else 0, miniters=None if tty else max(1, total // 10))


def default_backends(matrix: Matrix, device: torch.device) -> list[str]:
    """The matrix's backend list for this device kind (``all`` = every registered backend)."""
    key = "cpu" if device.type == "cpu" else "gpu"
    names = matrix.backends.get(key, "all") if isinstance(matrix.backends, dict) else matrix.backends
    return resolve_backends(names)


def resolve_backends(names, also: tuple[str, ...] = ()) -> list[str]:
    """Backend names from a list / comma-separated string; ``all`` = every registered backend;
    ``also``: further names the caller takes (bench: ``auto``, the dispatcher's own choice).
    Raises ValueError for a name the registry does not know."""
    if isinstance(names, str):
        names = [names]
    flat = [n.strip() for item in names for n in str(item).split(",") if n.strip()]
    known = registry.backend_names()
    out: list[str] = []
    for n in flat:
        for name in (known if n == "all" else [n]):
            if name not in known and name not in also:
                raise ValueError(f"--backends: got {name!r}; allowed: 'all' or any of {[*known, *also]}")
            if name not in out:
                out.append(name)
    return out


def emulated_backends(backends: list[str]) -> set[str]:
    """Backends whose results come from an emulator (``Backend.emulated``: labelled in the table
    and the JSON), e.g. AITER while its emulator is on (``--emulate-aiter``,
    ``DSV4_ATTN_AITER_EMULATOR``). A backend that cannot be imported is not emulated (its cells are
    skipped with the reason)."""
    return {name for name in backends if (impl := registry.get_backend(name)) is not None and impl.emulated}


def emulation_tags(emulated: set[str]) -> list[str]:
    """Per emulated backend, what it emulates, for file names (``Backend.emulation_tag``):
    ``aiter-gfx950-0.1.20.post1`` (the emulated arch and AITER version)."""
    return [impl.emulation_tag() if (impl := registry.get_backend(name)) is not None else name
            for name in sorted(emulated)]


def run_name(report: dict, full: bool) -> str:
    """The stem of a run's result files: machine, backends, emulation (and ``full``), so runs of
    different backends or emulators on one machine never overwrite each other, e.g.
    ``parity-cpu-cpu-torch``, ``parity-cpu-cpu-torch+aiter-emulated-aiter-gfx950-0.1.20.post1``,
    ``parity-cuda-sm90-torch+triton+flashmla-full``."""
    plat = report["platform"]
    parts = ["parity", plat["vendor"], plat["arch"], "+".join(report["backends"])]
    if report["emulated"]:
        parts += ["emulated", "+".join(emulation_tags(set(report["emulated"])))]
    if full:
        parts.append("full")
    return "".join(c if c.isalnum() or c in "+-._" else "_" for c in "-".join(parts))


def backend_labels(backends: list[str]) -> dict[str, str]:
    """A backend's own description for result files (``Backend.label()``, e.g. AITER's "aiter
    [EMULATED gfx950, AITER ...]"), its name when it cannot be imported."""
    out = {}
    for name in backends:
        impl = registry.get_backend(name)
        try:
            out[name] = impl.label() if impl is not None else name
        except Exception as exc:
            out[name] = f"{name} (label() raised {type(exc).__name__})"
    return out


def run(matrix: Matrix, backends: list[str], device: torch.device | str | None = None,
        cases: list[Case] | None = None, progress: bool = True, emulated: set[str] | None = None) -> dict:
    """Run every case on every backend; the full report (see docs/parity.md for its schema)."""
    device = resolve_device(device)
    cases = matrix.cases if cases is None else cases
    emulated = emulated_backends(backends) if emulated is None else emulated
    t0 = time.monotonic()
    bar = progress_bar(len(cases), progress)
    records = []
    try:
        for case in cases:
            cpu = make_inputs(case)
            dev = cpu.to(device)
            ref = CaseReference(dev)
            cells = {}
            for name in backends:
                cells[name] = run_cell(name, dev, ref, matrix.tolerance(case, name), name in emulated,
                                       matrix.output_full_max, matrix.output_sample)
            records.append({**case.describe(), "input_sha256": cpu.digest, "cells": cells})
            bar.set_postfix_str(case.name[-40:], refresh=False)
            bar.update(1)
    finally:
        bar.close()
    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.monotonic() - t0, 1),
        "matrix": {"path": matrix.shown_path, "sha256": matrix.sha256, "seed": matrix.seed,
                   "cases_in_matrix": len(matrix.cases), "cases_run": len(cases)},
        "device": str(device),
        "machine": _machine_label(device),
        "backends": backends,
        "emulated": sorted(emulated & set(backends)),
        "backend_labels": backend_labels(backends),
        "platform": platform_for_device(device).as_dict(),
        "environment": environment(),
        "summary": _summary(records, backends),
        "cases": records,
    }


def environment() -> dict:
    """Versions and host facts recorded in every report."""
    from .. import __version__

    versions = {"dsv4_attn": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
                "torch_cuda": torch.version.cuda, "torch_hip": getattr(torch.version, "hip", None),
                "numpy": _dist_version("numpy"), "pyyaml": _dist_version("pyyaml")}
    for key, info in probe().libraries.items():
        versions[key] = info.version if info.found else None
    return {"versions": versions, "os": _pyplatform.platform(), "cpu": _pyplatform.processor() or
            _pyplatform.machine(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _machine_label(device: torch.device) -> str:
    """The device's arch (cpu, sm90, gfx950, ...): merged columns are named backend@label."""
    return platform_for_device(device).arch


def _summary(records: list[dict], backends: list[str]) -> dict:
    out = {}
    for name in backends:
        counts = {"pass": 0, "fail": 0, "error": 0, "skip": 0}
        for rec in records:
            counts[rec["cells"][name]["status"]] += 1
        out[name] = counts
    return out


def failed(report: dict) -> bool:
    return any(c["fail"] or c["error"] for c in report["summary"].values())
