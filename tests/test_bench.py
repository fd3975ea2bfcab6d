"""`dsv4-attn bench` on CPU: its V4.1 configs, the bytes it charges each case (each distinct key
row once at its cache record's size, counted here from the step's definition, not from the plan) and the random
caches it fills (finite, nonzero, in every record)."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn import bench
from dsv4_attn.common import layout
from dsv4_attn.common.layout import KVFormat, Record
from dsv4_attn.common.spec import LayerKind

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
