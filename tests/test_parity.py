"""The parity matrix runner: matrix loading, deterministic case inputs with the promised edge
properties, and a tiny matrix run in which deliberately wrong backends (registered here) must
be flagged, plus the cross-machine merge."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from dsv4_attn import parity
from dsv4_attn.common import indices, layout
from dsv4_attn.common import registry as bm
from dsv4_attn.common.backend import Backend, Phase
from dsv4_attn.common.layout import KVFormat
from dsv4_attn.common.spec import LayerKind
from dsv4_attn.parity.report import finite_json
from dsv4_attn.portable.torch_backend import TorchBackend
from dsv4_attn.testing.steps import cache_to, flat_bytes

from kit.parity_tiny import TINY

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("matrix") / "tiny.yaml"
    path.write_text(TINY)
    return path


# ---- deliberately wrong backends ----------------------------------------------------------------
class DropsCompressed(TorchBackend):
    """Forgets the compressed scope (attends the SWA keys only)."""

    def forward(self, plan, layer, out):
        window_only = dataclasses.replace(layer, kind=LayerKind.SWA, comp_cache=None, topk=None, comp_geo=None)
        super().forward(plan, window_only, out)


class WritesHalf(TorchBackend):
    """Writes only the first half of the tokens."""

    def forward(self, plan, layer, out):
        full = torch.empty_like(out)
        super().forward(plan, layer, full)
        half = plan.num_tokens // 2
        out[:half] = full[:half]


class WritesNaN(TorchBackend):
    """Right everywhere except one element it writes as NaN."""

    def forward(self, plan, layer, out):
        super().forward(plan, layer, out)
        out[0, 0, 0] = math.nan


class Refuses(Backend):
    capabilities = TorchBackend.capabilities

    def extra_reasons(self, platform, spec, fmt, kind, phase, dialects):
        return ["needs a quantum computer"]


class DecodeOnly(TorchBackend):
    splits_phases = True
    capabilities = dataclasses.replace(TorchBackend.capabilities, phases=(Phase.DECODE,))


class Crashes(TorchBackend):
    def forward(self, plan, layer, out):
        raise RuntimeError("kernel exploded")


FAKES = {"drops-comp": DropsCompressed, "writes-half": WritesHalf, "writes-nan": WritesNaN, "refuses": Refuses,
         "decode-only": DecodeOnly, "crashes": Crashes}


@pytest.fixture(scope="module")
def fake_backends():
    for name, cls in FAKES.items():
        backend = cls()
        backend.name = name
        bm.register_backend(name, backend)
    yield list(FAKES)
    for name in FAKES:
        bm.unregister_backend(name)


@pytest.fixture(scope="module")
def report(tiny_path, fake_backends) -> dict:
    matrix = parity.load_matrix(tiny_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI does on CPU: small ops, no thread fan-out
    try:
        return parity.run(matrix, ["torch"] + fake_backends, "cpu", progress=False)
    finally:
        torch.set_num_threads(threads)


def _cells(report, backend):
    return {rec["name"]: rec["cells"][backend] for rec in report["cases"]}


@pytest.fixture
def keep_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


# ---- the matrix ---------------------------------------------------------------------------------
def test_default_matrix_covers_every_axis_combination():
    matrix = parity.load_matrix()
    core = {(c.kind.name, c.heads, c.fmt.value, c.mix, c.length) for c in matrix.cases if c.sweep == "core"}
    want = set(itertools.product(["SWA", "C4A", "C128A"], [16, 32, 64, 128],
                                 ["fp8_ds_mla", "bfloat16", "fp8_e4m3"], ["decode", "prefill", "mixed", "mtp"],
                                 ["short", "long", "edge"]))
    assert core == want
    names = [c.name for c in matrix.cases]
    assert len(names) == len(set(names)) and len({c.seed for c in matrix.cases}) == len(names)
    full = parity.load_matrix(full=True)
    assert set(names) < {c.name for c in full.cases}
    assert {c.swa_block_size for c in matrix.cases} >= {1, 2, 64, 256}
    long_cases = [c for c in matrix.cases if c.length == "long"]
    assert all(min(c.seq_lens) >= 32768 for c in long_cases) and max(c.num_tokens for c in long_cases) <= 16


def test_ci_matrix_is_the_packaged_file():
    packaged = parity.load_matrix()
    ci = parity.load_matrix(REPO / "ci" / "parity.yaml")
    assert ci.sha256 == packaged.sha256
    assert [c.name for c in ci.cases] == [c.name for c in packaged.cases]
    assert parity.default_matrix_path().is_file()


def test_one_line_pointer_file_is_followed(tmp_path):
    """What a checkout without symlink support makes of ci/parity.yaml: a file holding the path."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "real.yaml").write_text(TINY)
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "parity.yaml").write_text("../data/real.yaml\n")
    matrix = parity.load_matrix(tmp_path / "ci" / "parity.yaml")
    assert len(matrix.cases) == 12 and matrix.path.endswith("real.yaml")


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.replace("tolerances:", "tolerance:"), "tolerances"),
    (lambda t: t.replace("    heads: 16\n", "    heads: 16\n    headz: 3\n"), "headz"),
    (lambda t: t.replace("mix: [mixed, prefill]", "mix: [mixed, decode]"), "batches.<mix>.<length>"),
    (lambda t: t.replace("seq_lens: [1000]", "seq_lens: [3]"), "seq_lens[0]"),
    (lambda t: t.replace("decode: 2}", "decode: 5}"), "decode"),
    (lambda t: t.replace("version: 1", "version: 2"), "version"),
])
def test_bad_matrix_is_a_value_error_naming_the_key(tmp_path, edit, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(edit(TINY))
    with pytest.raises(ValueError, match=None) as info:
        parity.load_matrix(path)
    assert needle in str(info.value)


def test_case_selection_globs_and_substrings(tiny_path):
    matrix = parity.load_matrix(tiny_path)
    assert {c.kind for c in matrix.select("tiny.c4a.*")} == {LayerKind.C4A}
    assert {c.length for c in matrix.select("edge")} == {"edge"}
    assert len(matrix.select("tiny.swa.*,prefill")) == 4 + 6 - 2  # 4 SWA, 6 prefill, 2 both
    with pytest.raises(ValueError, match="matches none"):
        matrix.select("nothing-like-this")


def test_tolerance_overrides_match_backend_and_format(tiny_path):
    matrix = parity.load_matrix(tiny_path)
    case = matrix.cases[0]
    assert matrix.tolerance(case, "torch").rel_l2 == 1e-2
    assert matrix.tolerance(case, "loose").rel_l2 == 1e-2  # the override is for bfloat16 only
    assert matrix.tolerance(dataclasses.replace(case, fmt=KVFormat.BF16), "loose").rel_l2 == 0.5


def test_resolve_backends():
    assert parity.resolve_backends(["all"]) == bm.backend_names()
    assert parity.resolve_backends(["torch,triton", "torch"]) == ["torch", "triton"]
    with pytest.raises(ValueError, match="no-such"):
        parity.resolve_backends(["no-such"])


# ---- inputs -------------------------------------------------------------------------------------
def _case(name):
    return next(c for c in parity.load_matrix().cases if c.name == name)


def test_inputs_are_deterministic_and_per_case():
    case = _case("core.c4a.h16.fp8_ds_mla.mixed.short")
    a, b = parity.make_inputs(case), parity.make_inputs(case)
    assert a.digest == b.digest
    assert torch.equal(a.q, b.q) and torch.equal(a.topk, b.topk)
    assert torch.equal(flat_bytes(a.comp_cache), flat_bytes(b.comp_cache))
    other = parity.make_inputs(_case("core.c4a.h16.bfloat16.mixed.short"))
    assert other.digest != a.digest


def test_long_case_is_wide_through_positions_with_small_caches():
    inputs = parity.make_inputs(_case("core.c128a.h16.fp8_ds_mla.decode.long"))
    batch = inputs.batch
    assert int(batch.positions.min()) >= 32767 and batch.num_tokens == 3
    rows, lens = indices.all_rows(batch, LayerKind.C128A, inputs.case.spec.c128a_width)
    assert lens.tolist() == [256, 312, 512]  # (pos + 1) // 128; the last fills the 512-wide row
    assert bool((rows[2] >= 0).all())
    for cache in (inputs.swa_cache, inputs.comp_cache):
        assert cache.untyped_storage().nbytes() < 2 << 20


def test_edge_case_has_the_promised_edges():
    inputs = parity.make_inputs(_case("core.c4a.h16.fp8_ds_mla.mixed.edge"))
    batch, case = inputs.batch, inputs.case
    valid = batch.token_valid
    assert int((~valid).sum()) == 2  # padding tokens
    _, swa_lens = indices.swa_rows(batch, 128)
    assert swa_lens[~valid].eq(0).all()
    rows, lens = indices.topk_rows(batch, LayerKind.C4A, inputs.topk)
    assert bool((lens[valid] == 0).any())  # a real token with no compressed entry yet
    topk = inputs.topk
    past = torch.arange(topk.shape[1])[None, :] >= lens[:, None]
    assert bool(((topk >= 0) & past).any()) and bool(((topk == -1) & past).any())  # garbage lanes
    assert case.held_heads == 64 and inputs.q.shape[1] == 64 and not inputs.q[:, 16:].any()
    assert inputs.sink[0] == -math.inf and inputs.sink[1] == math.inf and bool((inputs.sink[16:] == -math.inf).all())


def test_unread_cache_slots_hold_garbage():
    inputs = parity.make_inputs(_case("core.swa.h16.bfloat16.mixed.long"))
    rows = inputs.swa_cache.reshape(-1, 512).float()
    assert bool((rows.abs().sum(dim=1) > 0).all()) and bool(torch.isfinite(rows).all())
    read, _ = indices.swa_rows(inputs.batch, 128)
    assert rows.shape[0] > torch.unique(read[read >= 0]).numel()  # there ARE unread slots


def test_page_stride_and_byte_offset(tmp_path):
    text = TINY.replace("    length: [short, edge]\n",
                        "    length: short\n    page_stride: 2\n    byte_offset: 1000000\n")
    (tmp_path / "m.yaml").write_text(text)
    case = parity.load_matrix(tmp_path / "m.yaml").select("tiny.c128a.*.mixed.*")[0]
    assert case.name.endswith(".stride2.off1000000")
    inputs = parity.make_inputs(case)
    page = layout.model1_page_bytes(64)
    assert inputs.swa_cache.stride(0) == 2 * page
    rows, _ = indices.swa_rows(inputs.batch, 128)
    assert int(rows[rows >= 0].min()) // 64 * 2 * page >= 1_000_000
    moved = cache_to(inputs.swa_cache, "cpu")
    assert moved.stride() == inputs.swa_cache.stride() and torch.equal(moved, inputs.swa_cache)


def test_default_matrix_has_the_v41_sweeps():
    cases = [c for c in parity.load_matrix().cases if c.sweep.startswith("v41")]
    v41 = {(c.kind.name, c.heads, c.fmt.value, c.mix, c.length) for c in cases if c.sweep == "v41"}
    assert v41 == set(itertools.product(["SWA", "C1A", "C2A"], [16, 64, 128],
                                        ["fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla", "bfloat16"],
                                        ["decode", "prefill", "mixed", "mtp"], ["short", "long", "edge"]))
    assert {(c.swa_block_size, c.block_size) for c in cases} == {(32, 128), (32, 64)}  # vLLM's V4.1 pages
    shared = [c for c in cases if c.shared]
    assert shared and all(c.kind.uses_topk for c in shared)
    assert {c.spec.kinds for c in cases} == {(LayerKind.SWA,), (LayerKind.SWA, LayerKind.C1A),
                                            (LayerKind.SWA, LayerKind.C2A)}


def test_shared_case_reads_two_layers_from_one_cache():
    inputs = parity.make_inputs(next(c for c in parity.load_matrix().cases if c.shared and c.length == "long"))
    assert inputs.other_topk is not None and not torch.equal(inputs.other_topk, inputs.topk)
    for topk in (inputs.topk, inputs.other_topk):  # every entry either layer reads has its own row
        rows, lens = indices.topk_rows(inputs.batch, inputs.case.kind, topk)
        used = rows[torch.arange(rows.shape[1])[None, :] < lens[:, None]]
        assert int((used >= 0).sum()) > 0 and bool((used >= 0).all())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_v41_cells_on_triton_under_the_interpreter(keep_threads):
    """Every V4.1 kind on every record the triton backend declares, decode / prefill / mixed / MTP
    (16 heads, short lengths: the interpreter is slow), plus a shared-cache case."""
    matrix = parity.load_matrix()
    cases = matrix.select("v41.*.h16.*.short*,v41-shared.c2a.h64.fp8_ds_mla.mixed.edge*")
    torch.set_num_threads(1)
    report = parity.run(matrix, ["triton"], "cpu", cases=cases, progress=False)
    declared = bm.get_backend("triton").capabilities.formats
    for rec in report["cases"]:
        cell = rec["cells"]["triton"]
        if KVFormat.parse(rec["format"]) in declared:
            assert cell["status"] == "pass", (rec["name"], cell)
        else:
            assert cell["status"] == "skip" and "caches only" in " ".join(cell["reasons"]), (rec["name"], cell)
    assert any(rec["cells"]["triton"]["status"] == "pass" for rec in report["cases"] if rec["shared"])


# ---- running: the wrong backends must be flagged ------------------------------------------------
def test_torch_passes_everything(report):
    assert all(c["status"] == "pass" for c in _cells(report, "torch").values())
    for cell in _cells(report, "torch").values():
        assert cell["written"] and cell["finite"] and cell["rel_l2"] < 5e-3 and cell["cosine"] > 0.99999


def test_dropping_the_compressed_scope_fails_exactly_the_compressed_kinds(report):
    torch_cells = _cells(report, "torch")
    for name, cell in _cells(report, "drops-comp").items():
        if ".swa." in name:
            assert cell["status"] == "pass" and cell["out_sha256"] == torch_cells[name]["out_sha256"]
        else:
            assert cell["status"] == "fail" and cell["written"] and cell["finite"], name
            assert any(r.startswith(("rel_l2", "max_abs", "cosine")) for r in cell["reasons"])


def test_unwritten_output_is_counted(report):
    for rec in report["cases"]:
        cell = rec["cells"]["writes-half"]
        assert cell["status"] == "fail" and not cell["written"]
        assert cell["unwritten"] == (rec["num_tokens"] - rec["num_tokens"] // 2) * rec["held_heads"] * 512


def test_written_nan_is_non_finite_not_unwritten(report):
    for cell in _cells(report, "writes-nan").values():
        assert cell["status"] == "fail" and cell["written"] and not cell["finite"] and cell["nonfinite"] == 1


def test_refusals_are_skips_with_reasons(report):
    for cell in _cells(report, "refuses").values():
        assert cell["status"] == "skip" and any("quantum computer" in r for r in cell["reasons"])


def test_decode_only_backend_runs_decode_and_records_the_prefill_backend(report):
    for name, cell in _cells(report, "decode-only").items():
        if ".prefill." in name:
            assert cell["status"] == "skip" and "decode" in cell["reasons"][0]
        else:
            assert cell["status"] == "pass" and cell["ran"] == {"decode": "decode-only", "prefill": "torch"}


def test_crash_is_an_error_cell(report):
    for cell in _cells(report, "crashes").values():
        assert cell["status"] == "error" and "kernel exploded" in cell["reasons"][0]


def test_report_summary_and_markdown(report):
    assert report["summary"]["torch"] == {"pass": 12, "fail": 0, "error": 0, "skip": 0}
    assert report["summary"]["drops-comp"] == {"pass": 4, "fail": 8, "error": 0, "skip": 0}
    assert parity.failed(report)
    assert report["platform"]["vendor"] == "cpu" and report["environment"]["versions"]["torch"] == torch.__version__
    md = parity.render_report(report)
    assert "| tiny.c4a.h16.fp8_ds_mla.mixed.short | pass" in md and "**FAIL**" in md
    assert "needs a quantum computer" in md and "prefill on torch" in md
    json.dumps(finite_json(report), allow_nan=False)


# ---- merge ----------------------------------------------------------------------------------------
def _as_machine(report, backend, machine):
    out = copy.deepcopy(report)
    out["backends"], out["machine"] = [backend], machine
    for rec in out["cases"]:
        rec["cells"] = {backend: rec["cells"][backend]}
    return out


def test_merge_compares_backends_across_machines(report):
    a, b = _as_machine(report, "torch", "cpu"), _as_machine(report, "drops-comp", "sm90")
    merged = parity.merge_reports([a, b], ["a.json", "b.json"])
    assert merged["columns"] == ["torch@cpu", "drops-comp@sm90"]
    (pair,) = merged["pairwise"]
    assert pair["compared"] == 12 and pair["identical"] == 4 and pair["max_diff"] > 5e-2
    swa = [c for c in merged["cases"] if ".swa." in c["name"]]
    assert all(c["max_pairwise_diff"] == 0 for c in swa)
    b["cases"][0]["input_sha256"] = "0" * 64  # as if that machine generated other inputs
    merged = parity.merge_reports([a, b], ["a.json", "b.json"])
    assert not merged["cases"][0]["inputs_identical"] and merged["pairwise"][0]["compared"] == 11
    md = parity.render_merge(merged)
    assert "| case | torch@cpu | drops-comp@sm90 | max diff |" in md and "inputs differ" in md


def test_merge_labels_runs_from_the_same_kind_of_machine(report):
    a = _as_machine(report, "torch", "cpu")
    merged = parity.merge_reports([a, copy.deepcopy(a)], ["x/p.json", "y/p.json"])
    assert merged["columns"] == ["torch@cpu#1", "torch@cpu#2"]
    assert merged["pairwise"][0]["identical"] == 12


# ---- main() in process (registered fakes are visible) ------------------------------------------
def test_main_exit_status_and_files(tmp_path, tiny_path, fake_backends, capsys, keep_threads):
    out = tmp_path / "out"
    rc = parity.main(["--matrix", str(tiny_path), "--backends", "torch,drops-comp", "--out", str(out),
                      "--no-progress", "--cases", "tiny.c4a.*"])
    assert rc == 1
    stdout = capsys.readouterr().out
    # stdout: the summary and the failing cells; every case only in the Markdown file
    assert "| drops-comp | 0 | 4 | 0 | 0 |" in stdout and "| tiny.c4a." not in stdout
    assert "4 cell(s) failed or raised:" in stdout and "tiny.c4a.h16.fp8_ds_mla.mixed.short on drops-comp: fail" \
        in stdout
    saved = json.loads((out / "parity-cpu-cpu-torch+drops-comp.json").read_text())
    assert saved["schema"] == parity.SCHEMA and len(saved["cases"]) == 4
    md = (out / "parity-cpu-cpu-torch+drops-comp.md").read_text()
    assert md.startswith("# dsv4-attn parity") and "| tiny.c4a.h16.fp8_ds_mla.mixed.short | pass" in md
    assert f"full table (every case, skip reasons): {out / 'parity-cpu-cpu-torch+drops-comp.md'}" in stdout
    assert parity.main(["--matrix", str(tiny_path), "--backends", "refuses", "--out", str(out),
                        "--no-progress"]) == 1  # nothing ran
    assert parity.main(["--matrix", str(tiny_path), "--backends", "nope", "--out", str(out)]) == 2


def test_runs_of_other_backends_or_emulators_get_their_own_files(report):
    assert parity.runner.run_name(report, full=False) == "parity-cpu-cpu-" + "+".join(report["backends"])
    emulated = {**report, "backends": ["torch", "aiter"], "emulated": ["aiter"]}
    name = parity.runner.run_name(emulated, full=True)
    assert name.startswith("parity-cpu-cpu-torch+aiter-emulated-aiter") and name.endswith("-full")
    variant = {**report, "backends": ["t:bn64"], "emulated": []}
    assert parity.runner.run_name(variant, full=False) == "parity-cpu-cpu-t_bn64"  # no ':' in file names


def test_matrix_path_is_never_a_home_directory(tiny_path, monkeypatch):
    assert parity.load_matrix().shown_path == "dsv4_attn/data/parity.yaml"
    monkeypatch.chdir(tiny_path.parent.parent)
    matrix = parity.load_matrix(tiny_path)
    assert matrix.shown_path == f"{tiny_path.parent.name}/{tiny_path.name}"
    monkeypatch.chdir(tiny_path.parent)
    assert parity.load_matrix(tiny_path.name).shown_path == tiny_path.name


def test_merge_skips_merged_tables_and_says_so(tmp_path, report, capsys):
    run = tmp_path / "parity-cpu-cpu-torch.json"
    run.write_text(json.dumps(finite_json(_as_machine(report, "torch", "cpu"))))
    assert parity.main(["--merge", str(run), str(run), "--out", str(tmp_path)]) == 0
    first = capsys.readouterr()
    assert "merged 2 run(s)" in first.out and "| torch@cpu#1 | torch@cpu#2 | 12 | 12 | 0.0e+00 |" in first.out
    assert "| tiny." not in first.out  # the per-case table is in merged.md only
    # a glob over the directory now also catches merged.json: skipped with a note, not an error
    assert parity.main(["--merge", *sorted(map(str, tmp_path.glob("*.json"))), "--out", str(tmp_path)]) == 0
    second = capsys.readouterr()
    assert f"skipped {tmp_path / 'merged.json'}: a merged table" in second.err and "merged 1 run(s)" in second.out
    assert parity.main(["--merge", str(tmp_path / "merged.json"), "--out", str(tmp_path)]) == 2
    assert "no parity run among them" in capsys.readouterr().err


def test_long_runs_are_announced(monkeypatch):
    from dsv4_attn.parity.cli import long_run_note

    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = parity.load_matrix().cases
    assert long_run_note(set(), ["torch"], cpu, cases) is None
    assert long_run_note({"aiter"}, ["torch", "aiter"], cpu, cases[:10]) is None  # seconds: no note
    note = long_run_note({"aiter"}, ["torch", "aiter"], cpu, cases[:504])
    assert "about 4 min for 504 cases" in note and "1.7 GB" in note
    assert "CPU interpreter" in long_run_note(set(), ["triton"], cpu, cases[:3])
    monkeypatch.delenv("TRITON_INTERPRET")
    assert long_run_note(set(), ["triton"], cpu, cases[:3]) is None  # refused on CPU: every cell a quick skip
