"""The parity matrix: every backend against the float64 reference on named, seeded cases.

    dsv4-attn parity                                   # packaged default matrix, this machine
    dsv4-attn parity --backends all --cases 'core.c4a.*'
    dsv4-attn parity --merge cpu/*.json h100/*.json

One module per job (docs/parity.md describes the matrix format, what a run does and the JSON):

- ``matrix``: the YAML matrix file, its validation and its expansion into named, seeded cases;
- ``inputs``: a case's inputs, generated on the CPU from its seed (the same bytes everywhere);
- ``judge``: one cell = one case on one backend, judged against the float64 reference;
- ``runner``: the run over cases x backends with a progress bar, into one report;
- ``report``: the report's JSON record and Markdown table;
- ``merge``: the cross-vendor table from runs on several machines;
- ``cli``: ``dsv4-attn parity``.
"""

from __future__ import annotations

from ..common.checks import default_device
from .cli import main
from .inputs import CaseInputs, make_inputs
from .judge import run_cell
from .matrix import Case, Matrix, Tolerance, default_matrix_path, load_matrix
from .merge import MERGE_SCHEMA, load_report, merge_reports, render_merge
from .report import SCHEMA, render_report
from .runner import default_backends, emulated_backends, failed, resolve_backends, run

__all__ = [
    "MERGE_SCHEMA", "SCHEMA", "Case", "CaseInputs", "Matrix", "Tolerance", "default_backends", "default_device",
    "default_matrix_path", "emulated_backends", "failed", "load_matrix", "load_report", "main", "make_inputs",
    "merge_reports", "render_merge", "render_report", "resolve_backends", "run", "run_cell",
]
