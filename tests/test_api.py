"""SparseMLA round trips on CPU (torch backend) against the float64 reference, plan reuse rules,
and input validation of the public API."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.common import reference
from dsv4_attn.common.spec import V4_KINDS, LayerKind
from dsv4_attn.testing.steps import make_step


def _check_against_reference(mla, plan, kind, q, caches, topk, sink, fmt="fp8_ds_mla"):
    comp = caches.get(kind)
    out = torch.full_like(q, float("nan"))
    mla.forward(plan, kind, q, caches["swa"], comp, topk=topk if kind is LayerKind.C4A else None,
                sink=sink, out=out, validate=True)
    assert not out.isnan().any(), "output not fully written"
    rows, lens = plan.comp_scope(kind, topk if kind is LayerKind.C4A else None)
    ref, _ = reference.sparse_mla(q, caches["swa"], plan.swa_rows, plan.swa_lens, comp, rows, lens, sink,
                                  mla.spec.scale, fmt)
    err = out.double() - ref
    rel = (err.norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0).item()
    assert rel < 1e-2 and cos > 0.9999 and err.abs().max().item() < 5e-2, (rel, cos)
    return out


@pytest.mark.parametrize("kind", list(V4_KINDS))
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bfloat16", "fp8_e4m3", "mxfp8_ds_mla", "nvfp4_ds_mla"])
def test_forward_matches_reference_every_kind(kind, fmt):
    gen = torch.Generator().manual_seed(max(kind.ratio, 1) * 7 + len(fmt))
    # decode, MTP pair, a prefill chunk crossing the window, a long request (C128A rows wide)
    spec, batch, caches, topk, q, sink = make_step(gen, [1, 2, 9, 1], [300, 131, 140, 33000], fmt=fmt).v4_inputs()
    mla = dsv4.SparseMLA(spec, fmt, backend="torch")
    plan = mla.plan(batch, validate=True)
    _check_against_reference(mla, plan, kind, q, caches, topk, sink, fmt)


def test_short_sequences_padding_tokens_and_infinite_sinks():
    gen = torch.Generator().manual_seed(3)
    # pos < W, pos + 1 < 4 (no compressed entry yet) and 3 padding tokens after the real ones
    spec, batch, caches, topk, q, sink = make_step(gen, [1, 3, 1], [1, 3, 7]).v4_inputs()
    padded = dsv4.StepBatch(batch.query_start_loc, batch.seq_lens, batch.num_decode_tokens,
                            batch.swa_block_table, batch.swa_block_size, batch.comp_block_tables,
                            batch.block_size, batch.max_model_len, num_tokens=batch.num_tokens + 3)
    q = torch.cat([q, torch.randn(3, q.shape[1], 512, generator=gen).bfloat16()])
    topk = torch.cat([topk, topk[:3]])
    sink[0], sink[1] = math.inf, -math.inf
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(padded)
    assert plan.swa_lens[-3:].tolist() == [0, 0, 0]
    for kind in V4_KINDS:
        out = _check_against_reference(mla, plan, kind, q, caches, topk, sink)
        assert out[:, 0].abs().max() == 0  # +inf sink swamps every key
        assert out[-3:].abs().max() == 0  # padding tokens have no keys


def test_padded_heads_and_phase_split_keep_results():
    gen = torch.Generator().manual_seed(5)
    spec, batch, caches, topk, q, sink = make_step(gen, [1, 1, 6], [90, 600, 700], heads=12).v4_inputs()
    q = torch.cat([q, torch.zeros(q.shape[0], 4, 512, dtype=q.dtype)], dim=1)  # pad 12 -> 16 heads
    sink = torch.cat([sink, torch.full((4,), -math.inf)])
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(batch)
    whole = _check_against_reference(mla, plan, LayerKind.C4A, q, caches, topk, sink)
    # the same layer run phase by phase (what a decode-only backend causes) gives the same bits
    split = torch.full_like(q, float("nan"))
    backend = dsv4.common.registry.get_backend("torch")
    nd = plan.num_decode_tokens
    for phase, a, b in ((dsv4.Phase.DECODE, 0, nd), (dsv4.Phase.PREFILL, nd, plan.num_tokens)):
        layer = mla.layer_inputs(plan, LayerKind.C4A, q, caches["swa"], caches[LayerKind.C4A], topk,
                                 sink).token_slice(a, b)
        backend.forward(plan.phase_plan(phase), layer, split[a:b])
    assert torch.equal(split, whole)


def test_stale_plan_and_foreign_plan_are_refused():
    gen = torch.Generator().manual_seed(7)
    spec, batch, caches, topk, q, sink = make_step(gen, [1, 1], [50, 60]).v4_inputs()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    old = mla.plan(batch)
    mla.plan(batch)
    with pytest.raises(ValueError, match="plan: got the plan of step 1"):
        mla.forward(old, "swa", q, caches["swa"])
    other = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    with pytest.raises(ValueError, match="not built by this SparseMLA"):
        other.forward(mla.plan(batch), "swa", q, caches["swa"])


def test_plan_reuses_preallocated_buffers():
    gen = torch.Generator().manual_seed(8)
    spec, batch, caches, topk, q, sink = make_step(gen, [1, 1], [50, 60]).v4_inputs()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", max_tokens=16)
    p1 = mla.plan(batch)
    ptrs = (p1.swa_rows.data_ptr(), p1.comp_rows[128][0].data_ptr(), p1.positions.data_ptr())
    spec2, batch2, *_ = make_step(gen, [1, 1], [900, 2000]).v4_inputs()
    p2 = mla.plan(batch2)
    assert (p2.swa_rows.data_ptr(), p2.comp_rows[128][0].data_ptr(), p2.positions.data_ptr()) == ptrs
    assert p2.comp_rows[128][0].shape[1] == spec.c128a_width  # fixed by the model, not the batch
    with pytest.raises(ValueError, match="max_tokens"):
        mla.plan(make_step(gen, [20], [40]).batch)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(q=a["q"].float()), r"q: got torch.float32"),
        (lambda a: a.update(q=a["q"][:, :8]), r"q: got .*allowed: torch.bfloat16 \[T=2, H, 512\] with 16 <= H"),
        (lambda a: a.update(q=torch.zeros(2, 130, 512, dtype=torch.bfloat16)), r"H <= 128"),
        (lambda a: a.update(sink=a["sink"].double()), r"sink: got torch.float64"),
        (lambda a: a.update(comp_cache=None), r"comp_cache: got None"),
        (lambda a: a.update(topk=None), r"topk: got None"),
        (lambda a: a.update(topk=a["topk"].float()), r"topk: got torch.float32"),
        (lambda a: a.update(swa_cache=a["swa_cache"].view(torch.int8).view(torch.uint8)[:, :, :512]),
         r"swa_cache: got shape"),
        (lambda a: a.update(out=torch.empty(2, 16, 512)), r"out: got torch.float32"),
        (lambda a: a.update(kv_scale=2.0), r"kv_scale: got 2.0; allowed: 1.0"),
    ],
)
def test_forward_rejects_bad_input_with_named_argument(mutate, match):
    gen = torch.Generator().manual_seed(9)
    spec, batch, caches, topk, q, sink = make_step(gen, [1, 1], [50, 60]).v4_inputs()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(batch)
    args = dict(q=q, swa_cache=caches["swa"], comp_cache=caches[LayerKind.C4A], topk=topk, sink=sink)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        mla.forward(plan, LayerKind.C4A, **args)


def test_validate_catches_cache_too_small_for_block_table():
    gen = torch.Generator().manual_seed(10)
    spec, batch, caches, topk, q, sink = make_step(gen, [1, 1], [50, 60]).v4_inputs()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(batch)
    small = caches["swa"][:1]
    with pytest.raises(ValueError, match="swa_cache: too small for this step"):
        mla.forward(plan, "swa", q, small, validate=True)


def test_constructor_and_plan_reject_bad_arguments():
    spec = dsv4.ModelSpec(num_heads=8)
    with pytest.raises(ValueError, match="fmt: got 'fp16'"):
        dsv4.SparseMLA(spec, "fp16")
    with pytest.raises(ValueError, match="backend: got 'cutlass'"):
        dsv4.SparseMLA(spec, "bf16", backend="cutlass")
    with pytest.raises(ValueError, match="max_tokens: got 0"):
        dsv4.SparseMLA(spec, "bf16", max_tokens=0)
    with pytest.raises(ValueError, match="num_heads: got 129"):
        dsv4.ModelSpec(num_heads=129)
    with pytest.raises(ValueError, match="batch: got dict"):
        dsv4.SparseMLA(spec, "bf16").plan({})


# ---- index front ends -------------------------------------------------------------------------

HAS_TRITON = importlib.util.find_spec("triton") is not None
FRONT_END_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _plan_fields(plan, topk):
    rows, lens = plan.comp_scope(LayerKind.C4A, topk)
    return {"positions": plan.positions, "token_to_req": plan.token_to_req, "token_valid": plan.token_valid,
            "swa_rows": plan.swa_rows, "swa_lens": plan.swa_lens, "c128a_rows": plan.comp_rows[128][0],
            "c128a_lens": plan.comp_rows[128][1], "c4a_rows": rows, "c4a_lens": lens}


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("swa_bs, block_size", [(1, 256), (2, 128), (64, 512)])
def test_triton_front_end_builds_the_torch_rows(swa_bs, block_size, gen):
    """Same rows, lens and per-token facts from both front ends (on CPU through the interpreter):
    odd block sizes, pos < W, no compressed entry yet, garbage top-k lanes, padding tokens."""
    spec, batch, caches, topk, q, sink = make_step(gen, [1, 2, 5, 1, 3], [300, 131, 70, 3, 2100], swa_bs=swa_bs,
                                               block_size=block_size).v4_inputs()
    dev = FRONT_END_DEVICE
    padded = dsv4.StepBatch(batch.query_start_loc.to(dev), batch.seq_lens.to(dev), batch.num_decode_tokens,
                            batch.swa_block_table.to(dev), swa_bs,
                            {r: t.to(dev) for r, t in batch.comp_block_tables.items()}, block_size,
                            batch.max_model_len, num_tokens=batch.num_tokens + 2)
    topk = torch.cat([topk, torch.randint(-3, 99, (2, topk.shape[1]), generator=gen).int()]).to(dev)
    got = {}
    for front_end in ("torch", "triton"):
        mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", device=dev, front_end=front_end, max_tokens=32)
        plan = mla.plan(padded)
        assert plan.front_end.name == front_end and f"index front end: {front_end}" in mla.explain()
        got[front_end] = _plan_fields(plan, topk)
    for name, want in got["torch"].items():
        assert torch.equal(got["triton"][name], want), name
    assert got["triton"]["c4a_lens"][-2:].tolist() == [0, 0] and (got["triton"]["c4a_rows"][-2:] == -1).all()


def test_front_end_choice_is_checked(monkeypatch):
    spec = dsv4.ModelSpec(num_heads=8)
    with pytest.raises(ValueError, match="front_end: got 'cuda'; allowed: one of"):
        dsv4.SparseMLA(spec, "bf16", front_end="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="front_end: got 'triton', but (device cpu is not a GPU|triton is not imp)"):
        dsv4.SparseMLA(spec, "bf16", device="cpu", front_end="triton")
    assert dsv4.SparseMLA(spec, "bf16", device="cpu")._front_end.name == "torch"  # auto on CPU


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA GPU and Triton")
def test_plan_and_topk_rows_replay_in_a_cuda_graph():
    """Capture plan() + the C4A translation on a short step, replay after writing a long step's
    lengths and top-k into the same tensors: the rows equal a fresh torch-front-end plan."""
    gen = torch.Generator().manual_seed(11)
    spec, batch, _, topk, _, _ = make_step(gen, [1, 1, 1, 1], [33000, 700, 131, 4000]).v4_inputs()
    tables = {r: t.cuda() for r, t in batch.comp_block_tables.items()}
    gpu_batch = dsv4.StepBatch(batch.query_start_loc.cuda(), torch.tensor([5, 9, 130, 40], dtype=torch.int32,
                               device="cuda"), batch.num_decode_tokens, batch.swa_block_table.cuda(),
                               batch.swa_block_size, tables, batch.block_size, batch.max_model_len,
                               num_tokens=batch.num_tokens)
    gpu_topk = torch.randint(-3, 3, topk.shape, generator=gen).int().cuda()
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", device="cuda", front_end="triton", max_tokens=8)
    mla.plan(gpu_batch)  # allocates the buffers (C128A rows too) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = mla.plan(gpu_batch)
        c4a_rows, c4a_lens = plan.comp_scope(LayerKind.C4A, gpu_topk)
    gpu_batch.seq_lens.copy_(batch.seq_lens)
    gpu_topk.copy_(topk)
    graph.replay()
    torch.cuda.synchronize()
    fresh = dsv4.StepBatch(gpu_batch.query_start_loc, gpu_batch.seq_lens, batch.num_decode_tokens,
                           gpu_batch.swa_block_table, batch.swa_block_size, tables, batch.block_size,
                           batch.max_model_len)
    want = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", device="cuda", front_end="torch").plan(fresh)
    assert int(plan.comp_rows[128][1].max()) == 33000 // 128  # the long step's rows, not the captured short ones
    for name, rows in _plan_fields(want, gpu_topk).items():
        got = {"c4a_rows": c4a_rows, "c4a_lens": c4a_lens}.get(name, _plan_fields(plan, gpu_topk)[name])
        assert torch.equal(got, rows), name


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"))])
def test_a_steps_plan_is_freed_without_a_garbage_collection(gen, backend):
    """A plan its own cache referred to (the step's route held it) lived until a collection, with
    every per-step tensor its backends' metadata held: an engine plans every step."""
    from kit.layers import assert_plan_freed_without_collection

    case = make_step(gen, [1, 3, 1], [40, 90, 300], kinds=V4_KINDS, topk=16, max_model_len=1024, block_size=256)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=backend)
    assert_plan_freed_without_collection(mla, case, V4_KINDS)

