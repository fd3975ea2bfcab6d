"""Measured backend choices (common/choices.py): a table built from a bench report, its token
ranges, and auto selection trying the measured order first -- never past a refusal."""

from __future__ import annotations

import json

import pytest

import dsv4_attn as dsv4
from dsv4_attn.common import choices
from dsv4_attn.common import registry as bm
from dsv4_attn.common.backend import Capabilities, PlatformSupport
from dsv4_attn.common.layout import KVFormat
from dsv4_attn.common.platform import Platform
from dsv4_attn.common.spec import LayerKind, ModelSpec


def _result(case, tokens, heads, times, kind="C4A", phase="decode"):
    return {"case": case, "phase": phase, "kind": kind, "heads": heads, "tokens": tokens, "format": "fp8_ds_mla",
            "backends": {name: {"us": us} for name, us in times.items()}}


REPORT = {"meta": {"device": "NVIDIA H100"}, "results": [
    _result("h64 b=2", 2, 64, {"triton": 17.5, "flashmla": 19.2}),
    _result("h64 b=64", 64, 64, {"triton": 38.4, "flashmla": 53.6, "auto": 38.0}),  # auto: not a backend
    _result("h64 b=256", 256, 64, {"triton": 99.0, "flashmla": 95.0}),
    _result("h128 b=128", 128, 128, {"triton": 130.0, "flashmla": 125.2}),
    _result("failed", 8, 64, {}),  # a row without timings is left out
    {"case": "broken", "phase": "decode", "error": "RuntimeError"},
]}


def test_table_from_a_bench_report_splits_ranges_between_measured_points():
    table = choices.from_bench(REPORT, "sm90")
    assert table["arch"] == "sm90" and table["device"] == "NVIDIA H100"
    h64 = [e for e in table["entries"] if e["heads"] == 64]
    # points 2, 64, 256: cuts halfway, (2+64)//2+1 = 34 and (64+256)//2+1 = 161
    assert [(e["tokens"], e["order"]) for e in h64] == [([1, 34], ["triton", "flashmla"]),
                                                        ([34, 161], ["triton", "flashmla"]),
                                                        ([161, 2**31], ["flashmla", "triton"])]
    assert h64[1]["evidence"] == "h64 b=64: triton 38.4 us, flashmla 53.6 us"
    h128 = [e for e in table["entries"] if e["heads"] == 128]
    assert [(e["tokens"], e["order"]) for e in h128] == [([1, 2**31], ["flashmla", "triton"])]


@pytest.fixture
def table(tmp_path, monkeypatch):
    yield _use_table(tmp_path, monkeypatch, choices.from_bench(REPORT, "sm90"))
    choices._load.cache_clear()


def _use_table(tmp_path, monkeypatch, table: dict) -> str:
    """Write ``table`` as the DSV4_ATTN_CHOICES file (loaded afresh); its path."""
    path = tmp_path / "choices.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("DSV4_ATTN_CHOICES", str(path))
    choices._load.cache_clear()
    return str(path)


class _Any(dsv4.Backend):
    def __init__(self, name, refuse=False):
        self.name, self._refuse = name, refuse
        self.capabilities = Capabilities(platforms=(PlatformSupport("*"),), formats=tuple(KVFormat))

    def extra_reasons(self, platform, spec, fmt, kind, phase, dialects):
        return ["refuses for the test"] if self._refuse else []


@pytest.fixture
def fakes():
    saved_registry, saved_priority = dict(bm._REGISTRY), {k: list(v) for k, v in bm.PRIORITY.items()}
    saved_instances = dict(bm._instances)
    bm._REGISTRY.clear()
    bm._instances.clear()
    for key in list(bm.PRIORITY):
        if key.startswith("cuda"):
            bm.PRIORITY[key] = []

    def add(name, refuse=False, index=None):
        bm.register_backend(name, _Any(name, refuse), priority=None if index is None else {"cuda": index})

    yield add
    bm._REGISTRY.clear(), bm._REGISTRY.update(saved_registry)
    bm.PRIORITY.clear(), bm.PRIORITY.update(saved_priority)
    bm._instances.clear(), bm._instances.update(saved_instances)
    bm._import_errors.clear()


SM90 = Platform("cuda", "sm90", "fake H100", "2.x")
SPEC = ModelSpec(num_heads=48)  # bucketed with the 64-head measurements


def _pick(tokens):
    return bm.select(SM90, SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.DECODE, num_tokens=tokens)


def test_auto_follows_the_measured_order_in_range_and_the_priority_list_elsewhere(table, fakes):
    fakes("flashmla", index=0)
    fakes("triton", index=1)
    assert [_pick(t) for t in (1, 64, 160, 161, 5000)] == ["triton", "triton", "triton", "flashmla", "flashmla"]
    assert _pick(None) == "flashmla"  # no token count: the priority list
    order, why = bm.auto_order(SM90, SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.DECODE, 64)
    assert order == ["triton", "flashmla"] and why.startswith(f"measured ({table}: h64 b=64: triton 38.4 us")
    # unmeasured kind, format or arch: the priority list
    assert bm.select(SM90, SPEC, KVFormat.BF16, LayerKind.C4A, dsv4.Phase.DECODE, num_tokens=64) == "flashmla"
    assert bm.select(Platform("cuda", "sm100", "B200", "2.x"), SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A,
                     dsv4.Phase.DECODE, num_tokens=64) == "flashmla"


def test_tensor_parallel_shards_are_measured_at_their_own_head_count(tmp_path, monkeypatch, fakes):
    """A TP shard (8 / 16 / 32 heads per rank) takes its own bucket's entries, not the 64-head ones
    (FlashMLA pads a shard to 64 heads, triton does not), and the priority list where the table
    measured no shard of its size."""
    assert [choices.heads_bucket(h) for h in (1, 4, 8, 9, 16, 17, 32, 33, 48, 64, 65, 128)] == [
        8, 8, 8, 16, 16, 32, 32, 64, 64, 64, 128, 128]
    report = {"meta": {"device": "NVIDIA H100"}, "results": [
        _result("h64 b=64", 64, 64, {"triton": 40.0, "flashmla": 30.0}),
        _result("h8 b=64", 64, 8, {"triton": 30.0, "flashmla": 70.0}),
    ]}
    table = choices.from_bench(report, "sm90")
    assert {e["heads"]: e["order"] for e in table["entries"]} == {8: ["triton", "flashmla"],
                                                                  64: ["flashmla", "triton"]}
    _use_table(tmp_path, monkeypatch, table)
    fakes("flashmla", index=1)
    fakes("triton", index=0)
    try:
        def pick(heads):
            return bm.auto_order(SM90, ModelSpec(num_heads=heads), KVFormat.MODEL1_FP8, LayerKind.C4A,
                                 dsv4.Phase.DECODE, 64)

        assert pick(64)[0] == pick(48)[0] == ["flashmla", "triton"]
        order, why = pick(8)
        assert order == ["triton", "flashmla"] and "h8 b=64: triton 30.0 us, flashmla 70.0 us" in why
        order, why = pick(16)  # no 16-head measurement: the priority list, not the 64-head order
        assert order == ["triton", "flashmla"] and "priority list" in why
    finally:
        choices._load.cache_clear()


def test_a_measured_choice_never_passes_a_refusal(table, fakes):
    fakes("flashmla", index=0)
    fakes("triton", refuse=True, index=1)
    assert _pick(64) == "flashmla"


def test_a_bad_choices_file_is_a_value_error_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_ATTN_CHOICES", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"^DSV4_ATTN_CHOICES: got '.*missing.json'; allowed: an existing"):
        choices.table_for("sm90")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"arch": "sm90", "entries": [{"phase": "decode"}]}))
    monkeypatch.setenv("DSV4_ATTN_CHOICES", str(bad))
    choices._load.cache_clear()
    with pytest.raises(ValueError, match=r"bad.json: got a file that is not a choices table"):
        choices.table_for("sm90")
    choices._load.cache_clear()


def test_explain_lists_the_measurements_for_the_model(table, monkeypatch):
    monkeypatch.setattr(dsv4.SparseMLA, "platform", property(lambda self: SM90))
    text = dsv4.SparseMLA(ModelSpec(num_heads=64), "fp8_ds_mla", backend="auto", device="cpu").explain()
    assert f"measured choices ({table}" in text
    assert "C4A    decode   tokens 34-160: triton > flashmla  [h64 b=64: triton 38.4 us, flashmla 53.6 us]" in text


def test_bench_reports_auto_against_the_fastest_named_backend():
    from dsv4_attn.bench import auto_gaps

    results = [{"case": "a", "format": "fp8_ds_mla", "backends": {"auto": {"us": 21.0, "picked": "flashmla"},
                                                                  "triton": {"us": 20.0}, "flashmla": {"us": 21.0}}},
               {"case": "b", "format": "fp8_ds_mla", "backends": {"auto": {"us": 10.0, "picked": "triton"},
                                                                  "triton": {"us": 10.0}, "flashmla": {"us": 13.0}}},
               {"case": "c", "backends": {"triton": {"us": 1.0}}},  # no auto row: not a gap
               {"case": "d", "error": "RuntimeError"}]
    gaps = auto_gaps(results)
    assert [(round(g, 6), round(spread, 6), case, picked, best) for g, spread, case, picked, best in gaps] == [
        (0.05, 0.0, "a fp8_ds_mla", "flashmla", "triton"), (0.0, 0.0, "b fp8_ds_mla", "triton", "triton")]


def test_cases_at_one_token_count_are_ordered_by_their_summed_time():
    """b=64 x s_q=2 and b=128 x s_q=1 both launch 128 tokens: one entry, ordered by the sum."""
    report = {"meta": {}, "results": [
        _result("b=64 s_q=2", 128, 64, {"triton": 50.0, "flashmla": 40.0}),
        _result("b=128 s_q=1", 128, 64, {"triton": 60.0, "flashmla": 80.0}),
        _result("b=256 s_q=1", 256, 64, {"triton": 90.0, "flashmla": 95.0})]}
    entries = choices.from_bench(report, "sm90")["entries"]
    assert [(e["tokens"], e["order"]) for e in entries] == [([1, 193], ["triton", "flashmla"]),
                                                            ([193, 2**31], ["triton", "flashmla"])]
    assert entries[0]["evidence"] == ("b=64 s_q=2: triton 50.0 us, flashmla 40.0 us; "
                                      "b=128 s_q=1: triton 60.0 us, flashmla 80.0 us")


def _stepped(case, tokens, heads, times, kind="C128A"):
    """A decode bench row with each backend's per-step work: times = {name: (layer us, per-step us)}."""
    return {"case": case, "phase": "decode", "kind": kind, "heads": heads, "tokens": tokens, "format": "fp8_ds_mla",
            "backends": {n: {"us": us, "per_step_us": ps} for n, (us, ps) in times.items()}}


def test_per_step_work_is_weighed_by_the_models_layers_of_the_kind(tmp_path, monkeypatch, fakes):
    """flashmla 1 us faster per layer but 20 us more per step: triton for a model with one C128A
    layer, flashmla from 49 layers on (3 % margin); an entry without costs keeps its measured order."""
    report = {"meta": {}, "results": [_stepped("c128a b=2", 2, 64, {"triton": (20.0, 1.0), "flashmla": (19.0, 21.0)}),
                                      _result("c4a b=2", 2, 64, {"triton": 18.0, "flashmla": 23.0})]}
    table = choices.from_bench(report, "sm90")
    c128a = next(e for e in table["entries"] if e["kind"] == "C128A")
    assert c128a["order"] == ["flashmla", "triton"]  # the layer alone
    assert c128a["us"] == {"flashmla": 19.0, "triton": 20.0} and c128a["per_step_us"] == {"flashmla": 21.0,
                                                                                         "triton": 1.0}
    assert "us" not in next(e for e in table["entries"] if e["kind"] == "C4A")
    _use_table(tmp_path, monkeypatch, table)
    fakes("flashmla", index=0)
    fakes("triton", index=1)

    def pick(spec, kind=LayerKind.C128A):
        return bm.select(SM90, spec, KVFormat.MODEL1_FP8, kind, dsv4.Phase.DECODE, num_tokens=2)

    assert bm.layers_per_step(ModelSpec(num_heads=64), LayerKind.C128A) == 1
    assert pick(ModelSpec(num_heads=64)) == "triton"  # 1 x 20 + 1 < 1 x 19 + 21
    # flashmla has 20 us more per-step work: it must win by MIX_MARGIN (3 %): (19 n + 21) x 1.03 < 20 n + 1
    assert pick(ModelSpec(num_heads=64, layers=["SWA"] + ["C128A"] * 30)) == "triton"  # 608.7 > 601
    assert pick(ModelSpec(num_heads=64, layers=["SWA"] + ["C128A"] * 60 + ["C4A"])) == "flashmla"  # 1195.8 < 1201
    assert pick(ModelSpec(num_heads=64, layers=["C128A", "C4A"]), LayerKind.C4A) == "triton"
    _, why = bm.auto_order(SM90, ModelSpec(num_heads=64), KVFormat.MODEL1_FP8, LayerKind.C128A, dsv4.Phase.DECODE, 2)
    assert "1 C128A layer(s) per step: triton 1 x 20.0 + 1.0 = 21.0 us, flashmla 1 x 19.0 + 21.0 = 40.0 us" in why
    monkeypatch.setattr(dsv4.SparseMLA, "platform", property(lambda self: SM90))
    text = dsv4.SparseMLA(ModelSpec(num_heads=64, layers=["C128A"] * 60), "fp8_ds_mla", device="cpu").explain()
    assert "C128A  decode   tokens 1-2147483647: flashmla > triton  [flashmla 60 x 19.0 + 21.0 = 1161.0 us" in text
    choices._load.cache_clear()


def test_a_cost_table_that_is_not_a_mapping_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    entry = {"phase": "decode", "kind": "C4A", "heads": 64, "format": "fp8_ds_mla", "tokens": [1, 5],
             "order": ["triton"], "us": [1.0]}
    bad.write_text(json.dumps({"arch": "sm90", "entries": [entry]}))
    monkeypatch.setenv("DSV4_ATTN_CHOICES", str(bad))
    choices._load.cache_clear()
    with pytest.raises(ValueError, match=r"bad.json: got a file that is not a choices table \(TypeError: a cost"):
        choices.table_for("sm90")
    choices._load.cache_clear()


def test_bench_gaps_count_each_backends_per_step_work():
    from dsv4_attn.bench import auto_gaps

    results = [_stepped("c128a b=2", 2, 64, {"triton": (20.0, 1.0), "flashmla": (19.0, 21.0)})]
    results[0]["backends"]["auto"] = {"us": 20.2, "picked": "triton"}
    [(gap, spread, case, picked, best)] = auto_gaps(results)
    assert (round(gap, 6), round(spread, 6), picked, best) == (0.0, 0.01, "triton", "triton")
    results[0]["backends"]["auto"]["picked"] = "flashmla"
    [(gap, *_)] = auto_gaps(results)
    assert round(gap, 6) == round(40.0 / 21.0 - 1, 6)


def test_layer_calls_reuse_the_decision_of_their_launch_size_range(table, fakes, monkeypatch):
    """SparseMLA.backend_for looks the measured order up once per (kind, phase, range of the
    table) -- eager and piecewise steps call it at every layer -- and decides as select() does
    for every launch size."""
    fakes("flashmla", index=0)
    fakes("triton", index=1)
    monkeypatch.setattr(dsv4.SparseMLA, "platform", property(lambda self: SM90))
    mla = dsv4.SparseMLA(SPEC, KVFormat.MODEL1_FP8)
    sizes = range(1, 400)
    expected = [_pick(t) for t in sizes]
    assert expected[32:34] == ["triton", "triton"] and expected[159:161] == ["triton", "flashmla"]  # range edges
    lookups = []
    real_order = bm.auto_order
    monkeypatch.setattr(bm, "auto_order", lambda *args: lookups.append(args[-1]) or real_order(*args))
    for _ in range(2):
        assert [mla.backend_for(LayerKind.C4A, dsv4.Phase.DECODE, t) for t in sizes] == expected
    assert lookups == [1, 34, 161]  # ranges [1, 34), [34, 161), [161, 2**31): one lookup each


def _device_table(folder, arch, device, first):
    """A packaged-style table measured on ``device`` whose C4A decode order starts with ``first``."""
    entry = {"phase": "decode", "kind": "C4A", "heads": 64, "format": "fp8_ds_mla", "tokens": [1, 2**31],
             "order": [first, "flashmla" if first == "triton" else "triton"], "evidence": f"measured on {device}"}
    path = folder / choices.packaged_name(arch, device)
    path.write_text(json.dumps({"arch": arch, "device": device, "source": "test", "entries": [entry]}))
    return path


@pytest.fixture
def device_tables(tmp_path, monkeypatch):
    """A choices folder holding an H100 table (triton first) and an H200 table (flashmla first)."""
    monkeypatch.delenv("DSV4_ATTN_CHOICES", raising=False)
    monkeypatch.setattr(choices, "_folder", lambda: tmp_path)
    choices._packaged.cache_clear()
    _device_table(tmp_path, "sm90", "NVIDIA H100 80GB HBM3", "triton")
    _device_table(tmp_path, "sm90", "NVIDIA H200", "flashmla")
    yield tmp_path
    choices._packaged.cache_clear()
    choices._load.cache_clear()


def test_packaged_names_follow_the_device():
    assert choices.packaged_name("sm90", "NVIDIA H100 80GB HBM3") == "sm90-h100-80gb-hbm3.json"
    assert choices.packaged_name("sm90", "NVIDIA H200") == "sm90-h200.json"
    assert choices.packaged_name("gfx942", "AMD Instinct MI300X") == "gfx942-mi300x.json"


def test_each_device_takes_its_own_table_and_another_part_the_nearest(device_tables, fakes):
    fakes("flashmla", index=0)
    fakes("triton", index=1)
    h100, h200 = (Platform("cuda", "sm90", name, "2.x") for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    pick = {p.device_name: bm.select(p, SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.DECODE, num_tokens=8)
            for p in (h100, h200)}
    assert pick == {"NVIDIA H100 80GB HBM3": "triton", "NVIDIA H200": "flashmla"}
    entries, where, note = choices.table_for("sm90", "NVIDIA H200")
    assert where == "dsv4_attn/data/choices/sm90-h200.json" and note == "" and "NVIDIA H200" in entries[0].evidence
    # an H100 PCIe shares 'h100' with the H100 SXM table: the nearest, named in the note
    entries, where, note = choices.table_for("sm90", "NVIDIA H100 PCIe")
    assert where.endswith("sm90-h100-80gb-hbm3.json")
    assert note == "no table measured on NVIDIA H100 PCIe; the nearest sm90 table is NVIDIA H100 80GB HBM3's"
    _, why = bm.auto_order(Platform("cuda", "sm90", "NVIDIA H100 PCIe", "2.x"), SPEC, KVFormat.MODEL1_FP8,
                           LayerKind.C4A, dsv4.Phase.DECODE, 8)
    assert "(no table measured on NVIDIA H100 PCIe; the nearest sm90 table is" in why
    # no table for the arch at all: nothing measured
    assert choices.table_for("sm100", "NVIDIA B200") == ((), "", "")


def test_explain_says_when_the_table_is_another_devices(device_tables, monkeypatch):
    monkeypatch.setattr(dsv4.SparseMLA, "platform", property(lambda self: Platform("cuda", "sm90", "NVIDIA H800",
                                                                                       "2.x")))
    text = dsv4.SparseMLA(ModelSpec(num_heads=64), "fp8_ds_mla", backend="auto", device="cpu").explain()
    assert "measured choices (dsv4_attn/data/choices/" in text
    assert "no table measured on NVIDIA H800; the nearest sm90 table is" in text


def test_the_shipped_tables_are_found_by_their_devices():
    """The packaged sm_90 tables were measured on an H100 and an H200 (their files say so): each
    reads its own with no note, another sm_90 part the nearest with one."""
    for device, name in (("NVIDIA H100 80GB HBM3", "sm90-h100-80gb-hbm3.json"), ("NVIDIA H200", "sm90-h200.json")):
        entries, where, note = choices.table_for("sm90", device)
        assert entries and where == f"dsv4_attn/data/choices/{name}" and note == ""
    entries, where, note = choices.table_for("sm90", "NVIDIA H20")
    assert entries and note.startswith("no table measured on NVIDIA H20; the nearest sm90 table is")


def test_every_shipped_table_measures_the_shard_head_counts_of_its_decode_layers():
    """A shard's launches (8 / 16 / 32 heads: -tp 8 / 4 ranks) that a table does not cover fall to
    the cuda decode priority list, flashmla first, which pads them to 64 heads: 1.8-2.7x slower
    than triton on whole V4-Flash / V4-Pro TP8 steps on the H200 (notes/perf-h200.md). So every
    packaged table that measures a decode layer kind and format at full heads measures the shard
    buckets too."""
    tables = sorted((path for path in choices._folder().iterdir() if path.name.endswith(".json")),
                    key=lambda path: path.name)
    assert tables
    for path in tables:
        entries = json.loads(path.read_text())["entries"]
        decode = {(e["kind"], e["format"], e["heads"]) for e in entries if e["phase"] == "decode"}
        full = {(kind, fmt) for kind, fmt, heads in decode if heads >= 64}
        missing = sorted((kind, fmt, heads) for kind, fmt in full for heads in (8, 16, 32)
                         if (kind, fmt, heads) not in decode)
        assert not missing, f"{path.name} has no decode entries for {missing}"


def test_bench_written_table_ships_under_the_name_it_prints(tmp_path, monkeypatch):
    """--write-choices' table (choices.from_bench) saved under packaged_name is what that device reads."""
    row = {"phase": "decode", "kind": "c4a", "heads": 64, "format": "fp8_ds_mla", "tokens": 8, "case": "h64 b=8",
           "backends": {"triton": {"us": 30.0}, "flashmla": {"us": 20.0}}}
    table = choices.from_bench({"meta": {"device": "NVIDIA H200"}, "results": [row]}, "sm90")
    (tmp_path / choices.packaged_name(table["arch"], table["device"])).write_text(json.dumps(table))
    monkeypatch.delenv("DSV4_ATTN_CHOICES", raising=False)
    monkeypatch.setattr(choices, "_folder", lambda: tmp_path)
    choices._packaged.cache_clear()
    try:
        hit, where = choices.measured("sm90", "decode", "C4A", 64, "fp8_ds_mla", 8, "NVIDIA H200")
        assert hit.order == ("flashmla", "triton") and where == "dsv4_attn/data/choices/sm90-h200.json"
    finally:
        choices._packaged.cache_clear()
        choices._load.cache_clear()


def test_a_written_table_orders_no_bench_variant(tmp_path):
    """A --variant ('t:...', registered in the bench's process only) timed beside the backends does
    not reach --write-choices' table, even when it was the fastest."""
    import argparse

    from dsv4_attn.bench import cli

    row = {"phase": "decode", "kind": "swa", "heads": 64, "format": "fp8_ds_mla", "tokens": 64, "case": "h64 b=64",
           "backends": {"triton": {"us": 23.5}, "flashmla": {"us": 18.2}, "t:nosplit": {"us": 17.0}}}
    path = tmp_path / "table.json"
    args = argparse.Namespace(json=None, csv=None, png=None, write_choices=str(path), update_choices=None)
    cli.write_outputs(args, {"device": "NVIDIA H200"}, [row], [row])
    (entry,) = json.loads(path.read_text())["entries"]
    assert entry["order"] == ["flashmla", "triton"] and "t:nosplit" not in entry["evidence"]


def _row(kind: str, heads: int, tokens: int, us: dict) -> dict:
    return {"phase": "decode", "kind": kind, "heads": heads, "format": "fp8_ds_mla", "tokens": tokens,
            "case": f"h{heads} {kind} {tokens}", "backends": {name: {"us": t} for name, t in us.items()}}


def test_update_choices_replaces_what_the_run_measured_and_keeps_the_rest(tmp_path):
    """bench --update-choices: the (phase, kind, heads, format) shapes the run timed take its
    entries (all of them: a shape's old token ranges go too), every other entry stays as it was."""
    import argparse

    from dsv4_attn.bench import cli
    from dsv4_attn.common.platform import probe

    old = choices.from_bench({"meta": {"device": "NVIDIA H100 80GB HBM3"}, "results": [
        _row("swa", 64, 64, {"triton": 23.9, "flashmla": 18.3}),
        _row("swa", 64, 256, {"triton": 34.0, "flashmla": 35.0}),
        _row("c4a", 64, 64, {"triton": 36.0, "flashmla": 50.0}),
        _row("swa", 8, 64, {"triton": 12.0, "flashmla": 26.0})]}, probe().arch)  # the arch the run writes
    path = tmp_path / "table.json"
    path.write_text(json.dumps(old))
    run = _row("swa", 64, 128, {"triton": 16.9, "flashmla": 18.2})
    args = argparse.Namespace(json=None, csv=None, png=None, write_choices=None, update_choices=str(path))
    cli.write_outputs(args, {"device": "NVIDIA H100 80GB HBM3"}, [run], [run])
    table = json.loads(path.read_text())
    by_shape = {(e["kind"], e["heads"]): e for e in table["entries"]}
    assert len(table["entries"]) == 3 and table["device"] == "NVIDIA H100 80GB HBM3"
    assert by_shape["SWA", 64]["order"] == ["triton", "flashmla"] and by_shape["SWA", 64]["tokens"] == [1, 2**31]
    assert by_shape["C4A", 64] == next(e for e in old["entries"] if e["kind"] == "C4A")
    assert by_shape["SWA", 8] == next(e for e in old["entries"] if e["heads"] == 8)


def test_update_choices_refuses_another_gpus_table():
    old = choices.from_bench({"meta": {"device": "NVIDIA H200"}, "results": [_row("swa", 64, 64, {"triton": 1.0})]},
                             "sm90")
    new = choices.from_bench({"meta": {"device": "NVIDIA H100 80GB HBM3"},
                              "results": [_row("swa", 64, 64, {"triton": 1.0})]}, "sm90")
    with pytest.raises(ValueError, match="--update-choices: got a table of device 'NVIDIA H200' for a run on "
                                         "'NVIDIA H100 80GB HBM3'"):
        choices.merged(old, new)
    with pytest.raises(ValueError, match="--update-choices: got a table of arch 'sm100'"):
        choices.merged({**new, "arch": "sm100"}, new)


@pytest.mark.parametrize("extra,shards", [([], False), (["--write-choices", "t.json"], True),
                                          (["--write-choices", "t.json", "--configs", "v4"], False)])
def test_a_table_run_times_the_shard_head_counts_unless_configs_are_named(extra, shards):
    """bench --write-choices without --configs times the 8 / 16 / 32-head decode configs too, so the
    table it writes covers a -tp rank's launches (the packaged tables' rule, above); named
    --configs are taken as given, and a run without a table keeps its default."""
    from dsv4_attn.bench import cli
    from dsv4_attn.bench.configs import DECODE_CONFIGS, is_shard

    args = cli._parser().parse_args(["--mode", "decode", *extra])
    args.batches, args.mtp = [2], [1]
    names = {name for _, name, *_ in cli.list_cases(args, [KVFormat.parse("fp8_ds_mla")])}
    assert any(is_shard(DECODE_CONFIGS[n]) for n in names) == shards
    assert {"h64-c4a512", "h128-c128a", "h64-swa"} <= names

