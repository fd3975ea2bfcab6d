"""Bad input, round 3 (issue 26): the 13 causes of the adversarial sweep, one test (or one
parametrized family) each. Every refusal is a ValueError naming the argument, raised before any
work, with caches and inputs untouched; where docs/bad-input.md defines a masking instead, the
test checks the masked answer against the same step written without the bad entry.

Small shapes: the Triton cases run under the CPU interpreter in CI.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn import envs
from dsv4_attn.common import choices
from dsv4_attn.common.spec import Layer, LayerKind, ModelSpec
from dsv4_attn.testing.steps import make_step

from kit.compare import assert_close, compare

HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="Triton missing"))]
C4A_ONLY = (LayerKind.SWA, LayerKind.C4A)


def _rows_step(gen, kinds=C4A_ONLY, positions=None):
    """A 3-request decode step as StepRows: SWA rows and the per-token facts taken from a torch
    plan of the same StepBatch, each top-k ratio as a TopkTable that is a ``[:R]`` view of a larger
    table whose extra row R holds valid (stale) block ids."""
    case = make_step(gen, [1, 1, 1], [40, 90, 17], kinds=kinds, topk=16, max_model_len=1024)
    plan = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch", front_end="torch").plan(case.batch)
    R = case.batch.num_reqs
    comp = {}
    for ratio, table in case.batch.comp_block_tables.items():
        stale = torch.cat([table, table[:1]])  # row R: another request's blocks, left over from an older step
        comp[ratio] = dsv4.TopkTable(stale[:R], case.batch.block_size // ratio)
    pos = plan.positions.clone() if positions is None else positions
    rows = dsv4.StepRows(plan.swa_rows.clone(), plan.swa_lens.clone(), pos, 3, comp,
                         token_to_req=plan.token_to_req.clone())
    return case, rows


def _forward(backend, case, rows, kind):
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=backend, front_end="torch")
    plan = mla.plan(rows)
    out = torch.full_like(case.q, float("nan"))
    mla.forward(plan, kind, case.q, case.caches["swa"], case.caches[kind], topk=case.topks[kind], sink=case.sink,
                out=out)
    assert not out.isnan().any(), "output not fully written"
    return out


# ---- causes 1 and 2: a request outside the TopkTables is padding --------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_of_a_request_past_the_topk_tables_reads_no_other_request(gen, backend):
    """token_to_req = R (the table is a [:R] view; row R holds another request's blocks): the token
    is padding (docs/bad-input.md), exactly as with token_to_req = -1; validate=True names it."""
    case, rows = _rows_step(gen)
    rows.token_to_req[1] = 3
    got = _forward(backend, case, rows, LayerKind.C4A)
    rows.token_to_req[1] = -1
    want = _forward(backend, case, rows, LayerKind.C4A)
    assert torch.equal(got, want)
    rows.token_to_req[1] = 3
    with pytest.raises(ValueError, match=r"^token_to_req: got 3 at token 1; allowed: -1 \(padding\) or a request 0..2"):
        rows.validate()


# ---- cause 3: int64 positions past 2**31 --------------------------------------------------------
@pytest.mark.skipif(not HAS_TRITON, reason="Triton missing")
def test_int64_positions_past_2_31_keep_every_top_k_entry(gen):
    """C1A, positions 2**31 + small: every local entry is visible; the Triton kernel used to cast
    the visible count to int32 (negative) and drop the compressed scope."""
    kinds = (LayerKind.SWA, LayerKind.C1A)
    case, rows = _rows_step(gen, kinds=kinds)
    rows.positions = rows.positions.long() + 2**31  # the local top-k (< the old positions) stays visible
    outs = {b: _forward(b, case, rows, LayerKind.C1A) for b in ("torch", "triton")}
    assert_close(compare(outs["triton"], outs["torch"]), what="triton vs torch at positions >= 2**31")


# ---- cause 4: out shares memory with what the kernels read -------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alias", ["q", "swa_cache"])
def test_out_overlapping_an_input_is_refused_before_any_write(gen, backend, alias):
    case = make_step(gen, [1, 1], [40, 90], kinds=C4A_ONLY, topk=16, max_model_len=1024)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=backend)
    plan = mla.plan(case.batch)
    T, H = case.q.shape[:2]
    q, swa = case.q, case.caches["swa"]
    if alias == "q":  # out = buf[1:], q = buf[:-1]
        buf = torch.cat([q, q[:1]])
        q, out = buf[:-1], buf[1:]
    else:  # out views the SWA cache's bytes
        out = torch.empty(0, dtype=torch.bfloat16).set_(swa.untyped_storage(), 0, (T, H, 512))
    before = (q.clone(), swa.clone())
    with pytest.raises(ValueError, match=rf"^out: got a tensor overlapping {alias} .*allowed: memory of its own"):
        mla.forward(plan, LayerKind.C4A, q, swa, case.caches[LayerKind.C4A], topk=case.topks[LayerKind.C4A],
                    sink=case.sink, out=out)
    assert torch.equal(q, before[0]) and torch.equal(swa, before[1])


def test_out_overlapping_a_plan_buffer_is_refused_at_every_layer(gen):
    """out viewing the plan's SWA rows: refused after a good layer call of the same step and again
    at the next call (the plan's buffer spans are computed once per plan), the rows untouched."""
    case = make_step(gen, [1, 1], [40, 90], kinds=C4A_ONLY, topk=16, max_model_len=1024)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(case.batch)

    def layer(out):
        mla.forward(plan, LayerKind.C4A, case.q, case.caches["swa"], case.caches[LayerKind.C4A],
                    topk=case.topks[LayerKind.C4A], sink=case.sink, out=out)

    layer(torch.full_like(case.q, float("nan")))
    storage = plan.swa_rows.untyped_storage()
    assert storage.nbytes() >= case.q.numel() * 2  # the plan buffer holds a whole output
    aliased = torch.empty(0, dtype=torch.bfloat16).set_(storage, 0, tuple(case.q.shape))
    rows = plan.swa_rows.clone()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^out: got a tensor overlapping plan\.swa_rows .*memory of its own"):
            layer(aliased)
    assert torch.equal(plan.swa_rows, rows)


# ---- cause 5: Layer records -------------------------------------------------------------------
def test_layer_records_are_checked_and_named_kinds_accepted():
    spec = ModelSpec(4, layers=[Layer(0, "c4a", 0)])  # a kind's name, as LayerKind.parse takes it
    assert spec.kinds == (LayerKind.C4A,)
    dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    with pytest.raises(ValueError, match=r"^Layer.comp_source: got None for a C4A layer; allowed: the index"):
        Layer(0, LayerKind.C4A)
    with pytest.raises(ValueError, match=r"^Layer.comp_source: got 0 for a SWA layer; allowed: None"):
        Layer(0, LayerKind.SWA, 0)
    with pytest.raises(ValueError, match=r"^kind: got 'c5a'"):
        Layer(0, "c5a", 0)
    with pytest.raises(ValueError, match=r"^layers: layer 0 \(C4A\) reads the compressed cache of layer 5 "
                                         r"\(no such layer\)"):
        ModelSpec(4, layers=[Layer(0, LayerKind.C4A, 5)])
    with pytest.raises(ValueError, match=r"^layers: layer 1 \(C1A\) reads the compressed cache of layer 0 "
                                         r"\(layer 0 is C4A\)"):
        ModelSpec(4, layers=[Layer(0, LayerKind.C4A, 0), Layer(1, LayerKind.C1A, 0)])
    with pytest.raises(ValueError, match=r"^layers: got indices \[0, 0\]; allowed: each index once"):
        ModelSpec(4, layers=[Layer(0, LayerKind.SWA), Layer(0, LayerKind.SWA)])


# ---- causes 6-8: from_hf_config names the key, coerces nothing, checks the counts --------------
def _v41(**changes):
    cfg = dict(num_attention_heads=64, num_hidden_layers=4, num_nextn_predict_layers=1, index_topk=512,
               sliding_window=128, max_position_embeddings=65536, compress_ratios=[0, 1, 2, 2, 0],
               kv_source_layer_ids=[1, 2])
    cfg.update(changes)
    return cfg


def _v4(**changes):
    cfg = dict(num_attention_heads=64, num_hidden_layers=3, index_topk=512, sliding_window=128,
               layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("cfg, message", [
    # cause 6: errors that did not name the key
    (_v41(sliding_window=None), r"^config.sliding_window: got None; allowed: an int >= 1"),
    (_v41(compress_ratios=[0, "a", 2, 2]), r"^config.compress_ratios: got \[0, 'a', 2, 2\]; allowed: a list of ints"),
    (_v41(compress_ratios=[0, -1, 2, 2]), r"^config.compress_ratios: got \[0, -1, 2, 2\]"),
    (_v41(compress_ratios="0122"), r"^config.compress_ratios: got '0122'"),
    (_v41(num_nextn_predict_layers="1"), r"^config.num_nextn_predict_layers: got '1'; allowed: an int >= 0"),
    (_v41(max_position_embeddings="big"), r"^config.max_position_embeddings: got 'big'"),
    (_v41(head_dim="512"), r"^config.head_dim: got '512'"),
    (_v41(kv_source_layer_ids="1"), r"^config.kv_source_layer_ids: got '1'"),
    (_v4(compress_rates={"compressed_sparse_attention": "4"}), r"^config.compress_rates: got "),
    (_v4(compress_rates=[4, 128]), r"^config.compress_rates: got \[4, 128\]; allowed: a mapping"),
    # cause 7: silent coercion
    (_v41(index_topk=1.5), r"^config.index_topk: got 1.5; allowed: an int >= 1"),
    (_v41(sliding_window=128.0), r"^config.sliding_window: got 128.0"),
    (_v4(layer_types="sliding_attention"), r"^config.layer_types: got 'sliding_attention'; allowed: a list of 3"),
    # cause 8: counts
    (_v41(compress_ratios=[0, 1]), r"^config.compress_ratios: got 2 entries; allowed: one per layer, 4 "),
    (_v41(compress_ratios=[0, 1, 2, 2, 0, 0]), r"^config.compress_ratios: got 6 entries"),
    (_v41(kv_source_layer_ids=[99]), r"^config.kv_source_layer_ids: got \[99\]; allowed: a list of ints in \[0, 4\]"),
    (_v4(layer_types=["sliding_attention"]), r"^config.layer_types: got \['sliding_attention'\]; allowed: a list of 3"),
])
def test_from_hf_config_names_the_key_and_coerces_nothing(cfg, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(cfg)


def test_from_hf_config_still_reads_real_configs():
    assert [k.name for k in ModelSpec.from_hf_config(_v41()).kinds] == ["SWA", "C1A", "C2A"]
    assert len(ModelSpec.from_hf_config(_v41(compress_ratios=[0, 1, 2, 2])).layers) == 5  # MTP layer appended
    assert [k.name for k in ModelSpec.from_hf_config(_v4()).kinds] == ["SWA", "C4A", "C128A"]


# ---- causes 9 and 10: environment variables ---------------------------------------------------
def test_choices_file_that_is_not_json_names_the_variable_and_the_file(monkeypatch, tmp_path):
    path = tmp_path / "choices.txt"
    path.write_text("arch = sm90\n")
    monkeypatch.setenv(envs.CHOICES.name, str(path))
    with pytest.raises(ValueError, match=rf"^DSV4_ATTN_CHOICES: got '{path}', which is not a choices table "
                                         r"\(Expecting value.*allowed: the JSON that `dsv4-attn bench"):
        choices.table_for("sm90")
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match=r"^DSV4_ATTN_CHOICES: got .*not a choices table"):
        choices.table_for("sm90")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_strided_sink_view_is_refused_before_the_work(gen, backend):
    """sink = every other element of a [2H] tensor (stride 2): the kernels read head h's sink at
    sink + h, so the Triton backend took the wrong heads' sinks; refused for every backend, the
    output left as it was."""
    case, rows = _rows_step(gen)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=backend, front_end="torch")
    plan = mla.plan(rows)
    H = case.q.shape[1]
    wide = torch.stack([case.sink, torch.randn(H, generator=gen)], dim=1).reshape(-1)
    sink = wide[::2]
    assert torch.equal(sink, case.sink) and sink.stride() == (2,)
    out = torch.full_like(case.q, float("nan"))
    with pytest.raises(ValueError, match=rf"^sink: got torch.float32 \({H},\) stride \(2,\) on cpu; "
                                         rf"allowed: contiguous torch.float32 \[{H}\]"):
        mla.forward(plan, LayerKind.C4A, case.q, case.caches["swa"], case.caches[LayerKind.C4A],
                    topk=case.topks[LayerKind.C4A], sink=sink, out=out)
    assert out.isnan().all()


@pytest.mark.parametrize("value", ["bogus", "gfx950:0.2", "gfx90a", "on:sparse"])
def test_aiter_emulator_variable_is_validated_and_probe_exits_2(monkeypatch, capsys, value):
    from dsv4_attn import probe_cli

    monkeypatch.setenv(envs.AITER_EMULATOR.name, value)
    with pytest.raises(ValueError, match=rf"^DSV4_ATTN_AITER_EMULATOR: got '{value}'; allowed: 0/off, 1/on"):
        envs.AITER_EMULATOR.get()
    assert probe_cli.main(["--json"]) == 2
    assert f"DSV4_ATTN_AITER_EMULATOR: got '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "ON", "gfx942", "gfx950:sparse", "gfx950:0.1.7"])
def test_aiter_emulator_variable_accepts_its_forms(monkeypatch, value):
    monkeypatch.setenv(envs.AITER_EMULATOR.name, value)
    assert envs.AITER_EMULATOR.get() == value.lower()


# ---- causes 11-13: the CLI refuses before the work, exit 2, no traceback -----------------------
def _no_work(monkeypatch):
    from dsv4_attn import bench
    from dsv4_attn.parity import cli as parity_cli

    def work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(parity_cli, "run", work)
    monkeypatch.setattr(bench, "measure_ceilings", work)


@pytest.mark.parametrize("argv, env, message", [
    (["parity", "--threads", "-3"], {}, "--threads: got -3; allowed: an int >= 1"),
    (["parity", "--threads", "0"], {}, "--threads: got 0; allowed: an int >= 1"),
    (["parity", "--out", "{file}"], {}, "--out: got '{file}', which is a file; allowed: a directory"),
    (["parity", "--merge", "x.json", "--out", "{file}"], {}, "--out: got '{file}', which is a file"),
    (["parity"], {"DSV4_ATTN_BACKEND": "nonsense"}, "DSV4_ATTN_BACKEND: got 'nonsense'; allowed: 'auto' or one of"),
    (["bench", "--json", "{missing}/r.json"], {}, "--json: got '{missing}/r.json', but '{missing}' is not a dir"),
    (["bench", "--csv", "{tmp}"], {}, "--csv: got '{tmp}', which is a directory; allowed: a file path"),
    (["bench", "--backends", "auto"], {"DSV4_ATTN_BACKEND": "nonsense"}, "DSV4_ATTN_BACKEND: got 'nonsense'"),
])
def test_cli_user_errors_exit_2_before_the_work(monkeypatch, capsys, tmp_path, argv, env, message):
    from dsv4_attn import cli

    _no_work(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "a-file").write_text("")
    where = {"file": str(tmp_path / "a-file"), "missing": str(tmp_path / "missing"), "tmp": str(tmp_path)}
    argv = [a.format(**where) for a in argv] + (["--device", "cpu"] if argv[0] == "bench" else
                                                 ["--cases", "core.swa.h16", "--device", "cpu"])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(**where) in err and "Traceback" not in err
