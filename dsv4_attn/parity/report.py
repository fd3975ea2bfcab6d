"""A run's report: the JSON record (schema ``dsv4-attn-parity/1``, fields in docs/parity.md) and
its Markdown table, written side by side.

Outputs are stored in the JSON as bf16 bytes (base64): whole when small, else a seeded sample of
the same element positions on every machine, which ``--merge`` compares across machines.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import torch

from .inputs import tensor_bytes

SCHEMA = "dsv4-attn-parity/1"


def sample_index(seed: int, numel: int, count: int) -> torch.Tensor:
    """Sorted distinct element positions of an output sample (same on every machine)."""
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    return torch.unique(torch.randint(numel, (count,), generator=gen, dtype=torch.int64))


def output_record(out: torch.Tensor, seed: int, full_max: int, sample: int) -> dict:
    """The output (bf16 bytes, base64) when small, else a seeded sample of its elements."""
    flat = out.contiguous().reshape(-1)
    full = flat.numel() <= full_max
    values = flat if full else flat[sample_index(seed, flat.numel(), sample)]
    return {"shape": list(out.shape), "sampled": not full, "count": values.numel(),
            "bf16_b64": base64.b64encode(tensor_bytes(values).tobytes()).decode()}


def decode_values(record: dict) -> torch.Tensor:
    """float64 [count]: the values ``output_record`` stored."""
    raw = bytearray(base64.b64decode(record["bf16_b64"]))
    return torch.frombuffer(raw, dtype=torch.bfloat16).double() if raw else torch.zeros(0, dtype=torch.float64)


def short_number(x) -> str:
    """An error figure for the tables: 2 significant digits, or n/a."""
    return "n/a" if x is None else f"{x:.1e}"


def _column(name: str, emulated: bool) -> str:
    return f"{name} (emulated)" if emulated else name


class Notes:
    """Numbered footnotes, one per distinct text."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"


def _cell_text(cell: dict, notes: Notes, name: str) -> str:
    status = cell["status"]
    if status == "skip":
        return "skip " + notes.ref(f"`{name}` skipped: " + " / ".join(cell["reasons"]))
    if status == "error":
        return "**ERROR** " + notes.ref(f"`{name}` raised: {cell['reasons'][0]}")
    text = f"pass {short_number(cell['rel_l2'])}" if status == "pass" else (
        f"**FAIL** {short_number(cell['rel_l2'])} " + notes.ref("; ".join(cell["reasons"])))
    others = {p: b for p, b in cell.get("ran", {}).items() if b != name}
    if others:
        text += " (" + ", ".join(f"{p} on {b}" for p, b in others.items()) + ")"
    return text


def render_report(report: dict) -> str:
    """The run as Markdown: header, one row per case (cell = status and relative L2 error),
    per-backend summary, footnotes with skip reasons and failure details."""
    plat, env = report["platform"], report["environment"]["versions"]
    backends, emulated = report["backends"], set(report["emulated"])
    notes = Notes()
    lines = [
        f"# dsv4-attn parity: {plat['vendor']}/{plat['arch']} ({plat['device_name']}), device {report['device']}",
        "",
        f"dsv4_attn {env['dsv4_attn']}, torch {env['torch']}, triton {env.get('triton')}, python {env['python']}; "
        f"matrix `{report['matrix']['path']}` (sha256 {report['matrix']['sha256'][:12]}), "
        f"{report['matrix']['cases_run']} of {report['matrix']['cases_in_matrix']} cases, {report['elapsed_s']} s.",
        "Cell: verdict and relative L2 error against the float64 reference; `phase on X` = that phase ran on "
        "backend X (the column's backend does not implement it).",
        "",
        "| case | " + " | ".join(_column(b, b in emulated) for b in backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for rec in report["cases"]:
        lines.append(f"| {rec['name']} | " + " | ".join(_cell_text(rec["cells"][b], notes, b) for b in backends)
                     + " |")
    lines += ["", "| backend | pass | fail | error | skip |", "|---|---|---|---|---|"]
    for b in backends:
        s = report["summary"][b]
        lines.append(f"| {_column(b, b in emulated)} | {s['pass']} | {s['fail']} | {s['error']} | {s['skip']} |")
    if notes.texts:
        lines += [""] + [f"[{i + 1}] {t}" for i, t in enumerate(notes.texts)]
    return "\n".join(lines) + "\n"


def render_summary(report: dict, markdown_path: Path, max_failures: int = 20) -> str:
    """What a run prints on stdout: the machine, the per-backend counts, the cells that failed or
    raised (at most ``max_failures``), and where the full table is."""
    plat, backends, emulated = report["platform"], report["backends"], set(report["emulated"])
    lines = [f"dsv4-attn parity on {plat['vendor']}/{plat['arch']} ({plat['device_name']}), device "
             f"{report['device']}: {report['matrix']['cases_run']} cases x {len(backends)} backend(s) in "
             f"{report['elapsed_s']} s, matrix {report['matrix']['path']}", "",
             "| backend | pass | fail | error | skip |", "|---|---|---|---|---|"]
    for b in backends:
        s = report["summary"][b]
        lines.append(f"| {_column(b, b in emulated)} | {s['pass']} | {s['fail']} | {s['error']} | {s['skip']} |")
    bad = [(rec["name"], b, cell) for rec in report["cases"] for b in backends
           if (cell := rec["cells"][b])["status"] in ("fail", "error")]
    if bad:
        lines += ["", f"{len(bad)} cell(s) failed or raised" + (f", the first {max_failures}:" if len(bad) >
                                                                  max_failures else ":")]
        lines += [f"  {name} on {b}: {cell['status']}: {'; '.join(cell['reasons'])[:200]}"
                  for name, b, cell in bad[:max_failures]]
    lines += ["", f"full table (every case, skip reasons): {markdown_path}"]
    return "\n".join(lines) + "\n"


def write_files(out_dir: Path, stem: str, report: dict, markdown: str) -> tuple[Path, Path]:
    """``<stem>.json`` (strict JSON) and ``<stem>.md`` in ``out_dir``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def finite_json(obj):
    """Replace non-finite floats (strict JSON has none) with strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_json(v) for v in obj]
    return obj
