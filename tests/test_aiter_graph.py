"""CUDA-graph capture of an `aiter` decode step (AITER EMULATOR on an NVIDIA GPU).

A decode step (index build into scratch, persistent work plan, staged q, gathered MODEL1 rows,
both scope calls, LSE merge and sink) of every layer kind is captured with SHORT sequences and
replayed after the plan buffers, block tables, top-k, q and sink were rewritten for LONG
sequences with new indices. The replay must match the float64 reference, allocate nothing
(``torch.cuda.memory_allocated`` unchanged) and keep every buffer where it was.
This proves the adapter's step is capture-safe (fixed shapes, no host sync); the kernels are the
emulator's, not AITER's.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn import emulation
from dsv4_attn.common.registry import get_backend, register_backend, unregister_backend
from dsv4_attn.common.spec import V4_KINDS, LayerKind
from dsv4_attn.rocm.aiter import AiterBackend

from kit.compare import BF16, FP8_Q, assert_close, compare
from kit.layers import reference_out
from kit.steps import aiter_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU for graph capture")]

# (emulated AITER flavor, backend kwargs, format, heads, tolerance): mla_decode_fwd persistent
# (fixed-stride indices, work plans, fp8 gather) and split (ragged, bf16 gather), the v4 nm kernel
# (MODEL1 records repacked, sink in the kernel) and sparse_mla_fwd (in place, sink in kernel)
PATHS = [("0.1.20", {"path": "mla_decode_fwd"}, "fp8_ds_mla", 64, FP8_Q),
         ("0.1.20", {"path": "mla_decode_fwd", "persistent_max_batch": 0}, "fp8_ds_mla", 16, BF16),
         ("0.1.20", {"path": "mla_decode_fwd_v4_nm", "fp8_compute": True}, "fp8_ds_mla", 64, FP8_Q),  # a8w8: opt-in
         ("sparse", {"path": "sparse_mla_fwd"}, "fp8_ds_mla", 64, BF16)]
SHORT = (3, 90, 140, 260, 130, 5)
LONG = (5000, 7000, 3100, 8000, 6000, 4500)


@pytest.fixture(autouse=True)
def _no_emulator_leak():
    yield
    emulation.disable()


@pytest.mark.parametrize("flavor,kwargs,fmt,heads,tol", PATHS, ids=["persistent", "split", "v4_nm", "sparse_mla_fwd"])
def test_decode_step_captured_and_replayed_with_new_contents(flavor, kwargs, fmt, heads, tol):
    emulation.enable("gfx950", flavor)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    name = "aiter-graph"
    register_backend(name, AiterBackend(name=name, max_decode_tokens=16, **kwargs))
    try:
        lens = dict(query_lens=(1,) * 4 + (2,), num_pad=1, device=dev, max_model_len=16384)
        short = aiter_step(gen, fmt, heads, seq_lens=SHORT[:5], **lens)
        long = aiter_step(gen, fmt, heads, seq_lens=LONG[:5], **lens)
        mla = dsv4.SparseMLA(short.spec, fmt, backend=name, device=dev, max_tokens=16)
        # what the captured step reads by address, as an engine keeps it: caches (sized for the long
        # case), compressed block tables (fixed width), top-k, q and sink
        static = {"q": long.q.clone(), "sink": long.sink.clone(), "topk": long.topks[LayerKind.C4A].clone()}
        caches = long.caches
        tables = {r: torch.zeros_like(t) for r, t in long.batch.comp_block_tables.items()}

        def load(case):
            for k, src in (("q", case.q), ("sink", case.sink), ("topk", case.topks[LayerKind.C4A])):
                static[k].copy_(src)
            for r, t in tables.items():
                src = case.batch.comp_block_tables[r]
                t.zero_()
                t[:, : src.shape[1]].copy_(src)
            b = case.batch
            return mla.plan(dsv4.StepBatch(b.query_start_loc, b.seq_lens, b.num_decode_tokens, b.swa_block_table,
                                           b.swa_block_size, tables, b.block_size, b.max_model_len, b.num_tokens))

        outs = {kind: torch.full_like(static["q"], math.nan) for kind in V4_KINDS}

        def layers(plan):
            for kind in V4_KINDS:
                mla.forward(plan, kind, static["q"], caches["swa"], caches.get(kind),
                            static["topk"] if kind is LayerKind.C4A else None, static["sink"], out=outs[kind])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layers(load(short))  # warm-up: allocates the scratch once
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        plan = load(short)  # a fresh plan: its per-step metadata is built INSIDE the capture
        with torch.cuda.graph(graph):
            layers(plan)
        scratch = list(get_backend(name)._scratch.values())
        assert len(scratch) == 1
        pointers = scratch[0].pointers() + [o.data_ptr() for o in outs.values()]

        for case in (long, short, long):
            plan = load(case)
            for o in outs.values():
                o.fill_(math.nan)
            gc.collect()  # the last plan's garbage freed now, not by a collection during the replay
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == before, "a replay allocated memory"
            assert scratch[0].pointers() + [o.data_ptr() for o in outs.values()] == pointers
            ref_case = dataclasses.replace(case, q=static["q"], sink=static["sink"],
                                           topks={LayerKind.C4A: static["topk"]}, caches=caches)
            for kind, out in outs.items():
                assert torch.isfinite(out).all(), f"{kind.name}: unwritten output after replay"
                err = compare(out, reference_out(plan, ref_case, kind))
                print(f"AITER-GRAPH {kwargs} {kind.name} seq_lens={case.batch.seq_lens.tolist()} {err}")
                assert_close(err, tol, max_abs=False, what=kind.name)
    finally:
        unregister_backend(name)

