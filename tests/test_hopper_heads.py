"""The heads-on-N Gluon Hopper kernel (``kernels/hopper_heads.py``, ``KernelConfig.heads_on_n``,
``ops.heads_on_n``): which head counts take it and with how many heads per program, that bad
settings are refused, and on an sm_90 GPU that it matches the float64 reference (every kind, with
and without a key split, the split merged by the combine launch or inside the kernel, head counts
that do not fill a program, MTP) eagerly and across CUDA-graph replays."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn.portable.kernels import hopper_heads, ops

from kit.layers import check_config_against_reference

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("heads,expected", [(1, 8), (4, 8), (8, 8), (9, 16), (12, 16), (16, 16)])
def test_heads_per_program(heads, expected):
    assert hopper_heads.heads_per_program(heads) == expected


CPU = torch.device("cpu")  # ops.num_sms: 4 there, so a launch of 8+ programs of the kernel is not split


@pytest.mark.parametrize("setting,gluon,heads,tiles,tokens", [
    (-1, False, 8, 18, 2),   # the portable kernel
    (1, False, 8, 18, 2),
    (0, True, 8, 18, 2),     # forced off
    (-1, True, 64, 18, 2),   # above the kernel's head count: the 64-head kernel
    (-1, True, 32, 18, 2),
    (1, True, 17, 18, 2),
    (-1, True, 16, 10, 67),  # C4A 512 (10 key tiles per token), split 3 over more than half the SMs
    (-1, True, 16, 3, 67),   # 3 key tiles, split (ops.one_program_per_sm: from 67 programs on 132 SMs, not)
])
def test_when_the_64_head_kernel_runs(monkeypatch, setting, gluon, heads, tiles, tokens):
    """On a 132-SM GPU, under Triton 3.8."""
    monkeypatch.setattr(ops, "num_sms", lambda device: 132)
    monkeypatch.setattr(ops, "_triton_version", lambda: "3.8.0")
    assert ops.heads_on_n(ops.KernelConfig(heads_on_n=setting), gluon, heads, tiles, tokens, CPU) == 0


def test_heads_on_n_setting_is_checked():
    with pytest.raises(ValueError, match=r"heads_on_n: got 2; allowed: -1 \(auto\), 0 or 1"):
        ops.KernelConfig(heads_on_n=2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the Gluon kernels need an sm_90 GPU")
@pytest.mark.parametrize("cfg,heads,batch,mtp,merge", [
    ("h8-c4a512", 8, 2, 1, -1),      # split, merged in the kernel (auto at 8 heads)
    ("h8-c4a512", 8, 70, 1, -1),     # 70 programs: split 3 (two per SM)
    ("h8-swa", 8, 1, 1, -1),
    ("h16-c128a", 16, 3, 1, -1),     # split, the combine launch
    ("h16-c4a1024", 16, 40, 2, 1),   # MTP, split merged in the kernel (forced)
    ("h16-c4a512", 16, 5, 1, 0),
    ("h16-c128a", 16, 300, 1, -1),   # 300 programs: no split
    ("h8-c4a512", 4, 3, 1, -1),      # 4 of a program's 8 heads
    ("h16-c128a", 12, 2, 1, 1),      # 12 of 16
    ("h16-swa", 10, 4, 1, 0),        # 10 of 16
])
def test_gpu_heads_on_n_matches_the_reference_across_graph_replays(cfg, heads, batch, mtp, merge):
    config = ops.KernelConfig(impl="gluon", heads_on_n=1, pair_tokens=0, merge_in_kernel=merge)
    check_config_against_reference(config, f"triton-heads-n-test-{merge}", cfg, heads, batch, mtp)


def _edge_rows(plan):
    """Lengths and rows a token pair's program must get right: an empty window (token 0), windows of
    1 and 65 keys (not a multiple of the 64-key tile), a C128A row of 1 and of 0 entries, and a
    window / C128A row of the second token of an MTP pair that no longer shares its neighbour's
    entries (one entry repeated: the prologue's check must read both lists)."""
    swa_lens = plan.swa_lens
    swa_lens[0], swa_lens[2], swa_lens[3] = 0, 1, 65
    plan.swa_rows[5, 7] = plan.swa_rows[5, 9]
    if 128 in plan.comp_rows:
        rows, lens = plan.comp_rows[128]
        lens[0], lens[4] = 1, 0
        rows[7, 0] = rows[7, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the Gluon kernels need an sm_90 GPU")
@pytest.mark.parametrize("cfg,heads,batch,mtp,merge,edges", [
    ("h8-swa", 8, 1, 2, -1, False),     # one pair, split, merged in the kernel
    ("h8-c128a", 8, 3, 2, 0, False),    # split, the combine launch
    ("h8-c128a", 8, 150, 2, -1, False),  # 150 pairs: no split
    ("h8-swa", 5, 7, 1, -1, False),     # pairs of different requests (nothing shared), an odd token alone
    ("h8-c128a", 8, 4, 3, 1, False),    # 3 tokens per request: pairs within and across requests
    ("h8-c128a", 8, 4, 2, -1, True),    # _edge_rows
    ("h8-swa", 4, 4, 2, 0, True),
    ("h8-c128a", 8, 200, 2, -1, True),  # _edge_rows, no split
])
def test_gpu_token_pairs_match_the_reference_across_graph_replays(cfg, heads, batch, mtp, merge, edges):
    config = ops.KernelConfig(impl="gluon", pair_tokens=1, merge_in_kernel=merge)
    check_config_against_reference(config, f"triton-pairs-test-{merge}", cfg, heads, batch, mtp,
                                   _edge_rows if edges else None)


@pytest.mark.parametrize("setting,heads,tiles,tokens,expected", [
    (-1, 8, 18, 2, 8),     # V4-Flash TP8 rank, C4A 1024 / C128A 1024, split 132
    (-1, 8, 18, 64, 8),    # split 2 (one program per SM)
    (-1, 16, 18, 2, 0),    # V4-Pro TP8 rank: 16 heads per program split beyond 5: the 64-head kernel
    (-1, 16, 18, 7, 0),    # split 18: still (fewer than ops.ONE_PER_SM_MIN_PROGRAMS[16])
    (-1, 16, 18, 8, 16),   # 8+ programs on at most half the SMs: always (one per SM)
    (-1, 16, 18, 32, 16),
    (-1, 16, 18, 40, 16),
    (-1, 16, 18, 64, 16),
    (-1, 16, 18, 67, 16),  # more than half the SMs: split 3 (<= 5 over 16+ tiles)
    (-1, 12, 18, 64, 16),  # 16 heads per program too
    (-1, 12, 18, 48, 16),  # split 5
    (-1, 16, 18, 88, 16),  # split 3
    (-1, 16, 18, 96, 16),  # split 2
    (-1, 16, 18, 128, 16),
    (-1, 16, 18, 256, 16),  # not split
    (-1, 8, 10, 32, 8),    # C4A 512, programs on at most half the SMs: always
    (-1, 16, 10, 48, 16),
    (-1, 8, 10, 67, 8),    # split 3: 8 heads per program take it over short rows too
    (-1, 8, 10, 100, 8),   # split 2
    (-1, 16, 10, 100, 0),  # ... 16 do not
    (-1, 8, 10, 256, 8),   # C4A 512, not split (b = 256)
    (-1, 16, 10, 256, 16),
    (-1, 16, 2, 8, 16),    # window only, not split
    (-1, 16, 2, 2, 16),    # window only: never split on this kernel (ops.short_rows_unsplit)
    (1, 8, 2, 2, 8),       # forced: any launch
    (1, 16, 18, 2, 16),
])
def test_when_the_heads_on_n_kernel_runs(monkeypatch, setting, heads, tiles, tokens, expected):
    """On a 132-SM GPU (2 x 132 program slots for this kernel), under Triton 3.8."""
    from dsv4_attn.portable.kernels import build

    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "")  # as where it compiles
    monkeypatch.setattr(ops, "num_sms", lambda device: 132)
    monkeypatch.setattr(ops, "_triton_version", lambda: "3.8.0")
    assert ops.heads_on_n(ops.KernelConfig(heads_on_n=setting), True, heads, tiles, tokens, CPU) == expected


@pytest.mark.parametrize("heads,tokens,heads_n,split,split_of_three", [
    (8, 2, 8, 1, 3),      # heads-on-N, unsplit (the split 64-head launch: 13.8 us, this 10.8 on the H200)
    (16, 64, 16, 1, 2),
    (32, 4, 0, 2, 3),     # 128 token-heads: the split pays (13.4 / 14.9 us)
    (64, 2, 0, 2, 3),
    (128, 2, 0, 2, 3),    # 256 token-heads: a tie, split as before
    (128, 4, 0, 1, 3),
    (64, 64, 0, 1, 2),    # the split launch took 23.5 us, unsplit 17.1
    (32, 64, 0, 1, 2),
])
def test_window_only_launches_split_only_while_their_partials_are_small(monkeypatch, heads, tokens, heads_n, split,
                                                                       split_of_three):
    """Rows of two 64-key tiles (a 128-key window) on a 132-SM GPU: split only up to
    SHORT_ROWS_SPLIT_MAX_TOKEN_HEADS token-heads, never on the heads-on-N kernel; rows of three
    tiles keep the split that fills the SMs (min(3, 132 // programs)), and a forced split stays."""
    from dsv4_attn.portable.kernels import build

    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "")
    monkeypatch.setattr(ops, "num_sms", lambda device: 132)
    tile = ops.KernelConfig().tile("sm90", heads)
    grid = ops.launch_grid(ops.KernelConfig(), True, tile, False, heads, tokens, CPU, 0, 128, 0)
    assert (grid[2], grid[6]) == (heads_n, split)
    three = ops.launch_grid(ops.KernelConfig(), True, tile, False, heads, tokens, CPU, 0, 192, 0)
    assert three[6] == split_of_three
    forced = ops.launch_grid(ops.KernelConfig(split=2), True, tile, False, heads, tokens, CPU, 0, 128, 0)
    assert forced[6] == 2


def test_heads_on_n_where_it_does_not_compile(monkeypatch):
    from dsv4_attn.portable.kernels import build

    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "the Gluon Hopper kernel does not compile: X")
    assert ops.heads_on_n(ops.KernelConfig(), True, 8, 18, 2, CPU) == 0  # auto: the 64-head kernel
    with pytest.raises(ValueError, match="config.heads_on_n: got 1; allowed only where the heads-on-N kernel "
                                         "compiles; here: the Gluon Hopper kernel does not compile: X"):
        ops.heads_on_n(ops.KernelConfig(heads_on_n=1), True, 8, 18, 2, CPU)


def test_pair_tokens_setting_is_checked():
    with pytest.raises(ValueError, match=r"pair_tokens: got 3; allowed: -1 \(auto\), 0 or 1"):
        ops.KernelConfig(pair_tokens=3)


@pytest.mark.parametrize("setting,gluon,heads,comp,per_request,tokens,expected", [
    (-1, True, 8, ops.K.COMP_GLOBAL, 2, 128, True),     # C128A, 64 pairs (measured faster from 64)
    (-1, True, 8, ops.K.COMP_GLOBAL, 3, 192, True),     # 3 tokens per request
    (-1, True, 8, ops.K.COMP_GLOBAL, 2, 64, False),     # 32 pairs: measured slower
    (-1, True, 8, ops.K.COMP_NONE, 2, 256, False),      # window only: measured slower
    (-1, True, 8, ops.K.COMP_GLOBAL, 1, 256, False),    # one token per request: nothing shared
    (-1, True, 8, ops.K.COMP_C4A_LOCAL, 2, 256, False),  # top-k: each token's entries differ
    (-1, True, 16, ops.K.COMP_GLOBAL, 2, 256, False),   # 2 x 16 heads: past wgmma N = 16
    (-1, False, 8, ops.K.COMP_GLOBAL, 2, 256, False),   # the portable kernel
    (0, True, 8, ops.K.COMP_GLOBAL, 2, 256, False),     # forced off
    (1, True, 4, ops.K.COMP_NONE, 1, 3, True),          # forced on: any step of a window / C128A layer
    (1, True, 8, ops.K.COMP_C4A_LOCAL, 2, 256, False),  # forced, but a top-k layer
    (1, True, 16, ops.K.COMP_GLOBAL, 1, 256, False),    # forced, but the head count does not fit
])
def test_when_token_pairs_run(monkeypatch, setting, gluon, heads, comp, per_request, tokens, expected):
    from dsv4_attn.portable.kernels import build

    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "")  # as where it compiles
    monkeypatch.setattr(ops, "_triton_version", lambda: "3.6.0")  # the Triton auto was measured with
    config = ops.KernelConfig(pair_tokens=setting)
    assert ops.pair_tokens(config, gluon, heads, comp, per_request, tokens, CPU) is expected


def test_token_pairs_where_they_do_not_compile(monkeypatch):
    from dsv4_attn.portable.kernels import build

    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "the Gluon Hopper kernel does not compile: X")
    monkeypatch.setattr(ops, "_triton_version", lambda: "3.6.0")
    assert not ops.pair_tokens(ops.KernelConfig(), True, 8, ops.K.COMP_GLOBAL, 2, 256, CPU)  # auto: one per program
    with pytest.raises(ValueError, match="config.pair_tokens: got 1; allowed only where the token-pair kernel "
                                         "compiles; here: the Gluon Hopper kernel does not compile: X"):
        ops.pair_tokens(ops.KernelConfig(pair_tokens=1), True, 8, ops.K.COMP_NONE, 2, 4, CPU)


@pytest.mark.parametrize("config,heads,comp,names", [
    (ops.KernelConfig(), 64, ops.K.COMP_C4A_LOCAL, ["the 64-head kernel"]),
    (ops.KernelConfig(), 32, ops.K.COMP_GLOBAL, ["the 64-head kernel"]),
    (ops.KernelConfig(), 16, ops.K.COMP_C4A_LOCAL, ["heads-on-N kernel (hopper_heads.py, 16 heads",
                                                     "else the 64-head"]),
    (ops.KernelConfig(), 8, ops.K.COMP_GLOBAL, ["heads-on-N kernel (hopper_heads.py, 8 heads", "token pairs",
                                                "2+ tokens per request and 64+ pairs"]),
    (ops.KernelConfig(pair_tokens=1), 8, ops.K.COMP_NONE, ["token pairs", "always"]),
    (ops.KernelConfig(heads_on_n=1, pair_tokens=0), 8, ops.K.COMP_NONE, ["heads-on-N"]),
    (ops.KernelConfig(heads_on_n=0, pair_tokens=0), 8, ops.K.COMP_NONE, ["the 64-head kernel"]),
])
def test_explain_names_the_gluon_kernel(config, heads, comp, names):
    text = ops.gluon_kernel_names(config, heads, comp)
    assert all(name in text for name in names), text
    if config.pair_tokens == 0 or comp == ops.K.COMP_C4A_LOCAL or heads > ops.PAIR_MAX_HEADS \
            or (config.pair_tokens == -1 and comp == ops.K.COMP_NONE):
        assert "token pairs" not in text, text
    if config.heads_on_n == 0:
        assert "heads-on-N" not in text, text


@pytest.mark.parametrize("decode,tokens,requests,expected", [
    (128, 128, 64, 2),   # MTP: 2 tokens per request
    (64, 64, 64, 1),
    (100, 128, 64, 1),   # prefill tokens in the step: no hint
    (192, 192, 64, 3),
])
def test_tokens_per_request_hint(decode, tokens, requests, expected):
    from types import SimpleNamespace

    from dsv4_attn.portable import triton_backend

    plan = SimpleNamespace(batch=SimpleNamespace(query_start_loc=torch.zeros(requests + 1)), num_decode_tokens=decode,
                           num_tokens=tokens)
    assert triton_backend._decode_tokens_per_request(plan) == expected


@pytest.mark.parametrize("version,expected", [("3.6.0", True), ("3.8.0", True), ("3.9.0", False)])
def test_token_pairs_auto_only_under_the_measured_triton(monkeypatch, version, expected):
    from dsv4_attn.portable.kernels import build

    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "")
    monkeypatch.setattr(ops, "_triton_version", lambda: version)
    assert ops.pair_tokens(ops.KernelConfig(), True, 8, ops.K.COMP_GLOBAL, 2, 256, CPU) is expected
    assert ops.pair_tokens(ops.KernelConfig(pair_tokens=1), True, 8, ops.K.COMP_GLOBAL, 2, 256, CPU)  # forced


def test_explain_names_the_records_kernel_for_v41_records():
    from dsv4_attn.common.layout import Record

    text = ops.gluon_kernel_names(ops.KernelConfig(), 8, ops.K.COMP_GLOBAL, (Record.MXFP8, Record.NVFP4))
    assert text.startswith("the V4.1 records' kernel (hopper_records.py") and "token pairs" not in text, text


@pytest.mark.parametrize("heads,tokens,comp,per_request,config,split,pdl", [
    # C4A 1024 (2 + 16 key tiles): programs on at most half of 132 SMs: split for one per SM, no PDL
    (8, 16, "c4a", 1, {}, 8, (False, False)),      # 132 // 16 (two per SM: 16)
    (8, 8, "c4a", 1, {}, 16, (False, False)),      # 132 // 8 (two per SM: 18, every tile)
    (8, 4, "c4a", 1, {}, 18, (False, False)),      # 8 heads per program: from 4 programs (every tile either way)
    (8, 3, "c4a", 1, {}, 18, (True, False)),       # below ops.ONE_PER_SM_MIN_PROGRAMS: two per SM, PDL
    (8, 32, "c4a", 1, {}, 4, (False, False)),      # (8)
    (16, 64, "c4a", 1, {}, 2, (False, False)),     # (4)
    (16, 67, "c4a", 1, {}, 3, (True, False)),      # more than half the SMs: two per SM, 264 // 67
    (8, 32, "c4a", 1, {"split": 4}, 4, (True, False)),  # a forced split: not the rule
    (8, 32, "c4a", 1, {"pdl": 1}, 4, (True, False)),    # PDL forced on
    (8, 128, "c128a", 2, {}, 4, (True, False)),   # 64 token pairs (two per SM: 264 // 64), not the rule
])
def test_launches_on_at_most_half_the_sms_run_one_program_per_sm_without_pdl(monkeypatch, heads, tokens, comp,
                                                                             per_request, config, split, pdl):
    from dsv4_attn.portable.kernels import build

    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "")
    monkeypatch.setattr(ops, "num_sms", lambda device: 132)
    monkeypatch.setattr(ops, "_triton_version", lambda: "3.6.0")
    cfg = ops.KernelConfig(**config)
    comp_mode, comp_width = (ops.K.COMP_C4A_LOCAL, 1024) if comp == "c4a" else (ops.K.COMP_GLOBAL, 1024)
    _, pair, heads_n, _, programs, _, got = ops.launch_grid(cfg, True, cfg.tile("sm90", heads), False, heads, tokens,
                                                           CPU, comp_mode, 128, comp_width, per_request)
    assert heads_n == (16 if pair or heads > 8 else 8) and pair == (comp == "c128a") and got == split
    one = ops.one_program_per_sm(cfg, heads_n, pair, programs, CPU)
    assert ops.pdl_launches(cfg, True, False, heads > 8, heads_n, heads, one) == pdl


@pytest.mark.parametrize("version,heads,setting,expected", [
    ("3.8.0", 16, -1, 16),
    ("3.9.0", 16, -1, 0),   # 16 heads per program: the 64-head kernel under 3.9 (ops.HEADS_ON_N_WIDE_TRITONS)
    ("3.9.0", 12, -1, 0),
    ("3.9.0", 8, -1, 8),    # 8 heads per program stay on it
    ("3.9.0", 16, 1, 16),   # forced
])
def test_sixteen_heads_per_program_only_under_the_tritons_measured_faster(monkeypatch, version, heads, setting,
                                                                          expected):
    from dsv4_attn.portable.kernels import build

    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "")
    monkeypatch.setattr(ops, "num_sms", lambda device: 132)
    monkeypatch.setattr(ops, "_triton_version", lambda: version)
    assert ops.heads_on_n(ops.KernelConfig(heads_on_n=setting), True, heads, 18, 64, CPU) == expected
