"""`dsv4-attn bench` on CPU: its V4.1 configs, the bytes it charges each case (each distinct key
row once at its cache record's size, counted here from the step's definition, not from the plan) and the random
caches it fills (finite, nonzero, in every record)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_attn import bench
from dsv4_attn.common import layout
from dsv4_attn.common.layout import KVFormat, Record
from dsv4_attn.common.spec import LayerKind

from kit.compare import assert_close, metrics

FORMATS = ["fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", [LayerKind.C1A, LayerKind.C2A, LayerKind.C4A])
def test_decode_case_bytes_count_each_distinct_row_at_its_record_size(fmt, kind):
    fmt = KVFormat.parse(fmt)
    cfg = bench.DecodeConfig("tiny", 16, kind, 48, seq_len=300, max_model_len=4096)
    case = bench.make_decode_case(cfg, 3, 2, torch.device("cpu"), fmt, seed=1)
    from dsv4_attn.api import SparseMLA

    plan = SparseMLA(case.spec, case.fmt, backend="torch").plan(case.batch)
    flops, nbytes, keys = bench.case_work(case, plan)
    pos = torch.tensor([298, 299] * 3)  # 3 requests of 300 tokens decoding their last 2
    swa_keys = int(torch.clamp(pos + 1, max=128).sum())
    comp_keys = int(torch.clamp((pos + 1) // kind.ratio, max=48).sum())
    # distinct rows: a request's two tokens share their window (positions 171..299: 129 rows) and
    # whatever their top-k rows (local entries of one request) have in common
    swa_rows = 3 * 129
    comp_rows = sum(len(set(case.topk[2 * r][case.topk[2 * r] >= 0].tolist())
                        | set(case.topk[2 * r + 1][case.topk[2 * r + 1] >= 0].tolist())) for r in range(3))
    size = {Record.V4_FP8: 584, Record.MXFP8: 528, Record.NVFP4: 288}
    assert keys == swa_keys + comp_keys
    assert nbytes == swa_rows * size[fmt.swa_record] + comp_rows * size[fmt.comp_record] + 2 * 6 * 16 * 512 * 2
    assert flops == 4.0 * 16 * 512 * keys
    # the local top-k rows hold distinct visible entries (what the count above assumes)
    for t in range(6):
        row = case.topk[t][case.topk[t] >= 0]
        assert row.numel() == min((int(pos[t]) + 1) // kind.ratio, 48) == row.unique().numel()
        assert int(row.max()) < (int(pos[t]) + 1) // kind.ratio


@pytest.mark.parametrize("record", list(Record))
def test_random_caches_are_finite_and_nonzero_in_every_record(record):
    cache = layout.new_cache(record, 3, 16, block_stride=None)
    bench.fill_random(cache, record)
    rows = layout.gather(cache, record, torch.arange(48), scale=1.0 if record is Record.FP8_TENSOR else None)
    assert torch.isfinite(rows).all()
    assert (rows.abs().amax(dim=1) > 0).all() and rows.abs().max() < 4096


def test_config_groups_and_which_formats_run_them():
    v41 = bench.select_configs(bench.DECODE_CONFIGS, ["v41"])
    assert v41 == ["h64-c1a512", "h128-c1a1024", "h64-c2a512", "h128-c2a1024"]
    assert bench.select_configs(bench.DECODE_CONFIGS, ["v4", "h64-c1a512"])[-1] == "h64-c1a512"
    assert all(bench.PREFILL_CONFIGS[n].kind in (LayerKind.C1A, LayerKind.C2A)
               for n in bench.select_configs(bench.PREFILL_CONFIGS, ["v41"]))
    # V4.1 records only with V4.1 kinds; the V4 record with both models' kinds
    assert bench.runs_in(LayerKind.C2A, KVFormat.NVFP4) and not bench.runs_in(LayerKind.C4A, KVFormat.MXFP8)
    assert bench.runs_in(LayerKind.C1A, KVFormat.MODEL1_FP8) and bench.runs_in(LayerKind.C128A, KVFormat.BF16)


def test_tensor_parallel_shards_are_timed_only_when_asked_for():
    """h8 / h16 / h32 decode configs (V4's kinds and V4.1's top-k kinds) and the TP8 step models: in
    the 'tp' group, not in the default set nor in 'v4' / 'v41' (the choices table counts their heads
    as 64)."""
    shards = [f"h{h}-{t}" for h in (8, 16, 32) for t in ("c4a512", "c4a1024", "c128a", "swa", "c1a512", "c2a1024")]
    assert bench.select_configs(bench.DECODE_CONFIGS, ["tp"]) == shards
    for names in (None, ["v4"], ["v41"]):
        assert not set(shards) & set(bench.select_configs(bench.DECODE_CONFIGS, names))
    assert bench.select_configs(bench.STEP_MODELS, None) == ["v4-flash", "v4-pro"]
    assert bench.select_configs(bench.STEP_MODELS, ["tp"]) == ["v4-flash-tp8", "v4-pro-tp8"]


def test_vllm_padding_of_a_shard_for_flashmla():
    q, sink = torch.randn(3, 8, 512).bfloat16(), torch.randn(8)
    q_pad, sink_pad = bench.runners.vllm_padded(q, sink)
    assert q_pad.shape == (3, 64, 512) and torch.equal(q_pad[:, :8], q) and not q_pad[:, 8:].any()
    assert torch.equal(sink_pad[:8], sink) and bool((sink_pad[8:] == float("-inf")).all())
    full = torch.randn(3, 64, 512).bfloat16()
    assert bench.runners.vllm_padded(full, torch.randn(64))[0] is full


# ---- --mode step: a whole decode step of V4-Flash / V4-Pro --------------------------------------
def test_step_models_follow_their_layer_patterns():
    """The layer lists ModelSpec.from_hf_config makes of the step models' config fields (the MTP
    draft layer is window-only and left out of the step)."""
    from dsv4_attn.common.spec import ModelSpec

    def kinds(name):
        spec = ModelSpec.from_hf_config(bench.STEP_MODELS[name].config)
        assert [la.index for la in spec.layers if la.mtp] == [len(spec.layers) - 1]
        return spec, [la.kind.name for la in spec.layers if not la.mtp]

    spec, flash = kinds("v4-flash")
    assert (spec.num_heads, spec.topk, len(flash)) == (64, 512, 43)
    assert flash[:2] == ["SWA", "SWA"] and flash[2::2] == ["C4A"] * 21 and flash[3::2] == ["C128A"] * 20
    spec, pro = kinds("v4-pro")
    assert (spec.num_heads, spec.topk, len(pro)) == (128, 1024, 61)
    assert pro[:2] == ["C128A", "C128A"] and pro[2::2] == ["C4A"] * 30 and pro[3::2] == ["C128A"] * 29
    # one rank under -tp 8: the same layers, an eighth of the heads
    assert kinds("v4-flash-tp8") == (dataclasses.replace(kinds("v4-flash")[0], num_heads=8), flash)
    assert kinds("v4-pro-tp8")[0].num_heads == 16 and kinds("v4-pro-tp8")[1] == pro


def test_vllm_c128a_width():
    # the next power of two >= the longest request's entries, at least 128, at most the model's width
    assert [bench.vllm_c128a_width(n, 1024) for n in (300, 128 * 129, 40000, 131072, 10**6)] == \
        [128, 256, 512, 1024, 1024]


def _step_case(seed=3, model="v4-flash"):
    return bench.make_model_step(bench.STEP_MODELS[model], 2, 1, torch.device("cpu"),
                                 max_model_len=bench.STEP_CPU_MAX_MODEL_LEN, seed=seed)


def _reference(case, layer):
    """float64 [T, H, 512]: the layer on rows built by common.indices from the step's batch."""
    from dsv4_attn.common import indices, reference

    swa_rows, swa_lens = indices.swa_rows(case.batch, case.spec.window)
    rows = lens = None
    if layer.kind.uses_topk:
        rows, lens = indices.topk_rows(case.batch, layer.kind, layer.topk)
    elif layer.kind.has_comp_scope:
        rows, lens = indices.all_rows(case.batch, layer.kind, case.spec.all_width(layer.kind.ratio))
    out, _ = reference.sparse_mla(layer.q, layer.swa_cache, swa_rows, swa_lens, layer.comp_cache, rows, lens,
                                  layer.sink, case.spec.scale, case.fmt)
    return out


def test_step_case_owns_its_caches_and_matches_the_reference():
    """Every layer its own SWA cache, q and sink, C128A layers their own compressed cache, the C4A
    layers one shared cache with their own top-k; one step through the API (plan once, every
    layer) writes every layer, and a C4A and a C128A layer match the float64 reference."""
    from kit.compare import compare

    case = _step_case()
    layers = case.layers
    assert len(layers) == 43 and case.num_tokens == 2
    assert 129 <= min(case.batch.seq_lens.tolist()) and max(case.batch.seq_lens.tolist()) <= 2048
    assert len({la.swa_cache.data_ptr() for la in layers}) == 43 and len({la.q.data_ptr() for la in layers}) == 43
    c4a = [la for la in layers if la.kind is LayerKind.C4A]
    c128a = [la for la in layers if la.kind is LayerKind.C128A]
    assert all(la.comp_cache is c4a[0].comp_cache for la in c4a)
    assert len({la.comp_cache.data_ptr() for la in c128a}) == len(c128a) == 20
    assert not torch.equal(c4a[0].topk, c4a[1].topk)
    run, outs, mla = bench.api_step_runner(case, "torch")
    for out in outs:
        out.fill_(float("nan"))
    run()
    assert all(not out.isnan().any() for out in outs)
    for layer in (c4a[3], c128a[5]):
        m = compare(outs[layers.index(layer)], _reference(case, layer))
        assert m["rel_l2"] < 1e-2 and m["cosine"] > 0.9999, (layer.kind, m)


@pytest.mark.parametrize("model", ["v4-flash", "v4-flash-tp8"])
def test_step_flashmla_as_vllm_runner_on_the_flashmla_stand_in(monkeypatch, model):
    """FlashMLA driven as vLLM drives a step, on CPU: its index kernels under TRITON_INTERPRET=1 and
    tests/test_flashmla.py's stand-in for FlashMLA's op (its argument contract enforced): every
    layer matches the float64 reference, one tile schedule per layer kind; a tensor-parallel shard
    (8 heads) runs FlashMLA at 64 heads, padded as vLLM pads them, and only its 8 are returned."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from kit.compare import compare
    from kit.flashmla_standin import FakeFlashMLA

    fake = FakeFlashMLA("sm90")
    monkeypatch.setattr(bench.runners, "raw_flashmla_ops", lambda: fake)
    case = _step_case(seed=5, model=model)
    run, outs, how = bench.flashmla_vllm_step_runner(case)
    assert run is not None, how
    assert "C128A rows 128 wide" in how  # lengths <= 2048: 16 entries -> vLLM's minimum width
    assert ("8 heads padded to 64" in how) == (model == "v4-flash-tp8")
    for out in outs:
        out.fill_(float("nan"))
    run()
    for layer, out in zip(case.layers, outs):
        assert not out.isnan().any(), layer.index
        m = compare(out, _reference(case, layer))
        assert m["rel_l2"] < 1e-2 and m["cosine"] > 0.9999, (layer.index, layer.kind, m)
    assert len(fake.decode_calls) == 43 and {call["h"] for call in fake.decode_calls} == {64}
    tiles = {}
    for call in fake.decode_calls:
        tiles.setdefault(call["config"], set()).add(id(call["tile"]))
    assert len(tiles) == 3 and all(len(t) == 1 for t in tiles.values())  # SWA, C4A, C128A: planned once each


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_step_is_captured_whole_and_agrees_with_flashmla_as_vllm():
    """On a GPU the whole step (plan + 43 layers) is captured as one graph for auto, triton and
    FlashMLA-as-vLLM, every layer is written, and their outputs agree (no timing asserted)."""
    from types import SimpleNamespace

    device = torch.device("cuda")
    case = bench.make_model_step(bench.STEP_MODELS["v4-flash"], 4, 2, device, max_model_len=16384)
    args = SimpleNamespace(reps=3, no_graph=False, no_flashmla=False)
    res = bench.run_step_case(case, ["triton"], args, bench.L2Flush(device))
    for name, r in res["backends"].items():
        assert (r["timing"], r["layers_written"]) == ("graph", 43), name
    assert res["backends"]["triton"]["vs_auto"]["max_rel_l2"] < 1e-2
    fm = res["flashmla_vllm"]
    if "unavailable" in fm:
        pytest.skip(f"FlashMLA as vLLM: {fm['unavailable']}")
    assert (fm["timing"], fm["layers_written"]) == ("graph", 43) and fm["vs_auto"]["max_rel_l2"] < 1e-2


def test_window_only_decode_case_has_no_compressed_scope():
    """The SWA configs (auto's measurement for window-only layers): no compressed cache, keys =
    each token's window, every row written by the torch backend and equal to the reference."""
    from dsv4_attn.api import SparseMLA

    cfg = bench.DecodeConfig("tiny-swa", 16, LayerKind.SWA, 0, max_model_len=4096)
    case = bench.make_decode_case(cfg, 3, 2, torch.device("cpu"), seed=2)
    assert case.comp_cache is None and case.topk is None
    mla = SparseMLA(case.spec, case.fmt, backend="torch")
    plan = mla.plan(case.batch)
    _, _, keys = bench.case_work(case, plan)
    assert keys == int(torch.clamp(case.batch.positions + 1, max=128).sum())
    out = torch.full_like(case.q, float("nan"))
    mla.forward(plan, LayerKind.SWA, case.q, case.swa_cache, None, sink=case.sink, out=out)
    # bench caches hold values up to ~28: rel_l2 and cosine judge
    assert_close(metrics(out, case.reference(plan)), max_abs=False)
    assert bench.select_configs(bench.DECODE_CONFIGS, ["h64-swa", "h128-swa"]) == ["h64-swa", "h128-swa"]


def test_step_gaps_compare_auto_with_the_fastest_named_backend():
    results = [{"case": "v4-flash b=2 s_q=1", "format": "fp8_ds_mla",
                "backends": {"auto": {"us": 691.5}, "triton": {"us": 656.3}, "flashmla": {"us": 757.0}}},
               {"case": "v4-pro b=2 s_q=1", "format": "fp8_ds_mla",
                "backends": {"auto": {"us": 1049.6}, "triton": {"us": 1076.6}, "flashmla": {"us": 1120.6}}},
               {"case": "no auto", "backends": {"triton": {"us": 1.0}}}]
    gaps = bench.step_auto_gaps(results)
    assert [(round(g, 4), case, best) for g, case, best in gaps] == [
        (round(691.5 / 656.3 - 1, 4), "v4-flash b=2 s_q=1 fp8_ds_mla", "triton"),
        (round(1049.6 / 1076.6 - 1, 4), "v4-pro b=2 s_q=1 fp8_ds_mla", "triton")]


def test_a_backend_that_cannot_be_captured_says_why_and_the_bench_times_it_eagerly():
    """FlashMLA's prefill sizes its workspace on the host: declared (Backend.uncapturable), and
    the bench names it instead of trying a capture that fails with a CUDA error."""
    from dsv4_attn.api import SparseMLA
    from dsv4_attn.common.backend import Phase
    from dsv4_attn.common.registry import get_backend

    assert "torch.unique" in get_backend("flashmla").uncapturable[Phase.PREFILL]
    assert Phase.DECODE not in get_backend("flashmla").uncapturable
    assert not get_backend("triton").uncapturable and not get_backend("torch").uncapturable
    cfg = bench.PrefillConfig("tiny", 16, 64, 1024, 256)
    case = bench.make_prefill_case(cfg, torch.device("cpu"), seed=3)
    plan = SparseMLA(case.spec, case.fmt, backend="torch").plan(case.batch)
    assert bench.uncapturable("flashmla", case, plan) == (
        "flashmla prefill cannot be graph-captured: " + get_backend("flashmla").uncapturable[Phase.PREFILL])
    assert bench.uncapturable("triton", case, plan) is None
    assert bench.uncapturable("auto", case, plan) is None  # the CPU picks torch
    decode = bench.make_decode_case(bench.DecodeConfig("tiny", 16, LayerKind.C4A, 48, seq_len=300,
                                                       max_model_len=4096), 2, 1, torch.device("cpu"))
    dplan = SparseMLA(decode.spec, decode.fmt, backend="torch").plan(decode.batch)
    assert bench.uncapturable("flashmla", decode, dplan) is None


def test_host_us_times_eager_calls_on_the_calling_thread():
    """bench's host µs per layer call (eager path): the calls made after one warm-up, per call,
    and a CSV column (the figure itself is a measurement, not asserted)."""
    from dsv4_attn import bench

    calls = []
    us = bench.host_us(lambda: calls.append(1), torch.device("cpu"), calls=7)
    assert len(calls) == 8 and us > 0 and "host_us" in bench.CSV_COLUMNS


def test_batch_invariant_rows_name_the_backends_that_offer_the_mode():
    """--batch-invariant adds 'NAME+batch-invariant' rows for the backends that declare the mode
    (triton), none for the others; a row name maps back to its backend and the mode."""
    from dsv4_attn.bench.cli import batch_invariant_rows
    from dsv4_attn.bench.runners import backend_mode

    assert batch_invariant_rows(["auto", "torch", "triton"]) == ["triton+batch-invariant"]
    assert backend_mode("triton+batch-invariant") == ("triton", True)
    assert backend_mode("triton") == ("triton", False)


@pytest.mark.parametrize("record", [Record.V4_FP8, Record.MXFP8, Record.NVFP4])
@pytest.mark.parametrize("block_stride", [None, 3 * 64 * 1024])  # own pages / other layers' pages between blocks
def test_the_gather_ceiling_kernel_reads_every_byte_of_each_row_it_is_given(record, block_stride):
    """bench.gather's kernel (interpreted) sums exactly the data and scale bytes of each slot of
    two caches (one launch): the rows layout.record_parts reads (data as little-endian int32
    words), nothing else."""
    from dsv4_attn.bench import gather

    caches = [layout.new_cache(record, 5, 64, block_stride=block_stride) for _ in range(2)]
    for cache in caches:  # its pages and the gaps between them
        torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage()).random_(0, 256)
    slots = [torch.tensor([0, 63, 64, 130, 319, 200, 5]), torch.tensor([191, 250, 7])]
    want = []
    for cache, s in zip(caches, slots):
        data, scales = layout.record_parts(cache, record, layout.check_cache(cache, record, "cache"), s)
        want.append(data.view(torch.int32).long().sum(dim=1) + scales.long().sum(dim=1))
    want = ((torch.cat(want) + 2**31) % 2**32 - 2**31).to(torch.int32)  # the kernel's int32 sums wrap
    g = gather.RowGather(list(zip(caches, slots)), record)
    for rows, warps in gather.SHAPES:
        g.out.fill_(-7)
        assert torch.equal(g(rows, warps), want), (rows, warps)


def test_byte_offsets_refuse_what_names_no_row():
    cache = layout.new_cache(Record.V4_FP8, 2, 64)
    with pytest.raises(ValueError, match="slots: got -1 entries"):
        layout.token_byte_offsets(cache, Record.V4_FP8, torch.tensor([3, -1]))
    with pytest.raises(ValueError, match=r"slots: got values in \[3, 128\]"):
        layout.token_byte_offsets(cache, Record.V4_FP8, torch.tensor([3, 128]))
    with pytest.raises(ValueError, match="fmt: got bf16"):
        layout.token_byte_offsets(torch.zeros(2, 64, 512, dtype=torch.bfloat16), Record.BF16, torch.tensor([0]))
