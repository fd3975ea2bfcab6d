"""Case builders and checks shared by tests/test_flashmla.py and tests/test_flashinfer.py.

A case is a random DeepSeek-V4 or V4.1 step: permuted block tables (optionally offset to huge
block ids), caches filled with random rows only where the tables point, for every top-k layer
kind an indexer top-k whose valid prefix holds visible entries and whose other lanes hold
garbage, random q and sinks. ``run_layer`` runs one layer through a SparseMLA with a
NaN-poisoned output and compares it with the float64 reference (``dsv4_attn.common.reference``)
on the plan's own rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import dsv4_attn as dsv4
from dsv4_attn.common import layout, reference
from dsv4_attn.common.spec import V4_KINDS, LayerKind, cdiv

from conftest import compare


@dataclass
class Case:
    spec: dsv4.ModelSpec
    fmt: str
    batch: dsv4.StepBatch
    caches: dict  # "swa" and each compressed kind (V4's C128A only when block_size % 128 == 0)
    topks: dict  # each top-k kind -> int32 [T, K] local top-k
    q: torch.Tensor  # bf16 [T, H, 512]
    sink: torch.Tensor  # float32 [H]
    kv_scale: float = 1.0

    @property
    def topk(self) -> torch.Tensor | None:
        """The C4A layer's top-k (V4 cases)."""
        return self.topks.get(LayerKind.C4A)

    def topk_for(self, kind: LayerKind) -> torch.Tensor | None:
        return self.topks.get(kind)


def _table(gen, reqs: int, blocks: int, base: int) -> torch.Tensor:
    return (torch.randperm(reqs * blocks, generator=gen).int() + base).view(reqs, blocks)


def randn(shape, gen, device) -> torch.Tensor:
    """Seeded normal samples made on ``device`` (large GPU cases skip a host round trip)."""
    if torch.device(device).type == "cpu":
        return torch.randn(shape, generator=gen)
    seed = int(torch.randint(2**62, (1,), generator=gen))
    return torch.randn(shape, generator=torch.Generator(device).manual_seed(seed), device=device)


def _cache(record, table, block_size, base, gen, device, block_stride=None, kv_scale=None):
    """A cache of ``record`` with base + table.numel() blocks, random rows in the blocks the table uses."""
    cache = layout.new_cache(record, base + table.numel(), block_size, device, block_stride=block_stride)
    slots = (table.long().reshape(-1, 1) * block_size + torch.arange(block_size)).reshape(-1)
    kv = (randn((slots.numel(), 512), gen, device) * 2).bfloat16()
    layout.insert(cache, record, slots.to(device), kv, scale=kv_scale if record is layout.Record.FP8_TENSOR else None)
    return cache


def make_case(gen, query_lens, seq_lens, *, kinds=V4_KINDS, heads=16, fmt="fp8_ds_mla", topk=64,
              max_model_len=4096, window=128, swa_bs=64, block_size=256, num_decode_tokens=None, pad_tokens=0,
              block_base=0, swa_block_stride=None, comp_block_stride=None, empty_topk_tokens=(), kv_scale=None,
              device="cpu") -> Case:
    """A step of a model whose layers are ``kinds``, caches in the records of ``fmt``.
    ``block_base`` offsets every SWA block id (huge slots); ``*_block_stride`` interleaves foreign
    pages; ``empty_topk_tokens`` get an all -1 top-k row in every top-k kind; ``pad_tokens``
    padding tokens follow. V4's C128A cache exists only when block_size % 128 == 0."""
    R, longest = len(query_lens), max(seq_lens)
    spec = dsv4.ModelSpec(num_heads=heads, topk=topk, max_model_len=max_model_len, window=window, layers=kinds)
    swa_table = _table(gen, R, cdiv(longest, swa_bs), block_base)
    comp_tables = {r: _table(gen, R, cdiv(longest // r, block_size // r) + 1, 0) for r in spec.comp_ratios
                   if block_size % r == 0}
    batch = dsv4.StepBatch.from_lists(query_lens, seq_lens, swa_table, swa_bs, comp_tables, block_size,
                                      max_model_len, num_decode_tokens=num_decode_tokens)
    T = batch.num_tokens + pad_tokens
    batch = dsv4.StepBatch(batch.query_start_loc.to(device), batch.seq_lens.to(device), batch.num_decode_tokens,
                           swa_table.to(device), swa_bs, {k: v.to(device) for k, v in comp_tables.items()},
                           block_size, max_model_len, num_tokens=T)
    topks = {}
    for kind in (k for k in spec.kinds if k.uses_topk):
        visible = (batch.positions.cpu() + 1) // kind.ratio
        local = torch.randint(-5, 10**6, (T, topk), generator=gen).int()  # garbage lanes
        picks = (torch.rand(T, topk, generator=gen) * visible[:, None]).long().int()  # visible (repeats allowed)
        prefix = torch.arange(topk)[None, :] < visible[:, None].clamp(max=topk)
        local = torch.where(prefix, picks, local)
        local[list(empty_topk_tokens)] = -1
        topks[kind] = local.to(device)
    records = layout.KVFormat.parse(fmt)
    caches = {"swa": _cache(records.swa_record, swa_table, swa_bs, block_base, gen, device, swa_block_stride,
                            kv_scale)}
    by_ratio = {r: _cache(records.comp_record, table, block_size // r, 0, gen, device, comp_block_stride, kv_scale)
                for r, table in comp_tables.items()}
    caches.update({k: by_ratio[k.ratio] for k in spec.kinds if k.ratio in by_ratio})
    q = randn((T, heads, 512), gen, device).bfloat16()
    sink = (torch.randn(heads, generator=gen) + 2).to(device)
    return Case(spec, fmt, batch, caches, topks, q, sink, 1.0 if kv_scale is None else kv_scale)


def redrawn_topk(gen, case: Case, kind: LayerKind) -> torch.Tensor:
    """Another layer's top-k for ``kind``: ``case``'s row with its valid prefix redrawn (other
    visible entries), its garbage lanes kept."""
    local = case.topks[kind].cpu().clone()
    visible = (case.batch.positions.cpu() + 1) // kind.ratio
    picks = (torch.rand(local.shape, generator=gen) * visible[:, None]).long().int()
    prefix = torch.arange(local.shape[1])[None, :] < visible[:, None].clamp(max=local.shape[1])
    return torch.where(prefix & (local >= 0), picks, local).to(case.topks[kind].device)


def reference_out(mla: dsv4.SparseMLA, plan, case: Case, kind: LayerKind, q=None, sink="case",
                  tokens: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [n, H, 512]: the reference on the plan's own rows for ``tokens`` (default all)."""
    q = case.q if q is None else q
    sink = case.sink if sink == "case" else sink
    comp = case.caches.get(kind) if kind.has_comp_scope else None
    rows, lens = plan.comp_scope(kind, case.topk_for(kind))
    sel = slice(None) if tokens is None else tokens
    ref, _ = reference.sparse_mla(q[sel], case.caches["swa"], plan.swa_rows[sel], plan.swa_lens[sel], comp,
                                  None if rows is None else rows[sel], None if lens is None else lens[sel], sink,
                                  mla.spec.scale, case.fmt, kv_scale=case.kv_scale)
    return ref


def forward_poisoned(mla: dsv4.SparseMLA, plan, case: Case, kind: LayerKind, q=None, sink="case") -> torch.Tensor:
    """One layer's output; ``out`` is NaN-filled before the call."""
    q = case.q if q is None else q
    sink = case.sink if sink == "case" else sink
    out = torch.full_like(q, float("nan"))
    mla.forward(plan, kind, q, case.caches["swa"], case.caches.get(kind) if kind.has_comp_scope else None,
                topk=case.topk_for(kind), sink=sink, out=out, validate=True,
                kv_scale=case.kv_scale)
    return out


def metrics(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """compare() plus ``written`` (no NaN poison left) and ``out``."""
    written = not bool(out.isnan().any())
    m = compare(out, ref) if written else {"max_abs": math.nan, "rel_l2": math.nan, "cosine": math.nan}
    return dict(m, written=written, out=out)


def run_layer(mla: dsv4.SparseMLA, plan, case: Case, kind: LayerKind, q=None, sink="case") -> dict:
    """forward_poisoned vs reference_out on every token."""
    kind = LayerKind.parse(kind)
    return metrics(forward_poisoned(mla, plan, case, kind, q, sink), reference_out(mla, plan, case, kind, q, sink))


def assert_close(m: dict, rel=1e-2, cos=0.9999, max_abs=5e-2) -> None:
    assert m["written"], "output not fully written (NaN poison survived)"
    assert m["rel_l2"] < rel and m["cosine"] > cos and m["max_abs"] < max_abs, m
