"""A C4A layer call's kernel launches as described on a GPU (nothing launched): what the bound-launch
tests (test_host_path.py, test_driver_launch.py) bind."""

from __future__ import annotations

import torch

import dsv4_attn as dsv4
from dsv4_attn.common.spec import LayerKind


def c4a_launches(case, split: int, **config):
    """The case's C4A layer's launches (nothing launched) under a KernelConfig of ``split`` and
    ``config``'s other fields."""
    from dsv4_attn.portable.kernels import ops

    kind = LayerKind.C4A
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(case.batch)
    out = torch.empty_like(case.q)
    return ops.layer_launches(
        case.q, out, "fp8_ds_mla", case.caches["swa"], plan.swa_rows, plan.swa_lens,
        comp_cache=case.caches[kind], comp_rows=case.topks[kind],
        c4a=(case.batch.comp_block_table(kind), plan.token_to_req, plan.positions), topk_ratio=kind.ratio,
        sink=case.sink, config=ops.KernelConfig(split=split, p_scratch=1, **config))
