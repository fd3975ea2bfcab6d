"""Merge: the cross-vendor table from parity runs on different machines.

One column per (backend, machine); per case every column's figures, whether the inputs were
identical everywhere (their sha256), and the largest difference between any two columns'
outputs over the stored outputs or their common seeded sample.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .report import SCHEMA, Notes, decode_values, short_number

MERGE_SCHEMA = "dsv4-attn-parity-merge/1"


def load_runs(paths: list[str]) -> tuple[list[dict], list[str], list[str]]:
    """(reports, their paths, one note per file skipped) of the files to merge. A merged table
    (this command's own output, which a glob like ``out/*.json`` also catches) is skipped with a
    note, not merged; anything else that is not a run's JSON is a ValueError."""
    reports, names, skipped = [], [], []
    for path in paths:
        try:
            schema = json.loads(Path(path).read_text()).get("schema")
        except (OSError, json.JSONDecodeError, AttributeError):
            schema = None  # load_report says what is wrong with it
        if schema == MERGE_SCHEMA:
            skipped.append(f"skipped {path}: a merged table ({MERGE_SCHEMA}), not a run")
            continue
        reports.append(load_report(path))
        names.append(path)
    if not reports:
        raise ValueError(f"--merge: got {paths}, no parity run among them; allowed: JSON files written by "
                         "`dsv4-attn parity`")
    return reports, names, skipped


def load_report(path: str | os.PathLike) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--merge: cannot read {path}: {exc}") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"--merge: {path} has schema {report.get('schema') if isinstance(report, dict) else None!r}; "
                         f"allowed: {SCHEMA!r} (a JSON written by `dsv4-attn parity`)")
    return report


def merge_reports(reports: list[dict], names: list[str]) -> dict:
    """Combine runs: one column per (backend, machine). Per case: every column's figures, whether
    the inputs were identical everywhere, and the largest difference between any two columns'
    outputs (over the stored outputs or their common seeded sample). Pairwise summary: per pair
    of columns the largest difference over all cases and how many outputs were bit-identical."""
    columns, sources = _merge_columns(reports)
    order: list[str] = []
    by_case: dict[str, dict] = {}
    for report, cols in zip(reports, sources):
        for rec in report["cases"]:
            if rec["name"] not in by_case:
                order.append(rec["name"])
                by_case[rec["name"]] = {"name": rec["name"], "inputs": {}, "cells": {}}
            entry = by_case[rec["name"]]
            for backend, col in cols.items():
                entry["cells"][col] = rec["cells"][backend]
                entry["inputs"][col] = rec["input_sha256"]
    pairs: dict[tuple[str, str], dict] = {}
    cases = []
    for name in order:
        entry = by_case[name]
        consistent = len(set(entry["inputs"].values())) == 1
        diffs = _pairwise(entry, consistent)
        for key, d in diffs.items():
            agg = pairs.setdefault(key, {"max_diff": 0.0, "compared": 0, "identical": 0})
            agg["max_diff"] = max(agg["max_diff"], d["max_diff"])
            agg["compared"] += 1
            agg["identical"] += int(d["identical"])
        cases.append({
            "name": name, "inputs_identical": consistent,
            "max_pairwise_diff": max((d["max_diff"] for d in diffs.values()), default=None),
            "cells": {col: {k: cell.get(k) for k in ("status", "max_abs", "rel_l2", "cosine", "emulated", "ran",
                                                        "reasons", "out_sha256")}
                      for col, cell in entry["cells"].items()},
        })
    return {"schema": MERGE_SCHEMA, "sources": [_source(r, n) for r, n in zip(reports, names)],
            "columns": columns, "cases": cases,
            "pairwise": [{"a": a, "b": b, **v} for (a, b), v in pairs.items()]}


def _source(report: dict, name: str) -> dict:
    return {"file": name, "machine": report["machine"], "device": report["device"],
            "device_name": report["platform"]["device_name"], "created": report["created"],
            "matrix_sha256": report["matrix"]["sha256"], "versions": report["environment"]["versions"]}


def _merge_columns(reports: list[dict]) -> tuple[list[str], list[dict]]:
    """Column label per (report, backend): ``backend@machine`` (``+emu`` when emulated), suffixed
    with ``#i`` (the i-th file, from 1) when two runs come from the same kind of machine."""
    labels = []
    for report in reports:
        emu = set(report.get("emulated", []))
        labels.append({b: f"{b}@{report['machine']}" + ("+emu" if b in emu else "") for b in report["backends"]})
    flat = [lab for cols in labels for lab in cols.values()]
    for i, cols in enumerate(labels):
        for b, lab in cols.items():
            if flat.count(lab) > 1:
                cols[b] = f"{lab}#{i + 1}"
    return [lab for cols in labels for lab in cols.values()], labels


def _pairwise(entry: dict, consistent: bool) -> dict:
    """Max abs difference between every two columns that produced an output of this case."""
    outs = {col: cell for col, cell in entry["cells"].items() if cell.get("output")}
    result = {}
    cols = sorted(outs)
    for i, a in enumerate(cols):
        for b in cols[i + 1:]:
            if not consistent and entry["inputs"][a] != entry["inputs"][b]:
                continue
            ra, rb = outs[a]["output"], outs[b]["output"]
            if ra["shape"] != rb["shape"] or ra["count"] != rb["count"]:
                continue
            va, vb = decode_values(ra), decode_values(rb)
            both = torch.isfinite(va) & torch.isfinite(vb)
            diff = float((va - vb)[both].abs().max()) if bool(both.any()) else 0.0
            if not bool(both.all()):
                diff = math.inf
            result[(a, b)] = {"max_diff": diff, "identical": outs[a]["out_sha256"] == outs[b]["out_sha256"]}
    return result


def render_merge(merged: dict) -> str:
    columns = merged["columns"]
    notes = Notes()
    lines = ["# dsv4-attn parity: cross-vendor table", ""]
    lines += [f"- #{i + 1} `{s['file']}`: {s['machine']} ({s['device_name']}), torch {s['versions']['torch']}, "
              f"dsv4_attn {s['versions']['dsv4_attn']}, matrix {s['matrix_sha256'][:12]}, {s['created']}"
              for i, s in enumerate(merged["sources"])]
    if len({s["matrix_sha256"] for s in merged["sources"]}) > 1:
        lines.append("- WARNING: the runs used different matrix files; only cases with identical inputs are compared.")
    lines += ["", "Cell: verdict and relative L2 error against the float64 reference. `max diff`: largest "
              "|difference| between any two columns' outputs (stored output or its common seeded sample).", "",
              "| case | " + " | ".join(columns) + " | max diff |", "|---|" + "---|" * (len(columns) + 1)]
    for case in merged["cases"]:
        cells = []
        for col in columns:
            cell = case["cells"].get(col)
            cells.append("-" if cell is None else _merge_cell(cell, notes, col))
        diff = short_number(case["max_pairwise_diff"])
        if not case["inputs_identical"]:
            diff += " " + notes.ref("inputs differ between runs (different torch / matrix versions): "
                                    "only runs with identical inputs are compared")
        lines.append(f"| {case['name']} | " + " | ".join(cells) + f" | {diff} |")
    lines += ["", "| column A | column B | cases compared | bit-identical | max diff |", "|---|---|---|---|---|"]
    for p in merged["pairwise"]:
        lines.append(f"| {p['a']} | {p['b']} | {p['compared']} | {p['identical']} | {short_number(p['max_diff'])} |")
    if notes.texts:
        lines += [""] + [f"[{i + 1}] {t}" for i, t in enumerate(notes.texts)]
    return "\n".join(lines) + "\n"


def _merge_cell(cell: dict, notes: Notes, col: str) -> str:
    if cell["status"] == "skip":
        return "skip " + notes.ref(f"`{col}` skipped: " + " / ".join(cell["reasons"]))
    if cell["status"] == "error":
        return "**ERROR** " + notes.ref(f"`{col}` raised: {cell['reasons'][0]}")
    verdict = "pass" if cell["status"] == "pass" else "**FAIL**"
    return f"{verdict} {short_number(cell['rel_l2'])}"

