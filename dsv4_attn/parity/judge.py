"""One cell = one case on one backend, judged against the float64 reference.

The output is poisoned with NaN, ``SparseMLA(backend=name)`` runs the layer, then (after the
kernel, so that allocator reuse cannot fake a pass) ``common.reference.sparse_mla`` runs on the
same inputs. Figures: max abs error, relative L2, cosine, all-finite, all-written, the verdict
against the matrix's tolerances, the sha256 of the output bytes and the output itself (small
cases) or a seeded sample of it. Cells a backend cannot serve are skipped with its reasons;
decode-only backends (AITER) run the decode tokens and the prefill tokens go to the backend the
front end picks, recorded per phase.
"""

from __future__ import annotations

import hashlib
import math

import torch

from ..common import indices, reference, registry
from ..common.backend import BackendUnavailableError, Phase
from ..common.layout import KVFormat
from ..common.platform import platform_for_device
from ..testing.errors import error_figures
from .inputs import CaseInputs, tensor_bytes
from .matrix import Case, Tolerance
from .report import output_record


class CaseReference:
    """The float64 reference of one case, computed on first use: AFTER the first backend ran (the
    FlashMLA habit: a reference allocated after the kernel cannot be a freed buffer the kernel's
    output reuses), on the inputs' device, returned on the CPU."""

    def __init__(self, inputs: CaseInputs) -> None:
        self.inputs = inputs
        self._out: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self._out is None:
            self._out = _reference_out(self.inputs).cpu()
        return self._out


def _reference_out(inputs: CaseInputs) -> torch.Tensor:
    """float64 [T, held_heads, 512] from index rows built by common.indices on the inputs' batch."""
    case, batch = inputs.case, inputs.batch
    spec = case.spec
    swa_rows, swa_lens = indices.swa_rows(batch, spec.window)
    comp_rows = comp_lens = None
    if case.kind.uses_topk:
        if inputs.topk is None:  # build_inputs draws one for every top-k case
            raise ValueError(f"topk: got None for case {case.name}; allowed: its local top-k")
        comp_rows, comp_lens = indices.topk_rows(batch, case.kind, inputs.topk)
    elif case.kind.attends_all:
        comp_rows, comp_lens = indices.all_rows(batch, case.kind, spec.all_width(case.kind.ratio))
    out, _ = reference.sparse_mla(inputs.q, inputs.swa_cache, swa_rows, swa_lens, inputs.comp_cache, comp_rows,
                                  comp_lens, inputs.sink, spec.scale, case.fmt, torch.float64,
                                  case.kv_scale if case.fmt is KVFormat.FP8_TENSOR else None,
                                  case.swa_dialect, case.comp_dialect)
    return out


def _skip(reasons: list[str], emulated: bool = False, ran: dict | None = None) -> dict:
    return {"status": "skip", "reasons": reasons, "emulated": emulated, "ran": ran or {}}


def _skip_reasons(name: str, case: Case, device: torch.device) -> list[str]:
    """Why backend ``name`` cannot serve this case ([] = it can serve at least one of its phases,
    and every phase it implements)."""
    backend = registry.get_backend(name)
    plat = platform_for_device(device)
    if backend is None:
        return registry.reasons_for(name, plat, case.spec, case.fmt, case.kind, Phase.DECODE)
    own = [p for p in case.phases if p in backend.phases]
    if not own:
        return [f"implements {'/'.join(p.value for p in backend.phases)} only; this case has "
                f"{'/'.join(p.value for p in case.phases)} tokens only"]
    reasons = []
    for phase in own:
        reasons += [f"{phase.value}: {r}" for r in
                    registry.reasons_for(name, plat, case.spec, case.fmt, case.kind, phase)]
    return reasons


def run_cell(name: str, inputs: CaseInputs, ref: CaseReference, tolerance: Tolerance, emulated: bool,
             output_full_max: int = 8192, output_sample: int = 2048) -> dict:
    """Run backend ``name`` on one case's (device) inputs; the cell's figures as a JSON-able dict."""
    case = inputs.case
    device = inputs.q.device
    reasons = _skip_reasons(name, case, device)
    if reasons:
        return _skip(reasons, emulated)
    ran: dict[str, str] = {}
    out = torch.full(inputs.q.shape, math.nan, dtype=torch.bfloat16, device=device)
    try:
        mla = _sparse_mla(name, inputs, device)
        ran = {p.value: mla.backend_for(case.kind, p) for p in case.phases}
        _forward(mla, inputs, out)
    except BackendUnavailableError as exc:
        return _skip([str(exc)], emulated)
    except Exception as exc:  # a crash is a finding about this cell, not the end of the run
        return {"status": "error", "reasons": [f"{type(exc).__name__}: {exc}"], "emulated": emulated, "ran": ran,
                "tolerance": tolerance.__dict__}
    out = out.cpu()
    never = _never_written(mla, inputs, out)
    cell = _judge(out, ref.get(), case, never)
    cell.update(emulated=emulated, ran=ran, tolerance=tolerance.__dict__,
                output=output_record(out[:, : case.heads], case.seed, output_full_max, output_sample))
    cell["status"], cell["reasons"] = _status(cell, tolerance)
    return cell


def _sparse_mla(name: str, inputs: CaseInputs, device: torch.device):
    """The layer for one cell, reserved as an engine start would for this case's decode launch:
    decode backends size their buffers from it (AITER's gathered rows: the case's few decode
    tokens, not the 1024-token default, ~0.75 GB zero-filled per cell)."""
    from ..api import SparseMLA  # api imports the registry; keep `import dsv4_attn.parity` light

    case = inputs.case
    mla = SparseMLA(case.spec, case.fmt, backend=name, device=device, max_tokens=max(case.num_tokens, 1),
                    max_reqs=max(len(case.query_lens), 1), swa_dialect=case.swa_dialect,
                    comp_dialect=case.comp_dialect)
    mla.reserve(mla.plan(inputs.batch, validate=True), max(case.num_decode_tokens, 1))
    return mla


def _forward(mla, inputs: CaseInputs, out: torch.Tensor) -> None:
    """One plan; for ``shared`` cases another layer reads the same compressed cache with its own
    top-k first (into a scratch output), so state a backend wrongly keeps per cache or per kind
    shows up in the judged layer."""
    case = inputs.case
    plan = mla.plan(inputs.batch, validate=True)
    layers = ([inputs.other_topk] if inputs.other_topk is not None else []) + [inputs.topk]
    for topk in layers:
        dest = out if topk is inputs.topk else torch.empty_like(out)
        mla.forward(plan, case.kind, inputs.q, inputs.swa_cache, inputs.comp_cache, topk=topk, sink=inputs.sink,
                    out=dest, kv_scale=case.kv_scale, validate=True)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)


def _never_written(mla, inputs: CaseInputs, out: torch.Tensor) -> torch.Tensor:
    """bool [T, H, 512] on the CPU: elements the layer never writes. NaN left by the NaN-poisoned
    run is either never written or NaN the kernel wrote; a second run over a finite poison tells
    them apart (an element never written keeps the poison)."""
    nan = torch.isnan(out)
    if not bool(nan.any()):
        return nan
    poison = -12345.0  # exact in bf16; no attention output reaches it (outputs are key averages)
    again = torch.full(inputs.q.shape, poison, dtype=torch.bfloat16, device=inputs.q.device)
    try:
        _forward(mla, inputs, again)
    except Exception:  # the second run failing leaves the first run's NaN as the answer
        return nan
    return (again == poison).cpu()


def _judge(out: torch.Tensor, ref: torch.Tensor, case: Case, never: torch.Tensor) -> dict:
    """Figures of one output (CPU). Errors: over the model's heads (padded heads only count for
    ``written``), over the elements that were written and are finite; ``nonfinite`` counts
    non-finite elements the layer wrote, ``unwritten`` the elements it never wrote."""
    heads = case.heads
    region, want = out[:, :heads].double(), ref[:, :heads].double()
    finite = torch.isfinite(region)
    nonfinite = int((~finite & ~never[:, :heads]).sum())
    ok = bool(finite.all())
    a, b = (region.reshape(-1), want.reshape(-1)) if ok else (region[finite], want[finite])
    unwritten = int(never.sum())
    return {**error_figures(a, b), "ref_norm": float(b.norm()), "finite": nonfinite == 0, "nonfinite": nonfinite,
            "written": unwritten == 0, "unwritten": unwritten,
            "out_sha256": hashlib.sha256(tensor_bytes(out[:, :heads])).hexdigest()}


def _status(cell: dict, tolerance: Tolerance) -> tuple[str, list[str]]:
    misses = []
    if not cell["written"]:
        misses.append(f"{cell['unwritten']} output elements never written (poison left)")
    if not cell["finite"]:
        misses.append(f"{cell['nonfinite']} non-finite output elements")
    misses += tolerance.verdict(cell)
    return ("fail" if misses else "pass"), misses

