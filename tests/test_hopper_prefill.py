"""The key-tile ping-pong Gluon kernel (``kernels/hopper_prefill.py``, ``KernelConfig.pingpong``,
``ops.pingpong``): which launches take it, that bad settings are refused, and on an sm_90 GPU that
it matches the float64 reference (every layer kind, 64 and 128 heads, heads that do not fill a
program, odd and zero key-tile counts, MTP; output and LSE) eagerly and across CUDA-graph replays."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn.portable.kernels import build, ops

from kit.layers import check_config_against_reference

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
CPU = torch.device("cpu")


def test_pingpong_setting_is_checked():
    with pytest.raises(ValueError, match=r"pingpong: got 2; allowed: -1 \(auto\), 0 or 1"):
        ops.KernelConfig(pingpong=2)


def test_pingpong_constexprs_name_the_kernel():
    from dsv4_attn.portable.kernels import hopper_prefill

    constexprs = build.hopper_constexprs(ops.K.COMP_C4A_LOCAL, write_lse=True, pingpong=True)
    fn, options = build.hopper_kernel(constexprs)
    assert fn is hopper_prefill.sparse_mla_fwd_hopper_prefill
    assert options == dict(num_warps=hopper_prefill.NUM_WARPS, maxnreg=hopper_prefill.MAXNREG)
    assert "PINGPONG" not in build.hopper_constexprs(ops.K.COMP_C4A_LOCAL, write_lse=True)


@pytest.mark.parametrize("setting,gluon,wide,split,tokens,expected", [
    (1, True, True, 1, 3, True),                                    # forced: any unsplit 64-head launch
    (1, True, True, 2, 4096, False),                                # split: the kernel has no split epilogue
    (1, True, False, 1, 4096, False),                               # heads-on-N / V4.1 records launches
    (1, False, True, 1, 4096, False),                               # the portable kernel
    (0, True, True, 1, 4096, False),                                # forced off
    (-1, True, True, 1, ops.PINGPONG_AUTO_MIN_TOKENS, True),        # auto: from this many tokens
    (-1, True, True, 1, ops.PINGPONG_AUTO_MIN_TOKENS - 1, False),
])
def test_when_the_pingpong_kernel_runs(monkeypatch, setting, gluon, wide, split, tokens, expected):
    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "")  # as where it compiles
    assert ops.pingpong(ops.KernelConfig(pingpong=setting), gluon, wide, split, tokens, CPU) is expected


def test_pingpong_where_it_does_not_compile(monkeypatch):
    monkeypatch.setattr(build, "compile_error", lambda *a, **k: "the Gluon Hopper kernel does not compile: X")
    assert not ops.pingpong(ops.KernelConfig(), True, True, 1, ops.PINGPONG_AUTO_MIN_TOKENS, CPU)
    with pytest.raises(ValueError, match="config.pingpong: got 1; allowed only where the ping-pong kernel "
                                         "compiles; here: the Gluon Hopper kernel does not compile: X"):
        ops.pingpong(ops.KernelConfig(pingpong=1), True, True, 1, 4, CPU)


def _edge_lens(plan):
    """Key-tile counts the pairs must get right: an empty window (0 tiles), windows of 1 and 65 keys
    (1 and 2 tiles), and, on a layer with a second scope, compressed rows of 1 and 0 entries (odd
    totals: the last pair's second tile is empty)."""
    plan.swa_lens[0], plan.swa_lens[2], plan.swa_lens[3] = 0, 1, 65
    for _rows, lens in plan.comp_rows.values():
        lens[1], lens[4] = 1, 0


# unsplit on an H100 (132 SMs): at least 132 programs of 64 heads
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the Gluon kernels need an sm_90 GPU")
@pytest.mark.parametrize("cfg,heads,batch,mtp,edges", [
    ("h64-c4a512", 64, 150, 1, False),     # top-k: 10 tiles per token
    ("h128-c4a1024", 128, 70, 1, False),   # two head blocks, 18 tiles
    ("h64-c128a", 64, 140, 1, True),       # C128A rows of every length (odd tile counts), _edge_lens
    ("h64-swa", 64, 200, 1, True),         # window only: 0 / 1 / 2 tiles
    ("h64-c4a512", 40, 160, 1, False),     # 40 of a program's 64 heads
    ("h64-c4a512", 64, 80, 2, True),       # MTP, _edge_lens
])
def test_gpu_pingpong_matches_the_reference_across_graph_replays(cfg, heads, batch, mtp, edges):
    config = ops.KernelConfig(impl="gluon", pingpong=1, heads_on_n=0)
    check_config_against_reference(config, "triton-pingpong-test", cfg, heads, batch, mtp,
                                   _edge_lens if edges else None, seed=batch * 5 + heads)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the Gluon kernels need an sm_90 GPU")
@pytest.mark.parametrize("cfg,batch", [("h64-c4a512", 140), ("h128-c128a", 70)])
def test_gpu_pingpong_lse_matches_the_reference(cfg, batch):
    """The LSE (natural log, sink excluded) and the output of a direct launch with compressed rows as
    global slots, against ``common.reference.sparse_mla`` in float64; a token with no key: LSE -inf."""
    from dsv4_attn import bench
    from dsv4_attn.common.reference import sparse_mla

    from kit.compare import assert_close, metrics

    case = bench.make_decode_case(bench.DECODE_CONFIGS[cfg], batch, 1, torch.device("cuda"), seed=batch + 3)
    from dsv4_attn import SparseMLA

    plan = SparseMLA(case.spec, case.fmt, backend="torch", max_tokens=case.q.shape[0]).plan(case.batch)
    rows, lens = plan.comp_scope(case.kind, case.topk)
    plan.swa_lens[5] = 0
    if lens is not None:
        lens[5] = 0
    T, H, _ = case.q.shape
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=case.q.device)
    ops.sparse_mla_fwd(case.q, out, case.fmt, case.swa_cache, plan.swa_rows, plan.swa_lens, case.comp_cache, rows,
                       lens, sink=case.sink, scale=case.spec.scale, lse=lse,
                       config=ops.KernelConfig(impl="gluon", pingpong=1))
    torch.cuda.synchronize()
    want, want_lse = sparse_mla(case.q, case.swa_cache, plan.swa_rows, plan.swa_lens, case.comp_cache, rows, lens,
                                case.sink, case.spec.scale, case.fmt)
    assert_close(metrics(out, want), max_abs=False, what=f"{cfg} b={batch}")
    assert torch.isneginf(lse[5]).all() and float(out[5].abs().max()) == 0.0
    live = torch.arange(T, device=lse.device) != 5
    err = (lse[live].double() - want_lse[live].double()).abs()
    assert float(err.max()) <= 1e-4 * (1.0 + float(want_lse[live].abs().max())), float(err.max())
