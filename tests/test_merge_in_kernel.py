"""The split merge after the Gluon Hopper kernel: inside the kernel (``KernelConfig.merge_in_kernel``,
``ops.merge_in_kernel``) or by the combine launch (its tile, ``ops.combine_tile``): when the
automatic choice takes which, that bad settings are refused, and on an sm_90 GPU that the in-kernel
merge matches the float64 reference eagerly and across CUDA-graph replays (its arrival counters
must be left zero by every launch)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attn.portable.kernels import ops

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("heads,split,gluon,setting,expected", [
    (8, 10, True, -1, True),      # V4-Flash TP8 shard, C4A 512 at b <= 4
    (8, 18, True, -1, True),      # C4A 1024 at b = 1
    (4, 2, True, -1, True),
    (16, 2, True, -1, False),     # two 8-head walks: the combine launch spreads them
    (64, 2, True, -1, False),
    (128, 18, True, -1, False),
    (8, 1, True, -1, False),      # no split, nothing to merge
    (8, 1, True, 1, False),
    (64, 10, True, 1, True),      # forced
    (8, 10, True, 0, False),      # forced off
    (8, 10, False, 1, False),     # the portable kernel always launches the combine
])
def test_when_the_gluon_kernel_merges_its_splits(heads, split, gluon, setting, expected):
    config = ops.KernelConfig(merge_in_kernel=setting)
    assert ops.merge_in_kernel(config, gluon, split, heads) is expected


def test_merge_settings_are_checked():
    with pytest.raises(ValueError, match="merge_in_kernel: got 2"):
        ops.KernelConfig(merge_in_kernel=2)
    with pytest.raises(ValueError, match="combine_heads / combine_dims: got None / 96"):
        ops.KernelConfig(combine_dims=96)


def test_combine_tile_after_each_kernel():
    assert ops.combine_tile(ops.KernelConfig(), gluon=True) == (8, 64)
    assert ops.combine_tile(ops.KernelConfig(), gluon=False) == (16, 128)
    assert ops.combine_tile(ops.KernelConfig(combine_heads=4, combine_dims=128), gluon=True) == (4, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("cfg,batch", [("h8-c4a512", 2), ("h8-swa", 1), ("h16-c128a", 3), ("h64-c4a512", 2),
                                       ("h128-c4a1024", 1)])
def test_gpu_in_kernel_merge_matches_the_reference_across_graph_replays(cfg, batch):
    from dsv4_attn import SparseMLA, bench
    from dsv4_attn.common import reference
    from dsv4_attn.common.registry import register_backend
    from dsv4_attn.portable.triton_backend import TritonBackend

    from kit.compare import assert_close, metrics

    name = "triton-merge-in-kernel-test"
    register_backend(name, TritonBackend(ops.KernelConfig(impl="gluon", merge_in_kernel=1)))
    case = bench.make_decode_case(bench.DECODE_CONFIGS[cfg], batch, 1, torch.device("cuda"), seed=batch + 11)
    case.sink[0] = math.inf  # head 0: all the weight on the sink, output 0
    mla = SparseMLA(case.spec, case.fmt, backend=name, max_tokens=case.q.shape[0])
    plan = mla.plan(case.batch)
    out = torch.empty_like(case.q)

    def run():
        mla.forward(plan, case.kind, case.q, case.swa_cache, case.comp_cache, topk=case.topk, sink=case.sink, out=out)

    rows, lens = plan.comp_scope(case.kind, case.topk)
    want, _ = reference.sparse_mla(case.q, case.swa_cache, plan.swa_rows, plan.swa_lens, case.comp_cache, rows, lens,
                                   case.sink, case.spec.scale, case.fmt)
    out.fill_(float("nan"))
    run()
    graph = bench.timing.capture_graph(run)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = metrics(out, want)
        assert_close(err, max_abs=False, what=f"{cfg} b={batch}")
        # bf16 output: one rounding of |out| (2^-8 relative) plus accumulation noise
        assert err["max_abs"] <= 1e-2 + 2**-7 * float(want.abs().max()), err
        assert float(out[:, 0].abs().max()) == 0.0
